"""The Triton kernel of ``losses.loss_rows_fused`` for every kind but ``kl_div`` (``soft_ce_triton.py``
runs that one): imported only when it runs (triton at the top).

One program per row, three passes over vocabulary tiles of ``BLOCK_N`` columns, nothing ``[rows x N]``
made besides ``G`` (no fp32 copy of the logits, no teacher gathered):

1. the online max of the logits (and the first column that reaches it) and the rescaled sum of
   exponentials: ``lse``, so ``log q = z - lse`` in the later passes;
2. the row sums the kind's loss and gradient need (``losses.py``'s table): the overlap ``alpha`` and
   ``sum_{q<p} q`` (TV's family), ``KL(p || q)`` (LK's lambda form), ``sum q (log q - log p)``
   (reverse KL), ``KL(p || m)`` and ``sum q g`` (JSD); reverse and forward KL both (``opd``: which one
   a row takes depends on its argmax, known after pass 1, against ``verify[row]``);
3. ``G``, the logit gradient, from those sums, stored in G's dtype (may be z's own storage: each
   program reads a tile before it writes it, and pass 3 reads z only at the tile it writes).

The teacher row ``teacher[tidx[row]]`` holds log-probabilities, read in place. On CUDA the tile is
autotuned per vocabulary size; ``TRITON_INTERPRET=1`` runs the plain kernel with ``INTERPRET_BLOCK``
columns.
"""

import torch
import triton
import triton.language as tl

from specforge.kernels.soft_ce_triton import _round_to_bf16

CONFIGS = [triton.Config({"BLOCK_N": b}, num_warps=w) for b, w in ((1024, 4), (2048, 8), (4096, 8), (8192, 16))]
INTERPRET_BLOCK = 64
CODES = {"tv": 1, "nla": 2, "lk_hybrid": 3, "rkl": 4, "jsd": 5, "opd": 6}
LN2 = tl.constexpr(0.6931471805599453)  # a global a jit function reads must be a constexpr


