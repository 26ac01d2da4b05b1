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
* ``loss_i`` = soft cross-entropy against ``softmax(last_hidden[t+1+i] @ teacher_weight_NH.T)``
  (the target distribution renormalized over the draft vocab), summed over counted rows.
  ``loss = sum_i decay**i * loss_i / num_valid`` where ``num_valid`` = counted rows of step 0
  (this rank's), or ``num_valid_global`` when given (the global step-0 count across data/sequence
  parallel ranks: then each rank's loss is its share of the global mean, and gradients must be
  SUMMED across ranks, not averaged).

Metrics (per step ``i``, over counted rows):

* ``acc_i``: draft argmax (mapped to a target id with ``d2t``) == target argmax.
* ``accept_rate_i``: mean target probability (renormalized over the draft vocab) of the draft's
  argmax token -- the acceptance probability of a greedy draft token under speculative sampling
  at temperature 1 (slightly optimistic because of the renormalization).
* ``tau`` = 1 + sum_k prod_{i<=k} acc_i: simulated acceptance length of greedy chain drafting.
* Raw counts ``valid_i``, ``correct_i``, ``loss_sum_i``, ``accept_sum_i`` (sum them across ranks,
  then :func:`metrics_from_counts` recomputes the rates).

Sequence parallelism (``num_rows`` given, or the batch carries ``num_rows``): the batch is one
rank's slice of the (padded) sequence -- see ``specforge/parallel/sp.py``. ``aux_hidden`` and
``position_ids`` have ``num_rows`` rows (the rows this rank owns, at global positions
``position_ids``); ``input_ids``, ``loss_mask``, ``target_ids`` and ``last_hidden`` have at least
``num_rows + ttt_length + 1`` rows (the owned rows plus a right halo: step ``i`` row ``t`` reads
x_{t+1+i}, the teacher/argmax at t+1+i and the loss mask at t+2+i), zero-padded past the end of
the sequence. Only owned rows are computed and counted, every step computes all of them (no
trimming: all ranks must run the same shapes through the attention collectives), and the last
step's output enters the loss with weight 0 so every rank runs every collective in backward.

Performance: the teacher and the per-step valid rows are computed once; ``lm_head``/soft-CE run
only on counted rows (gathered); the embedding half of the q/k/v projection is computed once for
the whole sequence and shifted per step; rows that no later step needs are trimmed; attention
uses the swappable core ``draft.midlayer.self_attn.core`` (fast path: no materialized masks).
Run it under ``specforge.device.autocast(device, torch.bfloat16)``.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F

from specforge.models.attention import ttt_attention_eager
from specforge.models.draft import apply_rotary

__all__ = [
    "ttt_loss",
    "ttt_loss_reference",
    "ttt_unroll",
    "ttt_logits",
    "valid_rows",
    "num_valid_rows",
    "teacher_weight_from_target",
    "metrics_from_counts",
    "soft_cross_entropy",
    "linear_soft_cross_entropy",
]

_COUNT_KEYS = ("valid", "correct", "loss_sum", "accept_sum")


def _get(batch: Any, name: str, default: Any = ...) -> Any:
    if isinstance(batch, Mapping):
        if name in batch:
            return batch[name]
    elif hasattr(batch, name):
        return getattr(batch, name)
    if default is ...:
        raise KeyError(f"batch has no {name!r}")
    return default


def _unpack(batch: Any):
    """(input_ids, loss_mask, aux_hidden, last_hidden, target_ids, position_ids) of a batch;
    positions default to ``arange(T)``."""
    ids = _get(batch, "input_ids_BT")
    pos = _get(batch, "position_ids_BT", None)
    if pos is None:
        B, T = ids.shape
        pos = torch.arange(T, device=ids.device).expand(B, T)
    names = ("loss_mask_BT", "aux_hidden_BT3H", "last_hidden_BTH", "target_ids_BT")
    return (ids, *(_get(batch, n) for n in names), pos)


