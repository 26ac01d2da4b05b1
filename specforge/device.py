"""The one place that picks device, dtype and the distributed backend.

Everything else asks here; no other module names ``cpu``/``cuda`` or ``gloo``/``nccl``.
"""

from __future__ import annotations

import contextlib
import functools
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

_TARGET_DTYPES = ("float32", "bfloat16", "float16")


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``: dtypes are named by their torch names everywhere (the
    one table of names and sizes is ``runtime.contracts.DTYPE_BYTES``, stdlib for the records)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype name")
    return dtype


def pick_device(choice: str = "auto", local_rank: int = 0) -> torch.device:
    """``auto`` -> this process's CUDA device if one exists, else the CPU."""
    if choice not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device {choice!r}: expected 'auto', 'cpu' or 'cuda'")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch sees no CUDA device")
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


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


def init_process_group(rank: int, world_size: int, init_method: str, backend: str, timeout_s: float) -> None:
    """Join the default group, always with a timeout so a dead peer cannot hang the rest."""
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def set_threads(num_threads: Optional[int]) -> None:
    """Ray sets OMP_NUM_THREADS=1 in actors; set torch's intra-op threads explicitly."""
    if num_threads:
        torch.set_num_threads(num_threads)
