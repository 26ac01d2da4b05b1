"""The algorithm registry, beside the seam (``specforge/seam.py``) at the ground of the package: the
registered names, and the lookups that turn a name, a saved draft folder or a GGUF into an algorithm.
It imports no torch and nothing of specforge but the seam; an algorithm's package is imported only
when its name is looked up. A new algorithm is its package plus one line in ``NAMES``.

The entry points, config validation and the runtime look algorithms up here; below the runtime
(models, data, parallel, memory terms, the trainer) a function is handed the role it uses and never
looks one up, and no code outside ``specforge/algorithms/`` compares a name (``tests/test_layering.py``).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Optional

from specforge.seam import BoundAlgorithm, DraftAlgorithm, missing_members

__all__ = ["NAMES", "get_algorithm", "owner", "bound_algorithm", "algorithm_of", "algorithm_name", "feature_layers",
           "load_draft", "by_gguf", "published_algorithm_name", "read_draft_config"]

# each name is a package specforge/algorithms/<name>/ exposing ALGORITHM
NAMES = ("eagle3", "dflash", "dspark", "eagle31", "peagle", "dflash2", "mtp", "xpress")


_CHECKED: set[str] = set()  # the algorithms found to play every role (each checked at its first lookup)


def get_algorithm(name: str) -> DraftAlgorithm:
    if name not in NAMES:
        raise ValueError(f"config key 'draft.algorithm'={name!r}: one of {', '.join(NAMES)}")
    algorithm = importlib.import_module(f"specforge.algorithms.{name}").ALGORITHM
    if name not in _CHECKED:  # registered means it plays every role of the seam: said at once, not at first use
        if missing := missing_members(algorithm):
            raise TypeError(f"draft algorithm {name!r} (specforge/algorithms/{name}) lacks {', '.join(missing)}: "
                            "every registered algorithm plays every role of specforge/seam.py")
        _CHECKED.add(name)
    return algorithm


def bound_algorithm(cfg) -> BoundAlgorithm:
    """The run's algorithm (``draft.algorithm``), bound to the run's options (``seam.RunFacts``)."""
    return get_algorithm(cfg.draft.algorithm).bind(cfg)


def owner(claims) -> Optional[str]:
    """The one algorithm of those that claim a folder (names, ``owns_checkpoint`` / ``owns_published``):
    a claimant whose format another claimant ``refines`` gives way to it. None if none claims it; a
    RuntimeError if two formats of their own both do (a registry defect, never a user's)."""
    claims = list(claims)
    kept = [n for n in claims if not any(get_algorithm(o).refines == n for o in claims)]
    if len(kept) > 1:
        raise RuntimeError(f"draft algorithms {', '.join(sorted(kept))} each own the same folder and none "
                           "refines another's format (seam.Format.refines)")
    return kept[0] if kept else None


def algorithm_name(hf_config: dict, where: str = "draft") -> str:
    """The algorithm of a saved draft, from its config.json: the algorithm that owns it
    (``owns_checkpoint``; where a refinement of a format and that format both do, the refinement)."""
    if (name := owner(n for n in NAMES if get_algorithm(n).owns_checkpoint(hf_config))) is not None:
        return name
    known = sorted({get_algorithm(n).architecture for n in NAMES})
    raise ValueError(f"{where}: config.json architectures {hf_config.get('architectures') or []} is none of "
                     f"{', '.join(known)}; not a draft checkpoint this project wrote")


def published_algorithm_name(hf_config: dict, where: str) -> str:
    """The algorithm of a published draft folder (``draft.init_from``): ours or an engine's format
    (``owns_published``, two claims resolved as ``owner`` says); a ValueError naming ``where`` if none reads it."""
    if (name := owner(n for n in NAMES if get_algorithm(n).owns_published(hf_config))) is not None:
        return name
    kind = hf_config.get("speculators_model_type") or hf_config.get("architectures") or []
    raise ValueError(f"{where}: config.json ({kind}) is not a draft folder any algorithm here reads "
                     f"({', '.join(NAMES)}: ours, SGLang's EAGLE-3, a speculators/vLLM EAGLE-3 export or "
                     "z-lab's DFlash)")


def algorithm_of(hf_config: dict, where: str = "draft") -> DraftAlgorithm:
    """The algorithm of a saved draft, from its config.json ``architectures``."""
    return get_algorithm(algorithm_name(hf_config, where))


def by_gguf(arch: str, tensor_names) -> Optional[DraftAlgorithm]:
    """The algorithm whose draft GGUF has ``general.architecture`` ``arch`` and these tensors (``owns_gguf``;
    two claims resolved as ``owner`` says); None: none of ours."""
    name = owner(n for n in NAMES if get_algorithm(n).owns_gguf(arch, set(tensor_names)))
    return None if name is None else get_algorithm(name)


def feature_layers(cfg, num_layers: int) -> list[int]:
    """The target layer outputs the run's draft algorithm reads (``model.aux_layer_ids`` checked
    against a target of ``num_layers`` layers, else the algorithm's default)."""
    return bound_algorithm(cfg).feature_layers(num_layers)


def read_draft_config(path: str | Path) -> dict:
    """config.json of a draft folder (no weights), with the error the checkpoint loader gives."""
    f = Path(path) / "config.json"
    if not f.is_file():
        raise ValueError(f"{str(path)!r} is not a draft checkpoint (needs config.json and model.safetensors)")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(f)!r} is not valid JSON ({e}): a truncated or hand-edited draft checkpoint") from None


def load_draft(path, target):
    """A saved draft folder of any algorithm (its config.json says which), frozen parts from ``target``."""
    return algorithm_of(read_draft_config(path), repr(str(path))).load(path, target)
