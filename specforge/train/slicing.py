"""Sequence-parallel slicing: the slice rule, the SP batch type, and building a rank's batch.

THE rule (``sp_slice_bounds``; stdlib, in ``runtime/contracts.py`` because the planner that cuts
the data-plane transfers uses it too): a micro-batch padded to ``T`` tokens is padded further to
a multiple of ``sp_size``; SP rank r owns rows ``[r*C, (r+1)*C)``, ``C = ceil(T / sp_size)``, and
also reads a right halo of ``ttt_length + 1`` rows (the TTT shifts). ``specforge/train/ttt.py``
says how the loss treats such a slice.

Two ways to a rank's batch, equal by construction (the SP placement tests check it):

* ``sp_slice_batch``: cut a full ``TrainBatch`` (features computed in process for whole samples);
* ``batch_from_samples``: assemble per-sample feature windows (received slices + halo, or whole
  samples read from disk) into this rank's ``TrainBatch`` / ``SPTrainBatch``.

Legend: B batch, T tokens, H target hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import torch

from specforge.runtime.contracts import sp_slice_bounds
from specforge.train.batch import TrainBatch

__all__ = ["SPTrainBatch", "sp_slice_bounds", "sp_slice_batch", "batch_from_samples"]


@dataclass
class SPTrainBatch(TrainBatch):
    """One SP rank's slice: owned rows + right halo (see ``specforge/train/ttt.py``)."""

    position_ids_BT: torch.Tensor  # B x num_rows, global positions start + t
    num_rows: int
    start: int

    def to(self, device: torch.device) -> "SPTrainBatch":
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        moved.update({k: v.to(device) for k, v in moved.items() if isinstance(v, torch.Tensor)})
        return SPTrainBatch(**moved)

    @property
    def num_tokens(self) -> int:  # owned tokens (padding rows included)
        return int(self.input_ids_BT.shape[0] * self.num_rows)


def _rows(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    part = x[:, start:stop]
    missing = (stop - start) - part.shape[1]
    if missing > 0:
        part = torch.cat([part, part.new_zeros(part.shape[0], missing, *part.shape[2:])], dim=1)
    return part


def sp_slice_batch(batch: TrainBatch, sp_rank: int, sp_size: int, ttt_length: int) -> SPTrainBatch:
    """This SP rank's :class:`SPTrainBatch` of a full right-padded ``batch`` (batch size any)."""
    B, T = batch.input_ids_BT.shape
    start, end, wend = sp_slice_bounds(T, sp_rank, sp_size, ttt_length)
    pos = torch.arange(start, end, device=batch.input_ids_BT.device).expand(B, end - start)
    return SPTrainBatch(
        input_ids_BT=_rows(batch.input_ids_BT, start, wend),
        loss_mask_BT=_rows(batch.loss_mask_BT, start, wend),  # zero past the end: never counted
        aux_hidden_BT3H=_rows(batch.aux_hidden_BT3H, start, end),
        last_hidden_BTH=_rows(batch.last_hidden_BTH, start, wend),
        target_ids_BT=_rows(batch.target_ids_BT, start, wend),
        position_ids_BT=pos,
        num_rows=end - start,
        start=start,
    )


def batch_from_samples(samples: Sequence, padded_length: int, pad_id: int, sp_rank: int = 0, sp_size: int = 1,
                       ttt_length: int = 0) -> TrainBatch:
    """One micro-batch of samples padded to ``padded_length`` tokens, as SP rank ``sp_rank`` of
    ``sp_size`` holds it: a plain ``TrainBatch`` without SP, else this rank's ``SPTrainBatch``.

    ``samples[b]``: a mapping of the ``FeatureSpec.eagle3`` field names to tensors of tokens
    ``[s.start, s.start + n)`` (e.g. a received ``FeatureBatch``: a slice + halo; or a whole
    sample, start 0). Equal to ``sp_slice_batch`` of the full right-padded micro-batch: pad id
    inside the padded length, zeros past it. The tensors are copied (receive buffers are reused).
    """
    T, B = padded_length, len(samples)
    start, end, wend = (0, T, T) if sp_size == 1 else sp_slice_bounds(T, sp_rank, sp_size, ttt_length)

    def stack(name: str, stop: int, fill, dtype=None) -> torch.Tensor:
        first = samples[0][name]
        out = torch.zeros((B, stop - start, *first.shape[1:]), dtype=dtype or first.dtype, device=first.device)
        if fill:
            out[:, : max(0, T - start)] = fill
        for b, s in enumerate(samples):
            lo, hi = max(s.start, start), min(s.start + s[name].shape[0], stop)
            if hi > lo:
                out[b, lo - start : hi - start] = s[name][lo - s.start : hi - s.start]
        return out

    batch = dict(
        input_ids_BT=stack("input_ids", wend, pad_id, torch.long),
        loss_mask_BT=stack("loss_mask", wend, 0, torch.long),
        aux_hidden_BT3H=stack("aux_hidden", end, 0),
        last_hidden_BTH=stack("last_hidden", wend, 0),
        target_ids_BT=stack("target_ids", wend, 0, torch.long),
    )
    if sp_size == 1:
        return TrainBatch(**batch)
    pos = torch.arange(start, end, device=batch["input_ids_BT"].device).expand(B, end - start)
    return SPTrainBatch(**batch, position_ids_BT=pos, num_rows=end - start, start=start)
