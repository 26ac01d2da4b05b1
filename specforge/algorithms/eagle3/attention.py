"""The swappable TTT attention core of the EAGLE-3 draft.

Interface (see docs/ARCHITECTURE.md)::

    core(q_BHTD, keys, values, q_offset=0) -> out_BHTD

* ``q_BHTD``: queries of one TTT step, ``Hq`` heads, ``T`` rows.
* ``keys[0]`` / ``values[0]`` (``B x Hkv x T0 x D``): the step-0 keys. Causal: the query at
  global position ``q_offset + t`` sees ``keys[0][..., :q_offset + t + 1, :]``. ``T0`` may be
  longer than ``q_offset + T`` (the all-gather ring reference, ``parallel/sp.py``, passes the whole
  sequence); keys past the last query are never seen.
* ``keys[j]``, ``j >= 1`` (``B x Hkv x T x D``): the keys of TTT step ``j``, aligned row by row
  with the queries: query ``t`` sees only ``keys[j][..., t, :]`` (the "diagonal").
* GQA (``Hq`` a multiple of ``Hkv``) is handled inside; head ``h`` uses kv head ``h // (Hq/Hkv)``
  (the HF ``repeat_kv`` convention).
* ``window`` (``W``, None = full attention): sliding-window attention by RoPE position, the rule
  engines apply at inference (a query at position ``p`` sees keys at positions ``> p - W``). The
  queries of TTT step ``n = len(keys) - 1`` sit at position ``q_offset + t + n`` (the model shifts
  their RoPE by the step), so row ``t`` sees step-0 keys ``q_offset + t + n - W < j <= q_offset + t``;
  its diagonal keys (positions ``t + 1 .. t + n``) stay inside the window as long as ``W > n``
  (the config requires ``W > ttt_length``). speculators' trainer windows by row, ignoring the step
  shift: the two differ at the window's edge by at most ``n`` keys, and ours is what is served.
* ``doc_ids_BT`` (``B x T0`` integer ids, None = one sample per row): packed rows (``data/packing.py``):
  a query sees only step-0 keys of its own sample (``doc_ids_BT[b, key] == doc_ids_BT[b, q_offset + t]``); its
  diagonal keys are its own row's, so always its own sample's.

Implementations (all exact up to rounding, all differentiable on CPU):

* :func:`ttt_attention_eager` -- the reference: concatenates all keys, materializes the full
  ``T x (T0 + i*T)`` boolean mask and runs a plain masked softmax. Used by tests and as the
  benchmark baseline.
* :func:`ttt_attention_fast` -- never builds the big mask. Scores against ``keys[0]`` are a causal
  block (computed per query chunk so the upper triangle is mostly skipped), each diagonal step
  contributes one score per query (``q . k_j``); one softmax over ``[causal block | i diagonal
  scores]`` with max subtraction, statistics in fp32. A hand-written autograd Function: saves
  the causal-block probabilities per chunk in the matmul dtype (bf16 under autocast; about half
  of ``T x T`` per head thanks to the chunking) and the diagonal parts are recomputed in backward
  (measured faster on CPU than recomputing the scores; on a GPU use a fused kernel instead).
* :func:`ttt_attention_sdpa` -- step 0 with ``q_offset == 0`` (plain causal attention) goes to
  ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` (fused kernels on CPU and
  GPU); everything else falls back to the fast path.
* :func:`ttt_attention_flex` -- ``torch.nn.attention.flex_attention`` over the concatenated keys
  ``cat(keys)`` with a block mask whose ``mask_mod`` is :func:`build_ttt_mask`'s rule (causal +
  window on the ``T0`` step-0 keys, then one diagonal per later step), ``enable_gqa``. On CUDA it
  runs ``torch.compile(flex_attention, dynamic=None)`` (one fused kernel forward, one backward;
  autograd keeps q, the concatenated K/V, out and the row log-sum-exp/max, no probabilities: O(T)
  per head). ``auto`` picks it on CUDA for unpacked rows (``pick_impl``). Shapes are dynamic after the
  first (each TTT step's keys are longer, and row counts vary per batch): a static compile per shape
  passed dynamo's recompile limit at the second T and fell back to the unfused form. Elsewhere
  eager: torch 2.13 runs its forward on the CPU as a dense reference (full
  scores materialized) and refuses its backward there (``NotImplementedError`` from
  ``flex_attention._validate_device``, re-raised here as a ValueError naming ``draft.attention``);
  the dense reference backward under that guard is exact, so the tests lift the guard to check the
  block mask and the gradients on the CPU.

:class:`TTTAttentionCore` wraps them as the module ``midlayer.self_attn.core``.
"""

