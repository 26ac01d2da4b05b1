"""Checkpoints: every save is an SGLang-loadable draft folder plus what resuming needs.

    <root>/step-000400/config.json          LlamaForCausalLMEagle3 config
    <root>/step-000400/model.safetensors    fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t, t2d
    <root>/step-000400/training_state.pt    optimizer, scheduler, step, RNG, sampler position

Writes go to a hidden temp folder that is renamed into place, so a crash mid-save never leaves
a folder that looks complete. The caller gathers sharded weights first (FSDP2 full state dict).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file, save_file

_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def save_checkpoint(
    root: str | Path,
    step: int,
    hf_config: dict,
    weights: dict[str, torch.Tensor],
    train_state: Optional[dict[str, Any]] = None,
    keep_last: int = 0,
) -> Path:
    """Atomically write ``<root>/step-N``; keep only the newest ``keep_last`` (0 = keep all)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = step_dir(root, step)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-step-{step}-"))
    try:
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True))
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in weights.items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "step": str(step)})
        if train_state is not None:
            torch.save(train_state, tmp / "training_state.pt")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _prune(root, keep_last)
    return final


def list_checkpoints(root: str | Path) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | Path) -> Optional[Path]:
    ckpts = [p for p in list_checkpoints(root) if (p / "model.safetensors").is_file()]
    return ckpts[-1] if ckpts else None


def _prune(root: Path, keep_last: int) -> None:
    if keep_last > 0:
        for old in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)


def load_draft_folder(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json as dict, weights) of a saved draft folder, with a clear error if it is not one."""
    path = Path(path)
    cfg_file, w_file = path / "config.json", path / "model.safetensors"
    if not cfg_file.is_file() or not w_file.is_file():
        raise ValueError(f"{str(path)!r} is not a draft checkpoint (needs config.json and model.safetensors)")
    return json.loads(cfg_file.read_text()), load_file(str(w_file))


def load_train_state(path: str | Path) -> Optional[dict[str, Any]]:
    f = Path(path) / "training_state.pt"
    return torch.load(f, map_location="cpu", weights_only=False) if f.is_file() else None


def load_draft(path: str | Path, target=None):
    """An ``Eagle3Draft`` from a saved folder; the frozen embedding comes from ``target``."""
    from specforge.models.draft import Eagle3Draft, Eagle3DraftConfig

    hf_config, weights = load_draft_folder(path)
    draft = Eagle3Draft(Eagle3DraftConfig.from_hf_config(hf_config))
    if target is not None and "embed_tokens.weight" not in weights:
        draft.init_embeddings_from_target(target.embed_weight_VH)
    elif "embed_tokens.weight" not in weights:
        raise ValueError(f"{str(path)!r} has no embedding: pass the target to take it from")
    draft.load_export_state_dict(weights)
    return draft.eval()
