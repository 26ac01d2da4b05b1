"""The one place that picks device, dtype and the distributed backend.

Everything else asks here; no other module names ``cpu``/``cuda`` or ``gloo``/``nccl``.

``SPECFORGE_DEVICE=cpu`` in the environment makes ``auto`` mean the CPU (and so gloo) even where CUDA
exists: the CPU test suite sets it (tests/conftest.py), so it runs unchanged on a GPU machine.
Ray workers get it too (``worker_env``, which ``runtime.actors.spawn_actors`` passes on).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

_TARGET_DTYPES = ("float32", "bfloat16", "float16")


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``: dtypes are named by their torch names everywhere (the
    one table of names and sizes is ``contracts.DTYPE_BYTES``, stdlib for the records)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype name")
    return dtype


FORCE_ENV = "SPECFORGE_DEVICE"  # "cpu": ``auto`` never picks CUDA (the CPU test suite on a GPU machine)


def cuda_allowed() -> bool:
    """Whether ``auto`` may pick CUDA in this process: CUDA exists and ``SPECFORGE_DEVICE`` is not cpu."""
    return os.environ.get(FORCE_ENV, "").lower() != "cpu" and torch.cuda.is_available()


def wants_gpu(choice: str, cluster_gpus: Optional[float] = None) -> bool:
    """Whether a run with ``model.device=choice`` puts its workers on GPUs: ``cuda``, or ``auto`` where
    GPUs exist (``cluster_gpus``: the Ray cluster's count; default: this machine's)."""
    if choice == "cuda":
        return True
    if choice != "auto" or os.environ.get(FORCE_ENV, "").lower() == "cpu":
        return False
    return (cluster_gpus or 0) > 0 if cluster_gpus is not None else torch.cuda.is_available()


def _ray_gpu_ids() -> list[str]:
    """The GPU ids Ray assigned to this actor ([] outside Ray or without GPUs)."""
    ray = sys.modules.get("ray")  # a process that never imported Ray is no Ray worker
    if ray is None or not ray.is_initialized():
        return []
    return [str(i) for i in ray.get_gpu_ids()]


def local_cuda_index(rank: int = 0) -> int:
    """This process's GPU among those it sees. Under Ray (which sets CUDA_VISIBLE_DEVICES per actor)
    that is 0; with ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` every actor sees all GPUs, so
    the actor's own GPU id; a launcher's ``LOCAL_RANK`` (torchrun); else ``rank`` modulo the count."""
    count = max(torch.cuda.device_count(), 1)
    if os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES") and (ids := _ray_gpu_ids()):
        return int(ids[0]) % count
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"]) % count
    return rank % count


def engine_gpu_ids(count: int) -> list[str]:
    """The GPUs, as ``CUDA_VISIBLE_DEVICES`` entries, that an engine this process starts over ``count``
    GPUs (``rollout.tp_size``) must take: this Ray actor's own (Ray sets ``CUDA_VISIBLE_DEVICES`` to them,
    or with ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` leaves every GPU visible and only its GPU ids
    say which are the actor's), else a launcher's ``LOCAL_RANK``-th group of ``count`` among the GPUs
    this process sees, else the first ``count`` it sees. ValueError where there are fewer."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = ([v.strip() for v in visible.split(",") if v.strip()] if visible is not None
            else [str(i) for i in range(torch.cuda.device_count())])
    if ids := _ray_gpu_ids():
        pick, where = ids, "Ray assigned this worker"
    elif "LOCAL_RANK" in os.environ:
        k = int(os.environ["LOCAL_RANK"])
        pick, where = seen[k * count:(k + 1) * count], f"LOCAL_RANK {k}'s share of the {len(seen)} visible"
    else:
        pick, where = seen[:count], f"{len(seen)} visible"
    if len(pick) < count:
        raise ValueError(f"config key 'rollout.tp_size'={count}: the engine needs {count} GPUs, {where} "
                         f"{len(pick)} ({','.join(pick) or 'none'}); give each worker rollout.tp_size GPUs")
    return pick[:count]


