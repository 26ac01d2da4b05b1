"""Ring attention for the TTT core: the step-0 keys/values travel around the ring, never gathered.

Legend: B batch, Hkv kv heads, G query heads per kv head, C rows of one ring rank's block, D head
dim, P ring size, n diagonal keys (TTT steps so far).

Ring rank ``r`` holds the queries and the step-0 keys/values of one contiguous block of rows,
block ``r`` (global rows ``[r*C, (r+1)*C)``; with Ulysses inside, the block of its Ulysses group,
see ``dims.py``). Step-0 attention is causal, so the queries of block ``r`` read key blocks
``0..r``: block ``r`` with the causal triangle, the blocks before it whole, the blocks after it
not at all. The diagonal keys of TTT steps ``>= 1`` (one per query row) are local.

Forward (P ring steps; the algorithm of yunchang's ``ring_pytorch_attn`` and of
ring-flash-attention): at step ``s`` the rank holds block ``(r - s) mod P``; it posts the exchange
that passes the held block to rank ``r + 1`` and receives block ``(r - s - 1) mod P`` from rank
``r - 1`` (one ``batch_isend_irecv``), attends to the held block if it is visible (a block
``out``, ``lse``; fp32 statistics), merges by log-sum-exp, and only then waits. The diagonal
part is merged the same way. Besides its own block, a rank holds the block it attends to (a copy
of its own at step 0) and the one it is receiving: three blocks of ``2 x B x Hkv x C x D``
whatever the ring size, and the backward adds the fp32 dK/dV accumulator it passes on.

Backward: the gradient of any part of a softmax over a union of keys depends only on the final
``out`` and ``lse`` (``dS = P * (dP - rowsum(dO * O))``, ``P = exp(S - lse)``), so no gradient
flows through a partial ``lse``: the K/V blocks travel the ring again; each rank adds its queries'
dK/dV of the held block to an fp32 accumulator that travels one step behind the block and reaches
the block's owner after P steps (ring-flash-attention's scheme).

Kernels per block (``kernel=``):

* ``"torch"`` -- matmuls in the inputs' dtype, softmax statistics in fp32, query rows in chunks
  (``device.loop_chunk``); any device, any dtype, GQA without repeating K/V. The CPU path.
* ``"flash"`` -- yunchang's ``flash_attn_forward`` / ``flash_attn_backward`` (its wrappers of
  flash-attn's kernels, which return the block's lse and take the final out/lse in backward): CUDA
  with ``flash-attn`` installed, fp16/bf16; GQA native.
* ``"auto"`` -- ``"flash"`` where it applies, ``"torch"`` elsewhere.

Why not yunchang's ring functions themselves (0.6.4, read, and run on 2 gloo ranks in fp32): its
torch ring ``ring_pytorch_attn_func`` computes each block with
``aten._scaled_dot_product_flash_attention``, which fails on the CPU ("Could not run
'aten::_scaled_dot_product_flash_attention' with arguments from the 'CPU' backend"; the
"efficient" op likewise, and the "math" op returns an all-zero lse); it casts the lse to the input
dtype, needs as many kv heads as query heads, and its backward calls ``pytorch_attn_backward``,
which raises "Not implemented backward for PyTorch attention types". Its flash ring
(``ring_flash_attn_func``) needs CUDA + flash-attn and returns a non-differentiable lse, while the
TTT core needs the step-0 part's lse merged with the diagonal keys' part and an exact gradient
through that merge. So the ring pass (this module) is ours on every device and yunchang supplies
the GPU block kernels. ``RingComm`` does what yunchang's ``RingComm`` does (one ``batch_isend_irecv``
per exchange) without needing the ``sp`` extra on the CPU, and counts the bytes it receives.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from specforge.device import loop_chunk, matmul_dtype, row_chunks

__all__ = ["RingComm", "ring_ttt_attention", "ring_grad_pass", "TorchKernel", "FlashKernel", "pick_kernel",
           "block_band"]

# Query rows per iteration of the torch block kernel (as the fast TTT core: CPU / GPU).
CHUNK_CPU, CHUNK_GPU = 128, 512


# ------------------------------------------------------------------------------ the exchange


class RingComm:
    """Passes a tensor to the next rank of ``group`` while receiving the previous rank's
    (``batch_isend_irecv``). Counts what it receives: ``bytes_recv`` (total), ``largest_recv``
    (the largest single tensor) and ``recv_shapes`` (every received shape, in order)."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self.reset_counters()

    def reset_counters(self) -> None:
        self.bytes_recv = 0
        self.largest_recv = 0
        self.recv_shapes: list[tuple[int, ...]] = []

    def start(self, x: torch.Tensor) -> "_Pending":
        """Post: send ``x`` to the next rank, receive a tensor like it from the previous one."""
        x = x.contiguous()
        buf = torch.empty_like(x)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, self.next, self.group),
                                        dist.P2POp(dist.irecv, buf, self.prev, self.group)])
        n = buf.numel() * buf.element_size()
        self.bytes_recv += n
        self.largest_recv = max(self.largest_recv, n)
        self.recv_shapes.append(tuple(buf.shape))
        return _Pending(works, x, buf)


