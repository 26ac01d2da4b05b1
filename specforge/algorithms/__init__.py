"""Draft algorithms behind one seam: the runtime trains, checkpoints and evaluates any of them.

An algorithm is one package (``eagle3/``, ``dflash/``) exposing ``ALGORITHM``, an object with the
hooks of :class:`~specforge.algorithms.base.DraftAlgorithm`: which target layers it reads, how its
draft is built, its loss and metrics, how its checkpoint is loaded, its proposer for the eval.
The runtime (placements, planner, feature sources, store, checkpoints, FSDP2, the loop, resume)
asks ``get_algorithm(cfg.draft.algorithm)`` and never branches on the name.
"""

from __future__ import annotations

import importlib

from specforge.algorithms.base import DraftAlgorithm

NAMES = ("eagle3", "dflash", "dspark")
# config.json "architectures" entry -> algorithm (what a saved draft folder says it is)
ARCHITECTURES = {"LlamaForCausalLMEagle3": "eagle3", "DFlashDraftModel": "dflash"}


def get_algorithm(name: str) -> DraftAlgorithm:
    if name not in NAMES:
        raise ValueError(f"config key 'draft.algorithm'={name!r}: one of {', '.join(NAMES)}")
    return importlib.import_module(f"specforge.algorithms.{name}").ALGORITHM


def algorithm_name(hf_config: dict, where: str = "draft") -> str:
    """The algorithm name of a saved draft, from its config.json ``architectures`` (no import)."""
    archs = hf_config.get("architectures") or []
    for a in archs:
        if a in ARCHITECTURES:
            return ARCHITECTURES[a]
    raise ValueError(f"{where}: config.json architectures {archs} is none of {', '.join(ARCHITECTURES)}; "
                     "not a draft checkpoint this project wrote")


def algorithm_of(hf_config: dict, where: str = "draft") -> DraftAlgorithm:
    """The algorithm of a saved draft, from its config.json ``architectures``."""
    return get_algorithm(algorithm_name(hf_config, where))


def load_draft(path, target):
    """A saved draft folder of any algorithm (its config.json says which), frozen parts from ``target``."""
    from specforge.compat import read_draft_config

    return algorithm_of(read_draft_config(path), repr(str(path))).load(path, target)
