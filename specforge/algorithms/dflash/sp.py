"""DFlash with ring sequence parallelism: the context's keys/values travel the ring, never gathered.

Legend: B batch, Hkv kv heads, G query heads per kv head, N blocks, K block size, Q = N*K block
rows, C context rows of one ring rank, D head dim, P ring size.

Ring rank ``r`` holds the context rows ``[r*C, (r+1)*C)`` of its micro-batch (``SPTrainBatch``: their
features, plus ``block_size - 1`` rows of ids / loss mask / target ids past them, for the labels).
The anchors are drawn over the whole micro-batch exactly as one process draws them (the ranks
all-gather the token ids and the loss mask, a few ints per token, never a feature) and each rank
keeps those in its rows (``loss.local_anchors``): a block is computed on the rank of its anchor.

Attention of the rows of a block anchored at ``a`` (``model.py``): the context ``p < a`` (with a
sliding window W, row k also ``p > a + k - W``) and the block's own rows. Per layer, the own-block
part is local (plain autograd); the context part runs over the ring (``_RingContext``): at step
``s`` the rank holds the K/V block of rank ``(r - s) mod P``, posts the exchange that passes it on
(``ring.RingComm``: one ``batch_isend_irecv``), attends to it under the anchors' mask (blocks of
later ranks are never visible and are skipped, so is a block no row sees through its window; a
block row that sees none of a held block gets ``lse = -inf`` and adds nothing), merges by
log-sum-exp, then waits. The two parts are merged by log-sum-exp too.

Backward: as ``specforge/parallel/ring.py``: the K/V blocks travel again and each rank's dK/dV
share of the held block rides an fp32 accumulator one step behind it back to the block's owner.
The context part is a function with two outputs (its ``out`` and ``lse``, both merged with the
own-block part by autograd), so its score gradient is ``P * (dP - rowsum(dO * O) + dLSE)``.

Kernel: plain torch (any device, any dtype; fp32 statistics; block rows in chunks). A GPU flash
kernel does not take the anchors' mask; not written yet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from specforge.device import loop_chunk, matmul_dtype
from specforge.parallel.ring import RingComm, ring_grad_pass
from specforge.parallel.sp import RingAttention, UlyssesAttention

__all__ = ["RingBlocks", "ring_comm", "gather_rows", "visible_context", "merge_parts"]

CHUNK_CPU, CHUNK_GPU = 128, 512  # block rows per iteration of the context kernel (CPU / GPU)


def ring_comm(draft) -> Optional[RingComm]:
    """The ring of a draft that ``parallelize_draft`` gave sequence parallelism (the wrapper that
    ``apply_sp`` put on ``draft.sp_attention``, the slot ``DFlash.sp_cores`` names), else None."""
    slot = getattr(draft, "sp_attention", None)
    if isinstance(slot, UlyssesAttention):
        raise ValueError("DFlash has no Ulysses sequence parallelism (parallel.sp_ulysses must be 1)")
    return slot.comm if isinstance(slot, RingAttention) else None


def gather_rows(x_BC: torch.Tensor, comm: RingComm) -> torch.Tensor:
    """``[B, P*C]``: every ring rank's ``[B, C]`` rows, in rank order (no gradient: ids and masks)."""
    parts = [torch.empty_like(x_BC) for _ in range(comm.size)]
    dist.all_gather(parts, x_BC.contiguous(), group=comm.group)
    return torch.cat(parts, dim=1)


def visible_context(anchors_BN: torch.Tensor, keep_BN: torch.Tensor, lo: int, hi: int, K: int,
                    window: Optional[int] = None) -> torch.Tensor:
    """``[B, N*K, hi - lo]``: which context positions ``[lo, hi)`` each block row sees: ``p < a``, and
    with a window ``(a + k) - p < window`` (row k sits at position a + k; ``model.build_block_mask``);
    a dropped block sees none."""
    p = torch.arange(lo, hi, device=anchors_BN.device)
    a = anchors_BN.repeat_interleave(K, dim=1).unsqueeze(-1)  # [B, N*K, 1]
    vis = (p < a) & keep_BN.repeat_interleave(K, dim=1).unsqueeze(-1)
    if window is not None:
        k = torch.arange(anchors_BN.shape[1] * K, device=p.device) % K
        vis &= p > a + k.unsqueeze(-1) - window
    return vis


