"""The one reader of the weights and state files a user can name (and the check that a folder a run
writes to can be written, ``check_writable``): a draft folder (``--draft``,
``draft.init_from``, ``adapt.draft``, an export), a checkpoint's ``training_state.pt``, a draft-vocab
file, a feature-store shard, the target's weights.

A truncated, empty or foreign file (another format, a text file) is one ``ValueError`` naming the
file, what it is and the way forward, never the parser's own message alone ("invalid header length",
"PytorchStreamReader failed reading zip archive"): every entry point prints it as its one ``error:``
line. Readers elsewhere call these; ``tests/test_bad_input.py`` hands each entry point a truncated file.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

BROKEN = "a truncated, empty or foreign file"


def _unreadable(path: Path, what: str, fix: str, e: BaseException) -> ValueError:
    size = path.stat().st_size if path.is_file() else None
    detail = "empty, 0 bytes" if size == 0 else f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
    return ValueError(f"{what} {str(path)!r} cannot be read ({detail}): {BROKEN}; {fix}")


def open_safetensors(path: str | Path, what: str, fix: str):
    """``safe_open`` of ``path`` (a context manager: header read, tensors on demand)."""
    path = Path(path)
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # SafetensorError (bad header, truncated) and OSError mean the same to the user
        raise _unreadable(path, what, fix, e) from None


def read_safetensors(path: str | Path, what: str, fix: str) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file, on the host."""
    path = Path(path)
    try:
        with open_safetensors(path, what, fix) as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except ValueError:
        raise
    except Exception as e:  # a header that promises more bytes than the file holds fails here
        raise _unreadable(path, what, fix, e) from None


def read_safetensors_folder(folder: str | Path, what: str, fix: str) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's safetensors files (one or sharded), in file-name order."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(read_safetensors(f, what, fix))
    return out


def read_torch(path: str | Path, what: str, fix: str, **kwargs: Any) -> Any:
    """``torch.load`` of ``path`` onto the host (``map_location="cpu"``: a file written on a GPU
    loads where there is none; the caller places what it restores)."""
    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", **kwargs)
    except Exception as e:  # a truncated zip, a pickle error: the same to the user
        raise _unreadable(path, what, fix, e) from None


def check_writable(key: str, folder: str | Path) -> None:
    """ValueError naming ``key`` unless ``folder`` is (or can be made as) a folder this process can
    write. Probed with a real temporary file in the nearest existing folder: root passes every
    mode-bit check, a read-only mount or a full disk does not."""
    path = Path(folder).expanduser()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "is a file" if existing == path else f"is under {str(existing)!r}, a file"
        raise ValueError(f"config key {key!r}={str(folder)!r} {what}, not a folder; name a folder (or move the file)")
    try:
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as e:
        raise ValueError(f"config key {key!r}={str(folder)!r} is not writable ({e.strerror} in {str(existing)!r}); "
                         "name a folder this user can write") from None


def publish_folder(tmp: Path, out: Path, done: str) -> None:
    """Move the finished folder ``tmp`` to ``out`` atomically: a half-written one is never seen. Where another
    process (a concurrent builder of the same cache entry) published its own first, that one is kept, told by
    its ``done`` file, and ``tmp`` is left for the caller to remove; any other folder there is an error."""
    try:
        os.replace(tmp, out)
    except OSError:  # a non-empty folder is already there (ENOTEMPTY/EEXIST)
        if not (Path(out) / done).is_file():  # not a finished one: the error stands
            raise


def human_bytes(n: float) -> str:
    """``n`` bytes as a person reads them: ``512 B``, ``1.5 MiB``, ``2.0 TiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"