from __future__ import annotations

import functools
import math
import weakref
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from specforge.device import loop_chunk, matmul_dtype, row_chunks

__all__ = [
    "TTTAttentionCore",
    "ttt_attention_eager",
    "ttt_attention_fast",
    "ttt_attention_sdpa",
    "ttt_attention_flex",
    "ttt_mask_mod",
    "build_ttt_mask",
    "window_start",
    "IMPLS",
    "CHOICES",
    "pick_impl",
]


def _check(q: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], q_offset: int):
    if len(keys) == 0 or len(keys) != len(values):
        raise ValueError("keys/values must be non-empty lists of equal length")
    B, Hq, T, D = q.shape
    Hkv = keys[0].shape[1]
    if Hq % Hkv:
        raise ValueError(f"query heads {Hq} not a multiple of kv heads {Hkv}")
    if keys[0].shape[2] < q_offset + T:
        raise ValueError(f"keys[0] has {keys[0].shape[2]} rows, queries need {q_offset + T}")
    for j in range(1, len(keys)):
        if keys[j].shape[2] != T:
            raise ValueError(f"keys[{j}] has {keys[j].shape[2]} rows, expected {T} (diagonal)")
    return B, Hq, Hkv, T, D


def window_start(row: int, num_diag: int, window: Optional[int]) -> int:
    """The first step-0 key the query of global row ``row`` sees at TTT step ``num_diag`` (0 without a window)."""
    return 0 if window is None else max(0, row + num_diag - window + 1)


def check_window(window: Optional[int], num_diag: int) -> None:
    if window is not None and window <= num_diag:
        raise ValueError(f"sliding window {window} must exceed the TTT steps' diagonal keys ({num_diag}): "
                         "a query would lose its own draft tokens")