def merge_parts(out, lse, o, l):
    """Two normalized parts of one softmax -> their union (an ``lse`` may be -inf: a part that saw
    no key; where both are, the result is 0 with lse -inf)."""
    new = torch.logaddexp(lse, l)
    ref = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
    return out * torch.exp(lse - ref).unsqueeze(-1) + o * torch.exp(l - ref).unsqueeze(-1), new


# ------------------------------------------------------------------------------ the context kernel


def _row_chunks(Q: int, K: int, device) -> list[tuple[int, int]]:
    step = max(1, loop_chunk(device, CHUNK_CPU, CHUNK_GPU) // K) * K  # whole blocks
    return [(q0, min(Q, q0 + step)) for q0 in range(0, Q, step)]


def _scores(q, k, vis_BQC, q0, q1, scale):
    """Masked scores ``[B, Hkv, G, q1-q0, C]`` (fp32 or wider) of block rows ``[q0, q1)``."""
    B, Hkv, G, _, D = q.shape
    n = q1 - q0
    f32 = torch.promote_types(q.dtype, torch.float32)
    s = torch.matmul(q[:, :, :, q0:q1].reshape(B, Hkv, G * n, D), k.transpose(-1, -2))
    s = s.view(B, Hkv, G, n, -1).to(f32) * scale
    return s.masked_fill(~vis_BQC[:, None, None, q0:q1], float("-inf"))


def _part_forward(q, k, v, vis_BQC, K, scale):
    """One held context block: ``out`` (normalized over it, 0 where nothing is visible) and ``lse``
    (-inf there), fp32."""
    B, Hkv, G, Q, D = q.shape
    f32 = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros(q.shape, dtype=f32, device=q.device)
    lse = torch.full(q.shape[:4], float("-inf"), dtype=f32, device=q.device)
    for q0, q1 in _row_chunks(Q, K, q.device):
        s = _scores(q, k, vis_BQC, q0, q1, scale)
        m = s.amax(dim=-1)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m.unsqueeze(-1))
        l = p.sum(dim=-1)
        o = torch.matmul(p.to(v.dtype).view(B, Hkv, G * (q1 - q0), -1), v).view(B, Hkv, G, q1 - q0, D).to(f32)
        out[:, :, :, q0:q1] = o / l.clamp_min(torch.finfo(f32).tiny).unsqueeze(-1)
        lse[:, :, :, q0:q1] = m + torch.log(l)
    return out, lse


def _part_backward(q, k, v, vis_BQC, K, scale, dout, lse_b, delta):
    """Gradients of one held block given the context part's final ``lse`` (+inf where it saw
    nothing) and ``delta = rowsum(dout * out) - dlse``: ``dq`` (like q), ``dk``, ``dv`` (fp32)."""
    B, Hkv, G, Q, D = q.shape
    f32 = lse_b.dtype
    dq = torch.zeros(q.shape, dtype=f32, device=q.device)
    dk = torch.zeros(k.shape, dtype=f32, device=q.device)
    dv = torch.zeros(v.shape, dtype=f32, device=q.device)
    for q0, q1 in _row_chunks(Q, K, q.device):
        n = q1 - q0
        p = torch.exp(_scores(q, k, vis_BQC, q0, q1, scale) - lse_b[:, :, :, q0:q1].unsqueeze(-1))
        do = dout[:, :, :, q0:q1].to(q.dtype).reshape(B, Hkv, G * n, D)
        pf = p.to(q.dtype).view(B, Hkv, G * n, -1)
        dv += torch.matmul(pf.transpose(-1, -2), do).to(f32)
        dp = torch.matmul(do, v.transpose(-1, -2)).view(B, Hkv, G, n, -1).to(f32)
        ds = (p * (dp - delta[:, :, :, q0:q1].unsqueeze(-1)) * scale).to(q.dtype).view(B, Hkv, G * n, -1)
        dq[:, :, :, q0:q1] = torch.matmul(ds, k).view(B, Hkv, G, n, D).to(f32)
        dk += torch.matmul(ds.transpose(-1, -2), q[:, :, :, q0:q1].reshape(B, Hkv, G * n, D)).to(f32)
    return dq, dk, dv


