"""Checkpoints: every save is an SGLang-loadable draft folder plus what resuming needs.

    <root>/step-000400/config.json          LlamaForCausalLMEagle3 config
    <root>/step-000400/model.safetensors    fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t, t2d
                                            (floats in config.json's torch_dtype: what a server loads)
    <root>/step-000400/training_state.pt    fp32 master weights, optimizer (full, keyed by parameter
                                            name), scheduler, step, data cursor, RNG states, and the
                                            run identity (hashes of target, vocab, data + the config
                                            keys a resume must share)
    <root>/latest -> step-000400            the last completed save of the run

Writes go to a hidden temp folder that is renamed into place, so a crash (even SIGKILL) mid-save
never leaves a folder that looks complete; ``latest`` moves only after that. Folders and files get
the permissions a plain mkdir/open would (umask applied), not mkdtemp's 0700, so an inference
server running as another user can read them. Resume restores the fp32 master weights from the
training state (the served file may be bf16), so it continues exactly. ``CheckpointManager`` is the one
component the single-process trainer and the Ray train workers save and resume with, plain or
FSDP2-sharded alike: full weights (not the frozen embedding) and full optimizer state are gathered,
shard by shard, into the host memory of the one rank that writes (``parallel/fsdp.py``; collective
over the train ranks): the other ranks hold and copy nothing.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import numpy as np
import torch
from safetensors.torch import save_file

from specforge import failpoints
from specforge.files import human_bytes, read_safetensors, read_torch
from specforge.parallel.fsdp import full_optimizer_state, full_state_dict, is_first_rank

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
    tensors = served_tensors(weights, hf_config.get("torch_dtype"))
    need = int(SAVE_MARGIN * (sum(t.nbytes for t in tensors.values()) + tensor_bytes(train_state)) + SAVE_SLACK)
    usage = shutil.disk_usage(root)
    free = usage.free
    if usage.total and free < need:  # refused before a byte is written (a mount that reports no size: unchecked)
        raise OSError(errno.ENOSPC, f"step {step} needs ~{human_bytes(need)}, {human_bytes(free)} free")
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-step-{step}-"))
    try:
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True))
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "step": str(step)})
        failpoints.hit("checkpoint.write")
        if train_state is not None:
            torch.save(train_state, tmp / "training_state.pt")
        make_readable(tmp)
        for f in tmp.iterdir():  # on disk before the folder is named: a node that loses power after the
            sync(f)  # rename must not come back with a complete-looking folder of empty files
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        sync(root)
    except OSError as e:  # the disk filled (or a file-size limit hit) mid-write: say what it needed
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise
        raise OSError(e.errno, f"{e.strerror or e} while writing step {step}, which needs ~{human_bytes(need)} "
                               f"({human_bytes(free)} were free when it started)") from e
    finally:  # a partial folder never stays (and ``latest`` moves only after the rename)
        shutil.rmtree(tmp, ignore_errors=True)
    failpoints.hit("checkpoint.publish")
    link = tmp.with_name(f".{LATEST}-{step}")
    link.unlink(missing_ok=True)
    link.symlink_to(final.name)
    os.replace(link, root / LATEST)
    sync(root)
    if keep_last > 0:
        for old in list_checkpoints(root)[:-keep_last]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    return final


SAVE_MARGIN, SAVE_SLACK = 1.05, 1 << 20  # a save's free-space check: its tensors' bytes + 5% + 1 MiB of pickle


def sync(path: Path) -> None:
    """Flush a file's (or a folder's entries') writes to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # a filesystem that cannot sync a folder (some network mounts): the rename still stands
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def clear_interrupted(root: str | Path) -> list[str]:
    """Remove what saves killed mid-way left under ``root`` (their hidden temp folders and links: never taken
    as a checkpoint, but they fill the disk); the names removed. Call it only where no save of ``root`` can
    be running (a run's start, before any step)."""
    root = Path(root)
    if not root.is_dir():
        return []
    left = sorted(p for p in root.iterdir() if p.name.startswith(".tmp-step-")
                  or (p.name.startswith(f".{LATEST}-") and p.is_symlink()))
    for p in left:
        if p.is_symlink() or not p.is_dir():
            p.unlink(missing_ok=True)
        else:
            shutil.rmtree(p, ignore_errors=True)
    return [p.name for p in left]



