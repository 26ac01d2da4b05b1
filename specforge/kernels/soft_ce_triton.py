"""The Triton kernel of ``soft_ce.soft_ce_rows`` (imported only when it runs: triton at the top).

One program per row, two passes over vocabulary tiles of ``BLOCK_N`` columns:

1. online statistics: the running max ``m`` (and the first column that reaches it), the sum of
   ``exp(z - m)`` rescaled whenever ``m`` grows, and ``sum(p * z)``;
2. ``G = exp(z - m) / ssum - p``, stored in G's dtype (may be z's own storage: each program reads a
   tile before it writes it).

The teacher row ``teacher[tidx[row]]`` is read in place. On CUDA the tile is autotuned per vocabulary
size (``CONFIGS``; the logits are restored between the tuning runs, since G may overwrite them);
``TRITON_INTERPRET=1`` runs the plain kernel with ``INTERPRET_BLOCK`` columns (small, so tests cross
several tiles and a ragged last one).
"""

import torch
import triton
import triton.language as tl

# (BLOCK_N, num_warps): one block the size of the vocabulary is slow; a few tile sizes tuned once per N
CONFIGS = [triton.Config({"BLOCK_N": b}, num_warps=w) for b, w in ((1024, 4), (2048, 8), (4096, 8), (8192, 16))]
INTERPRET_BLOCK = 64


@triton.jit
def _round_to_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), still in fp32: the cast after it is then exact.
    The interpreter's fp32 -> bf16 cast truncates; a GPU's rounds the same way as this."""
    u = x.to(tl.int32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & -65536
    return u.to(tl.float32, bitcast=True)


@triton.jit
def soft_ce_rows_kernel(z_ptr, stride_z, t_ptr, stride_t, tidx_ptr, ce_ptr, pred_ptr, accp_ptr, g_ptr, stride_g,
                        N, BLOCK_N: tl.constexpr, G_BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    p_row = t_ptr + tl.load(tidx_ptr + row).to(tl.int64) * stride_t
    g_row = g_ptr + row * stride_g
    cols = tl.arange(0, BLOCK_N)
    m = -float("inf")
    ssum = 0.0
    pz = 0.0
    best = 0
    for n0 in range(0, N, BLOCK_N):
        offs = n0 + cols
        mask = offs < N
        z = tl.load(z_row + offs, mask=mask, other=-float("inf")).to(tl.float32)
        p = tl.load(p_row + offs, mask=mask, other=0.0).to(tl.float32)
        tile_max = tl.max(z, 0)
        best = tl.where(tile_max > m, n0 + tl.argmax(z, 0, tie_break_left=True), best)  # the first maximum
        m_new = tl.maximum(m, tile_max)
        ssum = ssum * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        pz += tl.sum(p * tl.where(mask, z, 0.0), 0)  # not p * z: 0 * -inf past the end
        m = m_new
    tl.store(ce_ptr + row, m + tl.log(ssum) - pz)
    tl.store(pred_ptr + row, best.to(tl.int64))
    tl.store(accp_ptr + row, tl.load(p_row + best).to(tl.float32))
    for n0 in range(0, N, BLOCK_N):
        offs = n0 + cols
        mask = offs < N
        z = tl.load(z_row + offs, mask=mask, other=0.0).to(tl.float32)
        p = tl.load(p_row + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.exp(z - m) / ssum - p
        if G_BF16:
            g = _round_to_bf16(g)
        tl.store(g_row + offs, g.to(g_ptr.dtype.element_ty), mask=mask)


INTERPRETED = type(soft_ce_rows_kernel).__name__ == "InterpretedFunction"  # TRITON_INTERPRET=1 at import
_tuned = None if INTERPRETED else triton.autotune(CONFIGS, key=["N"], restore_value=["z_ptr"])(soft_ce_rows_kernel)


def launch(z_MN, teacher_PN, tidx_M, ce_M, pred_M, acc_p_M, G_MN) -> None:
    """One launch over the ``M`` rows (arguments checked by ``soft_ce.soft_ce_rows``)."""
    M, N = z_MN.shape
    args = (z_MN, z_MN.stride(0), teacher_PN, teacher_PN.stride(0), tidx_M, ce_M, pred_M, acc_p_M,
            G_MN, G_MN.stride(0), N)
    g_bf16 = G_MN.dtype == torch.bfloat16
    if INTERPRETED:
        soft_ce_rows_kernel[(M,)](*args, BLOCK_N=INTERPRET_BLOCK, G_BF16=g_bf16)
    else:
        _tuned[(M,)](*args, G_BF16=g_bf16)
