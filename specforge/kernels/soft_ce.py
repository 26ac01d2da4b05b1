"""The row-wise soft cross-entropy of a chunk of logits: a Triton kernel and its torch reference.

Legend: ``M`` rows of the chunk, ``N`` the (draft) vocabulary, ``P`` teacher rows.

For logits ``z_MN`` and teacher distributions ``p = teacher_PN[tidx_M]`` (gathered inside the kernel:
no gathered copy is made), per row, with fp32 statistics:

* ``ce = max(z) + log(sum(exp(z - max(z)))) - sum(p * z)`` (fp32), the soft cross-entropy;
* ``pred = argmax(z)`` (int64, the first maximum), ``acc_p = p[pred]`` (fp32);
* ``G = softmax(z) - p``, the gradient of ``ce`` w.r.t. ``z``, in ``g_dtype`` (default z's dtype).

``soft_ce_rows`` runs one Triton kernel per call (one program per row, two passes over vocabulary
tiles: an online max / sum of exponentials / ``sum(p * z)``, then ``G``); the tile is autotuned on
CUDA and fixed (``soft_ce_triton.INTERPRET_BLOCK``) under ``TRITON_INTERPRET=1``.
``soft_ce_rows_reference`` runs the torch ops the fused loss ran before the kernel (about a dozen
launches a chunk) and stays the default of ``algorithms/eagle3/loss.py``.

Both take ``out=(ce_M, pred_M, acc_p_M, G_MN)`` to write into (e.g. slices of the whole batch's
buffers); ``G_MN`` may be ``z_MN`` itself (the kernel then writes the gradient over the logits in
place). ``z_MN`` is scratch: the reference overwrites it when it is already fp32.
Triton is imported only when the kernel runs: this module imports without it.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch

__all__ = ["available", "soft_ce_rows", "soft_ce_rows_reference", "empty_outputs"]

Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # ce_M, pred_M, acc_p_M, G_MN
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the kernel reads and writes (fp32 maths)


def interpreting() -> bool:
    """``TRITON_INTERPRET=1``: Triton runs kernels in Python, on CPU tensors too."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


def available(device: torch.device | str) -> bool:
    """Can ``soft_ce_rows`` run on ``device``: triton importable, and a CUDA device or interpret mode."""
    if importlib.util.find_spec("triton") is None:
        return False
    return interpreting() or (torch.device(device).type == "cuda" and torch.cuda.is_available())


def empty_outputs(z_MN: torch.Tensor, g_dtype: Optional[torch.dtype] = None) -> Outputs:
    """Fresh ``(ce, pred, acc_p, G)`` for ``z_MN``: statistics in fp32 (or wider, as z), G in ``g_dtype``."""
    M, N = z_MN.shape
    f32 = torch.promote_types(z_MN.dtype, torch.float32)
    dev = z_MN.device
    return (torch.empty(M, dtype=f32, device=dev), torch.empty(M, dtype=torch.long, device=dev),
            torch.empty(M, dtype=f32, device=dev), torch.empty(M, N, dtype=g_dtype or z_MN.dtype, device=dev))


def soft_ce_rows_reference(z_MN: torch.Tensor, teacher_PN: torch.Tensor, tidx_M: torch.Tensor,
                           out: Optional[Outputs] = None, g_dtype: Optional[torch.dtype] = None) -> Outputs:
    """The torch ops (the reference and the default path): ``(ce, pred, acc_p, G)``, see the module docstring."""
    ce, pred, acc_p, G = empty_outputs(z_MN, g_dtype) if out is None else out
    f32 = torch.promote_types(z_MN.dtype, torch.float32)
    z = z_MN.to(f32)  # z_MN itself when already fp32: overwritten below
    p = teacher_PN.index_select(0, tidx_M).to(f32)
    m, am = z.max(dim=-1)
    pz = (p * z).sum(-1)
    z.sub_(m.unsqueeze(-1)).exp_()
    ssum = z.sum(-1)
    ce.copy_(m + torch.log(ssum) - pz)
    pred.copy_(am)
    acc_p.copy_(p.gather(1, am.unsqueeze(1)).squeeze(1))
    z.div_(ssum.unsqueeze(-1)).sub_(p)
    G.copy_(z)
    return ce, pred, acc_p, G


def soft_ce_rows(z_MN: torch.Tensor, teacher_PN: torch.Tensor, tidx_M: torch.Tensor,
                 out: Optional[Outputs] = None, g_dtype: Optional[torch.dtype] = None) -> Outputs:
    """The fused kernel: one launch, same results as ``soft_ce_rows_reference`` (fp32 maths)."""
    if not available(z_MN.device):
        raise ValueError(f"the soft-CE kernel cannot run on {z_MN.device}: it needs triton and a CUDA device "
                         "(or TRITON_INTERPRET=1); use soft_ce_rows_reference")
    outs = empty_outputs(z_MN, g_dtype) if out is None else out
    check_launch(z_MN, teacher_PN, tidx_M, outs)
    if z_MN.shape[0]:
        _kernel_module().launch(z_MN, teacher_PN, tidx_M.contiguous(), *outs)
    return outs


def check_launch(z_MN: torch.Tensor, teacher_PN: torch.Tensor, tidx_M: torch.Tensor, outs: Outputs) -> None:
    """What a row-wise loss kernel reads and writes (this one and ``losses_triton``'s): dtypes, unit strides
    along the vocabulary, matching shapes; a ValueError naming the first that does not hold."""
    ce, pred, acc_p, G = outs
    for name, t in (("z_MN", z_MN), ("teacher_PN", teacher_PN), ("G", G)):
        if t.dtype not in KERNEL_DTYPES:
            raise ValueError(f"soft-CE kernel: {name} is {t.dtype}; it reads and writes {KERNEL_DTYPES} "
                             "(fp32 maths): use soft_ce_rows_reference for others")
        if t.dim() != 2 or t.stride(-1) != 1:
            raise ValueError(f"soft-CE kernel: {name} must be 2-d with unit stride along the vocabulary")
    if G.shape != z_MN.shape or teacher_PN.shape[1] != z_MN.shape[1] or tidx_M.shape != z_MN.shape[:1]:
        raise ValueError(f"soft-CE kernel: shapes z {tuple(z_MN.shape)}, teacher {tuple(teacher_PN.shape)}, "
                         f"tidx {tuple(tidx_M.shape)}, G {tuple(G.shape)} do not match")
    if ce.dtype != torch.float32 or acc_p.dtype != torch.float32 or pred.dtype != torch.long:
        raise ValueError("soft-CE kernel: ce and acc_p must be float32, pred int64")
    if any(t.shape != z_MN.shape[:1] or t.stride(0) != 1 for t in (ce, pred, acc_p)):
        raise ValueError("soft-CE kernel: ce, pred and acc_p must be contiguous, one entry per row")


def _kernel_module():
    """The Triton kernel's module, imported at the first launch (it imports triton at its top)."""
    try:
        from specforge.kernels import soft_ce_triton  # lazy: optional (ImportError handled)
    except ImportError as e:
        raise ValueError(f"the soft-CE kernel needs triton ({e}): pip install triton") from e
    return soft_ce_triton