@triton.jit
def loss_rows_kernel(z_ptr, stride_z, t_ptr, stride_t, tidx_ptr, loss_ptr, pred_ptr, accp_ptr, g_ptr, stride_g,
                     N, nla_eps, lk_eta, verify_ptr, BLOCK_N: tl.constexpr, KIND: tl.constexpr,
                     G_BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    p_row = t_ptr + tl.load(tidx_ptr + row).to(tl.int64) * stride_t
    g_row = g_ptr + row * stride_g
    cols = tl.arange(0, BLOCK_N)
    m = -float("inf")
    ssum = 0.0
    best = 0
    for n0 in range(0, N, BLOCK_N):  # 1: lse and the argmax
        offs = n0 + cols
        z = tl.load(z_row + offs, mask=offs < N, other=-float("inf")).to(tl.float32)
        tile_max = tl.max(z, 0)
        best = tl.where(tile_max > m, n0 + tl.argmax(z, 0, tie_break_left=True), best)
        m_new = tl.maximum(m, tile_max)
        ssum = ssum * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        m = m_new
    lse = m + tl.log(ssum)
    s1 = 0.0  # TV family: alpha; rkl, opd: sum q (log q - log p); jsd: KL(p || m)
    s2 = 0.0  # TV family: sum_{q<p} q; jsd: sum q g
    s3 = 0.0  # lk_hybrid, opd: KL(p || q)
    accepted = False
    if KIND == 6:
        accepted = best.to(tl.int64) == tl.load(verify_ptr + row)
    for n0 in range(0, N, BLOCK_N):  # 2: the row sums
        offs = n0 + cols
        mask = offs < N
        logq = tl.load(z_row + offs, mask=mask, other=0.0).to(tl.float32) - lse
        logp = tl.load(p_row + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.where(mask, tl.exp(logq), 0.0)
        p = tl.where(mask, tl.exp(logp), 0.0)
        if KIND <= 3:
            below = q < p
            s1 += tl.sum(tl.where(below, q, p), 0)
            s2 += tl.sum(tl.where(below, q, 0.0), 0)
            if KIND == 3:
                s3 += tl.sum(tl.where(p > 0, p * (logp - logq), 0.0), 0)
        elif KIND == 4:
            s1 += tl.sum(q * (logq - logp), 0)
        elif KIND == 6:
            s1 += tl.sum(q * (logq - logp), 0)
            s3 += tl.sum(tl.where(p > 0, p * (logp - logq), 0.0), 0)
        else:
            hi = tl.maximum(logq, logp)
            logm = hi + tl.log(1.0 + tl.exp(-tl.abs(logq - logp))) - LN2
            s1 += tl.sum(tl.where(p > 0, p * (logp - logm), 0.0), 0)
            s2 += tl.sum(q * 0.5 * (logq - logm), 0)
    scale = 1.0
    lam = 0.0
    if KIND == 1:
        loss = 1.0 - s1
    elif KIND == 2:
        a = tl.maximum(s1, nla_eps)
        loss = -tl.log(a)
        scale = tl.where(s1 > nla_eps, 1.0 / a, 0.0)
    elif KIND == 3:
        lam = tl.exp(-lk_eta * s1)
        loss = lam * s3 + (1.0 - lam) * (1.0 - s1)
    elif KIND == 4:
        loss = s1
    elif KIND == 6:
        loss = tl.where(accepted, s3, s1)
    else:
        loss = 0.5 * s1 + s2
    tl.store(loss_ptr + row, loss)
    tl.store(pred_ptr + row, best.to(tl.int64))
    tl.store(accp_ptr + row, tl.exp(tl.load(p_row + best).to(tl.float32)))
    for n0 in range(0, N, BLOCK_N):  # 3: G
        offs = n0 + cols
        mask = offs < N
        logq = tl.load(z_row + offs, mask=mask, other=0.0).to(tl.float32) - lse
        logp = tl.load(p_row + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.exp(logq)
        p = tl.exp(logp)
        if KIND <= 3:
            g = q * s2 - tl.where(q < p, q, 0.0)
            if KIND == 2:
                g = g * scale
            if KIND == 3:
                g = lam * (q - p) + (1.0 - lam) * g
        elif KIND == 4:
            g = q * (logq - logp - s1)
        elif KIND == 6:
            g = tl.where(accepted, q - p, q * (logq - logp - s1))
        else:
            hi = tl.maximum(logq, logp)
            logm = hi + tl.log(1.0 + tl.exp(-tl.abs(logq - logp))) - LN2
            g = q * (0.5 * (logq - logm) - s2)
        if G_BF16:
            g = _round_to_bf16(g)
        tl.store(g_row + offs, g.to(g_ptr.dtype.element_ty), mask=mask)


INTERPRETED = type(loss_rows_kernel).__name__ == "InterpretedFunction"  # TRITON_INTERPRET=1 at import
_tuned = None if INTERPRETED else triton.autotune(CONFIGS, key=["N", "KIND"], restore_value=["z_ptr"])(
    loss_rows_kernel)


def launch(kind: str, z_MN, teacher_PN, tidx_M, loss_M, pred_M, acc_p_M, G_MN, nla_eps: float,
           lk_eta: float, verify_M) -> None:
    """One launch over the ``M`` rows (arguments checked by ``losses.loss_rows_fused``; ``verify_M``,
    int64, read by ``opd`` alone)."""
    M, N = z_MN.shape
    args = (z_MN, z_MN.stride(0), teacher_PN, teacher_PN.stride(0), tidx_M, loss_M, pred_M, acc_p_M,
            G_MN, G_MN.stride(0), N, float(nla_eps), float(lk_eta), verify_M)
    g_bf16 = G_MN.dtype == torch.bfloat16
    if INTERPRETED:
        loss_rows_kernel[(M,)](*args, BLOCK_N=INTERPRET_BLOCK, KIND=CODES[kind], G_BF16=g_bf16)
    else:
        _tuned[(M,)](*args, KIND=CODES[kind], G_BF16=g_bf16)
