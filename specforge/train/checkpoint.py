"""Checkpoints: every save is an SGLang-loadable draft folder plus what resuming needs.

    <root>/step-000400/config.json          LlamaForCausalLMEagle3 config
    <root>/step-000400/model.safetensors    fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t, t2d
    <root>/step-000400/training_state.pt    optimizer (full, keyed by parameter name), scheduler, step, RNG
    <root>/latest -> step-000400            the last completed save of the run

Writes go to a hidden temp folder that is renamed into place, so a crash mid-save never leaves
a folder that looks complete; ``latest`` moves only after that. ``CheckpointManager`` is the one
component the single-process trainer and the Ray train workers save and resume with, plain or
FSDP2-sharded alike: full weights and full optimizer state are gathered by torch's distributed
state-dict API (collective over the train ranks) and written by one rank.
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
LATEST = "latest"


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
    """Atomically write ``<root>/step-N`` and point ``latest`` at it; keep only the newest
    ``keep_last`` step folders (0 = keep all; never the one just written)."""
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
    link = tmp.with_name(f".{LATEST}-{step}")
    link.unlink(missing_ok=True)
    link.symlink_to(final.name)
    os.replace(link, root / LATEST)
    if keep_last > 0:
        for old in list_checkpoints(root)[:-keep_last]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: str | Path) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | Path) -> Optional[Path]:
    """Where ``latest`` points if that folder is complete, else the newest complete step folder."""
    link = Path(root) / LATEST
    if link.is_symlink() and (Path(root) / os.readlink(link) / "model.safetensors").is_file():
        return Path(root) / os.readlink(link)
    ckpts = [p for p in list_checkpoints(root) if (p / "model.safetensors").is_file()]
    return ckpts[-1] if ckpts else None


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


# ------------------------------------------------------------------------------ the manager


class CheckpointManager:
    """Save and resume a ``DraftTrainer`` (its draft, optimizer, scheduler, step) under ``root``.

    One code path for a plain and an FSDP2-sharded draft: ``save``/``load`` are collective over
    the train ranks when sharded (call them on every train rank), and only ``writer`` writes.
    """

    def __init__(self, root: str | Path, keep_last: int = 0, writer: bool = True):
        self.root, self.keep_last, self.writer = Path(root), keep_last, writer
        self.saved_step = -1  # the step whose state is on disk (a save of it again is a no-op)

    def save(self, trainer) -> Optional[Path]:
        """Write the trainer's current step; the folder on the writer, None elsewhere or if saved."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        from specforge.parallel.fsdp import full_state_dict

        if trainer.step_count == self.saved_step:
            return None
        draft = trainer.draft
        keys = set(draft.export_state_dict())  # the SGLang keys (sharded entries: no gather)
        weights = {k: v for k, v in full_state_dict(draft).items() if k in keys}  # {} except on the writer
        # cpu_offload=True would keep the optimizer state on GLOBAL rank 0 only, a rollout rank when
        # disaggregated; so every train rank gathers it (one layer + lm_head: small).
        optim = get_optimizer_state_dict(draft, trainer.optimizer, options=StateDictOptions(full_state_dict=True))
        self.saved_step = trainer.step_count
        if not self.writer:
            return None
        state = {"step": trainer.step_count, "optimizer": optim, "full_optimizer_state": True,
                 "scheduler": trainer.scheduler.state_dict(), "rng": torch.get_rng_state()}
        return save_checkpoint(self.root, trainer.step_count, draft.config.to_hf_config(), weights, state, self.keep_last)

    def load(self, trainer, path: Optional[str | Path] = None) -> int:
        """Restore ``path`` (default: the latest checkpoint) into the trainer; returns the step to
        continue from (0 when there is nothing to resume)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, set_model_state_dict, set_optimizer_state_dict)

        path = path or latest_checkpoint(self.root)
        if path is None:
            return 0
        weights, state = load_draft_folder(path)[1], load_train_state(path)
        missing = set(trainer.draft.export_state_dict()) - set(weights)
        if missing or state is None:
            raise ValueError(f"{str(path)!r} cannot be resumed from: missing {sorted(missing) or 'training_state.pt'}")
        opts = StateDictOptions(full_state_dict=True, strict=False)  # the frozen embedding is not saved
        set_model_state_dict(trainer.draft, weights, options=opts)
        if state.get("full_optimizer_state"):
            set_optimizer_state_dict(trainer.draft, trainer.optimizer, state["optimizer"], options=opts)
        else:  # written before the manager: a plain optimizer.state_dict()
            trainer.optimizer.load_state_dict(state["optimizer"])
        trainer.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        trainer.step_count = self.saved_step = int(state["step"])
        return trainer.step_count