def teacher_weight_from_target(target_lm_head_VH: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """The frozen teacher head: target lm_head rows of the draft vocab (``N x H``)."""
    ids = torch.arange(d2t.numel(), device=d2t.device) + d2t
    return target_lm_head_VH.detach()[ids.to(target_lm_head_VH.device)].clone()


def valid_rows(loss_mask_BT: torch.Tensor, target_ids_BT: torch.Tensor, t2d_V: torch.Tensor, ttt_length: int) -> torch.Tensor:
    """``ttt_length x B x T`` bool: does row t of step i count? (see the module docstring)."""
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
    return out


def _owned_rows(batch: Any, num_rows: Optional[int]) -> Optional[int]:
    n = _get(batch, "num_rows", None) if num_rows is None else num_rows
    return None if n is None else int(n)


def num_valid_rows(batch: Any, t2d_V: torch.Tensor, ttt_length: int, num_rows: Optional[int] = None) -> int:
    """Rows that count at TTT step 0 (the loss normalizer); only owned rows of an SP slice."""
    loss_mask = _get(batch, "loss_mask_BT")
    valid0 = valid_rows(loss_mask, _get(batch, "target_ids_BT"), t2d_V.to(loss_mask.device), 1)[0]
    n = _owned_rows(batch, num_rows)
    return int((valid0 if n is None else valid0[:, :n]).sum())


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
    """Fused ``lm_head`` + soft cross-entropy over row chunks (the logits never exist whole).

    Forward, per chunk of rows: ``z = h @ W.T`` (matmul dtype = h's), fp32 statistics, the row
    losses, argmax and the teacher probability of the argmax (metrics), and the logit gradient
    ``softmax(z) - p`` (stored in h's dtype). Backward: two GEMMs scaled by the incoming scalar.
    Returns ``(loss_sum, per-row loss, argmax, teacher prob of argmax)``; only the first is
    differentiable. ``teacher[tidx]`` are the rows' target distributions.
    """

    @staticmethod
    def forward(ctx, h_MH, W_NH, teacher_PN, tidx_M, chunk: int):
        M = h_MH.shape[0]
        f32 = torch.promote_types(h_MH.dtype, torch.float32)
        G = torch.empty(M, W_NH.shape[0], dtype=h_MH.dtype, device=h_MH.device)
        ce = torch.empty(M, dtype=f32, device=h_MH.device)
        pred = torch.empty(M, dtype=torch.long, device=h_MH.device)
        acc_p = torch.empty(M, dtype=f32, device=h_MH.device)
        Wt = W_NH.t()
        for c0 in range(0, M, chunk):
            c1 = min(M, c0 + chunk)
            z = torch.matmul(h_MH[c0:c1], Wt).to(f32)
            p = teacher_PN.index_select(0, tidx_M[c0:c1]).to(f32)
            m, am = z.max(dim=-1)
            pz = (p * z).sum(-1)
            z.sub_(m.unsqueeze(-1)).exp_()
            ssum = z.sum(-1)
            ce[c0:c1] = m + torch.log(ssum) - pz
            pred[c0:c1] = am
            acc_p[c0:c1] = p.gather(1, am.unsqueeze(1)).squeeze(1)
            z.div_(ssum.unsqueeze(-1)).sub_(p)
            G[c0:c1] = z
        ctx.save_for_backward(h_MH, W_NH, G)
        ctx.mark_non_differentiable(ce, pred, acc_p)
        return ce.sum(), ce, pred, acc_p

    @staticmethod
    def backward(ctx, g, *_):
        h, W, G = ctx.saved_tensors
        g = g.to(G.dtype)
        dh = torch.matmul(G, W) * g if ctx.needs_input_grad[0] else None
        dW = torch.matmul(G.t(), h) * g if ctx.needs_input_grad[1] else None
        return dh, dW, None, None, None


def linear_soft_cross_entropy(h_MH, W_NH, teacher_PN, tidx_M, chunk: int = 64):
    """``(loss_sum, row_loss, argmax, teacher_prob_of_argmax)`` of ``h @ W.T`` vs ``teacher[tidx]``.

    Under autocast the matmuls run in the autocast dtype (h and W are cast once here).
    """
    dev = h_MH.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        h_MH, W_NH = h_MH.to(dt), W_NH.to(dt)
    else:
        dt = torch.promote_types(h_MH.dtype, W_NH.dtype)
        h_MH, W_NH = h_MH.to(dt), W_NH.to(dt)
    with torch.autocast(dev, enabled=False):
        return _LinearSoftCE.apply(h_MH, W_NH, teacher_PN, tidx_M, int(chunk))


def soft_cross_entropy(logits_MN: torch.Tensor, probs_MN: torch.Tensor) -> torch.Tensor:
    """Per-row soft cross-entropy (fp32 statistics), differentiable w.r.t. the logits."""
    with torch.autocast(logits_MN.device.type, enabled=False):
        return _SoftCE.apply(logits_MN, probs_MN)


def metrics_from_counts(counts: Mapping[str, float], ttt_length: int) -> dict[str, float]:
    """Rates (loss_i, acc_i, accept_rate_i, tau) from (possibly rank-summed) raw counts."""
    out: dict[str, float] = {}
    tau, prod = 1.0, 1.0
    for i in range(ttt_length):
        n = float(counts[f"valid_{i}"])
        d = max(n, 1.0)
        out[f"loss_{i}"] = float(counts[f"loss_sum_{i}"]) / d
        out[f"acc_{i}"] = float(counts[f"correct_{i}"]) / d
        out[f"accept_rate_{i}"] = float(counts[f"accept_sum_{i}"]) / d
        prod *= out[f"acc_{i}"]
        tau += prod
    out["tau"] = tau
    return out


def _finish_metrics(stats: torch.Tensor, loss: torch.Tensor, normalizer: float, ttt_length: int) -> dict:
    vals = stats.tolist()  # one sync
    counts: dict[str, float] = {}
    for i, row in enumerate(vals):
        for key, v in zip(_COUNT_KEYS, row):
            counts[f"{key}_{i}"] = int(round(v)) if key in ("valid", "correct") else float(v)
    metrics = dict(counts)
    metrics.update(metrics_from_counts(counts, ttt_length))
    metrics["loss"] = float(loss.detach())
    metrics["num_valid"] = counts["valid_0"]
    metrics["normalizer"] = float(normalizer)
    return metrics


def ttt_unroll(draft, input_ids_BT, aux_hidden_BT3H, position_ids_BT, t_len: list[int]):
    """Yield ``(i, Ti, hidden_out_B_Ti_H)`` for TTT steps ``i = 0..len(t_len)-1``.

    Step ``i`` computes rows ``t < t_len[i]`` (non-increasing); row ``t`` reads the embedding of
    x_{t+1+i} (zeros past the end), the previous step's hidden, RoPE position ``pos[t] + i``.
    The embedding half of q/k/v is projected once for the whole sequence and shifted.
    """
    B, T = input_ids_BT.shape
    core = draft.midlayer.self_attn.core
    w_emb, w_hid = draft.qkv_weights()
    e_full = draft.embed_part(draft.embed(input_ids_BT), w_emb)  # (B,T,F) for x_0..x_{T-1}
    hidden = draft.project_aux(aux_hidden_BT3H)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for i, Ti in enumerate(t_len):
        hidden = hidden[:, :Ti]
        e_i = e_full[:, 1 + i : 1 + i + Ti]
        if e_i.shape[1] < Ti:
            e_i = F.pad(e_i, (0, 0, 0, Ti - e_i.shape[1]))
        q, k, v = draft.layer_qkv(e_i, hidden, position_ids_BT[:, :Ti] + i, w_hid)
        keys.append(k)
        values.append(v)
        # step-0 keys stay whole (causal, may be longer than Ti); diagonal keys are cut to Ti
        # (passed as the same tensor objects when not cut: SP cores cache their collectives by identity)
        cut = lambda x: x if x.shape[2] == Ti else x[:, :, :Ti]  # noqa: E731
        attn = core(q, [keys[0]] + [cut(kk) for kk in keys[1:]], [values[0]] + [cut(vv) for vv in values[1:]])
        hidden = draft.layer_finish(attn, hidden)
        yield i, Ti, hidden


def ttt_logits(draft, batch: Any, ttt_length: int = 7) -> list[torch.Tensor]:
    """Draft-vocab logits of every step and row (``B x T x N`` each) via the training path."""
    ids = _get(batch, "input_ids_BT")
    B, T = ids.shape
    pos = _get(batch, "position_ids_BT", None)
    if pos is None:
        pos = torch.arange(T, device=ids.device).expand(B, T)
    aux = _get(batch, "aux_hidden_BT3H")
    return [draft.logits(h) for _, _, h in ttt_unroll(draft, ids, aux, pos, [T] * ttt_length)]


def ttt_loss(
    draft,
    batch: Any,
    teacher_weight_NH: torch.Tensor,
    ttt_length: int = 7,
    decay: float = 0.8,
    num_valid_global: Optional[float] = None,
    num_rows: Optional[int] = None,
) -> tuple[torch.Tensor, dict]:
    """The TTT loss of one batch (fast path) and its metrics.

    ``batch`` (mapping or object): ``input_ids_BT``, ``loss_mask_BT``, ``aux_hidden_BT3H``,
    ``last_hidden_BTH``, ``target_ids_BT``; optional ``position_ids_BT`` (default ``arange(T)``).
    Right padding must carry ``loss_mask`` 0. ``num_rows`` (default: ``batch.num_rows`` if
    present): sequence-parallel slice mode, see the module docstring.
    """
    ids, loss_mask, aux, last_hidden, target_ids, pos = _unpack(batch)
    B, T = ids.shape
    dev = ids.device
    L = int(ttt_length)
    sp_rows = _owned_rows(batch, num_rows)
    if sp_rows is not None and T < sp_rows + L + 1:
        raise ValueError(f"SP slice: {T} window rows, need num_rows + ttt_length + 1 = {sp_rows + L + 1}")
    R = T if sp_rows is None else sp_rows  # rows this call computes

    valid = valid_rows(loss_mask, target_ids, draft.t2d, L)[:, :, :R]  # L,B,R
    # Teacher once, at every position p = t+1+i that some counted row uses.
    used = torch.zeros(B, T, dtype=torch.bool, device=dev)
    for i in range(L):
        n = min(R, T - 1 - i)
        if n > 0:
            used[:, 1 + i : 1 + i + n] |= valid[i, :, :n]
    used_idx = used.view(-1).nonzero().squeeze(-1)
    pos_map = torch.full((B * T,), -1, dtype=torch.long, device=dev)
    pos_map[used_idx] = torch.arange(used_idx.numel(), device=dev)
    with torch.no_grad():
        tl = F.linear(last_hidden.reshape(B * T, -1)[used_idx], teacher_weight_NH.detach())
        teacher = torch.softmax(tl.to(torch.promote_types(tl.dtype, torch.float32)), dim=-1)
    target_flat = target_ids.reshape(-1)
    d2t = draft.d2t

    # Rows step i must compute: t < t_len[i] = 1 + the last row counted at any step >= i
    # (a row's later steps depend on its own earlier steps; step 0 also provides the keys).
    later = (valid.flip(0).int().cumsum(dim=0).flip(0) > 0).any(dim=1)  # L,T: counted at a step >= i
    idx = torch.arange(1, R + 1, device=dev)
    t_len = [max(int(n), 1) for n in torch.where(later, idx, 0).amax(dim=1).tolist()]
    if sp_rows is not None:  # same shapes on every SP rank (collectives inside the core)
        t_len = [R] * L

    stats = torch.zeros(L, 4, dtype=torch.float64, device=dev)
    total = None
    hidden = None
    for i, Ti, hidden in ttt_unroll(draft, ids, aux, pos, t_len):
        rows_bt = valid[i, :, :Ti].reshape(-1).nonzero().squeeze(-1)  # in (B, Ti) flat
        if rows_bt.numel() == 0:
            continue
        b, t = rows_bt // Ti, rows_bt % Ti
        flat_p = b * T + t + 1 + i  # position of the teacher / target argmax
        h_rows = draft.norm(hidden.reshape(B * Ti, -1)[rows_bt])
        ce_sum, ce, pred, accept = linear_soft_cross_entropy(h_rows, draft.lm_head.weight, teacher, pos_map[flat_p])
        step_loss = ce_sum * (decay**i)
        total = step_loss if total is None else total + step_loss
        with torch.no_grad():
            correct = (pred + d2t[pred]) == target_flat[flat_p]
            stats[i, 0] = rows_bt.numel()
            stats[i, 1] = correct.sum()
            stats[i, 2] = ce.sum()
            stats[i, 3] = accept.sum()
    normalizer = float(num_valid_global) if num_valid_global is not None else float(valid[0].sum())
    if total is None:  # nothing counted: a zero that still reaches every trainable parameter
        total = sum(p.sum() for p in draft.parameters() if p.requires_grad) * 0.0
    if sp_rows is not None:  # every step's attention (and its collectives) takes part in backward
        total = total + hidden.sum() * 0.0
    loss = total / max(normalizer, 1.0)
    return loss, _finish_metrics(stats, loss, normalizer, L)


def ttt_loss_reference(
    draft,
    batch: Any,
    teacher_weight_NH: torch.Tensor,
    ttt_length: int = 7,
    decay: float = 0.8,
    num_valid_global: Optional[float] = None,
) -> tuple[torch.Tensor, dict]:
    """The straightforward TTT loss (test reference and benchmark baseline).

    Plain cat-then-project q/k/v, the eager attention with a materialized full TTT mask over
    concatenated keys, lm_head + log_softmax on ALL ``B x T`` rows every step, the teacher for
    all positions, masks applied by multiplication. Same conventions and result as
    :func:`ttt_loss`.
    """
    ids, loss_mask, aux, last_hidden, target_ids, pos = _unpack(batch)
    B, T = ids.shape
    dev = ids.device
    L = int(ttt_length)
    valid = valid_rows(loss_mask, target_ids, draft.t2d, L).float()
    with torch.no_grad():
        tl = F.linear(last_hidden, teacher_weight_NH.detach())
        teacher_all = torch.softmax(tl.to(torch.promote_types(tl.dtype, torch.float32)), dim=-1)  # B,T,N
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
        attn = ttt_attention_eager(q, keys, values)
        hidden = draft.layer_finish(attn, hidden)
        z = draft.logits(hidden)
        logp = torch.log_softmax(z.to(torch.promote_types(z.dtype, torch.float32)), dim=-1)  # B,T,N
        teacher_i = F.pad(teacher_all[:, 1 + i :], (0, 0, 0, min(1 + i, T)))[:, :T]
        ce = -(teacher_i * logp).sum(-1)  # B,T
        m = valid[i]
        total = total + (decay**i) * (ce * m).sum()
        with torch.no_grad():
            pred = logp.argmax(-1)
            tgt = F.pad(target_ids[:, 1 + i :], (0, min(1 + i, T)))[:, :T]
            stats[i, 0] = m.sum()
            stats[i, 1] = (((pred + draft.d2t[pred]) == tgt).float() * m).sum()
            stats[i, 2] = (ce * m).sum()
            stats[i, 3] = (teacher_i.gather(-1, pred.unsqueeze(-1)).squeeze(-1) * m).sum()
    normalizer = float(num_valid_global) if num_valid_global is not None else float(valid[0].sum())
    loss = total / max(normalizer, 1.0)
    return loss, _finish_metrics(stats, loss, normalizer, L)
