"""Sequence parallelism for the TTT attention core, applied from outside the model.

Legend: B batch, H heads, T/C tokens (C = rows one rank owns), D head dim, P group size.

Each SP rank owns a contiguous slice ``[start, start + C)`` of the sequence, padded to a
multiple of ``sp_size`` (``specforge/training/slicing.py``). Everything in the draft is row-local
except attention, so only the attention cores the algorithm names (``sp_cores``; EAGLE-3's TTT core
``draft.midlayer.self_attn.core``) are wrapped (:func:`apply_sp`):

* :class:`UlyssesAttention` -- all-to-all from sequence-sharded ``[B, H, C, D]`` to
  head-sharded ``[B, H/P, P*C, D]`` for q, every key and value (the diagonal keys of later TTT
  steps are position-aligned with q, so they move exactly like q), the inner core, and the
  inverse all-to-all of the output. GQA: when the kv heads do not split over ``P`` they are
  repeated (the least factor that keeps the q->kv head map); when the query heads do not split
  either (SmolLM2: 9 heads), q/k/v are expanded to MHA and zero heads are padded up to a
  multiple of ``P`` and dropped afterwards (zero queries attend uniformly to zero values: their
  output is 0 and no gradient reaches a real head).
* :class:`RingAttention` -- ring attention (``ring.py``): each ring rank keeps its own block of
  the step-0 keys/values and passes it around the ring (P2P, one block at a time); the causal
  step-0 part is computed block by block (later blocks skipped) and merged by log-sum-exp with the
  diagonal keys of later TTT steps, which stay local; the backward rings dK/dV back to their
  owners. Per-rank step-0 K/V memory is a few blocks of ``1/P`` of the sequence (its own, the
  held one, the one in flight), never the whole sequence. Block kernels: plain torch (CPU, any dtype) or \
yunchang's flash-attn wrappers (CUDA,
  fp16/bf16, when flash-attn is installed).
* :class:`AllGatherRingAttention` -- the former context parallel by all-gather, kept as a reference
  (tests, benchmarks): the step-0 keys/values are gathered along the sequence (an exact autograd
  all-gather whose backward reduce-scatters the key gradients) and the inner core runs with
  ``q_offset`` = this rank's global start: full-length step-0 K/V on every rank.
* 2D: ``UlyssesAttention(RingAttention(core))`` -- see ``dims.py`` for why the layout (ring
  outermost, ulysses innermost) makes the Ulysses output a contiguous range for the ring.

The Ulysses wrapper (and the all-gather reference) move every key once per TTT unroll (not once
per step): results are cached while ``keys[0]`` is the same tensor (a new unroll = a new
``keys[0]``). The ring passes the step-0 block around once per TTT step (forward and backward):
holding the passed blocks for the next step would be the gather it avoids.
The wrappers take ``q_offset == 0`` (the local slice is aligned with the local keys) and find
global offsets from their group rank. Packed rows (``train.pack_tokens``): ``doc_ids_BT`` holds the sample
ids of this rank's rows; each wrapper all-gathers them (once per unroll) and hands the inner core
those of the rows it attends over, which masks keys of other samples.
"""

from __future__ import annotations

import weakref
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from specforge.parallel.ring import RingComm, ring_ttt_attention

__all__ = [
    "UlyssesAttention",
    "RingAttention",
    "AllGatherRingAttention",
    "apply_sp",
    "seq_to_heads",
    "heads_to_seq",
    "gather_seq",
    "gather_ids",
]

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ------------------------------------------------------------------------------ collectives