class _Pending:
    def __init__(self, works, sent: torch.Tensor, buf: torch.Tensor):
        self.works, self.sent, self.buf = works, sent, buf  # ``sent`` stays alive until the wait

    def wait(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        self.sent = None
        return self.buf


# ------------------------------------------------------------------------------ block kernels


class TorchKernel:
    """One block of attention in plain torch: ``q`` (B,Hkv,G,C,D) against ``k``/``v``
    (B,Hkv,Ck,D); ``causal`` only for the rank's own block (``C == Ck``, row t sees keys <= t).
    ``band = (d, left)`` (a sliding window; overrides ``causal``): key ``a`` is visible to row ``t``
    iff ``d - left <= a - t <= d`` (``d``: how many rows the query block starts after the key
    block; ``left``: the keys a row sees before its own position). Each chunk of rows computes
    only the keys its band reaches. ``docs = (q_doc, k_doc)`` (packed rows, ``train.pack_tokens``:
    ``B x C`` and ``B x Ck`` sample ids of the query and key rows): a key of another sample is masked."""

    name = "torch"

    def __init__(self, chunk: Optional[int] = None):
        self.chunk = chunk

    def _chunk(self, q: torch.Tensor) -> int:
        return self.chunk or loop_chunk(q.device, CHUNK_CPU, CHUNK_GPU)

    @staticmethod
    def _span(c0, c1, Ck, causal, band) -> tuple[int, int]:
        """``[lo, hi)``: the keys rows ``c0 .. c1 - 1`` may see."""
        if band is None:
            return 0, (c1 if causal else Ck)
        d, left = band
        return max(0, c0 + d - left), min(Ck, c1 + d)

    @staticmethod
    def _scores(qc, k, c0, lo, hi, causal, band, scale, f32, docs=None):
        B, Hkv, G, n = qc.shape[:4]
        L = hi - lo
        s = torch.matmul(qc.reshape(B, Hkv, G * n, -1), k[:, :, lo:hi].transpose(-1, -2)).view(B, Hkv, G, n, L)
        s = s.to(f32) * scale
        if band is not None:
            d, left = band
            rel = (lo + torch.arange(L, device=s.device))[None, :] - (c0 + torch.arange(n, device=s.device))[:, None]
            s.masked_fill_((rel > d) | (rel < d - left), float("-inf"))
        elif causal:  # the chunk's last n keys: key L-n+a visible to chunk row a' iff a <= a'
            s[..., L - n:].masked_fill_(torch.ones(n, n, dtype=torch.bool, device=s.device).triu_(1), float("-inf"))
        if docs is not None:
            q_doc, k_doc = docs
            s.masked_fill_((q_doc[:, c0 : c0 + n, None] != k_doc[:, None, lo:hi])[:, None, None], float("-inf"))
        return s

    def forward(self, q, k, v, causal: bool, scale: float, band=None, docs=None):
        """-> ``out`` (fp32, normalized over this block), ``lse`` (fp32, B,Hkv,G,C)."""
        B, Hkv, G, C, D = q.shape
        f32 = torch.promote_types(q.dtype, torch.float32)
        out = torch.empty(q.shape, dtype=f32, device=q.device)
        lse = torch.empty(q.shape[:4], dtype=f32, device=q.device)
        for c0, c1 in row_chunks(C, self._chunk(q)):
            n = c1 - c0
            lo, hi = self._span(c0, c1, k.shape[2], causal, band)
            if hi <= lo:  # (a band) no row of the chunk sees a key of this block: an empty part
                out[:, :, :, c0:c1], lse[:, :, :, c0:c1] = 0.0, float("-inf")
                continue
            s = self._scores(q[:, :, :, c0:c1], k, c0, lo, hi, causal, band, scale, f32, docs)
            m = s.amax(dim=-1)
            if band is not None or docs is not None:  # rows that see no key here: p = 0, l = 0, out 0, lse -inf
                m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            p = torch.exp(s - m.unsqueeze(-1))
            l = p.sum(dim=-1)
            o = torch.matmul(p.to(v.dtype).view(B, Hkv, G * n, hi - lo), v[:, :, lo:hi]).view(B, Hkv, G, n, D).to(f32)
            out[:, :, :, c0:c1] = o / torch.where(l > 0, l, torch.ones_like(l)).unsqueeze(-1)
            lse[:, :, :, c0:c1] = m + torch.log(l)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, delta, causal: bool, scale: float, band=None, docs=None):
        """Gradients of this block's keys given the FINAL ``lse`` and ``delta = rowsum(dout * out)``
        (fp32): -> ``dq`` (B,Hkv,G,C,D), ``dk``, ``dv`` (B,Hkv,Ck,D), all fp32."""
        B, Hkv, G, C, D = q.shape
        f32 = torch.promote_types(q.dtype, torch.float32)
        dq = torch.empty(q.shape, dtype=f32, device=q.device)
        dk = torch.zeros(k.shape, dtype=f32, device=q.device)
        dv = torch.zeros(v.shape, dtype=f32, device=q.device)
        for c0, c1 in row_chunks(C, self._chunk(q)):
            n = c1 - c0
            lo, hi = self._span(c0, c1, k.shape[2], causal, band)
            if hi <= lo:
                dq[:, :, :, c0:c1] = 0.0
                continue
            L = hi - lo
            qc = q[:, :, :, c0:c1]
            dout_c = dout[:, :, :, c0:c1].reshape(B, Hkv, G * n, D)
            s = self._scores(qc, k, c0, lo, hi, causal, band, scale, f32, docs)
            p = torch.exp(s - lse[:, :, :, c0:c1].unsqueeze(-1))  # a row with no key here (band, doc_ids_BT): all 0
            dv[:, :, lo:hi] += torch.matmul(p.to(q.dtype).view(B, Hkv, G * n, L).transpose(-1, -2), dout_c).to(f32)
            dp = torch.matmul(dout_c, v[:, :, lo:hi].transpose(-1, -2)).view(B, Hkv, G, n, L).to(f32)
            ds = (p * (dp - delta[:, :, :, c0:c1].unsqueeze(-1)) * scale).to(q.dtype).view(B, Hkv, G * n, L)
            dq[:, :, :, c0:c1] = torch.matmul(ds, k[:, :, lo:hi]).view(B, Hkv, G, n, D).to(f32)
            dk[:, :, lo:hi] += torch.matmul(ds.transpose(-1, -2), qc.reshape(B, Hkv, G * n, D)).to(f32)
        return dq, dk, dv


