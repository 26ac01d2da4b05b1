"""The training-time-test (TTT) unrolled EAGLE-3 loss: the ONE train step's forward.

Conventions (``shared/DESIGN.md``, "EAGLE-3 facts"); ``x`` = input ids, ``T`` = sequence length:

* Step 0, row ``t``: hidden = ``fc(aux[t])`` (target has seen x_0..x_t), embedding of x_{t+1},
  RoPE position ``t``; predicts x_{t+2}; teacher = target distribution at position ``t+1``.
* Step ``i``, row ``t``: hidden = step ``i-1``'s output hidden at row ``t``, embedding of
  x_{t+1+i}, RoPE position ``t+i``; attends to step-0 keys ``<= t`` and to its own row's keys of
  steps ``1..i``; predicts x_{t+2+i}; teacher = target distribution at position ``t+1+i``
  (the teacher of step ``i`` is the step-0 teacher shifted by ``i``, so it is computed ONCE).
* Row ``t`` of step ``i`` counts iff ``t+2+i < T`` and ``loss_mask[t+2+i] == 1`` (the predicted
  token is an assistant token -- the *shifted* mask; upstream SpecForge issue #885 applies the
  unshifted one) and ``t2d[target_ids[t+1+i]]`` (the target argmax there is in the draft vocab).
* ``loss_i`` = the row loss of ``loss_kind`` (``train.loss``; ``kernels/losses.py``: the soft
  cross-entropy ``kl_div`` by default, or TV, LK's two forms, reverse KL, JSD, Draft-OPD's) against
  ``softmax(last_hidden[t+1+i] @ teacher_weight_NH.T)`` (the target distribution renormalized over
  the draft vocab), summed over counted rows; for a
  family whose logits are soft-capped (Gemma: ``cap * tanh(z / cap)``, ``softcap``) the cap is
  applied before the softmax, as the target's own logits are (``teacher_probs``).
  ``loss = sum_i decay**i * loss_i / num_valid`` where ``num_valid`` = counted rows of step 0
  (this rank's), or ``num_valid_global`` when given (the global step-0 count across data/sequence
  parallel ranks: then each rank's loss is its share of the global mean, and gradients must be
  SUMMED across ranks, not averaged).
* Draft-OPD (``loss_kind="opd"``, arXiv 2605.29343, on-policy and acceptance-aware): row ``t`` of step
  ``i`` counts with weight 1 only while its chain is *reached*: at every earlier step the target's
  greedy verification accepted the draft's argmax and the data's next token is the target's (then
  the unroll's state is the one the draft's own drafts lead to, :func:`reached_after`); its row loss is
  forward KL where the target accepts this step's draft, reverse KL where it rejects it. Unreached
  rows weigh 0 (still computed: the counters and metrics below stay those of every counted row,
  comparable across kinds); the normalizer stays the counted rows of step 0 (all reached).

Metrics (per step ``i``, over counted rows):

* ``acc_i``: draft argmax (mapped to a target id with ``d2t``) == target argmax.
* ``accept_rate_i``: mean target probability (renormalized over the draft vocab) of the draft's
  argmax token -- the acceptance probability of a greedy draft token under speculative sampling
  at temperature 1 (slightly optimistic because of the renormalization).
* ``tau`` = 1 + sum_k prod_{i<=k} acc_i: simulated acceptance length of greedy chain drafting.
* The loss returns only raw counters, one float64 ``[ttt_length, 4]`` tensor with the columns
  :data:`COUNTERS` (summed over micro-batches and ranks as is); :func:`metrics_from_counts` turns
  the sum into the rates above once, where they are logged.

Sequence parallelism (``num_rows`` given, or the batch carries ``num_rows``): the batch is one
rank's slice of the (padded) sequence -- see ``specforge/parallel/sp.py``. ``aux_hidden`` and
``position_ids`` have ``num_rows`` rows (the rows this rank owns, at global positions
``position_ids``); ``input_ids``, ``loss_mask``, ``target_ids`` and ``last_hidden`` have at least
``num_rows + ttt_length + 1`` rows (the owned rows plus a right halo: step ``i`` row ``t`` reads
x_{t+1+i}, the teacher/argmax at t+1+i and the loss mask at t+2+i), zero-padded past the end of
the sequence. Only owned rows are computed and counted, every step computes all of them (no
trimming: all ranks must run the same shapes through the attention collectives), and the last
step's head runs even on no counted rows (a zero loss that still reaches every trainable
parameter), so every rank runs every collective in backward and reduces the same gradients.

The unroll is the draft's forward (``Eagle3Draft.forward``); the loss hands it a head that runs
the fused ``lm_head`` + soft cross-entropy on each step's counted rows inside that forward.
Performance: the teacher and the per-step valid rows are computed once; ``lm_head``/soft-CE run
only on counted rows (gathered); rows that no later step needs are trimmed; attention uses the
swappable core ``draft.midlayer.self_attn.core`` (fast path: no materialized masks).
Run it under ``specforge.device.autocast(device, torch.bfloat16)``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F

from specforge.algorithms.eagle3.attention import ttt_attention_eager
from specforge.algorithms.eagle3.model import apply_rotary
from specforge.device import loop_chunk
from specforge.kernels import soft_ce
from specforge.kernels.losses import DEFAULT as DEFAULT_LOSS
from specforge.kernels.losses import log_teacher, loss_reference, loss_rows, loss_rows_fused
from specforge.models.layers import cast_once

__all__ = [
    "ttt_loss",
    "ttt_loss_reference",
    "ttt_logits",
    "valid_rows",
    "num_valid_rows",
    "teacher_weight_from_target",
    "teacher_probs",
    "TeacherHead",
    "metrics_from_counts",
    "COUNTERS",
    "soft_cross_entropy",
    "linear_soft_cross_entropy",
    "target_to_draft",
    "reached_after",
]

COUNTERS = ("valid", "correct", "loss_sum", "accept_sum")  # the columns of the counts ttt_loss returns


def _get(batch: Any, name: str, default: Any = ...) -> Any:
    if isinstance(batch, Mapping):
        if name in batch:
            return batch[name]
    elif hasattr(batch, name):
        return getattr(batch, name)
    if default is ...:
        raise KeyError(f"batch has no {name!r}")
    return default


def _unpack(batch: Any, names=("loss_mask_BT", "aux_hidden_BTKH", "last_hidden_BTH", "target_ids_BT")):
    """(input_ids, *names, position_ids) of a batch; positions default to ``arange(T)``."""
    ids = _get(batch, "input_ids_BT")
    pos = _get(batch, "position_ids_BT", None)
    if pos is None:
        B, T = ids.shape
        pos = torch.arange(T, device=ids.device).expand(B, T)
    return (ids, *(_get(batch, n) for n in names), pos)


def teacher_weight_from_target(target_lm_head_VH: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """The frozen teacher head: target lm_head rows of the draft vocab (``N x H``)."""
    ids = torch.arange(d2t.numel(), device=d2t.device) + d2t
    return target_lm_head_VH.detach()[ids.to(target_lm_head_VH.device)].clone()


@dataclass(frozen=True)
class TeacherHead:
    """EAGLE-3's frozen train state: the target lm_head rows of the draft vocab (``N x H``) and the
    target's final logit soft-cap (``targets.logit_softcap``: Gemma; None for most families)."""

    weight_NH: torch.Tensor
    softcap: Optional[float] = None

    def to(self, *args, **kwargs) -> "TeacherHead":
        return replace(self, weight_NH=self.weight_NH.to(*args, **kwargs))