def build_ttt_mask(T: int, T0: int, num_diag: int, q_offset: int = 0, device=None,
                   window: Optional[int] = None, doc_ids_BT: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The full boolean TTT mask ``T x (T0 + num_diag * T)``: causal block (banded by ``window``),
    then diagonals; with ``doc_ids_BT`` (``B x T0``) ``B x T x (T0 + num_diag * T)``, the causal block
    kept to each query's own sample."""
    t = torch.arange(T, device=device)
    j = torch.arange(T0, device=device)[None, :]
    causal = j <= (q_offset + t)[:, None]
    if window is not None:
        causal &= j > (q_offset + t + num_diag - window)[:, None]
    eye = torch.eye(T, dtype=torch.bool, device=device)
    if doc_ids_BT is not None:
        causal = causal & (doc_ids_BT[:, q_offset : q_offset + T, None] == doc_ids_BT[:, None, :])
        eye = eye.expand(doc_ids_BT.shape[0], T, T)
    return torch.cat([causal] + [eye] * num_diag, dim=-1)


# ------------------------------------------------------------------------------ eager reference


def ttt_attention_eager(
    q: torch.Tensor,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    q_offset: int = 0,
    scale: Optional[float] = None,
    window: Optional[int] = None,
    doc_ids_BT: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Reference: concatenated keys + materialized full mask, softmax in fp32."""
    B, Hq, Hkv, T, D = _check(q, keys, values, q_offset)
    check_window(window, len(keys) - 1)
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    K = torch.cat(list(keys), dim=2).repeat_interleave(G, dim=1)
    V = torch.cat(list(values), dim=2).repeat_interleave(G, dim=1)
    mask = build_ttt_mask(T, keys[0].shape[2], len(keys) - 1, q_offset, q.device, window, doc_ids_BT)
    if doc_ids_BT is not None:
        mask = mask[:, None]  # B x 1 x T x K: every head
    f32 = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q, K.transpose(-1, -2)).to(f32) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(V.dtype)
    return torch.matmul(probs, V).to(q.dtype)


# ------------------------------------------------------------------------------ fast path


# Query rows per iteration of the fast core. CPU: 128 measured fastest here (benchmarks/README.md).
# GPU: 512 cuts the launches per layer 4x; the saved causal-block probabilities grow from
# T^2/2 + 64T to T^2/2 + 256T per head (the memory model counts the chunk it is given).
CHUNK_CPU, CHUNK_GPU = 128, 512


class _TTTAttentionFn(torch.autograd.Function):
    """Exact TTT attention with recomputation in backward.

    Inputs ``q`` (B,Hkv,G,T,D), ``k0``/``v0`` (B,Hkv,T0,D), ``kd``/``vd`` (B,Hkv,n,T,D) or None.
    Softmax statistics are fp32; matmuls run in the inputs' dtype.
    """

    @staticmethod
    def forward(ctx, q, k0, v0, kd, vd, q_offset: int, scale: float, chunk: int, window: Optional[int] = None,
                doc_ids_BT: Optional[torch.Tensor] = None):
        B, Hkv, G, T, D = q.shape
        f32 = torch.promote_types(q.dtype, torch.float32)  # fp64 stays fp64 (gradcheck)
        n = 0 if kd is None else kd.shape[2]
        # diagonal scores (B,Hkv,G,T,n) in fp32
        if kd is not None:
            sd = torch.einsum("bkgtd,bkntd->bkgtn", q.to(f32), kd.to(f32)) * scale
        out = torch.empty_like(q)
        lse = torch.empty(B, Hkv, G, T, dtype=f32, device=q.device)
        probs = []  # normalized causal-block probabilities per chunk, saved for backward
        firsts = _first_keys(doc_ids_BT, q_offset, T, chunk)  # packed rows: keys before a chunk's samples are skipped
        for ci, (c0, c1) in enumerate(row_chunks(T, chunk)):
            C = c1 - c0
            lo, L = _span(q_offset, c0, c1, n, window)  # step-0 keys this chunk may see
            lo = max(lo, firsts[ci]) if firsts else lo
            qc = q[:, :, :, c0:c1].reshape(B, Hkv, G * C, D)
            s = torch.matmul(qc, k0[:, :, lo:L].transpose(-1, -2)).view(B, Hkv, G, C, L - lo).to(f32)
            s.mul_(scale)
            _mask_span(s, q_offset, c0, lo, n, window)
            if doc_ids_BT is not None:  # packed rows: another sample's keys are never seen (own key always is)
                other = doc_ids_BT[:, q_offset + c0 : q_offset + c1, None] != doc_ids_BT[:, None, lo:L]
                s.masked_fill_(other[:, None, None], float("-inf"))
            m = s.amax(dim=-1)
            if kd is not None:
                sdc = sd[:, :, :, c0:c1]
                m = torch.maximum(m, sdc.amax(dim=-1))
            s.sub_(m.unsqueeze(-1)).exp_()
            l = s.sum(dim=-1)
            if kd is not None:
                pd = torch.exp(sdc - m.unsqueeze(-1))
                l = l + pd.sum(dim=-1)
            s.div_(l.unsqueeze(-1))
            p_lo = s.to(v0.dtype).view(B, Hkv, G * C, L - lo)
            probs.append(p_lo)
            o = torch.matmul(p_lo, v0[:, :, lo:L]).view(B, Hkv, G, C, D).to(f32)
            if kd is not None:
                o = o + torch.einsum("bkgtn,bkntd->bkgtd", pd / l.unsqueeze(-1), vd[:, :, :, c0:c1].to(f32))
            out[:, :, :, c0:c1] = o.to(out.dtype)
            lse[:, :, :, c0:c1] = m + torch.log(l)
        ctx.save_for_backward(q, k0, v0, kd, vd, out, lse, *probs)
        ctx.q_offset, ctx.scale, ctx.chunk, ctx.window, ctx.firsts = q_offset, scale, chunk, window, firsts
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k0, v0, kd, vd, out, lse, *probs = ctx.saved_tensors
        q_offset, scale, chunk, window = ctx.q_offset, ctx.scale, ctx.chunk, ctx.window
        B, Hkv, G, T, D = q.shape
        n = 0 if kd is None else kd.shape[2]
        f32 = torch.promote_types(q.dtype, torch.float32)
        dout = dout.to(q.dtype)
        delta = (dout.to(f32) * out.to(f32)).sum(dim=-1)  # (B,Hkv,G,T)
        dq = torch.empty_like(q)
        dk0 = torch.zeros(k0.shape, dtype=f32, device=q.device)
        dv0 = torch.zeros(v0.shape, dtype=f32, device=q.device)
        for ci, (c0, c1) in enumerate(row_chunks(T, chunk)):
            C = c1 - c0
            lo, L = _span(q_offset, c0, c1, n, window)
            lo = max(lo, ctx.firsts[ci]) if ctx.firsts else lo
            W = L - lo
            qc = q[:, :, :, c0:c1].reshape(B, Hkv, G * C, D)
            dout_c = dout[:, :, :, c0:c1].reshape(B, Hkv, G * C, D)
            k0c, v0c = k0[:, :, lo:L], v0[:, :, lo:L]
            p_lo = probs[ci]  # (B,Hkv,G*C,W), masked entries are exact zeros
            dv0[:, :, lo:L] += torch.matmul(p_lo.transpose(-1, -2), dout_c).to(f32)
            dp = torch.matmul(dout_c, v0c.transpose(-1, -2)).view(B, Hkv, G, C, W).to(f32)
            dp.sub_(delta[:, :, :, c0:c1].unsqueeze(-1)).mul_(p_lo.view(B, Hkv, G, C, W)).mul_(scale)  # dS
            ds = dp.to(q.dtype).view(B, Hkv, G * C, W)
            dq[:, :, :, c0:c1] = torch.matmul(ds, k0c).view(B, Hkv, G, C, D).to(dq.dtype)
            dk0[:, :, lo:L] += torch.matmul(ds.transpose(-1, -2), qc).to(f32)
        dkd = dvd = None
        if kd is not None:
            qf, dof = q.to(f32), dout.to(f32)
            sd = torch.einsum("bkgtd,bkntd->bkgtn", qf, kd.to(f32)) * scale
            pd = torch.exp(sd - lse.unsqueeze(-1))  # (B,Hkv,G,T,n)
            dpd = torch.einsum("bkgtd,bkntd->bkgtn", dof, vd.to(f32))
            dsd = pd * (dpd - delta.unsqueeze(-1)) * scale
            dq = (dq.to(f32) + torch.einsum("bkgtn,bkntd->bkgtd", dsd, kd.to(f32))).to(q.dtype)
            dkd = torch.einsum("bkgtn,bkgtd->bkntd", dsd, qf).to(kd.dtype)
            dvd = torch.einsum("bkgtn,bkgtd->bkntd", pd, dof).to(vd.dtype)
        # the saved probabilities are exact zeros where doc_ids_BT masked: backward needs nothing more
        return dq, dk0.to(k0.dtype), dv0.to(v0.dtype), dkd, dvd, None, None, None, None, None


def _first_keys(doc_ids_BT: Optional[torch.Tensor], q_offset: int, T: int, chunk: int) -> list[int]:
    """Packed rows: per query chunk, the first step-0 key any of its rows may see (the start of the
    earliest sample among its rows, over the batch). [] without ``doc_ids_BT``. One host read per ``doc_ids_BT``
    tensor: the model hands every TTT step of an unroll the same one (the steps differ only in how
    many chunks they run), so a GPU waits once per unroll, not once per step."""
    if doc_ids_BT is None:
        return []
    n = -(-T // chunk)
    hit = _FIRSTS_CACHE[0]
    if hit is not None and hit[0]() is doc_ids_BT and hit[1] == (q_offset, chunk) and len(hit[2]) >= n:
        return hit[2][:n]
    firsts = _chunk_firsts(doc_ids_BT, q_offset, chunk)
    _FIRSTS_CACHE[0] = (weakref.ref(doc_ids_BT), (q_offset, chunk), firsts)
    return firsts[:n]


_FIRSTS_CACHE: list = [None]  # (weak reference to the last doc_ids_BT, (q_offset, chunk), its firsts)


def _chunk_firsts(doc_ids_BT: torch.Tensor, q_offset: int, chunk: int) -> list[int]:
    """``_first_keys`` of every chunk start up to the end of ``doc_ids_BT`` (the one host read)."""
    idx = torch.arange(doc_ids_BT.shape[1], device=doc_ids_BT.device)
    new = torch.ones(doc_ids_BT.shape, dtype=torch.bool, device=doc_ids_BT.device)
    new[:, 1:] = doc_ids_BT[:, 1:] != doc_ids_BT[:, :-1]
    starts = torch.where(new, idx, 0).cummax(dim=1).values  # each key's sample start
    rows = torch.arange(q_offset, doc_ids_BT.shape[1], chunk, device=doc_ids_BT.device)
    return starts[:, rows].amin(dim=0).tolist()


def _span(q_offset: int, c0: int, c1: int, n: int, window: Optional[int]) -> tuple[int, int]:
    """``[lo, L)``: the step-0 keys rows ``c0 .. c1 - 1`` (after ``q_offset``) may see at step ``n``."""
    return window_start(q_offset + c0, n, window), q_offset + c1


def _mask_span(s: torch.Tensor, q_offset: int, c0: int, lo: int, n: int, window: Optional[int]) -> None:
    """-inf where a row of the chunk (``s``: ``... x C x (L - lo)`` scores of keys ``lo..L-1``) must
    not look: past its own position, or (with a window) before the window's start."""
    C, S = s.shape[-2:]
    if window is None:  # causal inside the chunk's last C keys: key L-C+a visible to row r iff a <= r
        s[..., S - C :].masked_fill_(torch.ones(C, C, dtype=torch.bool, device=s.device).triu_(1), float("-inf"))
        return
    row = (q_offset + c0 + torch.arange(C, device=s.device))[:, None]
    key = (lo + torch.arange(S, device=s.device))[None, :]
    s.masked_fill_((key > row) | (key <= row + n - window), float("-inf"))


def ttt_attention_fast(
    q: torch.Tensor,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    q_offset: int = 0,
    scale: Optional[float] = None,
    chunk: Optional[int] = None,
    window: Optional[int] = None,
    doc_ids_BT: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """TTT attention without materialized masks (see module docstring). ``chunk``: query rows per
    iteration, by default ``CHUNK_CPU`` on the CPU and ``CHUNK_GPU`` on a GPU (``device.loop_chunk``).
    With a ``window`` each chunk computes only the keys its band reaches (``T x (W + chunk)``, not
    ``T^2 / 2``, scores and saved probabilities)."""
    B, Hq, Hkv, T, D = _check(q, keys, values, q_offset)
    check_window(window, len(keys) - 1)
    chunk = chunk or loop_chunk(q.device, CHUNK_CPU, CHUNK_GPU)
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    dt = matmul_dtype(q, keys[0], values[0])
    qg = q.to(dt).reshape(B, Hkv, G, T, D)
    k0, v0 = keys[0].to(dt), values[0].to(dt)
    if len(keys) > 1:
        kd = torch.stack([k.to(dt) for k in keys[1:]], dim=2)  # (B,Hkv,n,T,D)
        vd = torch.stack([v.to(dt) for v in values[1:]], dim=2)
    else:
        kd = vd = None
    with torch.autocast(q.device.type, enabled=False):
        out = _TTTAttentionFn.apply(qg, k0, v0, kd, vd, int(q_offset), float(scale), int(chunk),
                                    None if window is None else int(window), doc_ids_BT)
    return out.reshape(B, Hq, T, D)


def ttt_attention_sdpa(
    q: torch.Tensor,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    q_offset: int = 0,
    scale: Optional[float] = None,
    window: Optional[int] = None,
    doc_ids_BT: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Fused SDPA for plain causal attention (step 0, no offset, no window, one sample per row); the
    fast path otherwise."""
    if len(keys) == 1 and q_offset == 0 and keys[0].shape[2] == q.shape[2] and window is None and doc_ids_BT is None:
        dt = matmul_dtype(q, keys[0], values[0])
        return F.scaled_dot_product_attention(
            q.to(dt), keys[0].to(dt), values[0].to(dt), is_causal=True, scale=scale,
            enable_gqa=q.shape[1] != keys[0].shape[1],
        )
    return ttt_attention_fast(q, keys, values, q_offset=q_offset, scale=scale, window=window, doc_ids_BT=doc_ids_BT)


# ------------------------------------------------------------------------------ flex_attention


def ttt_mask_mod(T: int, T0: int, q_offset: int = 0, window: Optional[int] = None, num_diag: int = 0,
                 doc_ids_BT: Optional[torch.Tensor] = None) -> Callable:
    """``mask_mod(b, h, q, kv)`` of :func:`build_ttt_mask` over ``cat(keys)``: key ``kv < T0`` is step 0's
    (causal at ``q_offset + q``, banded by ``window`` with the step shift ``num_diag``, and with ``doc_ids_BT``
    (``B x T0``, packed rows) of the query's own sample); key ``kv >= T0`` belongs to diagonal step
    ``1 + (kv - T0) // T`` and is seen only by its own row."""
    last = None if window is None else num_diag - window  # step-0 key kv visible iff kv > q_offset + q + last

    def mask_mod(b, h, q, kv):
        row = q + q_offset
        causal = (kv < T0) & (kv <= row)
        if last is not None:
            causal = causal & (kv > row + last)
        if doc_ids_BT is not None:
            causal = causal & (doc_ids_BT[b, kv.clamp(max=T0 - 1)] == doc_ids_BT[b, row])
        return causal | ((kv >= T0) & ((kv - T0) % T == q))

    return mask_mod


@functools.lru_cache(maxsize=32)
def _block_mask(T: int, T0: int, n: int, q_offset: int, window: Optional[int], device: torch.device):
    """The block mask of one TTT step's shape (cached: the same shapes recur every batch)."""
    return create_block_mask(ttt_mask_mod(T, T0, q_offset, window, n), None, None, T, T0 + n * T, device=device)


@functools.lru_cache(maxsize=None)
def _flex_fn(device_type: str) -> Callable:
    """``flex_attention`` compiled once per process on CUDA (fused kernels), eager elsewhere. ``dynamic=None``
    (dynamo's automatic dynamic shapes): the first shape compiles static, the next marks the sizes that
    changed dynamic and compiles once more for all later shapes. With ``dynamic=False`` each TTT step's key
    length (``T0 + n T``) compiled anew, so the second sequence length passed dynamo's recompile limit (8) and
    flex_attention fell back, silently, to its unfused eager form: the full score matrix materialized
    (H200, 2026-11-30: T 4096 at 0.15x the fused speed, T 8192 out of memory)."""
    return torch.compile(flex_attention, dynamic=None) if device_type == "cuda" else flex_attention


def ttt_attention_flex(
    q: torch.Tensor,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    q_offset: int = 0,
    scale: Optional[float] = None,
    window: Optional[int] = None,
    doc_ids_BT: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """TTT attention as one ``flex_attention`` call over ``cat(keys)`` (see the module docstring);
    packed rows (``doc_ids_BT``) build their block mask per call (it depends on the samples' lengths)."""
    B, Hq, Hkv, T, D = _check(q, keys, values, q_offset)
    check_window(window, len(keys) - 1)
    dt = matmul_dtype(q, keys[0], values[0])
    K = torch.cat([k.to(dt) for k in keys], dim=2) if len(keys) > 1 else keys[0].to(dt)
    V = torch.cat([v.to(dt) for v in values], dim=2) if len(values) > 1 else values[0].to(dt)
    w = None if window is None else int(window)
    if doc_ids_BT is None:
        mask = _block_mask(T, keys[0].shape[2], len(keys) - 1, int(q_offset), w, q.device)
    else:
        T0 = keys[0].shape[2]
        mask = create_block_mask(ttt_mask_mod(T, T0, int(q_offset), w, len(keys) - 1, doc_ids_BT), B, None, T,
                                 T0 + (len(keys) - 1) * T, device=q.device)
    try:
        with torch.autocast(q.device.type, enabled=False):
            return _flex_fn(q.device.type)(q.to(dt), K, V, block_mask=mask, scale=scale, enable_gqa=Hq != Hkv)
    except NotImplementedError as e:
        if "backward" not in str(e):
            raise
        raise ValueError(f"config key 'draft.attention'='flex': torch {torch.__version__} has no flex_attention "
                         f"backward on {q.device.type} ({e}); use draft.attention=auto there") from e


IMPLS = {"eager": ttt_attention_eager, "fast": ttt_attention_fast, "sdpa": ttt_attention_sdpa,
         "flex": ttt_attention_flex}
# THE values of draft.attention (the config's Literal is built from this tuple; docs/ARCHITECTURE.md
# lists the same, tests/test_docs.py compares them): "auto" or a core of IMPLS by its name
CHOICES = ("auto", *IMPLS)


# flex_attention's block (its default BLOCK_SIZE): the flex core asks for query rows in whole blocks
FLEX_BLOCK = 128


def pick_impl(impl: str, device_type: str, packed: bool = False) -> str:
    """The core ``impl`` runs on ``device_type``: ``auto`` = ``fast`` on a CPU; on CUDA ``flex``, or ``sdpa``
    for packed rows (``packed``: the flex core builds their block mask every call); ``sdpa`` elsewhere.
    Measured on an H200 (2026-11-30, be72d44, 8B draft shapes, benchmarks/README.md "GPU runs"): flex
    21,337 / 25,914 / 27,229 tok/s at T 2k / 4k / 8k against sdpa's 17,034 / 18,639 / 15,411, peaks 11.2 /
    14.6 / 20.9 GiB against 11.5 / 17.5 / 33.0, 1,692-2,072 launches a step against 3,123-7,079; packed
    rows of 4096 6,431 (useful tok/s) against 14,707."""
    if impl == "auto":
        if device_type == "cpu":
            return "fast"
        return "flex" if device_type == "cuda" and not packed else "sdpa"
    return impl


class TTTAttentionCore(nn.Module):
    """``midlayer.self_attn.core``: no parameters; ``impl`` one of ``CHOICES``.

    ``auto`` = ``fast`` on CPU (measured faster than the fused CPU SDPA kernel even for plain
    causal attention, see benchmarks/README.md); on CUDA ``flex`` (compiled flex_attention for every
    step: measured faster and leaner than ``sdpa`` on an H200, ``pick_impl``), ``sdpa`` for packed rows.
    Sequence parallel wrappers replace this module or call it from outside; it holds no state.
    ``window``: sliding-window attention (module docstring); the ring wrapper reads it from here.
    """

    def __init__(self, impl: str = "auto", scale: Optional[float] = None, window: Optional[int] = None):
        super().__init__()
        self.impl = impl
        self.scale = scale
        self.window = window

    @property
    def impl(self) -> str:
        return self._impl

    @impl.setter
    def impl(self, value: str) -> None:
        if value not in CHOICES:
            raise ValueError(f"config key 'draft.attention': got {value!r}, expected one of "
                             f"{', '.join(map(repr, CHOICES))}")
        self._impl = value

    def row_multiple(self, device_type: str) -> int:
        """Rows a TTT step's query span is rounded up to (at most the sequence): ``FLEX_BLOCK`` for
        ``flex``, so a step's shapes recur from batch to batch (its block mask is cached per shape and
        a compiled flex_attention compiles once per shape); 1 (no rounding) for the other cores."""
        return FLEX_BLOCK if pick_impl(self._impl, device_type) == "flex" else 1  # packed rows: harmless

    def forward(self, q_BHTD, keys, values, q_offset: int = 0, doc_ids_BT: Optional[torch.Tensor] = None):
        fn = IMPLS[pick_impl(self._impl, q_BHTD.device.type, packed=doc_ids_BT is not None)]
        kw = {} if doc_ids_BT is None else {"doc_ids_BT": doc_ids_BT}  # packed rows (module docstring)
        return fn(q_BHTD, keys, values, q_offset=q_offset, scale=self.scale, window=self.window, **kw)

    def extra_repr(self) -> str:
        return f"impl={self._impl!r}" + ("" if self.window is None else f", window={self.window}")