class FlashKernel:
    """One block through yunchang's flash-attn wrappers (CUDA, fp16/bf16). Layout (B, S, H, D);
    query head ``kv * G + g`` reads kv head ``kv`` (flash-attn's GQA rule = the TTT core's)."""

    name = "flash"

    @staticmethod
    def available(q: torch.Tensor) -> bool:
        if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
            return False
        try:
            from yunchang.globals import HAS_FLASH_ATTN  # lazy: optional (yunchang)
        except ImportError:
            return False
        return bool(HAS_FLASH_ATTN)

    @staticmethod
    def _q(x):  # (B,Hkv,G,C,D) -> (B,C,Hkv*G,D)
        B, Hkv, G, C, D = x.shape
        return x.permute(0, 3, 1, 2, 4).reshape(B, C, Hkv * G, D).contiguous()

    @staticmethod
    def _unq(x, shape):  # (B,C,Hkv*G,D) -> (B,Hkv,G,C,D)
        B, Hkv, G, C, D = shape
        return x.view(B, C, Hkv, G, D).permute(0, 2, 3, 1, 4)

    def forward(self, q, k, v, causal: bool, scale: float, band=None, docs=None):
        from yunchang.kernels.attention import flash_attn_forward  # lazy: optional (yunchang)

        _no_band(band, docs)
        out, lse = flash_attn_forward(self._q(q), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(),
                                      0.0, scale, causal, (-1, -1), 0.0, None, False)
        return self._unq(out, q.shape).float(), lse.float().view(q.shape[:4])

    def backward(self, dout, q, k, v, out, lse, delta, causal: bool, scale: float, band=None, docs=None):
        from yunchang.kernels.attention import flash_attn_backward  # lazy: optional (yunchang)

        _no_band(band, docs)
        qf, kf, vf = self._q(q), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        dq, dk, dv = torch.empty_like(qf), torch.empty_like(kf), torch.empty_like(vf)
        B, Hkv, G, C, _ = q.shape
        flash_attn_backward(self._q(dout), qf, kf, vf, self._q(out), lse.reshape(B, Hkv * G, C).contiguous(),
                            dq, dk, dv, 0.0, scale, causal, (-1, -1), 0.0, None, False, None)
        return self._unq(dq, q.shape).float(), dk.transpose(1, 2).float(), dv.transpose(1, 2).float()


