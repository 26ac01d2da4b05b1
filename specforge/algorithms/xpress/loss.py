"""XPress's training objective: DFlash's anchors and blocks (DSpark's row layout), the refiner trained
teacher-forced and free-running, the backbone held to the target (speculators 0.9.0
``models/xpress/{core,metrics}.py``).

Legend: B batch, N blocks per row, K block size, R = K + shift token rows of a block, V vocab.

Rows, labels, counted rows and the teacher's row are the block family's shifted layout
(:func:`~specforge.algorithms.dflash.blocks.shifted_targets`): token row j of a block anchored at a
stands for the token at a + j; its label is the target's greedy token (or, with ``ce_from_data``,
the data token, for the CE part only); its teacher is ``softmax(lm_head(last_hidden[a + j - 1]))``.
The refiner reads all K rows of a block (its block mean and causal mix see them), the loss the
predicting ones.

Per predicted row and logits ``z``: ``d(z) = ce_weight x CE(z, label) + tv_weight x TV(z, teacher)
+ kl_weight x KL(teacher || z)`` (speculators' default mix: 0.1 CE + 0.9 TV). Three kinds of ``z``:

* teacher-forced: ``base + bias(prev = the data tokens)``;
* ``consistency_passes`` free-running passes: ``base + bias(prev = the previous pass's argmax)``,
  the first seeded by the base argmax, no gradient through the argmax (the recurrence drafting runs,
  :meth:`~.model.XPressDraft.jacobi`); their losses averaged;
* the base logits alone (the anchor term: keeps the backbone a good seed).

``loss = sum(w x (d_tf + consistency_weight x mean_j d_j + anchor_weight x d_base)) / normalizer``,
``w`` DFlash's position decay (the first drafted token weighs 1; with ``anchor_full_weight`` the
anchor term's w is 1 on every counted row) and the normalizer the global sum of the counted rows'
decay weights. speculators divides each term by the count of rows instead (tests/test_xpress.py
feeds that count as the normalizer).

Counters ``[R, 8]`` in token space (row 0 stays 0): DFlash's four (the row's whole loss, valid,
the teacher-forced refined argmax correct, the accepted run), then the teacher-forced, consistency
and base terms, and the base argmax correct.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from specforge.algorithms.dflash.blocks import accepted_run, chunked, drafted_metrics, rows_at, token_rows
from specforge.algorithms.dflash.loss import decay_weights, loss_weights
from specforge.kernels.losses import kl_of_logs, tv_of_logs

from .model import jacobi_prev

__all__ = ["COUNTERS", "LossMix", "teacher_prev", "xpress_block_loss", "xpress_metrics"]

COUNTERS = ("loss_sum", "valid", "correct", "accepted", "tf_sum", "consistency_sum", "anchor_sum", "base_correct")


class LossMix:
    """The per-row divergence mix and the term weights (the module docstring)."""

    def __init__(self, ce_weight: float, tv_weight: float, kl_weight: float, consistency_weight: float,
                 consistency_passes: int, anchor_weight: float, anchor_full_weight: bool = False,
                 dpace: bool = False):
        self.ce, self.tv, self.kl = ce_weight, tv_weight, kl_weight
        self.consistency, self.passes = consistency_weight, consistency_passes
        self.anchor, self.anchor_full = anchor_weight, anchor_full_weight
        self.dpace = dpace  # D-PACE's confidences wanted (draft.loss_weighting=dpace): one more softmax a chunk

    @classmethod
    def of(cls, opt) -> "LossMix":
        return cls(opt.ce_weight, opt.tv_weight, opt.kl_weight, opt.consistency_weight, opt.consistency_passes,
                   opt.anchor_weight, opt.anchor_full_weight, opt.loss_weighting == "dpace")

    def divergence(self, z: torch.Tensor, labels: torch.Tensor, logp: Optional[torch.Tensor]) -> torch.Tensor:
        """``d(z)`` per row: ``z [..., V]``, ``labels [...]``, ``logp`` the teacher's log-softmax (fp32)."""
        logq = F.log_softmax(z.float(), dim=-1)
        d = logq.new_zeros(labels.shape)
        if self.ce:
            d = d + self.ce * -logq.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        if self.tv:
            d = d + self.tv * tv_of_logs(logq, logp)
        if self.kl:
            d = d + self.kl * kl_of_logs(logq, logp)
        return d