def tensor_bytes(obj: Any) -> int:
    """The bytes of every tensor in ``obj`` (dicts, lists and tuples walked): what ``torch.save`` writes, less
    its pickle."""
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def served_tensors(weights: dict[str, torch.Tensor], dtype_name: Optional[str]) -> dict[str, torch.Tensor]:
    """CPU copies of ``weights`` with floating tensors in ``dtype_name`` (config.json's torch_dtype,
    so the file holds what it declares); d2t/t2d (int64/bool) keep their dtypes."""
    dtype = getattr(torch, dtype_name) if dtype_name else None
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise ValueError(f"config.json torch_dtype {dtype_name!r} is not a torch dtype name")

    def cast(v: torch.Tensor) -> torch.Tensor:
        v = v.detach().to("cpu")
        return (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous()

    return {k: cast(v) for k, v in weights.items()}


def make_readable(folder: Path) -> None:
    """Give ``folder`` and its files the modes a plain mkdir/open would (0777/0666 minus the umask):
    mkdtemp makes 0700 and some writers 0600, which another user's server cannot read."""
    mask = os.umask(0)
    os.umask(mask)
    folder.chmod(0o777 & ~mask)
    for f in folder.iterdir():
        f.chmod((0o777 if f.is_dir() else 0o666) & ~mask)


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
    try:
        hf_config = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(cfg_file)!r} is not valid JSON ({e}): "
                         "a truncated or hand-edited draft checkpoint") from None
    return hf_config, read_safetensors(w_file, "draft checkpoint file", "use another checkpoint folder (step-*) or "
                                       "retrain (a truncated or corrupt draft checkpoint)")


def load_train_state(path: str | Path, mmap: bool = False) -> Optional[dict[str, Any]]:
    """``training_state.pt`` of a checkpoint folder (None without one); ``mmap`` reads only what is used."""
    f = Path(path) / "training_state.pt"
    if not f.is_file():
        return None
    return read_torch(f, "checkpoint state", "a truncated or corrupt checkpoint: move that step folder away to resume "
                      "from the one before, or start fresh (checkpoint.resume=false)", weights_only=False, mmap=mmap)


def recorded_rows(path: str | Path) -> list[dict]:
    """The metric rows a checkpoint folder recorded (``kind``, ``step``, metrics), oldest first."""
    state = load_train_state(path, mmap=True)
    return list((state or {}).get("recent_rows", []))


class CheckpointNotSaved(OSError):
    """A save could not be written where asked; the message says where the state went instead."""