def _no_band(band, docs=None) -> None:
    if docs is not None:
        raise ValueError("the flash block kernel takes no packed rows here (its masks are causal only); ring "
                         "attention with train.pack_tokens uses kernel 'torch'")
    if band is not None:
        raise ValueError("the flash block kernel takes no sliding window here (flash-attn's window cannot mask "
                         "a block that starts a whole window back); ring attention with a window uses kernel 'torch'")


def pick_kernel(kernel, q: torch.Tensor, window: Optional[int] = None, packed: bool = False):
    """``"auto"`` | ``"torch"`` | ``"flash"`` (or a kernel object, used as is) for queries ``q``.
    A sliding ``window`` runs the torch kernel (on any device): flash-attn's ``window_size`` is
    relative to the block's own diagonal and cannot express a band that starts beyond a whole
    block; a flash path for windows would split such blocks. ``packed`` rows (sample masks) too:
    a flash path would cut each block at its samples' bounds (varlen), not written yet."""
    if not isinstance(kernel, str):
        return kernel
    if kernel == "auto":
        kernel = "flash" if FlashKernel.available(q) and window is None and not packed else "torch"
    if kernel == "flash":
        _no_band(None if window is None else (0, window), True if packed else None)
        return FlashKernel()
    if kernel == "torch":
        return TorchKernel()
    raise ValueError(f"ring attention kernel {kernel!r}: expected 'auto', 'torch' or 'flash'")


# ------------------------------------------------------------------------------ the ring pass


def block_role(src: int, rank: int) -> Optional[str]:
    """What the queries of ring block ``rank`` do with key block ``src``: ``"causal"`` (its own),
    ``"full"`` (an earlier block), ``None`` (a later block: skipped)."""
    if src == rank:
        return "causal"
    return "full" if src < rank else None


def block_band(src: int, rank: int, C: int, left: Optional[int]) -> Optional[tuple[int, int]]:
    """With a sliding window (``left``: step-0 keys a query sees before its own position), the band
    of key block ``src`` for the queries of block ``rank`` (``TorchKernel``'s ``(d, left)``), or None
    when no query of the block reaches a key of it (the block is skipped)."""
    d = (rank - src) * C
    return (d, left) if d - left <= C - 1 else None


def _merge(out, lse, o, l):
    """Two normalized parts of one softmax -> their union (fp32; both lse finite)."""
    new = torch.logaddexp(lse, l)
    return out * torch.exp(lse - new).unsqueeze(-1) + o * torch.exp(l - new).unsqueeze(-1), new