def teacher_prev(input_ids_BT: torch.Tensor, anchors_BN: torch.Tensor, block_size: int, shift: int,
                 doc_ids_BT: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[B, N, K]``: the data token before the one each row stands for (anchor-first: the row's own
    token). Row 0 of DFlash's layout reads the token before the anchor, or the anchor itself at a
    sequence's (a packed sample's) start; rows past the sequence read its last token (their bias only
    reaches later rows, which are not counted either)."""
    T = input_ids_BT.shape[1]
    pos = anchors_BN.unsqueeze(-1) + torch.arange(block_size, device=anchors_BN.device) - 1 + shift
    if not shift:
        before = pos[..., 0].clamp(min=0)
        own = anchors_BN.eq(0)
        if doc_ids_BT is not None:
            own |= doc_ids_BT.gather(1, before) != doc_ids_BT.gather(1, anchors_BN)
        pos[..., 0] = torch.where(own, anchors_BN, before)
    return rows_at(input_ids_BT, pos.clamp(max=T - 1))


def _chunk_terms(draft, hidden, prev, teacher, labels, ce_labels, valid, mix: LossMix):
    """Per predicted row: (d_tf, mean_j d_j, d_base, refined correct, base correct, the teacher-forced refined
    head's probability of the label: D-PACE's confidence), zero where not counted."""
    shift = draft.config.shift
    head = draft.refiner_head
    base = draft.logits(hidden)  # [B, n, K, V]
    ctx = head.context(hidden)
    logp = None
    if mix.tv or mix.kl:
        with torch.no_grad():
            logp = F.log_softmax(draft.logits(teacher).float(), dim=-1)
    rows = slice(1 - shift, None)  # the hidden rows that predict token rows 1 .. R-1
    v = valid.float()

    def d(z):
        z = z[..., rows, :]
        if ce_labels is labels:
            return mix.divergence(z, labels, logp)
        soft = LossMix(0.0, mix.tv, mix.kl, 0, 0, 0).divergence(z, labels, logp)
        return soft + LossMix(mix.ce, 0.0, 0.0, 0, 0, 0).divergence(z, ce_labels, None)

    refined = base + head.bias(ctx, prev).to(base.dtype)
    d_tf = d(refined)
    d_cons = torch.zeros_like(v)
    if mix.consistency and mix.passes:
        pred = base.detach().argmax(-1)
        first, anchor = prev[..., 0], prev[..., 1 - shift]  # teacher forcing's row 0, and the anchor
        for _ in range(mix.passes):
            z = base + head.bias(ctx, jacobi_prev(first, anchor, pred, shift)).to(base.dtype)
            d_cons = d_cons + d(z)
            pred = z.detach().argmax(-1)
        d_cons = d_cons / mix.passes
    d_base = d(base) if mix.anchor else torch.zeros_like(v)
    with torch.no_grad():
        correct = (refined[..., rows, :].argmax(-1) == labels) & valid
        base_correct = (base[..., rows, :].argmax(-1) == labels) & valid
        label_p = torch.zeros_like(v)
        if mix.dpace:
            logq = F.log_softmax(refined[..., rows, :].float(), -1)
            label_p = logq.gather(-1, labels.unsqueeze(-1)).squeeze(-1).exp()
    return d_tf * v, d_cons * v, d_base * v, correct, base_correct, label_p * v


def xpress_block_loss(draft, hidden_BNKH: torch.Tensor, batch, labels_BNR, valid_BNR, prev_pos_BNJ, prev_BNK, *,
                      gamma: Optional[float], mix: LossMix, ce_labels_BNR=None,
                      normalizer: Optional[torch.Tensor] = None, chunk_blocks: int = 0,
                      dpace_alpha: Optional[float] = None):
    """``(loss, counts[R, 8])`` of one micro-batch (the module docstring). ``batch``: its
    ``last_hidden_BTH`` (with a TV or KL term); ``prev_pos_BNJ`` the teacher's rows (``shifted_targets``);
    ``prev_BNK`` the teacher-forced
    previous tokens (:func:`teacher_prev`); ``ce_labels_BNR`` the CE's labels where they are not
    ``labels``. ``chunk_blocks > 0``: that many blocks' full-vocab logits at a time, recomputed in
    backward (the refiner is per block, so chunks over blocks are exact). ``dpace_alpha``: D-PACE's weights
    (``dflash.loss.dpace_weights``, from the teacher-forced refined head) instead of the decay."""
    labels, valid = labels_BNR[..., 1:], valid_BNR[..., 1:]
    ce_labels = labels if ce_labels_BNR is None else ce_labels_BNR[..., 1:]
    teacher = rows_at(batch.last_hidden_BTH, prev_pos_BNJ).to(hidden_BNKH.dtype) if mix.tv or mix.kl else None
    args = (hidden_BNKH, prev_BNK, teacher, labels, ce_labels, valid)
    d_tf, d_cons, d_base, correct, base_correct, label_p = chunked(_chunk_terms, draft, args, mix,
                                                                   chunk_blocks=chunk_blocks)
    w, normalizer = loss_weights(valid, gamma, normalizer, dpace_alpha, label_p, first_row=1)
    w_anchor = valid.float() if mix.anchor_full else w
    total = (d_tf + mix.consistency * d_cons) * w + mix.anchor * d_base * w_anchor
    loss = total.sum() / normalizer.clamp_min(1e-12)
    with torch.no_grad():
        rows = token_rows
        row_loss = d_tf + mix.consistency * d_cons + mix.anchor * d_base
        counts = torch.stack([rows(row_loss), rows(valid), rows(correct), rows(accepted_run(correct)), rows(d_tf),
                              rows(d_cons), rows(d_base), rows(base_correct)], 1)
    return loss, counts


def xpress_metrics(counts_R8: torch.Tensor, gamma: Optional[float]) -> dict[str, float]:
    """Rates from summed counters: DFlash's (``loss``, ``loss_k``, ``acc_k`` and ``tau`` of the
    teacher-forced refined argmax; block row k logged as position k-1), ``loss_tf``,
    ``loss_consistency``, ``loss_anchor`` (decay-weighted means) and ``acc_base`` (the backbone's
    argmax alone, drafting's seed)."""
    c = counts_R8.double().cpu()
    out = drafted_metrics(c[:, :4], gamma)
    w = decay_weights(c.shape[0], gamma, c.device).double()
    denom = (w * c[:, 1]).sum().item()
    n = c[:, 1].sum().item()
    for i, name in ((4, "loss_tf"), (5, "loss_consistency"), (6, "loss_anchor")):
        out[name] = (w * c[:, i]).sum().item() / denom if denom else math.nan
    out["acc_base"] = c[:, 7].sum().item() / n if n else math.nan
    return out
