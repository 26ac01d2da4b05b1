"""Run a function on N local ranks (processes of their own, one default process group each).

For tests and benchmarks on one machine; Ray workers join their group themselves.
``fn(rank, world_size, *args)`` must be importable (it is pickled by reference).

The ranks are forked from the process' fork server (``specforge.forkserver``), which imported torch
once: a spawned rank spent ~1.5 s of CPU importing torch before its first op, and the test suite
starts many ranks. Each rank is handed the caller's environment at the call.
"""

from __future__ import annotations

import faulthandler
import os
import time
import uuid
import warnings
from pathlib import Path
from typing import Callable

import torch.distributed as dist
import torch.multiprocessing as mp

from specforge import forkserver
from specforge.device import barrier, init_process_group, pick_backend, pick_device, set_threads

__all__ = ["run_ranks"]


def _entry(rank: int, fn: Callable, world_size: int, init_file: str, backend: str, timeout_s: float,
           threads: int, env: dict, args: tuple) -> None:
    forkserver.adopt_env(env)
    faulthandler.enable()  # a native abort (SIGABRT/SIGSEGV) prints every thread's Python stack
    set_threads(threads)
    here = pick_device("auto", rank)
    backend = pick_backend(backend, here)
    init_process_group(rank, world_size, f"file://{init_file}", backend, timeout_s, here)  # binds the GPU
    try:
        fn(rank, world_size, *args)
        # No rank tears its groups down while a peer may still use a connection to it.
        barrier(here)
        Path(f"{init_file}.done{rank}").touch()
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args, workdir: str | os.PathLike, backend: str = "auto",
              timeout_s: float = 120.0, threads: int = 1) -> None:
    """Start ``world_size`` ranks running ``fn``; raise if one fails or all take over ``timeout_s``
    (every process group also times out after ``timeout_s``, so a dead peer cannot hang the rest)."""
    init_file = Path(workdir) / f"pg-{uuid.uuid4().hex}"
    forkserver.context()  # its preload, for torch's start_processes below
    ctx = mp.start_processes(
        _entry, args=(fn, world_size, str(init_file), backend, timeout_s, threads, dict(os.environ), args),
        nprocs=world_size, join=False, start_method="forkserver",
    )
    deadline = time.monotonic() + timeout_s + 60  # + start-up (imports on a loaded machine)
    while not _join(ctx, fn, init_file, world_size):
        if time.monotonic() > deadline:
            for p in ctx.processes:  # only the processes started here
                if p.is_alive():
                    p.terminate()
            raise TimeoutError(f"{world_size} ranks running {fn.__name__} did not finish in time")


def _join(ctx, fn: Callable, init_file: Path, world_size: int) -> bool:
    """``ctx.join`` for half a second. A rank killed by a signal after EVERY rank finished ``fn``
    and the closing barrier (its work, checks included, is done) is torch's process-group
    teardown failing, not ``fn``: warn and count the run as finished. Any other failure raises."""
    try:
        return ctx.join(timeout=0.5)
    except mp.ProcessExitedException as e:
        if e.signal_name and all(Path(f"{init_file}.done{r}").exists() for r in range(world_size)):
            warnings.warn(f"{fn.__name__}: {e} after all {world_size} ranks finished (process-group teardown)",
                          stacklevel=2)
            return True
        raise
