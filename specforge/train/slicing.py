"""Sequence-parallel slicing: the slice rule, the SP batch type, and building a rank's batch.

THE rule (``slice_bounds``; stdlib, in ``parallel/bounds.py`` because the planner that cuts
the data-plane transfers uses it too): a micro-batch padded to ``T`` tokens is padded further to
a multiple of ``sp_size``; SP rank r owns rows ``[r*C, (r+1)*C)``, ``C = ceil(T / sp_size)``, and
also reads a right halo of ``halo`` rows (the algorithm's ``sp_halo``: EAGLE-3's TTT shifts need
``ttt_length + 1``; ``algorithms/eagle3/loss.py`` says how its loss treats such a slice).

Two ways to a rank's batch, equal by construction (the SP placement tests check it):

* ``sp_slice_batch``: cut a full ``TrainBatch`` (features computed in process for whole samples);
* ``batch_from_samples``: assemble per-sample feature windows (received slices + halo, or whole
  samples read from disk) into this rank's ``TrainBatch`` / ``SPTrainBatch``.

Both assemble through ``_fields`` (a full batch's rows are whole samples of its padded length).

Legend: B batch, T tokens, H target hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import torch

from specforge.models.features import TrainBatch
from specforge.parallel.bounds import slice_bounds

__all__ = ["SPTrainBatch", "WholeSample", "slice_bounds", "sp_slice_batch", "batch_from_samples"]


@dataclass
class SPTrainBatch(TrainBatch):
    """One SP rank's slice: owned rows + right halo (see ``specforge/algorithms/eagle3/loss.py``)."""

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


_FIELDS = {"input_ids": "input_ids_BT", "loss_mask": "loss_mask_BT", "aux_hidden": "aux_hidden_BTKH",
           "last_hidden": "last_hidden_BTH", "target_ids": "target_ids_BT"}  # sample field -> batch field


class WholeSample(dict):
    """A whole sample (its tokens start at 0) as ``batch_from_samples`` takes it: a stored one, or a
    row of a full batch."""

    start = 0


def sp_slice_batch(batch: TrainBatch, sp_rank: int, sp_size: int, halo: int) -> SPTrainBatch:
    """This SP rank's :class:`SPTrainBatch` of a full right-padded ``batch`` (batch size any):
    each row is a whole sample of the padded length, assembled like any other."""
    B, T = batch.input_ids_BT.shape
    rows = [WholeSample({k: getattr(batch, f)[b] for k, f in _FIELDS.items()}) for b in range(B)]
    return _sp_batch(rows, T, 0, sp_rank, sp_size, halo)


def batch_from_samples(samples: Sequence, padded_length: int, pad_id: int, sp_rank: int = 0, sp_size: int = 1,
                       halo: int = 0) -> TrainBatch:
    """One micro-batch of samples padded to ``padded_length`` tokens, as SP rank ``sp_rank`` of
    ``sp_size`` holds it: a plain ``TrainBatch`` without SP, else this rank's ``SPTrainBatch``.

    ``samples[b]``: a mapping of the ``FeatureSpec.hidden_states`` field names to tensors of tokens
    ``[s.start, s.start + n)`` (e.g. a received ``FeatureBatch``: a slice + halo; or a whole
    sample, start 0). Equal to ``sp_slice_batch`` of the full right-padded micro-batch: pad id
    inside the padded length, zeros past it. The tensors are copied (receive buffers are reused).
    """
    T = padded_length
    if sp_size == 1:
        lengths = [min(s.start + s["input_ids"].shape[0], T) for s in samples]
        return TrainBatch(**_fields(samples, T, pad_id, 0, T, T),
                          length_B=torch.tensor(lengths))  # device: host (metadata, TrainBatch.length_B)
    return _sp_batch(samples, T, pad_id, sp_rank, sp_size, halo)


def _sp_batch(samples: Sequence, T: int, pad_id: int, sp_rank: int, sp_size: int, halo: int) -> SPTrainBatch:
    start, end, wend = slice_bounds(T, sp_rank, sp_size, halo)
    pos = torch.arange(start, end, device=samples[0]["input_ids"].device).expand(len(samples), end - start)
    return SPTrainBatch(**_fields(samples, T, pad_id, start, end, wend), position_ids_BT=pos, num_rows=end - start,
                        start=start)


def _fields(samples: Sequence, T: int, pad_id: int, start: int, end: int, wend: int) -> dict[str, torch.Tensor]:
    """Batch rows ``[start, end)`` (aux) and ``[start, wend)`` (the rest) of the samples padded to ``T``."""
    B = len(samples)

    def stack(name: str, stop: int, fill) -> torch.Tensor:
        first = samples[0][name]
        dtype = first.dtype if first.is_floating_point() else torch.long
        out = torch.zeros((B, stop - start, *first.shape[1:]), dtype=dtype, device=first.device)
        if fill:
            out[:, : max(0, T - start)] = fill
        for b, s in enumerate(samples):
            lo, hi = max(s.start, start), min(s.start + s[name].shape[0], stop)
            if hi > lo:
                out[b, lo - start : hi - start] = s[name][lo - s.start : hi - s.start]
        return out

    return {f: stack(k, end if k == "aux_hidden" else wend, pad_id if k == "input_ids" else 0) for k, f in _FIELDS.items()}
