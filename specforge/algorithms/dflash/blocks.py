"""The block family's shared pieces: what DSpark, DFlash2 and XPress (and DFlash itself, where it has the
same) take from DFlash's package, each written once. No block algorithm imports a sibling's modules:
DFlash's package is the family's library, and this module its shared part beyond DFlash's own hooks.

Legend: B batch, T tokens, N blocks per row, K block size, R = K + shift token rows of a block, J rows.

* ``ShiftedLayout``: a block config's ``shift`` (row k predicts the token after a + k with
  ``sample_from_anchor``) and ``drafts_per_block``.
* ``shifted_targets``: DFlash's labels and counted rows over R token rows, and each predicted row's
  previous position (the Markov head's, the selector's and the refiner's previous token; the teacher's
  row); ``rows_at`` reads a tensor at those positions.
* ``chunked`` (``dflash.loss``'s, DFlash's own loss uses it): a per-row loss over the blocks, that many
  blocks' full-vocab logits at a time, each chunk recomputed in backward (``torch.utils.checkpoint``).
* ``accepted_run``, ``token_rows``, ``drafted_metrics``: the counters of a block (the leading run of
  correct rows; per token row) and DFlash's rates with block row k logged as draft position k - 1.
* ``ShiftedBlocks``: the hooks DSpark, DFlash2 and XPress share over DFlash's: anchors and targets drawn
  once per micro-batch (the normalizer's draw is the loss's), and the draft's forward with the loss's
  heads run inside it.
"""

from __future__ import annotations

import re
import weakref
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .loss import block_targets, build_block_ids, chunked, metrics_from_counts, next_token_labels

__all__ = ["ShiftedLayout", "shifted_targets", "rows_at", "chunked", "accepted_run", "token_rows",
           "drafted_metrics", "DrawnOnce", "ShiftedBlocks"]


class ShiftedLayout:
    """A block config with ``sample_from_anchor`` (and DFlash's ``block_size``): DSpark's, DFlash2's and
    XPress's, mixed in before ``DFlashConfig``."""

    @property
    def shift(self) -> int:
        """1 when row k predicts the token after a + k (sample_from_anchor), else 0."""
        return int(self.sample_from_anchor)

    @property
    def drafts_per_block(self) -> int:
        """Tokens one block of K rows drafts: K anchor-first, K - 1 otherwise."""
        return self.block_size - 1 + self.shift


def shifted_targets(input_ids_BT: torch.Tensor, target_ids_BT: Optional[torch.Tensor], loss_mask_BT: torch.Tensor,
                    anchors_BN: torch.Tensor, keep_BN: torch.Tensor, block_size: int, shift: int,
                    doc_ids_BT: Optional[torch.Tensor] = None):
    """``(labels [B,N,R], valid [B,N,R], prev_pos [B,N,R-1])``: DFlash's labels and counted rows over
    R = K + shift token rows, and for predicted rows 1 .. R-1 the position of the token before each
    (the previous token's and the teacher's row), clamped inside the sequence.
    ``doc_ids_BT``: packed rows; a counted row lies in its anchor's sample (so does its
    previous position; an uncounted one's may not, and weighs 0)."""
    T = input_ids_BT.shape[1]
    R = block_size + shift
    labels = next_token_labels(input_ids_BT, target_ids_BT)
    labels_BNR, valid = block_targets(labels, loss_mask_BT, anchors_BN, keep_BN, R, doc_ids_BT)
    prev_pos = (anchors_BN.unsqueeze(-1) + torch.arange(R - 1, device=anchors_BN.device)).clamp(max=T - 1)
    return labels_BNR, valid, prev_pos


def rows_at(x_BTX: torch.Tensor, pos_BNJ: torch.Tensor) -> torch.Tensor:
    """``x`` at positions ``pos [B, N, J]`` -> ``[B, N, J(, X)]``."""
    B, N, J = pos_BNJ.shape
    flat = pos_BNJ.reshape(B, N * J)
    if x_BTX.dim() == 2:
        return x_BTX.gather(1, flat).view(B, N, J)
    return x_BTX.gather(1, flat.unsqueeze(-1).expand(-1, -1, x_BTX.shape[-1])).view(B, N, J, -1)


