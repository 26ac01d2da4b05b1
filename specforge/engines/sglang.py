"""SGLang's side: a saved draft folder and the files SGLang serves of it.

Each algorithm's checkpoint checks and per-engine exports live in its package
(``specforge/algorithms/<name>/export.py``); an EAGLE-3 checkpoint IS SGLang's
``LlamaForCausalLMEagle3`` format, a DFlash one z-lab's ``DFlashDraftModel`` folder that SGLang
serves with ``--speculative-algorithm DFLASH``. Here: finding a checkpoint and copying what is served.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from specforge.training.checkpoint import latest_checkpoint

SERVED_FILES = ("config.json", "model.safetensors")  # training_state.pt is resume state, not served


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder (``step-*``), or a checkpoint root: its ``latest`` checkpoint."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"--draft {str(path)!r} does not exist; pass a checkpoint folder (step-*) "
                         "or the run's checkpoint root")
    if (path / "config.json").is_file() or not path.is_dir():
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise ValueError(f"--draft {str(path)!r} is not a draft checkpoint: no config.json and no step-* "
                         "checkpoint inside; pass a checkpoint folder (step-*) or the run's checkpoint root")
    return found


def copy_served(draft_dir: str | Path, out_dir: str | Path) -> Path:
    """Copy the served files of a (validated) checkpoint into ``out_dir`` (which must exist)."""
    for name in SERVED_FILES:
        shutil.copy2(Path(draft_dir) / name, Path(out_dir) / name)
    return Path(out_dir)
