"""The hand-off of hidden states from a vLLM engine to our client: how a request's file is written, how
a failed write is told, where the files go, and what the folder must hold.

Imported by both sides: the connector inside the engine (``models/vllm_connector.py``, vLLM's venv:
torch and safetensors only here, nothing else of specforge) and the client
(``models/vllm_engine.py``).

* A file appears complete or not at all: written under a temporary name (``.part``), then renamed
  to the path the engine returned; a client waits for that path alone (``models/arrivals``).
* A write that fails (a full ``/dev/shm``, a disk error) removes its ``.part`` and puts at the path a
  small file holding only the error (``ERROR_KEY``): the client raises it at once instead of waiting
  for its request timeout, and the engine goes on serving (a raise inside its step would kill it).
* The folder is sized before the engine starts (``pick_folder``): the client keeps up to
  ``MAX_INFLIGHT`` requests in flight, each a file of up to ``max_model_len x (K + 1) x hidden`` values.
  Shared memory where it holds them (no disk round trip), else the temp folder on disk, said in one
  line; ``rollout.vllm_storage`` names the folder, refused when too small.
* Each file names what captured it (``origin``: the model the engine serves, the layer ids it
  captures, from the engine's own config): the client refuses another engine's states.
* Each engine's folder is named after the host and process that own it (``specforge-vllm-<host>-<pid>-...``):
  a start removes this host's folders of owners that are gone (a SIGKILLed worker never ran its ``close``). A
  user-run engine's fixed folder is swept of files no client will read (``sweep_stale``) when a client
  first hears from it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

ERROR_KEY = "specforge_error"  # the one tensor of a failed write's file: the error's UTF-8 bytes
DISCARD = "specforge_discard"  # a request's kv_transfer_params key: write no hidden states (a generation)
MAX_INFLIGHT = 64  # requests the client keeps in flight (models/vllm_engine.VllmEngine.hidden_states)
PREFIX = "specforge-vllm-"
SHM = "/dev/shm"


class HandoffFailed(RuntimeError):
    """The engine could not write a request's hidden states; the message is its error."""


def save_atomically(tensors: dict, filename: str, metadata: Optional[dict] = None) -> bool:
    """Write ``tensors`` (and the header ``metadata``: what captured them, ``origin``) to ``filename`` as
    a whole (a ``.part`` renamed into place); on failure the ``.part`` goes and an error file takes the
    path (``tell_failure``). True if the tensors were written."""
    tmp = f"{filename}.{os.getpid()}.part"
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
        os.replace(tmp, filename)
        return True
    except Exception as e:  # noqa: BLE001 - any failure is told to the client, never raised in the engine
        with contextlib.suppress(OSError):
            os.remove(tmp)
        tell_failure(filename, e)
        return False


def tell_failure(filename: str, err: BaseException) -> None:
    """Put at ``filename`` a file holding only ``err`` (a few hundred bytes: it fits where the hidden
    states did not). Where even that fails, the client waits for its request timeout."""
    msg = " ".join(f"{type(err).__name__}: {err}".split())[:400].encode()
    tmp = f"{filename}.{os.getpid()}.err.part"
    try:
        save_file({ERROR_KEY: torch.frombuffer(bytearray(msg), dtype=torch.uint8)}, tmp)
        os.replace(tmp, filename)
    except Exception:  # noqa: BLE001 - nothing more to tell with
        with contextlib.suppress(OSError):
            os.remove(tmp)


def origin(model: str, layer_ids) -> dict:
    """The header every file carries: the model the engine serves and the layer ids (vLLM's) it captures."""
    return {"model": str(model), "layer_ids": ",".join(str(int(i)) for i in layer_ids)}


def read(path: str) -> tuple[dict, dict]:
    """``(tensors, header metadata)`` of a request's file; ``HandoffFailed`` with the engine's error for
    an error file."""
    with safe_open(path, "pt") as f:  # one open: the header's metadata and the tensors
        meta = f.metadata() or {}
        data = {k: f.get_tensor(k) for k in f.keys()}
    if ERROR_KEY in data:
        raise HandoffFailed(bytes(data[ERROR_KEY].tolist()).decode(errors="replace"))
    return data, meta