def rescue_roots(root: Path) -> list[Path]:
    """Where a save that cannot be written under ``root`` goes instead, in order: a sibling
    folder, then the temp folder (the state must not be lost because one disk is full or read-only)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return [root.with_name(f"{root.name}.rescue-{stamp}"),
            Path(tempfile.gettempdir()) / f"specforge-rescue-{stamp}-{os.getpid()}"]


def save_or_rescue(root: Path, step: int, *args, **kwargs) -> Path:
    """``save_checkpoint``; if it fails (OSError), the same save under a rescue root, then
    ``CheckpointNotSaved`` naming both. Raises the first error if no rescue root works either."""
    try:
        return save_checkpoint(root, step, *args, **kwargs)
    except OSError as first:
        for alt in rescue_roots(root):
            try:
                saved = save_checkpoint(alt, step, *args, **kwargs)
            except OSError:
                continue
            raise CheckpointNotSaved(
                f"could not write checkpoint step {step} under {str(root)!r} ({first.strerror or first}); "
                f"it is saved in {str(saved)!r} instead: resume from it with checkpoint.dir={alt}, "
                "or copy it where you want it") from first
        raise


def set_aside(root: str | Path) -> Optional[Path]:
    """Move the checkpoints under ``root`` (step folders and ``latest``) into ``root/previous-<time>``
    so that a fresh run (``checkpoint.resume=false``) never overwrites them; that folder, or None."""
    root = Path(root)
    old = list_checkpoints(root)
    if not old:
        return None
    dest = root / f"previous-{time.strftime('%Y%m%d-%H%M%S')}"
    while dest.exists():
        dest = dest.with_name(dest.name + "-1")
    dest.mkdir()
    for p in old + [root / LATEST]:
        if p.is_symlink() or p.exists():
            os.replace(p, dest / p.name)
    return dest


# ------------------------------------------------------------------------------ what a resume must share


def tensor_digest(named: Iterable[tuple[str, torch.Tensor]], sample: int = 0,
                  dtype: Optional[torch.dtype] = None) -> str:
    """sha256 over names, shapes, dtypes and values: every value, or ``sample`` evenly strided values
    per tensor (a cheap fingerprint of a large model that still tells two fine-tunes apart).
    ``dtype``: the digest the floating tensors would have had if loaded in that dtype."""
    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda kv: kv[0]):
        flat = t.detach().reshape(-1)
        if sample and flat.numel() > sample:
            flat = flat[:: flat.numel() // sample][:sample]
        if dtype is not None and t.is_floating_point():
            flat = flat.to(dtype)
        h.update(f"{name}:{tuple(t.shape)}:{flat.dtype}".encode())
        h.update(flat.to("cpu", torch.float64 if t.is_floating_point() else torch.int64).numpy().tobytes())
    return h.hexdigest()[:16]


def data_cursor(step: int, global_batch: int, num_samples: int) -> dict[str, int]:
    """Where the data order stands after ``step`` optimizer steps (order = f(seed, epoch, step))."""
    epoch, offset = divmod(step * global_batch, max(num_samples, 1))
    return {"step": step, "epoch": epoch, "sample_offset": offset, "global_batch": global_batch,
            "num_samples": num_samples}


# Run-identity entries that are not config keys themselves: the keys a user sets to change them.
IDENTITY_KEYS = {
    "total_steps": "total_steps (the LR schedule's length in steps, from train.max_steps and train.epochs)"}
SCHEDULE = ("total_steps", "train.lr", "train.min_lr_ratio", "train.warmup_steps")  # what "train longer" changes


def identity_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``name: checkpoint X, this run Y`` for every entry of the run identity that differs."""
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, "<absent>"), current.get(key, "<absent>")
        if a != b:
            out.append(f"{IDENTITY_KEYS.get(key, key)}: checkpoint {a!r}, this run {b!r}")
    return out


def resume_refusal(path: str | Path, saved: dict[str, Any], current: dict[str, Any]) -> str:
    """Why a checkpoint is not resumed, and the ways forward (a changed schedule has two)."""
    diffs = identity_differences(saved, current)
    changed = {k for k in set(saved) | set(current) if saved.get(k, "<absent>") != current.get(k, "<absent>")}
    msg = f"checkpoint {str(path)!r} is from a different run, refusing to resume from it: " + "; ".join(diffs)
    if changed <= set(SCHEDULE):
        return (msg + ". A resumed run keeps the schedule it started with (its losses stay exact): restore these "
                "values to resume it; or, to train the finished draft longer, start a new run from this checkpoint "
                f"(draft.init_from={path} with another train.output_dir and the new schedule; README, "
                "\"Training a finished draft longer\")")
    return (msg + ". Resume with the same target, data, vocab and these config values, or start fresh "
            "(checkpoint.resume=false, or another checkpoint.dir)")