def accepted_run(correct: torch.Tensor) -> torch.Tensor:
    """Per predicted row ``[..., J]``: whether it and every predicted row before it in its block are correct."""
    return F.pad(correct, (1, 0), value=True).long().cumprod(-1).bool()[..., 1:]


def token_rows(x: torch.Tensor) -> torch.Tensor:
    """A counter of predicted rows ``[B, N, R-1]`` summed per token row ``[R]`` (row 0, the anchor: zero)."""
    return F.pad(x.detach().float().flatten(0, 1).sum(0), (1, 0))


def drafted_metrics(counts_K4: torch.Tensor, gamma: Optional[float]) -> dict[str, float]:
    """DFlash's rates (``dflash.loss.metrics_from_counts``) with block row k logged as position k - 1, as
    EAGLE-3's ``acc_0`` is its first drafted token, so dashboards and the end-of-run line read both alike."""
    out = {}
    for key, v in metrics_from_counts(counts_K4, gamma).items():
        m = re.fullmatch(r"(loss|acc)_(\d+)", key)
        out[f"{m[1]}_{int(m[2]) - 1}" if m else key] = v
    return out


class DrawnOnce:
    """What a micro-batch's hooks draw (anchors, targets), kept from the normalizer's call for the loss's.
    Keyed by the micro-batch's token-id tensor (held weakly: one gone is never matched; the trainer's fp32
    copy of a batch's features keeps it), the step and whether it trains; once per kind."""

    def __init__(self):
        self._kept: dict = {}

    def __getstate__(self):  # a copy (pickled, deep-copied) keeps nothing: its weak keys do not travel
        return {"_kept": {}}

    def get(self, kind: str, batch, step: int, training: bool, draw: Callable[[], tuple]) -> tuple:
        ids = batch.input_ids_BT
        key = (kind, id(ids), step, training)
        hit = self._kept.get(key)
        if hit is not None and hit[0]() is ids:
            return hit[1]
        self._kept = {k: v for k, v in self._kept.items() if k[2:] == (step, training) and v[0]() is not None}
        value = draw()
        self._kept[key] = (weakref.ref(ids), value)
        return value


class ShiftedBlocks:
    """DFlash's anchors with the shifted block targets and their decay-weighted normalizer, and the loss's
    forward: shared by DSpark, DFlash2 and XPress (mixed in before ``DFlash``), whose heads read the same
    targets."""

    def _targets(self, draft, batch, step: int, training: bool):
        def draw():
            c = draft.config
            anchors, keep, _ = self._anchors(draft, batch, step, training)  # DFlash's, per sample (no ring: refused)
            labels, valid, prev_pos = shifted_targets(batch.input_ids_BT, batch.target_ids_BT, batch.loss_mask_BT,
                                                      anchors, keep, c.block_size, c.shift,
                                                      getattr(batch, "doc_ids_BT", None))
            return anchors, keep, labels, valid, prev_pos

        return self.drawn.get("targets", batch, step, training, draw)  # DFlash.drawn

    def normalizer(self, draft, batch, step: int, *, training: bool) -> torch.Tensor:
        valid = self._targets(draft, batch, step, training)[3]
        return self.weight_sum(valid)  # DFlash.weight_sum

    def _forward_with(self, draft, batch, anchors, keep, normalizer: Optional[torch.Tensor], head_loss: Callable):
        """The draft's forward over the micro-batch's blocks with ``head_loss(module, hidden, normalizer)``
        run inside it (FSDP2 unshards the parameters for it): ``(loss, counts)``. Packed rows: positions
        restart per sample, a block sees its own sample only."""
        c = draft.config
        block_ids = build_block_ids(batch.input_ids_BT, anchors, c.block_size, c.mask_token_id)

        def heads(module, hidden):
            return head_loss(module, hidden, self.loss_normalizer(normalizer, hidden.device))

        return draft(batch.aux_hidden_BTKH, block_ids, anchors, keep, getattr(batch, "position_ids_BT", None),
                     getattr(batch, "doc_ids_BT", None), heads=heads)
