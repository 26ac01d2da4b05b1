"""DSpark's training objective: DFlash's anchors and blocks, the Markov-biased logits, the confidence head.

Legend: B batch, T tokens, N blocks per row, K block size, R = K + shift rows of a block in
"token space", H hidden, V target vocab.

Token space: row j of a block anchored at a stands for the token at a + j (row 0: the anchor,
never predicted). With ``sample_from_anchor`` (shift 1) draft row k predicts row k + 1, so the K
draft rows predict rows 1 .. K; without it (shift 0, DFlash's layout) draft row k predicts row k,
so rows 1 .. K - 1 (``dflash.blocks.shifted_targets``). Labels and which rows count are DFlash's
:func:`block_targets` over R rows (the target's greedy token, the run stopping at the first
non-assistant token); the weights are
DFlash's decay over R rows (``exp(-(j - 1) / gamma)`` for row j: the first drafted token weighs 1).

Per predicted row (at token position p = a + j):

* the previous token ``x_{p-1}`` (a data token: teacher forcing, as speculators trains) feeds the
  Markov head: ``logits = lm_head(h) + W2 W1[x_{p-1}]``;
* the teacher is the target's distribution at p - 1, ``softmax(lm_head(last_hidden[p - 1]))``
  (``last_hidden`` is the target's post-norm final hidden state; a Gemma-style logit soft-cap is
  not applied, on either side);
* main term: ``kl_weight * KL(teacher || draft) + ce_weight * CE(draft, greedy label)``;
* confidence term (with the head): ``BCEWithLogits(conf, c*)`` with ``c* = sum_v min(q_v, p_v)``
  (1 - total variation: the probability that sampling verification accepts the row, detached),
  weighted ``confidence_weight``. Neither the hidden state nor W1 is detached (speculators' choice:
  the confidence term also trains the backbone and W1).

``loss = sum(w * (main + confidence_weight * bce)) / normalizer`` where the normalizer is the
global sum of the counted rows' weights (speculators divides by a count of rows; we divide by
the weight sum as DFlash does here, so per-row terms, not totals, compare with speculators').

Counters ``[R, 7]`` in token space (row 0 stays 0): DFlash's four (main loss sum, counted rows,
greedy-correct rows, leading run of correct rows) so :func:`dflash.loss.metrics_from_counts` turns
them into ``loss_k`` / ``acc_k`` / ``tau`` unchanged, plus the BCE sum, the sum of
``|sigmoid(conf) - c*|`` and the sum of ``c*`` (speculators' accept rate).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from specforge.algorithms.dflash.blocks import accepted_run, chunked, drafted_metrics, rows_at, token_rows
from specforge.algorithms.dflash.loss import decay_weights, loss_weights
from specforge.kernels.losses import kl_of_logs

__all__ = ["COUNTERS", "dspark_block_loss", "dspark_metrics"]

COUNTERS = ("loss_sum", "valid", "correct", "accepted", "conf_bce_sum", "conf_abs_err_sum", "accept_prob_sum")


def _chunk_terms(draft, hidden, prev, teacher, labels, valid, kl_weight: float, ce_weight: float):
    """Per predicted row: (main loss, bce, greedy correct, c*, |sigmoid(conf) - c*|, the draft's probability
    of the label: D-PACE's confidence), zero where not counted."""
    logits, conf = draft.head(hidden, prev)
    logq = F.log_softmax(logits.float(), dim=-1)
    v = valid.float()
    main = torch.zeros_like(v)
    if ce_weight:
        main = main + ce_weight * -logq.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    bce = err = accept = torch.zeros_like(v)
    if teacher is not None:
        with torch.no_grad():
            logp = F.log_softmax(draft.logits(teacher).float(), dim=-1)
        if kl_weight:
            main = main + kl_weight * kl_of_logs(logq, logp)
        with torch.no_grad():
            accept = torch.minimum(logq.exp(), logp.exp()).sum(-1)
        if conf is not None:
            bce = F.binary_cross_entropy_with_logits(conf.float(), accept, reduction="none")
            with torch.no_grad():
                err = (torch.sigmoid(conf.float()) - accept).abs()
    correct = (logq.argmax(-1) == labels) & valid
    with torch.no_grad():
        label_p = logq.gather(-1, labels.unsqueeze(-1)).squeeze(-1).exp()
    return main * v, bce * v, correct, accept * v, err * v, label_p * v


def dspark_block_loss(draft, hidden_BNKH: torch.Tensor, batch, anchors_BN, labels_BNR, valid_BNR, prev_pos_BNJ,
                      *, gamma: Optional[float], kl_weight: float, ce_weight: float, confidence_weight: float,
                      normalizer: Optional[torch.Tensor] = None, chunk_blocks: int = 0,
                      dpace_alpha: Optional[float] = None):
    """``(loss, counts[R, 7])`` of one micro-batch (see the module docstring). ``hidden_BNKH``: the
    backbone's rows; ``batch``: its ``input_ids_BT`` and ``last_hidden_BTH`` (the teacher).
    ``dpace_alpha``: D-PACE's weights (``dflash.loss.dpace_weights``) instead of the decay.
    ``chunk_blocks > 0``: that many blocks' full-vocab logits at a time, recomputed in backward."""
    c = draft.config
    R = valid_BNR.shape[-1]
    shift = R - c.block_size
    hidden = hidden_BNKH[:, :, 1 - shift:]  # the draft rows that predict token rows 1 .. R-1
    labels, valid = labels_BNR[..., 1:], valid_BNR[..., 1:]
    prev = rows_at(batch.input_ids_BT, prev_pos_BNJ)
    need_teacher = bool(kl_weight) or draft.confidence_head is not None
    teacher = rows_at(batch.last_hidden_BTH, prev_pos_BNJ).to(hidden.dtype) if need_teacher else None
    main, bce, correct, accept, err, label_p = chunked(_chunk_terms, draft, (hidden, prev, teacher, labels, valid),
                                                       kl_weight, ce_weight, chunk_blocks=chunk_blocks)
    w, normalizer = loss_weights(valid, gamma, normalizer, dpace_alpha, label_p, first_row=1)
    alpha = confidence_weight if draft.confidence_head is not None else 0.0
    loss = ((main + alpha * bce) * w).sum() / normalizer.clamp_min(1e-12)
    with torch.no_grad():
        rows = token_rows
        counts = torch.stack([rows(main), rows(valid), rows(correct), rows(accepted_run(correct)), rows(bce), rows(err),
                              rows(accept)], 1)
    return loss, counts


def dspark_metrics(counts_R7: torch.Tensor, gamma: Optional[float], confidence_weight: float,
                   confidence_head: bool, teacher: bool = True) -> dict[str, float]:
    """Rates from summed counters: DFlash's (``loss_k``, ``acc_k``, ``tau``; block row k logged as
    position k-1, the first drafted token's being position 0), ``loss`` as trained (main +
    confidence term), ``loss_main``, ``accept_rate`` (mean c*; only when the teacher was computed:
    a KL term or a confidence head), ``conf_bce`` and ``conf_error``."""
    c = counts_R7.double().cpu()
    out = drafted_metrics(c[:, :4], gamma)
    w = decay_weights(c.shape[0], gamma, c.device).double()
    denom = (w * c[:, 1]).sum().item()
    n = c[:, 1].sum().item()
    out["loss_main"] = out["loss"]
    if teacher:
        out["accept_rate"] = c[:, 6].sum().item() / n if n else math.nan
    if confidence_head:
        bce = (w * c[:, 4]).sum().item() / denom if denom else math.nan
        out["conf_bce"] = c[:, 4].sum().item() / n if n else math.nan
        out["conf_error"] = c[:, 5].sum().item() / n if n else math.nan
        out["loss"] = out["loss_main"] + confidence_weight * bce
    return out