def capture_rng() -> dict[str, Any]:
    """Every RNG a step may draw from (torch CPU + accelerator, Python, NumPy)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Any) -> None:
    if isinstance(state, torch.Tensor):  # written before the RNG dict: torch CPU only
        torch.set_rng_state(state)
        return
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        # a checkpoint saved where more GPUs were visible: the streams of the GPUs this process has
        torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])


# ------------------------------------------------------------------------------ the manager


class CheckpointManager:
    """Save and resume a ``DraftTrainer`` (its draft, optimizer, scheduler, step, RNG) under ``root``.

    One code path for a plain and an FSDP2-sharded draft: ``save``/``load`` are collective over
    the train ranks when sharded (call them on every train rank), and only ``writer`` writes.
    ``identity`` (``trainer.run_identity``: hashes of target, vocab mapping and data, the data
    cursor's global batch and sample count, the config keys that change what a step computes)
    is written with every save; ``load`` refuses a checkpoint whose identity differs, naming what.
    """

    def __init__(self, root: str | Path, keep_last: int = 0, writer: bool = True,
                 identity: Optional[dict[str, Any]] = None):
        self.root, self.keep_last, self.writer = Path(root), keep_last, writer
        self.identity = dict(identity or {})
        self.saved_step = -1  # the step whose state is on disk (a save of it again is a no-op)

    def save(self, trainer, rows: Sequence[dict] = ()) -> Optional[Path]:
        """Write the trainer's current step; the folder on the writer, None elsewhere or if saved.
        ``rows``: the newest metric rows (``recorded_rows`` reads them back when resuming)."""
        if trainer.step_count == self.saved_step:
            return None
        draft = trainer.draft
        assert self.writer == is_first_rank(draft), (
            "the writer must be the FSDP mesh's first rank (where the gathers land)")
        keys = set(draft.export_state_dict())  # the SGLang keys (sharded entries: no gather)
        # Both gathers are collective and land in the writer's host memory only ({} elsewhere); the
        # frozen target embedding is not saved, so it is not copied either.
        weights = {k: v for k, v in full_state_dict(draft, include_frozen=False).items() if k in keys}
        optim = full_optimizer_state(draft, trainer.optimizer)
        self.saved_step = trainer.step_count
        if not self.writer:
            return None
        step = trainer.step_count
        state = {"step": step, "optimizer": optim, "full_optimizer_state": True,
                 "model": weights,  # fp32 master weights, in host memory
                 "scheduler": trainer.scheduler.state_dict(), "rng": capture_rng(), "identity": self.identity,
                 "recent_rows": [dict(r) for r in rows if r["step"] <= step]}
        if "global_batch" in self.identity:
            state["cursor"] = data_cursor(step, self.identity["global_batch"], self.identity["num_samples"])
        return save_or_rescue(self.root, step, trainer.algorithm.hf_config(draft), weights, state, self.keep_last)

    def check(self, path: str | Path, state: dict[str, Any]) -> None:
        """Refuse a checkpoint of another run (ValueError naming every difference)."""
        saved = state.get("identity")
        if saved is None or not self.identity:  # written before identities, or nothing to compare
            return
        if identity_differences(saved, self.identity):
            raise ValueError(resume_refusal(path, saved, self.identity))

    def load(self, trainer, path: Optional[str | Path] = None) -> int:
        """Restore ``path`` (default: the latest checkpoint) into the trainer; returns the step to
        continue from (0 when there is nothing to resume)."""
        path = path or latest_checkpoint(self.root)
        if path is None:
            return 0
        state = load_train_state(path)
        if state is None:
            raise ValueError(f"{str(path)!r} cannot be resumed from: missing training_state.pt")
        self.check(path, state)
        weights = state.get("model") or load_draft_folder(path)[1]  # older saves: the served file
        missing = set(trainer.draft.export_state_dict()) - set(weights)
        if missing:
            raise ValueError(f"{str(path)!r} cannot be resumed from: missing {sorted(missing)}")
        from torch.distributed.checkpoint.state_dict import (  # lazy: heavy (torch) distributed.tensor
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, strict=False)  # the frozen embedding is not saved
        set_model_state_dict(trainer.draft, weights, options=opts)
        if state.get("full_optimizer_state"):
            set_optimizer_state_dict(trainer.draft, trainer.optimizer, state["optimizer"], options=opts)
        else:  # written before the manager: a plain optimizer.state_dict()
            trainer.optimizer.load_state_dict(state["optimizer"])
        trainer.scheduler.load_state_dict(state["scheduler"])
        restore_rng(state["rng"])
        trainer.step_count = self.saved_step = int(state["step"])
        return trainer.step_count