class _RingContext(torch.autograd.Function):
    """``q`` (B,Hkv,G,Q,D) block rows, ``k``/``v`` (B,Hkv,C,D) this rank's context block; the
    anchors are global positions. Returns the context part's ``out`` and ``lse`` (fp32)."""

    @staticmethod
    def forward(ctx, q, k, v, anchors_BN, keep_BN, comm: RingComm, K: int, window, scale: float, skip_hop):
        P, r, C = comm.size, comm.rank, k.shape[2]
        f32 = torch.promote_types(q.dtype, torch.float32)
        out = torch.zeros(q.shape, dtype=f32, device=q.device)
        lse = torch.full(q.shape[:4], float("-inf"), dtype=f32, device=q.device)
        kv = torch.stack((k, v))
        for s in range(P):
            pending = comm.start(kv) if s + 1 < P else None  # pass the held block on, receive the next
            src = (r - s) % P
            if src <= r and s != skip_hop:  # later ranks' context is after every anchor here
                vis = visible_context(anchors_BN, keep_BN, src * C, (src + 1) * C, K, window)
                if bool(vis.any()):  # (a window may hide a whole earlier block)
                    out, lse = merge_parts(out, lse, *_part_forward(q, kv[0], kv[1], vis, K, scale))
            if pending is not None:
                kv = pending.wait()
        ctx.save_for_backward(q, k, v, anchors_BN, keep_BN, out, lse)
        ctx.comm, ctx.K, ctx.window, ctx.scale, ctx.skip_hop = comm, K, window, scale, skip_hop
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, anchors_BN, keep_BN, out, lse = ctx.saved_tensors
        comm, K, window, scale = ctx.comm, ctx.K, ctx.window, ctx.scale
        r, C = comm.rank, k.shape[2]
        f32 = lse.dtype
        delta = (dout.to(f32) * out).sum(dim=-1) - dlse.to(f32)
        lse_b = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("inf")))  # p = 0 there
        dq = torch.zeros(q.shape, dtype=f32, device=q.device)

        def block_grads(s, src, kb, vb):
            if src > r or s == ctx.skip_hop:
                return None
            vis = visible_context(anchors_BN, keep_BN, src * C, (src + 1) * C, K, window)
            if not bool(vis.any()):
                return None
            dq_b, dk_b, dv_b = _part_backward(q, kb, vb, vis, K, scale, dout, lse_b, delta)
            dq.add_(dq_b)
            return dk_b, dv_b

        dk, dv = ring_grad_pass(comm, k, v, block_grads, f32)  # every rank's share of my block
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, None


# ------------------------------------------------------------------------------ the attention of a layer


def _own_block(q, kb, vb, K, scale):
    """The block rows against their own block (bidirectional): ``out``, ``lse`` (fp32, autograd)."""
    B, Hkv, G, Q, D = q.shape
    f32 = torch.promote_types(q.dtype, torch.float32)
    N = Q // K
    s = torch.einsum("bhgnkd,bhnjd->bhgnkj", q.view(B, Hkv, G, N, K, D), kb.view(B, Hkv, N, K, D)).to(f32) * scale
    lse = torch.logsumexp(s, dim=-1)
    o = torch.einsum("bhgnkj,bhnjd->bhgnkd", torch.exp(s - lse.unsqueeze(-1)), vb.view(B, Hkv, N, K, D).to(f32))
    return o.reshape(B, Hkv, G, Q, D), lse.reshape(B, Hkv, G, Q)


@dataclass
class RingBlocks:
    """What the draft's forward needs to run its blocks over the ring: the ring, this rank's first
    context position and, for negative controls only, a ring step whose held block is ignored."""

    comm: RingComm
    start: int
    skip_hop: int = -1

    def attention(self, anchors_BN: torch.Tensor, keep_BN: torch.Tensor, K: int, window: Optional[int] = None):
        """``attend(q_BHQD, k_blk, v_blk, ctx_kv)`` for ``DFlashAttention`` (anchors local to this rank;
        ``window``: the draft's sliding window, None = the whole context before the anchor)."""
        anchors = anchors_BN + self.start

        def attend(q_BHQD, k_blk, v_blk, ctx_kv):
            B, Hq, Q, D = q_BHQD.shape
            Hkv = k_blk.shape[1]
            scale = 1.0 / math.sqrt(D)
            dt = matmul_dtype(q_BHQD, k_blk, ctx_kv[0])
            q = q_BHQD.to(dt).reshape(B, Hkv, Hq // Hkv, Q, D)
            with torch.autocast(q.device.type, enabled=False):  # matmuls in dt, statistics in fp32
                o, lse = _own_block(q, k_blk.to(dt), v_blk.to(dt), K, scale)
                oc, lc = _RingContext.apply(q, ctx_kv[0].to(dt), ctx_kv[1].to(dt), anchors, keep_BN, self.comm, K,
                                            window, scale, self.skip_hop)
                out, _ = merge_parts(o, lse, oc, lc)
            return out.to(q_BHQD.dtype).reshape(B, Hq, Q, D)

        return attend