class _RingTTTAttention(torch.autograd.Function):
    """``q`` (B,Hkv,G,C,D), ``k0``/``v0`` (B,Hkv,C,D) this rank's step-0 block, ``kd``/``vd``
    (B,Hkv,n,C,D) the diagonal keys or None. Returns ``out`` (B,Hkv,G,C,D) in q's dtype."""

    @staticmethod
    def forward(ctx, q, k0, v0, kd, vd, comm: RingComm, kernel, scale: float, window: Optional[int] = None,
                doc_ids_BT: Optional[torch.Tensor] = None):
        P, r = comm.size, comm.rank
        left = _left(window, kd)
        kv = torch.stack((k0, v0))
        out = lse = None
        for s in range(P):
            pending = comm.start(kv) if s + 1 < P else None  # pass the held block on, receive the next
            src = (r - s) % P
            role, band = _role(src, r, q.shape[3], left)
            if role is not None:
                o, l = kernel.forward(q, kv[0], kv[1], role == "causal", scale, band,
                                      _docs(doc_ids_BT, src, r, q.shape[3]))
                out, lse = (o, l) if out is None else _merge(out, lse, o, l)
            if pending is not None:
                kv = pending.wait()
        if out is None:
            raise RuntimeError("ring attention: no key block visible (block_role skipped the rank's own block)")
        if kd is not None:
            f32 = out.dtype
            sd = torch.einsum("bkgtd,bkntd->bkgtn", q.to(f32), kd.to(f32)) * scale
            ld = torch.logsumexp(sd, dim=-1)
            od = torch.einsum("bkgtn,bkntd->bkgtd", torch.exp(sd - ld.unsqueeze(-1)), vd.to(f32))
            out, lse = _merge(out, lse, od, ld)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k0, v0, kd, vd, out, lse)
        ctx.comm, ctx.kernel, ctx.scale, ctx.left, ctx.doc_ids_BT = comm, kernel, scale, left, doc_ids_BT
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k0, v0, kd, vd, out, lse = ctx.saved_tensors
        comm, kernel, scale, left, doc_ids_BT = ctx.comm, ctx.kernel, ctx.scale, ctx.left, ctx.doc_ids_BT
        r = comm.rank
        f32 = lse.dtype
        dout = dout.to(q.dtype).contiguous()
        delta = (dout.to(f32) * out.to(f32)).sum(dim=-1)
        dq = torch.zeros(q.shape, dtype=f32, device=q.device)
        dkd = dvd = None
        if kd is not None:  # the diagonal part, local
            qf, dof = q.to(f32), dout.to(f32)
            pd = torch.exp(torch.einsum("bkgtd,bkntd->bkgtn", qf, kd.to(f32)) * scale - lse.unsqueeze(-1))
            dsd = pd * (torch.einsum("bkgtd,bkntd->bkgtn", dof, vd.to(f32)) - delta.unsqueeze(-1)) * scale
            dq += torch.einsum("bkgtn,bkntd->bkgtd", dsd, kd.to(f32))
            dkd = torch.einsum("bkgtn,bkgtd->bkntd", dsd, qf).to(kd.dtype)
            dvd = torch.einsum("bkgtn,bkgtd->bkntd", pd, dof).to(vd.dtype)

        def block_grads(s, src, k, v):
            role, band = _role(src, r, q.shape[3], left)
            if role is None:
                return None
            dq_b, dk_b, dv_b = kernel.backward(dout, q, k, v, out, lse, delta, role == "causal", scale, band,
                                               _docs(doc_ids_BT, src, r, q.shape[3]))
            dq.add_(dq_b)
            return dk_b, dv_b

        dk0, dv0 = ring_grad_pass(comm, k0, v0, block_grads, f32)
        return dq.to(q.dtype), dk0.to(k0.dtype), dv0.to(v0.dtype), dkd, dvd, None, None, None, None, None


def ring_grad_pass(comm: RingComm, k: torch.Tensor, v: torch.Tensor, block_grads, f32: torch.dtype):
    """The backward's ring (ring-flash-attention's scheme): this rank's K/V block travels the ring
    again; at step ``s`` the rank holds rank ``src``'s block and ``block_grads(s, src, k, v)`` returns
    its queries' ``(dk, dv)`` of it (fp32) or None; an fp32 accumulator of the held block's dK/dV
    travels one step behind the block and, after ``P`` steps, is back at its owner: returns this
    rank's own block's ``dk``, ``dv``, every rank's share summed."""
    P, r = comm.size, comm.rank
    kv = torch.stack((k, v))
    acc_pending = None
    for s in range(P):
        kv_pending = comm.start(kv) if s + 1 < P else None
        grads = block_grads(s, (r - s) % P, kv[0], kv[1])
        block = None if grads is None else torch.stack(grads)
        if s == 0:  # the own block's accumulator starts here
            acc = block if block is not None else torch.zeros((2, *k.shape), dtype=f32, device=k.device)
        else:  # the accumulator of the held block, one step behind it
            acc = acc_pending.wait()
            if block is not None:
                acc = acc + block
        acc_pending = comm.start(acc) if P > 1 else None
        if kv_pending is not None:
            kv = kv_pending.wait()
    dkv = acc_pending.wait() if acc_pending is not None else acc
    return dkv[0], dkv[1]