@torch.no_grad()
def teacher_probs(last_hidden_NH: torch.Tensor, teacher_weight_NH: torch.Tensor,
                  softcap: Optional[float] = None, log: bool = False) -> torch.Tensor:
    """The target distribution over the draft vocab (``M x N``, fp32 at least): the target's logits
    on the draft vocab rows, soft-capped as the target caps them, softmax over those rows (``log``:
    its log, the teacher every loss but ``kl_div`` reads: ``kernels.losses.log_teacher``)."""
    z = F.linear(last_hidden_NH, teacher_weight_NH.detach())
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return torch.log_softmax(z, dim=-1) if log else torch.softmax(z, dim=-1)


def valid_rows(loss_mask_BT: torch.Tensor, target_ids_BT: torch.Tensor, t2d_V: torch.Tensor, ttt_length: int,
               doc_ids_BT: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``ttt_length x B x T`` bool: does row t of step i count? (see the module docstring). Packed
    rows (``doc_ids_BT``): only if the predicted token ``t+2+i`` is in row t's own sample (then so are
    the input token and the teacher's position between them)."""
    B, T = loss_mask_BT.shape
    lm = loss_mask_BT.bool()
    # cond[p]: the token after position p is an assistant token and the target argmax at p is
    # in the draft vocab; row t of step i counts iff cond[t + 1 + i].
    cond = torch.zeros(B, T, dtype=torch.bool, device=lm.device)
    cond[:, :-1] = lm[:, 1:] & t2d_V.to(lm.device)[target_ids_BT[:, :-1]]
    out = torch.zeros(ttt_length, B, T, dtype=torch.bool, device=lm.device)
    for i in range(ttt_length):
        if T - 1 - i > 0:
            out[i, :, : T - 1 - i] = cond[:, 1 + i :]
            if doc_ids_BT is not None:
                out[i, :, : T - 2 - i] &= doc_ids_BT[:, 2 + i :] == doc_ids_BT[:, : T - 2 - i]
    return out


def _owned_rows(batch: Any, num_rows: Optional[int]) -> Optional[int]:
    n = _get(batch, "num_rows", None) if num_rows is None else num_rows
    return None if n is None else int(n)


def num_valid_rows(batch: Any, t2d_V: torch.Tensor, ttt_length: int,
                   num_rows: Optional[int] = None) -> torch.Tensor:
    """Rows that count at TTT step 0 (the loss normalizer); only owned rows of an SP slice. A 0-dim
    int64 tensor on the batch's device: no host read (the trainer sums and divides on the device)."""
    loss_mask = _get(batch, "loss_mask_BT")
    valid0 = valid_rows(loss_mask, _get(batch, "target_ids_BT"), t2d_V.to(loss_mask.device), 1,
                        _get(batch, "doc_ids_BT", None))[0]
    n = _owned_rows(batch, num_rows)
    return (valid0 if n is None else valid0[:, :n]).sum()


class _SoftCE(torch.autograd.Function):
    """Row-wise ``logsumexp(z) - sum(p * z)`` with a fused backward ``softmax(z) - p``."""

    @staticmethod
    def forward(ctx, logits, probs):
        f32 = torch.promote_types(logits.dtype, torch.float32)
        z = logits.to(f32)
        lse = torch.logsumexp(z, dim=-1)
        loss = lse - (probs.to(f32) * z).sum(-1)
        ctx.save_for_backward(logits, probs, lse)
        return loss

    @staticmethod
    def backward(ctx, g):
        logits, probs, lse = ctx.saved_tensors
        f32 = lse.dtype
        z = logits.to(f32, copy=True)  # a copy even when already fp32: modified in place below
        grad = z.sub_(lse.unsqueeze(-1)).exp_().sub_(probs.to(f32)).mul_(g.to(f32).unsqueeze(-1))
        return grad.to(logits.dtype), None


class _LinearSoftCE(torch.autograd.Function):
    """Fused ``lm_head`` + loss over row chunks (the logits never exist whole).

    Forward, per chunk of rows: ``z = h @ W.T`` (matmul dtype = h's), fp32 statistics, the row
    losses of ``kind``, argmax and the teacher probability of the argmax (metrics), and the logit
    gradient (``softmax(z) - p`` for ``kl_div``; stored in h's dtype). Backward: two GEMMs scaled by
    the incoming scalar. Returns ``(loss_sum, per-row loss, argmax, teacher prob of argmax)``; only
    the first is differentiable. ``teacher[tidx]`` are the rows' target distributions (log-probs for
    every kind but ``kl_div``). The row-wise part runs as torch ops (``kernels.losses.loss_rows``) or,
    with ``kernel``, as one fused Triton kernel a chunk (``kernels.losses.loss_rows_fused``).
    """

    @staticmethod
    def forward(ctx, h_MH, W_NH, teacher_PN, tidx_M, chunk: int, kernel: bool, kind: str, verify_M, weight_M):
        M = h_MH.shape[0]
        f32 = torch.promote_types(h_MH.dtype, torch.float32)
        G = torch.empty(M, W_NH.shape[0], dtype=h_MH.dtype, device=h_MH.device)
        ce = torch.empty(M, dtype=f32, device=h_MH.device)
        pred = torch.empty(M, dtype=torch.long, device=h_MH.device)
        acc_p = torch.empty(M, dtype=f32, device=h_MH.device)
        Wt = W_NH.t()
        for c0 in range(0, M, chunk):
            c1 = min(M, c0 + chunk)
            v = None if verify_M is None else verify_M[c0:c1]
            if kernel:  # the logits land in G's rows and the kernel writes the gradient over them
                z = torch.matmul(h_MH[c0:c1], Wt, out=G[c0:c1])
                loss_rows_fused(kind, z, teacher_PN, tidx_M[c0:c1], out=(ce[c0:c1], pred[c0:c1], acc_p[c0:c1], z),
                                verify_M=v)
            else:
                z = torch.matmul(h_MH[c0:c1], Wt)
                loss_rows(kind, z, teacher_PN, tidx_M[c0:c1], out=(ce[c0:c1], pred[c0:c1], acc_p[c0:c1], G[c0:c1]),
                          verify_M=v)
            if weight_M is not None:  # each row's weight scales its loss and its logit gradient
                w = weight_M[c0:c1]
                ce[c0:c1].mul_(w)
                G[c0:c1].mul_(w.to(G.dtype).unsqueeze(-1))
        ctx.save_for_backward(h_MH, W_NH, G)
        ctx.mark_non_differentiable(ce, pred, acc_p)
        return ce.sum(), ce, pred, acc_p

    @staticmethod
    def backward(ctx, g, *_):
        h, W, G = ctx.saved_tensors
        g = g.to(G.dtype)
        dh = torch.matmul(G, W) * g if ctx.needs_input_grad[0] else None
        dW = torch.matmul(G.t(), h) * g if ctx.needs_input_grad[1] else None
        return dh, dW, None, None, None, None, None, None, None


# Rows per chunk of the fused loss. CPU: 64 (cache-sized). GPU: as many rows as keep one chunk's
# fp32 logits near LOSS_CHUNK_BYTES (256 MiB: 2,000 rows at a 32k draft vocab), so a micro-batch
# is a few chunks, not thousands of launches.
LOSS_CHUNK_CPU, LOSS_CHUNK_BYTES = 64, 256 * 2**20


def loss_chunk(device: torch.device, vocab: int) -> int:
    """Rows per chunk of ``linear_soft_cross_entropy`` on ``device`` for a ``vocab``-wide head."""
    return loop_chunk(device, LOSS_CHUNK_CPU, max(LOSS_CHUNK_CPU, LOSS_CHUNK_BYTES // (4 * max(vocab, 1))))


# The row-wise part of each loss chunk: the torch ops or the fused Triton kernel of every loss kind
# (``kernels/losses.py``: one launch a chunk instead of 16-40). None (the default): the kernel on a CUDA
# device where triton imports, the torch ops elsewhere (the CPU's interpreter is for tests). Measured on an
# H200 (2026-11-30, be72d44, bf16, H 4096, N 32000, benchmarks/README.md "GPU runs"): the whole loss
# forward + backward 1.5-2.4x faster for every kind, its peak 1.4-2.8 GiB -> 1.0 GiB at 8,192 rows, losses
# equal to 2e-7 relative. ``kernel=`` of ``linear_soft_cross_entropy`` / ``soft_ce_kernel=`` of ``ttt_loss``
# choose per call; None reads this switch (True / False force it).
SOFT_CE_KERNEL: Optional[bool] = None


def kernel_default(device: torch.device) -> bool:
    """Does a loss on ``device`` run the fused kernel when the caller does not say (``SOFT_CE_KERNEL``)?"""
    if SOFT_CE_KERNEL is not None:
        return SOFT_CE_KERNEL
    return device.type == "cuda" and soft_ce.available(device)


def linear_soft_cross_entropy(h_MH, W_NH, teacher_PN, tidx_M, chunk: Optional[int] = None,
                              kernel: Optional[bool] = None, kind: str = DEFAULT_LOSS,
                              verify_M: Optional[torch.Tensor] = None, weight_M: Optional[torch.Tensor] = None):
    """``(loss_sum, row_loss, argmax, teacher_prob_of_argmax)`` of ``h @ W.T`` vs ``teacher[tidx]``,
    the row loss of ``kind`` (``kernels.losses``; the teacher rows are log-probs unless ``kl_div``).
    ``verify_M``: ``opd``'s verification tokens (``kernels.losses.verified``). ``weight_M``: a weight per row
    (fp32), applied to the row losses (those returned too) and their gradients.

    Under autocast the matmuls run in the autocast dtype (h and W are cast here unless already in it;
    ``ttt_loss`` hands W in cast once for all its steps: ``models.layers.cast_once``). ``chunk``:
    rows per iteration, by default ``loss_chunk`` (device-aware). ``kernel``: the fused Triton kernel
    for the row-wise part (``kernels.soft_ce.available(device)`` must hold; fp32/bf16/fp16 only;
    default ``kernel_default``: on a CUDA device with triton).
    """
    kernel = kernel_default(h_MH.device) if kernel is None else kernel
    chunk = chunk or loss_chunk(h_MH.device, W_NH.shape[0])
    dev = h_MH.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        h_MH, W_NH = h_MH.to(dt), W_NH.to(dt)
    else:
        dt = torch.promote_types(h_MH.dtype, W_NH.dtype)
        h_MH, W_NH = h_MH.to(dt), W_NH.to(dt)
    with torch.autocast(dev, enabled=False):
        return _LinearSoftCE.apply(h_MH, W_NH, teacher_PN, tidx_M, int(chunk), bool(kernel), kind, verify_M, weight_M)


def soft_cross_entropy(logits_MN: torch.Tensor, probs_MN: torch.Tensor) -> torch.Tensor:
    """Per-row soft cross-entropy (fp32 statistics), differentiable w.r.t. the logits."""
    with torch.autocast(logits_MN.device.type, enabled=False):
        return _SoftCE.apply(logits_MN, probs_MN)


def metrics_from_counts(counts_L4: torch.Tensor, decay: float) -> dict[str, float]:
    """Rates from (micro-batch and rank summed) counters: ``loss_i``, ``acc_i``, ``accept_rate_i``,
    ``tau``, ``loss`` (the decayed TTT loss per valid step-0 row) and ``valid_tokens``.
    A step with no counted row (not unrolled during ``train.ttt_warmup_steps``) has no rates:
    they are absent, not 0, so dashboards do not draw a "loss 0" for a step nobody trained;
    ``tau`` stops there (as a 0 accuracy would)."""
    rows = counts_L4.tolist()  # one sync
    out: dict[str, float] = {}
    tau, prod = 1.0, 1.0
    for i, (n, correct, loss_sum, accept_sum) in enumerate(rows):
        if n > 0:
            out[f"loss_{i}"], out[f"acc_{i}"], out[f"accept_rate_{i}"] = loss_sum / n, correct / n, accept_sum / n
        prod *= out.get(f"acc_{i}", 0.0)
        tau += prod
    out["tau"] = tau
    out["loss"] = sum(decay**i * r[2] for i, r in enumerate(rows)) / max(rows[0][0], 1.0)
    out["valid_tokens"] = rows[0][0]
    return out


def ttt_logits(draft, batch: Any, ttt_length: int = 7) -> list[torch.Tensor]:
    """Draft-vocab logits of every step and row (``B x T x N`` each) via the training forward."""
    ids, aux, pos = _unpack(batch, ("aux_hidden_BTKH",))
    return draft(ids, aux, pos, [ids.shape[1]] * ttt_length, head=lambda i, h: draft.logits(h))


def _teacher(used_idx, last_hidden_BTH, teacher_weight_NH, softcap=None, log: bool = False):
    """The target distributions over the draft vocab (``log``: their logs), once, at every position
    p = t+1+i some counted row uses (``used_idx``, flat ``b*T + p``, from ``_step_rows``):
    ``(teacher_PN, pos_map)``, ``pos_map[b*T + p]`` = its row in ``teacher``."""
    B, T = last_hidden_BTH.shape[:2]
    pos_map = torch.full((B * T,), -1, dtype=torch.long, device=used_idx.device)
    pos_map[used_idx] = torch.arange(used_idx.numel(), device=used_idx.device)
    return teacher_probs(last_hidden_BTH.reshape(B * T, -1)[used_idx], teacher_weight_NH, softcap, log), pos_map


def _step_rows(valid_LBR: torch.Tensor, T: int, sp_rows: Optional[int], multiple: int = 1
               ) -> tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Every unroll step's rows at once: ``t_len[i]``, the rows step i must compute (t < 1 + the last
    row counted at any step >= i: a row's later steps depend on its own earlier steps; step 0 also
    provides the keys; rounded up to a ``multiple`` (the core's ``row_multiple``), at most ``R``;
    all ``R`` of an SP slice, the same shapes on every rank), step i's counted
    rows as ``(b, t)`` index tensors in ``(b, t)`` order, and the flat positions ``b*T + t+1+i`` any
    counted row reads its teacher at (each once, ascending).
    The loss's one host read (a GPU sync): every size the host must know, in one copy; the index
    tensors then come from ``nonzero_static`` at those sizes, which reads nothing back."""
    L, B, R = valid_LBR.shape
    used = torch.zeros(B, T, dtype=torch.bool, device=valid_LBR.device)
    for i in range(L):
        n = min(R, T - 1 - i)
        if n > 0:
            used[:, 1 + i : 1 + i + n] |= valid_LBR[i, :, :n]
    sizes = [valid_LBR.sum(dim=(1, 2)), used.sum().reshape(1)]
    if sp_rows is None:
        later = (valid_LBR.flip(0).int().cumsum(dim=0).flip(0) > 0).any(dim=1)
        idx = torch.arange(1, R + 1, device=valid_LBR.device)
        sizes.append(torch.where(later, idx, 0).amax(dim=1))
    host = torch.cat(sizes).tolist()  # the one read
    counts, n_used = host[:L], host[L]
    t_len = [min(R, -(-max(int(n), 1) // multiple) * multiple) for n in host[L + 1 :]] if sp_rows is None else [R] * L
    nz = torch.nonzero_static(valid_LBR, size=sum(counts))  # (n, 3): step, b, t; step-major, then b, then t
    used_idx = torch.nonzero_static(used.view(-1), size=n_used).squeeze(-1)
    return t_len, [(part[:, 1], part[:, 2]) for part in nz.split([int(c) for c in counts])], used_idx


def ttt_loss(
    draft,
    batch: Any,
    teacher_weight_NH: torch.Tensor,
    ttt_length: int = 7,
    decay: float = 0.8,
    num_valid_global: Optional[float | torch.Tensor] = None,
    num_rows: Optional[int] = None,
    softcap: Optional[float] = None,
    soft_ce_kernel: Optional[bool] = None,
    loss_kind: str = DEFAULT_LOSS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The TTT loss of one batch (fast path) and its counters: ``(loss, counts_L4)``, float64
    ``[ttt_length, 4]`` with the columns :data:`COUNTERS`.

    ``batch`` (mapping or object): ``input_ids_BT``, ``loss_mask_BT``, ``aux_hidden_BTKH``,
    ``last_hidden_BTH``, ``target_ids_BT``; optional ``position_ids_BT`` (default ``arange(T)``).
    Right padding must carry ``loss_mask`` 0. ``num_rows`` (default: ``batch.num_rows`` if
    present): sequence-parallel slice mode, see the module docstring. ``softcap``: the target's
    final logit soft-cap, applied to the teacher's logits (``teacher_probs``). ``soft_ce_kernel``: the
    fused Triton kernel for the loss's row-wise part (``linear_soft_cross_entropy``'s ``kernel``).
    ``loss_kind``: the row loss (``kernels.losses.KINDS``; ``train.loss``).
    """
    ids, loss_mask, aux, last_hidden, target_ids, pos = _unpack(batch)
    B, T = ids.shape
    L = int(ttt_length)
    sp_rows = _owned_rows(batch, num_rows)
    if sp_rows is not None and T < sp_rows + L + 1:
        raise ValueError(f"SP slice: {T} window rows, need num_rows + ttt_length + 1 = {sp_rows + L + 1}")
    R = T if sp_rows is None else sp_rows  # rows this call computes
    doc_ids_BT = _get(batch, "doc_ids_BT", None)  # packed rows (data/packing.py)
    valid = valid_rows(loss_mask, target_ids, draft.t2d, L, doc_ids_BT)[:, :, :R]  # L,B,R
    # SP: the same shapes on every rank (collectives inside the attention core)
    row_multiple = getattr(draft, "row_multiple", None)  # the attention core's (flex: whole blocks)
    multiple = 1 if row_multiple is None else row_multiple(ids.device.type)
    t_len, step_rows, used_idx = _step_rows(valid, T, sp_rows, multiple)
    teacher, pos_map = _teacher(used_idx, last_hidden, teacher_weight_NH, softcap, log_teacher(loss_kind))
    target_flat = target_ids.reshape(-1)
    counts = torch.zeros(L, 4, dtype=torch.float64, device=ids.device)
    lm_head = []  # cast_once of lm_head.weight, made at the first step: inside the forward (FSDP2 unshards it there)
    opd = loss_kind == "opd"
    if opd:  # Draft-OPD: which chains the draft's own drafts keep going (see reached_after)
        to_draft = target_to_draft(draft.d2t, draft.t2d.numel())
        reached_BR = torch.ones(B, R, dtype=torch.bool, device=ids.device)
        ids_flat = ids.reshape(-1)

    def head(i: int, hidden: torch.Tensor) -> torch.Tensor:
        """Step i's decayed loss sum over its counted rows; runs inside the draft's forward, and
        on zero rows too (see the module docstring)."""
        Ti = hidden.shape[1]  # t_len[i]: every counted row of step i lies below it
        b_idx, t_idx = step_rows[i]
        rows_bt = b_idx * Ti + t_idx  # in (B, Ti) flat, the order valid[i, :, :Ti].nonzero() gives
        flat_p = rows_bt // Ti * T + rows_bt % Ti + 1 + i  # position of the teacher / target argmax
        h_rows = draft.norm(hidden.reshape(B * Ti, -1)[rows_bt])
        if not lm_head:
            lm_head.append(cast_once(draft.lm_head.weight))
        verify = weight = None
        if opd:
            verify, weight = to_draft[target_flat[flat_p]], reached_BR[b_idx, t_idx].float()
        ce_sum, ce, pred, accept = linear_soft_cross_entropy(h_rows, lm_head[0](), teacher, pos_map[flat_p],
                                                            kernel=soft_ce_kernel, kind=loss_kind,
                                                            verify_M=verify, weight_M=weight)
        with torch.no_grad():
            correct = (pred + draft.d2t[pred]) == target_flat[flat_p]
            counts[i, 0] = rows_bt.numel()
            counts[i, 1] = correct.sum()
            counts[i, 2] = ce.sum()
            counts[i, 3] = accept.sum()
            if opd:
                reached_BR.copy_(reached_after(reached_BR, b_idx, t_idx, correct,
                                               ids_flat[flat_p + 1] == target_flat[flat_p]))
        return ce_sum * (decay**i)

    # the denominator stays on the device (a float or a 0-dim tensor), rounded to the loss's dtype
    # there, as a Python float would be
    normalizer = valid[0].sum() if num_valid_global is None else num_valid_global
    normalizer = torch.as_tensor(normalizer, dtype=torch.float64, device=ids.device).clamp(min=1.0)
    kw = {} if doc_ids_BT is None else {"doc_ids_BT": doc_ids_BT}
    loss = sum(draft(ids, aux, pos, t_len, head, **kw))
    return loss / normalizer.to(loss.dtype), counts


def target_to_draft(d2t_N: torch.Tensor, vocab: int) -> torch.Tensor:
    """Each target token's index in the draft vocabulary (-1 where it has none): ``d2t``'s inverse."""
    out = torch.full((vocab,), -1, dtype=torch.long, device=d2t_N.device)
    idx = torch.arange(d2t_N.numel(), device=d2t_N.device)
    out[idx + d2t_N] = idx
    return out


def reached_after(reached_BR: torch.Tensor, b_idx: torch.Tensor, t_idx: torch.Tensor, accepted_M: torch.Tensor,
                  fed_ok_M: torch.Tensor) -> torch.Tensor:
    """Draft-OPD's chains after one unroll step (``loss_kind="opd"``): row ``t``'s chain goes on to step
    ``i + 1`` iff it was reached at step ``i``, counted there (``b_idx, t_idx``: step i's counted rows;
    an uncounted row ends its chain), the target accepted the draft's token (greedy verification: the
    draft's argmax is the target's) and the token the unroll feeds next is that same target token (the
    data follows the target there), so step ``i + 1``'s state is the one the draft's own drafts lead to
    in decoding. Rows not reached train with weight 0: a state decoding never shows the draft."""
    out = torch.zeros_like(reached_BR)
    out[b_idx, t_idx] = reached_BR[b_idx, t_idx] & accepted_M & fed_ok_M
    return out


def ttt_loss_reference(
    draft,
    batch: Any,
    teacher_weight_NH: torch.Tensor,
    ttt_length: int = 7,
    decay: float = 0.8,
    num_valid_global: Optional[float] = None,
    softcap: Optional[float] = None,
    loss_kind: str = DEFAULT_LOSS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The straightforward TTT loss (test reference and benchmark baseline).

    Plain cat-then-project q/k/v, the eager attention with a materialized full TTT mask over
    concatenated keys, lm_head + log_softmax on ALL ``B x T`` rows every step, the teacher for
    all positions, masks applied by multiplication, the row loss as ``kernels.losses.loss_reference``
    writes it. Same conventions and result as :func:`ttt_loss`.
    """
    ids, loss_mask, aux, last_hidden, target_ids, pos = _unpack(batch)
    B, T = ids.shape
    dev = ids.device
    L = int(ttt_length)
    doc_ids_BT = _get(batch, "doc_ids_BT", None)  # packed rows
    valid = valid_rows(loss_mask, target_ids, draft.t2d, L, doc_ids_BT).float()
    teacher_all = teacher_probs(last_hidden, teacher_weight_NH, softcap, log=True)  # B,T,N: log-probs
    to_draft = target_to_draft(draft.d2t, draft.t2d.numel())
    reached = torch.ones(B, T, dtype=torch.bool, device=dev)  # Draft-OPD's chains (reached_after)
    layer = draft.midlayer
    attn_mod = layer.self_attn
    hidden = draft.project_aux(aux)
    keys, values = [], []
    stats = torch.zeros(L, 4, dtype=torch.float64, device=dev)
    total = 0.0
    for i in range(L):
        ids_i = F.pad(ids[:, 1 + i :], (0, min(1 + i, T)))[:, :T]
        x = torch.cat([layer.input_layernorm(draft.embed(ids_i)), layer.hidden_norm(hidden)], dim=-1)
        Hq, Hk, D = attn_mod.num_heads, attn_mod.num_kv_heads, attn_mod.head_dim
        q = attn_mod.q_proj(x).view(B, T, Hq, D).transpose(1, 2)
        k = attn_mod.k_proj(x).view(B, T, Hk, D).transpose(1, 2)
        v = attn_mod.v_proj(x).view(B, T, Hk, D).transpose(1, 2)
        cos, sin = draft.rope(pos + i)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        keys.append(k)
        values.append(v)
        attn = ttt_attention_eager(q, keys, values, doc_ids_BT=doc_ids_BT)
        hidden = draft.layer_finish(attn, hidden)
        z = draft.logits(hidden)
        teacher_i = F.pad(teacher_all[:, 1 + i :], (0, 0, 0, min(1 + i, T)))[:, :T]  # log-probs
        tgt = F.pad(target_ids[:, 1 + i :], (0, min(1 + i, T)))[:, :T]
        ce = loss_reference(loss_kind, z, teacher_i, to_draft[tgt])  # B,T
        m = valid[i]
        if loss_kind == "opd":  # only the rows the draft's own drafts reach count
            m = m * reached
        total = total + (decay**i) * (ce * m).sum()
        with torch.no_grad():
            pred = torch.log_softmax(z.to(torch.promote_types(z.dtype, torch.float32)), dim=-1).argmax(-1)
            correct = (pred + draft.d2t[pred]) == tgt
            stats[i, 0] = valid[i].sum()
            stats[i, 1] = (correct.float() * valid[i]).sum()
            stats[i, 2] = (ce * m).sum()
            stats[i, 3] = (teacher_i.gather(-1, pred.unsqueeze(-1)).squeeze(-1).exp() * valid[i]).sum()
            fed = F.pad(ids[:, 2 + i :], (0, min(2 + i, T)))[:, :T] == tgt  # the token step i + 1 reads
            reached = reached & valid[i].bool() & correct & fed
    normalizer = float(num_valid_global) if num_valid_global is not None else float(valid[0].sum())
    return total / max(normalizer, 1.0), stats