def same_model(a: str, b: str) -> bool:
    """Whether two model paths name one model: the same folder where both are local folders, else the
    same last path part (an engine on another host may mount it elsewhere)."""
    if os.path.isdir(a) and os.path.isdir(b):
        return os.path.realpath(a) == os.path.realpath(b)
    return os.path.basename(os.path.normpath(a)) == os.path.basename(os.path.normpath(b))


def request_bytes(max_tokens: int, layers: int, hidden: int, dtype: torch.dtype) -> int:
    """The largest file one request writes: ``max_tokens`` x ``layers`` x ``hidden`` values (+ ids)."""
    return max_tokens * (layers * hidden * dtype.itemsize + 8)


def owner_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _owner_prefix() -> str:
    """This host's part of an engine folder's name: a folder on a filesystem other hosts share is
    theirs to sweep, not ours (a pid says nothing across hosts)."""
    return f"{PREFIX}{socket.gethostname()}-"


def sweep(root: str, alive: Callable[[int], bool] = owner_alive) -> list[str]:
    """Remove this host's engine folders under ``root`` whose owner process is gone; their paths."""
    gone = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            m = re.fullmatch(re.escape(_owner_prefix()) + r"(\d+)-.*", entry.name)
            if m and entry.is_dir(follow_symlinks=False) and not alive(int(m.group(1))):
                shutil.rmtree(entry.path, ignore_errors=True)
                gone.append(entry.path)
    return gone


def sweep_stale(folder: str, older_than_s: float, now: Optional[float] = None) -> list[str]:
    """Remove the files in a user-run engine's fixed folder (``--vllm-storage``) that no client will read:
    written more than ``older_than_s`` ago (a client waits for its file at most its request timeout);
    their paths."""
    now = time.time() if now is None else now
    gone = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            if entry.name.endswith((".safetensors", ".part")) and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    if now - entry.stat().st_mtime > older_than_s:
                        os.remove(entry.path)
                        gone.append(entry.path)
    return gone


def pick_folder(need: int, configured: Optional[str] = None, shm: str = SHM,
                disk: Optional[str] = None) -> tuple[str, Optional[str]]:
    """``(root, note)``: where an engine's hand-off folder goes, given the bytes ``need`` it may hold at
    once. ``configured`` (``rollout.vllm_storage``): there, or ValueError naming the key when its
    filesystem has less free. Else shared memory where it is writable and holds ``need``, else the temp
    folder on disk (``disk``) with a one-line ``note`` saying why; ValueError when neither does."""
    def free(path: str) -> int:
        return shutil.disk_usage(path).free

    gib = 2.0**30
    if configured is not None:
        try:
            Path(configured).expanduser().mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"config key 'rollout.vllm_storage'={configured!r} cannot be made ({e.strerror}): "
                             "name a folder this user can write") from None
        if free(configured) < need:
            raise ValueError(f"config key 'rollout.vllm_storage'={configured!r} has {free(configured) / gib:.2f} GiB "
                             f"free; the engine's hidden states need up to {need / gib:.2f} GiB there "
                             f"({MAX_INFLIGHT} requests of the longest sample): name a folder with room")
        return configured, None
    disk = disk or tempfile.gettempdir()
    shm_free = free(shm) if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
    if shm_free is not None and shm_free >= need:
        return shm, None
    if free(disk) >= need:
        why = (f"{shm} has {shm_free / gib:.2f} GiB free" if shm_free is not None else f"no writable {shm}")
        return disk, (f"rollout.backend=vllm: {why}, the engine's hidden states need up to {need / gib:.2f} GiB "
                      f"({MAX_INFLIGHT} requests of the longest sample): they go through {disk} on disk "
                      "(set rollout.vllm_storage to choose the folder)")
    raise ValueError(f"rollout.backend=vllm: the engine's hidden states need up to {need / gib:.2f} GiB "
                     f"({MAX_INFLIGHT} requests of the longest sample); neither {shm} nor {disk} has that free: set "
                     "config key 'rollout.vllm_storage' to a folder with room (or lower data.max_length)")


def engine_folder(root: str) -> str:
    """A new private hand-off folder under ``root``, named after this process (``sweep``)."""
    return tempfile.mkdtemp(prefix=f"{_owner_prefix()}{os.getpid()}-", dir=root)
