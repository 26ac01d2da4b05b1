"""Draft algorithms behind one seam: the runtime trains, checkpoints, evaluates and exports any of them.

An algorithm is one package (``eagle3/``, ``dflash/``) exposing ``ALGORITHM``, an object with the
hooks of :class:`~specforge.algorithms.base.DraftAlgorithm`: its config keys, which target layers
it reads, how its draft is built, its loss and metrics, what sequence parallelism wraps, its memory
terms, how its checkpoint is checked and loaded, its proposer for the eval, its engine exports.
The runtime (placements, planner, feature sources, store, checkpoints, FSDP2, the loop, resume,
export, eval) asks ``get_algorithm(cfg.draft.algorithm)`` and never compares a name. A new
algorithm is its package plus one line in ``NAMES``.
"""

from __future__ import annotations

import importlib
from typing import Optional

from specforge.algorithms.base import DraftAlgorithm, ExportRequest

__all__ = ["NAMES", "DraftAlgorithm", "ExportRequest", "get_algorithm", "algorithm_of", "algorithm_name",
           "feature_layers", "load_draft", "by_gguf", "default_feature_layers", "published_algorithm_name"]

# the registry: each name is a package specforge/algorithms/<name>/ exposing ALGORITHM
NAMES = ("eagle3", "dflash", "dspark", "eagle31", "peagle")


def get_algorithm(name: str) -> DraftAlgorithm:
    if name not in NAMES:
        raise ValueError(f"config key 'draft.algorithm'={name!r}: one of {', '.join(NAMES)}")
    return importlib.import_module(f"specforge.algorithms.{name}").ALGORITHM


def algorithm_name(hf_config: dict, where: str = "draft") -> str:
    """The algorithm of a saved draft, from its config.json: the last registered algorithm that owns
    it (``owns_checkpoint``; a later algorithm may refine an earlier one's format, so it asks first)."""
    for name in reversed(NAMES):
        if get_algorithm(name).owns_checkpoint(hf_config):
            return name
    known = sorted({get_algorithm(n).architecture for n in NAMES})
    raise ValueError(f"{where}: config.json architectures {hf_config.get('architectures') or []} is none of "
                     f"{', '.join(known)}; not a draft checkpoint this project wrote")


def published_algorithm_name(hf_config: dict, where: str) -> str:
    """The algorithm of a published draft folder (``draft.init_from``): ours or an engine's format
    (``owns_published``, asked last registered first); a ValueError naming ``where`` if none reads it."""
    for name in reversed(NAMES):
        if get_algorithm(name).owns_published(hf_config):
            return name
    kind = hf_config.get("speculators_model_type") or hf_config.get("architectures") or []
    raise ValueError(f"{where}: config.json ({kind}) is not a draft folder any algorithm here reads ({', '.join(NAMES)}: "
                     "ours, SGLang's EAGLE-3, a speculators/vLLM EAGLE-3 export or z-lab's DFlash)")


def algorithm_of(hf_config: dict, where: str = "draft") -> DraftAlgorithm:
    """The algorithm of a saved draft, from its config.json ``architectures``."""
    return get_algorithm(algorithm_name(hf_config, where))


def by_gguf(arch: str, tensor_names) -> Optional[DraftAlgorithm]:
    """The algorithm whose draft GGUF has ``general.architecture`` ``arch`` and these tensors (the last
    registered that owns it, ``owns_gguf``); None: none of ours."""
    return next((a for a in map(get_algorithm, reversed(NAMES)) if a.owns_gguf(arch, set(tensor_names))), None)


def feature_layers(cfg, num_layers: int) -> list[int]:
    """The target layer outputs the run's draft algorithm reads (``model.aux_layer_ids`` checked
    against a target of ``num_layers`` layers, else the algorithm's default)."""
    return get_algorithm(cfg.draft.algorithm).feature_layers(cfg, num_layers)


def default_feature_layers(model_cfg, num_layers: int) -> list[int]:
    """The layers the default algorithm (``config.DEFAULT_ALGORITHM``) reads, for ``model_cfg`` (a
    ``ModelConfig``): what a target loaded without a run's config captures."""
    from specforge.config import Config

    return feature_layers(Config(model=model_cfg), num_layers)


def load_draft(path, target):
    """A saved draft folder of any algorithm (its config.json says which), frozen parts from ``target``."""
    from specforge.compat import read_draft_config

    return algorithm_of(read_draft_config(path), repr(str(path))).load(path, target)