def _left(window: Optional[int], kd: Optional[torch.Tensor]) -> Optional[int]:
    """Step-0 keys a query sees before its own position under ``window`` at this TTT step (its query
    sits ``n`` = diagonal keys positions later: ``attention.py``'s rule), None without a window."""
    if window is None:
        return None
    n = 0 if kd is None else kd.shape[2]
    if window <= n:
        raise ValueError(f"sliding window {window} must exceed the TTT steps' diagonal keys ({n})")
    return window - 1 - n


def _docs(doc_ids_BT: Optional[torch.Tensor], src: int, rank: int, C: int):
    """Packed rows: (the query block's, key block ``src``'s) sample ids, cut from the ring's whole ``doc_ids_BT``."""
    if doc_ids_BT is None:
        return None
    return doc_ids_BT[:, rank * C : (rank + 1) * C], doc_ids_BT[:, src * C : (src + 1) * C]


def _role(src: int, rank: int, C: int, left: Optional[int]) -> tuple[Optional[str], Optional[tuple[int, int]]]:
    """``block_role``, and with a window the block's band (a block the band misses: skipped)."""
    role = block_role(src, rank)
    if role is None or left is None:
        return role, None
    band = block_band(src, rank, C, left)
    return (role, band) if band is not None else (None, None)


def ring_ttt_attention(q_BHCD: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                       comm: RingComm, scale: Optional[float] = None, kernel: str = "auto",
                       window: Optional[int] = None, doc_ids_BT: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The TTT core's attention (``algorithms/eagle3/attention.py`` interface, ``q_offset`` implied by
    the ring rank) over ``comm``'s ring: ``keys[0]``/``values[0]`` this rank's step-0 block (as many
    rows as ``q``), ``keys[j >= 1]`` the diagonal keys, row-aligned with ``q``. GQA inside.
    ``window``: the core's sliding window (blocks wholly outside every row's band are not computed;
    they still pass through the ring). ``doc_ids_BT`` (packed rows, ``train.pack_tokens``): ``B x (P*C)``
    sample ids of the ring's whole row (every rank's block in ring order); a query sees only keys
    of its own sample (the diagonal keys are its own row's)."""
    B, Hq, C, D = q_BHCD.shape
    Hkv = keys[0].shape[1]
    if Hq % Hkv:
        raise ValueError(f"query heads {Hq} not a multiple of kv heads {Hkv}")
    for j, k in enumerate(keys):
        if k.shape[2] != C:
            raise ValueError(f"ring attention: keys[{j}] has {k.shape[2]} rows, expected this rank's block of {C}")
    if doc_ids_BT is not None and tuple(doc_ids_BT.shape) != (B, comm.size * C):
        raise ValueError(f"ring attention: doc_ids_BT is {tuple(doc_ids_BT.shape)}, "
                         f"expected the whole row ({B}, {comm.size * C})")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    dt = matmul_dtype(q_BHCD, keys[0], values[0])
    q = q_BHCD.to(dt).reshape(B, Hkv, Hq // Hkv, C, D)
    k0, v0 = keys[0].to(dt), values[0].to(dt)
    kd = vd = None
    if len(keys) > 1:
        kd = torch.stack([k.to(dt) for k in keys[1:]], dim=2)
        vd = torch.stack([v.to(dt) for v in values[1:]], dim=2)
    with torch.autocast(q.device.type, enabled=False):
        kern = pick_kernel(kernel, q, window, doc_ids_BT is not None)
        out = _RingTTTAttention.apply(q, k0, v0, kd, vd, comm, kern, scale, window, doc_ids_BT)
    return out.reshape(B, Hq, C, D)