def _a2a(x: torch.Tensor, group, to_heads: bool) -> torch.Tensor:
    """``to_heads``: [B, H, C, D] -> [B, H/P, P*C, D]; else the inverse."""
    P = dist.get_world_size(group)
    if to_heads:
        B, H, C, D = x.shape
        if H % P:
            raise ValueError(f"{H} heads do not split over {P} Ulysses ranks")
        inp = x.reshape(B, P, H // P, C, D).transpose(0, 1).contiguous()  # [P, B, H/P, C, D]
        out = torch.empty_like(inp)
        dist.all_to_all_single(out, inp, group=group)  # out[r] = rank r's rows of my heads
        return out.permute(1, 2, 0, 3, 4).reshape(B, H // P, P * C, D)
    B, h, TT, D = x.shape
    C = TT // P
    inp = x.reshape(B, h, P, C, D).permute(2, 0, 1, 3, 4).contiguous()  # [P, B, h, C, D]
    out = torch.empty_like(inp)
    dist.all_to_all_single(out, inp, group=group)  # out[r] = rank r's heads of my rows
    return out.transpose(0, 1).reshape(B, P * h, C, D)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, to_heads: bool):
        ctx.group, ctx.to_heads = group, to_heads
        return _a2a(x, group, to_heads)

    @staticmethod
    def backward(ctx, g):
        return _a2a(g.contiguous(), ctx.group, not ctx.to_heads), None, None


def seq_to_heads(x_BHCD: torch.Tensor, group) -> torch.Tensor:
    return _AllToAll.apply(x_BHCD, group, True)


def heads_to_seq(x_BhTD: torch.Tensor, group) -> torch.Tensor:
    return _AllToAll.apply(x_BhTD, group, False)


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 2 (rank order); backward = reduce-scatter (sum) of the gradient.

    Written by hand: ``torch.distributed.nn.functional.all_gather`` gave wrong gradients on gloo."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        P = dist.get_world_size(group)
        B, H, C, D = x.shape
        out = x.new_empty(P * B, H, C, D)  # rank-major along dim 0
        _all_gather(out, x.contiguous(), group=group)
        return out.view(P, B, H, C, D).permute(1, 2, 0, 3, 4).reshape(B, H, P * C, D)

    @staticmethod
    def backward(ctx, g):
        P = dist.get_world_size(ctx.group)
        B, H, TT, D = g.shape
        inp = g.reshape(B, H, P, TT // P, D).permute(2, 0, 1, 3, 4).reshape(P * B, H, TT // P, D)
        out = g.new_empty(B, H, TT // P, D)
        _reduce_scatter(out, inp, group=ctx.group)
        return out, None


def gather_seq(x_BHCD: torch.Tensor, group) -> torch.Tensor:
    return _GatherSeq.apply(x_BHCD, group)


def gather_ids(ids_BC: torch.Tensor, group) -> torch.Tensor:
    """All-gather of per-row ids (``B x C`` -> ``B x P*C``, rank order; no gradient): packed rows'
    sample ids, which every rank of an SP core needs for the whole sequence it attends over."""
    P = dist.get_world_size(group)
    B, C = ids_BC.shape
    out = ids_BC.new_empty(P * B, C)
    _all_gather(out, ids_BC.contiguous(), group=group)
    return out.view(P, B, C).transpose(0, 1).reshape(B, P * C)


# ------------------------------------------------------------------------------ wrappers


class _PerUnrollCache:
    """Results per input tensor, valid while ``keys[0]`` is the same object (one TTT unroll)."""

    def __init__(self):
        self._anchor = None
        self._items: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def start(self, k0: torch.Tensor) -> None:
        if self._anchor is None or self._anchor() is not k0:
            self._anchor = weakref.ref(k0)
            self._items = {}

    def get(self, x: torch.Tensor, fn) -> torch.Tensor:
        hit = self._items.get(id(x))
        if hit is not None and hit[0] is x:
            return hit[1]
        y = fn(x)
        self._items[id(x)] = (x, y)
        return y


def _kv_repeat(Hq: int, Hkv: int, P: int) -> Optional[int]:
    """Least r with Hkv*r and Hq splitting over P and keeping head h -> kv h // (Hq/Hkv)."""
    if Hq % P:
        return None
    G = Hq // Hkv
    return next(r for r in range(1, G + 1) if G % r == 0 and (Hkv * r) % P == 0)


class UlyssesAttention(nn.Module):
    """All-to-all (sequence <-> heads) around ``inner`` over ``group`` (see the module docstring)."""

    def __init__(self, inner: nn.Module, group):
        super().__init__()
        self.inner = inner
        self.group = group
        self._cache = _PerUnrollCache()

    def forward(self, q_BHTD, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], q_offset: int = 0,
                doc_ids_BT: Optional[torch.Tensor] = None):
        if q_offset:
            raise ValueError("sequence-parallel core: q_offset must be 0 (local slice aligned with local keys)")
        P = dist.get_world_size(self.group)
        Hq, Hkv = q_BHTD.shape[1], keys[0].shape[1]
        r, pad = _kv_repeat(Hq, Hkv, P), 0
        if r is None:  # query heads do not split: MHA + zero heads up to a multiple of P
            r, pad = Hq // Hkv, -Hq % P

        def prep(x: torch.Tensor, is_kv: bool) -> torch.Tensor:
            if is_kv and r > 1:
                x = x.repeat_interleave(r, dim=1)
            if pad:
                x = F.pad(x, (0, 0, 0, 0, 0, pad))
            return seq_to_heads(x, self.group)

        self._cache.start(keys[0])
        q = prep(q_BHTD, False)
        ks = [self._cache.get(k, lambda x: prep(x, True)) for k in keys]
        vs = [self._cache.get(v, lambda x: prep(x, True)) for v in values]
        kw = {} if doc_ids_BT is None else {
            "doc_ids_BT": self._cache.get(doc_ids_BT, lambda x: gather_ids(x, self.group))}
        out = heads_to_seq(self.inner(q, ks, vs, q_offset=0, **kw), self.group)
        return out[:, :Hq] if pad else out


class RingAttention(nn.Module):
    """Ring attention over ``group`` (``ring.py``); ``inner`` (the TTT core) gives the softmax scale.
    ``kernel``: ``"auto"`` | ``"torch"`` | ``"flash"`` (``ring.pick_kernel``). ``comm`` counts the
    bytes this rank receives (tests, benchmarks)."""

    def __init__(self, inner: nn.Module, group, kernel: str = "auto"):
        super().__init__()
        self.inner = inner
        self.group = group
        self.kernel = kernel
        self.comm = RingComm(group)
        self._cache = _PerUnrollCache()

    def forward(self, q_BHTD, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], q_offset: int = 0,
                doc_ids_BT: Optional[torch.Tensor] = None):
        if q_offset:
            raise ValueError("sequence-parallel core: q_offset must be 0 (local slice aligned with local keys)")
        if doc_ids_BT is not None:
            self._cache.start(keys[0])
            doc_ids_BT = self._cache.get(doc_ids_BT, lambda x: gather_ids(x, self.group))
        return ring_ttt_attention(q_BHTD, keys, values, self.comm, getattr(self.inner, "scale", None), self.kernel,
                                  getattr(self.inner, "window", None), doc_ids_BT)


class AllGatherRingAttention(nn.Module):
    """Reference: context parallel by all-gather of the step-0 keys/values over ``group`` (every
    rank then holds the whole sequence's step-0 K/V; see the module docstring)."""

    def __init__(self, inner: nn.Module, group):
        super().__init__()
        self.inner = inner
        self.group = group
        self._cache = _PerUnrollCache()

    def forward(self, q_BHTD, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], q_offset: int = 0,
                doc_ids_BT: Optional[torch.Tensor] = None):
        if q_offset:
            raise ValueError("sequence-parallel core: q_offset must be 0 (local slice aligned with local keys)")
        offset = dist.get_rank(self.group) * q_BHTD.shape[2]  # all ranks hold equal slices
        self._cache.start(keys[0])
        k0 = self._cache.get(keys[0], lambda x: gather_seq(x, self.group))
        v0 = self._cache.get(values[0], lambda x: gather_seq(x, self.group))
        kw = {} if doc_ids_BT is None else {
            "doc_ids_BT": self._cache.get(doc_ids_BT, lambda x: gather_ids(x, self.group))}
        return self.inner(q_BHTD, [k0, *keys[1:]], [v0, *values[1:]], q_offset=offset, **kw)


def apply_sp(draft: nn.Module, cores, ulysses_group=None, ring_group=None, ring_cls=None) -> nn.Module:
    """Wrap each attention core ``(module, attribute)`` of ``cores`` (the algorithm's ``sp_cores``;
    EAGLE-3: ``draft.midlayer.self_attn.core``) in the SP wrappers (``None`` group = degree 1).
    ``ring_cls``: the ring wrapper (default :class:`RingAttention`; :class:`AllGatherRingAttention`
    for reference runs)."""
    for module, name in cores:
        core = getattr(module, name)
        if ring_group is not None:
            core = (ring_cls or RingAttention)(core, ring_group)
        if ulysses_group is not None:
            core = UlyssesAttention(core, ulysses_group)
        setattr(module, name, core)
    return draft
