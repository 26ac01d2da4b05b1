"""DFlash2's training objective: DFlash's anchors and blocks (DSpark's row layout), a unary term and
the selector's K-way cross-entropy (speculators 0.9.0 ``models/dflash2/metrics.py``).

Legend: B batch, N blocks per row, K block size, R = K + shift token rows of a block, V vocab, k top-k.

Rows, labels, counted rows, the previous token and the teacher's row are DSpark's
(:func:`~specforge.algorithms.dflash.blocks.shifted_targets`): row j of a block anchored at a stands
for the token at a + j; the label is the target's greedy token; the previous token ``x_{p-1}`` is
the data token (teacher forcing); the teacher is ``softmax(lm_head(last_hidden[p - 1]))``.

Per predicted row:

* unary: ``u = lm_head(h)``; ``main = kl_weight * KL(teacher || softmax(u)) + ce_weight * CE(u, label)``
  (speculators' default: KL alone);
* selector: candidates = top-k of ``u``; where the label is not among them it replaces the last
  (training only: drafting never sees the label); ``sel = CE(scores over the k candidates, the
  label's slot)``. The gradient reaches ``u`` through the gathered unary scores too.

``loss = sum(w * (main + selector_weight * sel)) / normalizer`` with DFlash's position decay
``w`` (the first drafted token weighs 1) and the normalizer the global sum of the counted rows'
weights. speculators divides each term by the count of rows instead (tests/test_dflash2.py feeds
that count as the normalizer).

Counters ``[R, 8]`` in token space (row 0 stays 0): DFlash's four, where "correct" is the
selector's teacher-forced pick (what drafting drafts), plus the unary and selector loss sums, the
unary argmax's correct rows and the rows whose label is in the unary top-k (recall).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from specforge.algorithms.dflash.blocks import accepted_run, chunked, drafted_metrics, rows_at, token_rows
from specforge.algorithms.dflash.loss import decay_weights, loss_weights
from specforge.kernels.losses import kl_of_logs

__all__ = ["COUNTERS", "training_candidates", "dflash2_block_loss", "dflash2_metrics"]

COUNTERS = ("loss_sum", "valid", "correct", "accepted", "unary_sum", "selector_sum", "unary_correct", "recall")


def training_candidates(top_ids: torch.Tensor, labels: torch.Tensor):
    """``(candidates [..., k], the label's slot [...], label in the top-k [...])``: the unary top-k
    with the label put in the last slot where it is missing."""
    hit = top_ids.eq(labels.unsqueeze(-1))
    contains = hit.any(-1)
    slot = torch.where(contains, hit.long().argmax(-1), top_ids.shape[-1] - 1)
    cand = top_ids.clone()
    cand[..., -1] = torch.where(contains, cand[..., -1], labels)
    return cand, slot, contains


def _chunk_terms(draft, hidden, prev, teacher, labels, valid, kl_weight: float, ce_weight: float):
    """Per predicted row: (main, sel, selector correct, unary correct, recall, the unary head's probability of
    the label: D-PACE's confidence), zero where not counted."""
    unary = draft.logits(hidden)
    logq = F.log_softmax(unary.float(), dim=-1)
    v = valid.float()
    main = torch.zeros_like(v)
    if ce_weight:
        main = main + ce_weight * -logq.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    if kl_weight:
        with torch.no_grad():
            logp = F.log_softmax(draft.logits(teacher).float(), dim=-1)
        main = main + kl_weight * kl_of_logs(logq, logp)
    sel_mod = draft.candidate_selector
    cand, slot, contains = training_candidates(unary.detach().topk(sel_mod.top_k, dim=-1).indices, labels)
    scores = sel_mod.scores(unary, hidden, prev, cand).float()
    sel = F.cross_entropy(scores.flatten(0, -2), slot.flatten(), reduction="none").view_as(slot)
    with torch.no_grad():
        picked = cand.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)
        correct = (picked == labels) & contains & valid  # a label injected for training is never drafted
        unary_correct = (logq.argmax(-1) == labels) & valid
        label_p = logq.gather(-1, labels.unsqueeze(-1)).squeeze(-1).exp()
    return main * v, sel * v, correct, unary_correct, contains & valid, label_p * v


def dflash2_block_loss(draft, hidden_BNKH: torch.Tensor, batch, labels_BNR, valid_BNR, prev_pos_BNJ, *,
                       gamma: Optional[float], kl_weight: float, ce_weight: float, selector_weight: float,
                       normalizer: Optional[torch.Tensor] = None, chunk_blocks: int = 0,
                       dpace_alpha: Optional[float] = None):
    """``(loss, counts[R, 8])`` of one micro-batch (the module docstring). ``batch``: its
    ``input_ids_BT`` and, with a KL term, ``last_hidden_BTH``. ``chunk_blocks > 0``: that many blocks'
    full-vocab logits at a time, recomputed in backward. ``dpace_alpha``: D-PACE's weights
    (``dflash.loss.dpace_weights``, from the unary head's probability of the label) instead of the decay."""
    R = valid_BNR.shape[-1]
    shift = R - draft.config.block_size
    hidden = hidden_BNKH[:, :, 1 - shift:]  # the draft rows that predict token rows 1 .. R-1
    labels, valid = labels_BNR[..., 1:], valid_BNR[..., 1:]
    prev = rows_at(batch.input_ids_BT, prev_pos_BNJ)
    teacher = rows_at(batch.last_hidden_BTH, prev_pos_BNJ).to(hidden.dtype) if kl_weight else None
    main, sel, correct, unary_correct, recall, label_p = chunked(
        _chunk_terms, draft, (hidden, prev, teacher, labels, valid), kl_weight, ce_weight, chunk_blocks=chunk_blocks)
    w, normalizer = loss_weights(valid, gamma, normalizer, dpace_alpha, label_p, first_row=1)
    total = main + selector_weight * sel
    loss = (total * w).sum() / normalizer.clamp_min(1e-12)
    with torch.no_grad():
        rows = token_rows
        counts = torch.stack([rows(total), rows(valid), rows(correct), rows(accepted_run(correct)), rows(main),
                              rows(sel), rows(unary_correct), rows(recall)], 1)
    return loss, counts


def dflash2_metrics(counts_R8: torch.Tensor, gamma: Optional[float], top_k: int) -> dict[str, float]:
    """Rates from summed counters: DFlash's (``loss`` as trained, ``loss_k``, ``acc_k`` and ``tau`` of
    the selector's picks; block row k logged as position k-1), ``loss_unary``, ``loss_selector``
    (decay-weighted means), ``acc_unary`` (the unary argmax's accuracy) and ``recall_at_<k>``."""
    c = counts_R8.double().cpu()
    out = drafted_metrics(c[:, :4], gamma)
    w = decay_weights(c.shape[0], gamma, c.device).double()
    denom = (w * c[:, 1]).sum().item()
    n = c[:, 1].sum().item()
    out["loss_unary"] = (w * c[:, 4]).sum().item() / denom if denom else math.nan
    out["loss_selector"] = (w * c[:, 5]).sum().item() / denom if denom else math.nan
    out["acc_unary"] = c[:, 6].sum().item() / n if n else math.nan
    out[f"recall_at_{top_k}"] = c[:, 7].sum().item() / n if n else math.nan
    return out