def pick_device(choice: str = "auto", local_rank: Optional[int] = None) -> torch.device:
    """``auto`` -> this process's CUDA device if one exists (``local_cuda_index``), else the CPU."""
    if choice not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device {choice!r}: expected 'auto', 'cpu' or 'cuda'")
    if choice == "cuda" and not torch.cuda.is_available():  # only model.device names cuda
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise ValueError(f"config key 'model.device'='cuda': torch {torch.__version__} ({build}) sees no CUDA device "
                         "on this machine; use model.device=auto (a GPU where there is one, else the CPU) or cpu, "
                         "or run where a GPU is visible (CUDA_VISIBLE_DEVICES)")
    if choice == "cuda" or (choice == "auto" and cuda_allowed()):
        return torch.device("cuda", local_cuda_index(local_rank or 0))
    return torch.device("cpu")


def bind(device: torch.device) -> None:
    """Make ``device`` this thread's current CUDA device (kernels, NCCL communicators and
    ``cuda:0``-relative code land there, not on GPU 0); a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device``: a timer that reads the clock after this measures
    finished work, not kernel launches. For benchmark probes; a step's timers use ``StageClock``
    (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StageClock:
    """The marks of one step's stages, read when its report is built (``ms``), never at a mark. On
    CUDA each mark records an event on the current stream, and ``ms`` waits for the later one only
    then: the host goes on at the mark (posts sends, collates) while the device computes, and the
    time is the device's between the marks. On the CPU, where a call returns once its work is done,
    the host clock. ``event``: the event class (CUDA's; tests pass another)."""

    def __init__(self, device: torch.device, event=None):
        self.event = event if event is not None else (torch.cuda.Event if device.type == "cuda" else None)
        self.marks: dict = {}

    def mark(self, name: str) -> None:
        if self.event is None:
            self.marks[name] = time.perf_counter()
            return
        e = self.event(enable_timing=True)
        e.record()
        self.marks[name] = e

    def ms(self, start: str, end: str) -> float:
        a, b = self.marks[start], self.marks[end]
        if self.event is None:
            return (b - a) * 1e3
        b.synchronize()
        return float(a.elapsed_time(b))


def target_devices(choice: str = "auto", num_gpus: int = 1) -> list[torch.device]:
    """The devices one copy of the target spans (``model.device``, ``model.num_gpus``): the first is
    where its inputs and captured features live. More than one = this process's first ``num_gpus``
    CUDA devices (a Ray worker sees only the GPUs it was given, as cuda:0..n-1)."""
    first = pick_device(choice)
    if num_gpus <= 1:
        return [first]
    if first.type != "cuda":
        raise ValueError(f"config key 'model.num_gpus'={num_gpus}: splitting the target over GPUs needs CUDA, "
                         f"and this process has none (model.device={choice!r}); use 1")
    have = torch.cuda.device_count()
    if have < num_gpus:
        raise ValueError(f"config key 'model.num_gpus'={num_gpus}: this process sees {have} CUDA device(s); "
                         f"give it {num_gpus} (CUDA_VISIBLE_DEVICES) or lower model.num_gpus")
    return [torch.device("cuda", i) for i in range(num_gpus)]


def host_device() -> torch.device:
    """Host memory: where a process keeps target weights it only reads from (memory-mapped)."""
    return torch.device("cpu")


@functools.lru_cache(maxsize=1)
def cpu_fast_bf16() -> bool:
    """Does this CPU have bf16 matmul instructions (AVX512-BF16 or AMX)? Without them oneDNN
    emulates bf16 and a bf16 matmul is several times SLOWER than fp32 (measured: 5x on an AVX2
    EPYC), with them about 1.9x faster (avx512_bf16): so 'auto' must look."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def pick_dtype(choice: str, device: torch.device) -> torch.dtype:
    """Storage dtype of the frozen target. ``auto`` = bf16 where it is fast, else fp32."""
    if choice != "auto":
        if choice not in _TARGET_DTYPES:
            raise ValueError(f"dtype {choice!r}: expected 'auto' or one of {sorted(_TARGET_DTYPES)}")
        return torch_dtype(choice)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_fast_bf16() else torch.float32


def autocast_dtype(precision: str, device: torch.device) -> Optional[torch.dtype]:
    """Compute dtype for the draft's autocast region (None = run in fp32)."""
    if precision == "fp32":
        return None
    if precision == "fp16":
        return torch.float16
    if precision == "bf16":
        return torch.bfloat16
    # auto: bf16 on GPUs that support it and on CPUs with bf16 instructions, fp16 on older GPUs
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_fast_bf16() else None


def autocast(device: torch.device, dtype: Optional[torch.dtype]):
    """An autocast context for ``dtype``, or a no-op when ``dtype`` is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def pick_backend(choice: str = "auto", device: Optional[torch.device] = None) -> str:
    """torch.distributed backend: NCCL for CUDA tensors when built with it, else gloo.

    A mixed string like "cpu:gloo,cuda:nccl" fails on CPU-only builds, so choose one.
    """
    if choice not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend {choice!r}: expected 'auto', 'gloo' or 'nccl'")
    if choice != "auto":
        if choice == "nccl" and not (dist.is_nccl_available() and torch.cuda.is_available()):
            raise ValueError("backend 'nccl' requested but NCCL or CUDA is unavailable")
        return choice
    device = device or pick_device()
    if device.type == "cuda" and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def loop_chunk(device: torch.device, cpu: int, gpu: int) -> int:
    """Rows per iteration of a hot Python loop over chunks (the TTT attention's query chunks, the
    fused loss's rows): small on the CPU, where a cache-sized chunk measured fastest, large on a
    GPU, where every iteration costs several kernel launches and a small chunk leaves it idle."""
    return gpu if device.type == "cuda" else cpu


def row_chunks(T: int, chunk: int):
    """``(start, end)`` of consecutive ``chunk``-row pieces of ``T`` rows (the last may be shorter)."""
    start = 0
    while start < T:
        end = min(T, start + chunk)
        yield start, end
        start = end


def matmul_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """Matmul dtype of a hand-written attention kernel: the autocast dtype when autocast is on for
    the tensors' device, else their common dtype."""
    dev = tensors[0].device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    dt = tensors[0].dtype
    for t in tensors[1:]:
        dt = torch.promote_types(dt, t.dtype)
    return dt


def stream_semantics(backend: str) -> bool:
    """Whether transfers on ``backend`` complete the way NCCL's do: ``Work.wait()`` only orders the
    CUDA stream and returns at once, completion shows only through ``is_completed()`` or a sync, and
    a receive whose peer died never fails. ``SPECFORGE_EMULATE_NCCL=1`` gives gloo transfers those
    semantics (``runtime/completion.py``), so the CPU tests exercise the GPU path's waits."""
    return backend == "nccl" or os.environ.get(EMULATE_NCCL_ENV) == "1"


EMULATE_NCCL_ENV = "SPECFORGE_EMULATE_NCCL"


def worker_env() -> dict[str, str]:
    """The device switches set in this (driver) process, for its Ray workers' environment: a worker
    started by an already-running Ray would not inherit them otherwise."""
    return {k: os.environ[k] for k in (FORCE_ENV, EMULATE_NCCL_ENV) if k in os.environ}


def init_process_group(rank: int, world_size: int, init_method: str, backend: str, timeout_s: float,
                       device: Optional[torch.device] = None) -> None:
    """Join the default group, always with a timeout so a dead peer cannot hang the rest. On NCCL
    the rank is bound to ``device`` first (its communicator and barrier use that GPU, whatever
    ``CUDA_VISIBLE_DEVICES`` says)."""
    extra = {}
    if backend == "nccl" and device is not None:
        bind(device)
        extra["device_id"] = device
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        **extra,
    )


def barrier(device: torch.device, group=None) -> None:
    """``dist.barrier`` that names the rank's GPU on NCCL (it otherwise guesses one from the rank)."""
    if device.type == "cuda" and dist.get_backend(group) == "nccl":
        dist.barrier(group=group, device_ids=[device.index])
    else:
        dist.barrier(group=group)


@contextlib.contextmanager
def kept_process_settings():
    """The caller's torch thread count and current CUDA device as they were once the block ends: a run
    in the user's own process (``specforge.train.run``) sets them for itself, not for its caller."""
    threads = torch.get_num_threads()
    cuda = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if torch.cuda.is_initialized():
            torch.cuda.set_device(0 if cuda is None else cuda)  # 0: CUDA's own default, had it not been set


def set_threads(num_threads: Optional[int]) -> None:
    """Ray sets OMP_NUM_THREADS=1 in actors; set torch's intra-op threads explicitly."""
    if num_threads:
        torch.set_num_threads(num_threads)
