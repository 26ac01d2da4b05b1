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
from typing import Optional, Sequence

import torch

from specforge.contracts import row_offsets
from specforge.data.packing import packed_rows
from specforge.models.features import TrainBatch
from specforge.parallel.bounds import slice_bounds

__all__ = ["SPTrainBatch", "PackedBatch", "PackedSPTrainBatch", "WholeSample", "slice_bounds", "sp_slice_batch",
           "batch_from_samples", "pack_micro_batches"]


@dataclass
class PackedBatch(TrainBatch):
    """One packed row (B = 1, ``train.pack_tokens``; ``data/packing.py``): samples end to end, each
    with positions from 0 and its own doc id."""

    position_ids_BT: torch.Tensor
    doc_ids_BT: torch.Tensor  # (TrainBatch.to moves these two as well: it rebuilds type(self) from its fields)


@dataclass
class SPTrainBatch(TrainBatch):
    """One SP rank's slice: owned rows + right halo (see ``specforge/algorithms/eagle3/loss.py``)."""

    position_ids_BT: torch.Tensor  # B x num_rows, global positions start + t
    num_rows: int
    start: int

    def to(self, device: torch.device) -> "SPTrainBatch":
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        moved.update({k: v.to(device) for k, v in moved.items() if isinstance(v, torch.Tensor)})
        return type(self)(**moved)

    @property
    def num_tokens(self) -> int:  # owned tokens (padding rows included)
        return int(self.input_ids_BT.shape[0] * self.num_rows)


@dataclass
class PackedSPTrainBatch(SPTrainBatch):
    """One SP rank's slice of a packed row (``train.pack_tokens``; B = 1): ``position_ids_BT`` restart
    at 0 per sample, ``doc_ids_BT`` (rows ``[start, start + len(input_ids))``, owned + halo) say
    which sample a row belongs to (rows past the row's tokens: one more id, a padding sample)."""

    doc_ids_BT: torch.Tensor


SAMPLE_FIELDS = {"input_ids": "input_ids_BT", "loss_mask": "loss_mask_BT", "aux_hidden": "aux_hidden_BTKH",
           "last_hidden": "last_hidden_BTH", "target_ids": "target_ids_BT"}  # sample field -> batch field


class WholeSample(dict):
    """A whole sample (its tokens start at 0) as ``batch_from_samples`` takes it: a stored one, or a
    row of a full batch."""

    start = 0


def sp_slice_batch(batch: TrainBatch, sp_rank: int, sp_size: int, halo: int,
                   packed: Optional[Sequence[int]] = None) -> SPTrainBatch:
    """This SP rank's :class:`SPTrainBatch` of a full right-padded ``batch`` (batch size any):
    each row is a whole sample of the padded length, assembled like any other. ``packed``: the
    rows' lengths, whose samples a packed plan lays end to end in ONE row (``PackedSPTrainBatch``;
    ``sp_size`` 1: the whole ``PackedBatch``)."""
    B, T = batch.input_ids_BT.shape
    cut = [T] * B if packed is None else packed
    rows = [WholeSample({k: getattr(batch, f)[b, :n] for k, f in SAMPLE_FIELDS.items()}) for b, n in enumerate(cut)]
    if packed is None:
        return _sp_batch(rows, T, 0, sp_rank, sp_size, halo)
    return _packed_batch(rows, row_offsets(cut), sum(cut), 0, sp_rank, sp_size, halo)


def batch_from_samples(samples: Sequence, padded_length: int, pad_id: int, sp_rank: int = 0, sp_size: int = 1,
                       halo: int = 0, offsets: Optional[Sequence[int]] = None) -> TrainBatch:
    """One micro-batch of samples padded to ``padded_length`` tokens, as SP rank ``sp_rank`` of
    ``sp_size`` holds it: a plain ``TrainBatch`` without SP, else this rank's ``SPTrainBatch``.

    ``samples[b]``: a mapping of the ``FeatureSpec.hidden_states`` field names to tensors of tokens
    ``[s.start, s.start + n)`` (e.g. a received ``FeatureBatch``: a slice + halo; or a whole
    sample, start 0). Equal to ``sp_slice_batch`` of the full right-padded micro-batch: pad id
    inside the padded length, zeros past it. The tensors are copied (receive buffers are reused).

    ``offsets`` (a packed plan, ``StepPlan.row_offsets``): the samples are ONE row of
    ``padded_length`` tokens, sample d starting at ``offsets[d]`` (its ``s.start`` counts from
    there): a ``PackedBatch`` without SP, else this rank's ``PackedSPTrainBatch``.
    """
    T = padded_length
    if offsets is not None:
        return _packed_batch(samples, offsets, T, pad_id, sp_rank, sp_size, halo)
    if sp_size == 1:
        lengths = [min(s.start + s["input_ids"].shape[0], T) for s in samples]
        return TrainBatch(**_fields(samples, T, pad_id, 0, T, T),
                          length_B=torch.tensor(lengths))  # device: host (metadata, TrainBatch.length_B)
    return _sp_batch(samples, T, pad_id, sp_rank, sp_size, halo)


def pack_micro_batches(micro_batches: Sequence[TrainBatch], budget: int) -> list[PackedBatch]:
    """The samples of right-padded ``micro_batches`` (``length_B`` recorded) laid out in the packed
    rows of ``budget`` tokens (``data/packing.packed_rows``), each row its own micro-batch: what a
    packed plan's source hands over, made from padded batches (tests, benchmarks)."""
    samples, lengths = [], []
    for mb in micro_batches:
        if mb.length_B is None:
            raise RuntimeError("train.pack_tokens: a micro-batch without length_B (its source did not record the "
                               "samples' lengths); packing needs whole samples")
        for b, n in enumerate(mb.length_B.tolist()):
            samples.append(WholeSample({k: getattr(mb, f)[b, :n] for k, f in SAMPLE_FIELDS.items()}))
            lengths.append(int(n))
    return [batch_from_samples([samples[i] for i in row.samples], row.tokens, 0, offsets=row.offsets)
            for row in packed_rows(lengths, budget)]


def _sp_batch(samples: Sequence, T: int, pad_id: int, sp_rank: int, sp_size: int, halo: int) -> SPTrainBatch:
    start, end, wend = slice_bounds(T, sp_rank, sp_size, halo)
    pos = torch.arange(start, end, device=samples[0]["input_ids"].device).expand(len(samples), end - start)
    return SPTrainBatch(**_fields(samples, T, pad_id, start, end, wend), position_ids_BT=pos, num_rows=end - start,
                        start=start)


def _packed_batch(samples: Sequence, offsets: Sequence[int], T: int, pad_id: int, sp_rank: int, sp_size: int,
                  halo: int) -> TrainBatch:
    """The samples end to end in one row of ``T`` tokens (``batch_from_samples`` with ``offsets``)."""
    if len(offsets) != len(samples):
        raise ValueError(f"batch_from_samples: {len(offsets)} offsets for {len(samples)} samples")
    start, end, wend = slice_bounds(T, sp_rank, sp_size, halo) if sp_size > 1 else (0, T, T)
    place = [(0, o) for o in offsets]
    got = _fields(samples, T, pad_id, start, end, wend, place)
    device = got["input_ids_BT"].device
    rows = torch.arange(start, start + got["input_ids_BT"].shape[1], device=device)
    # sample d holds rows [offsets[d], offsets[d + 1]); rows past T get id len(samples) (padding)
    firsts = torch.tensor([*offsets, T], device=device)
    doc_ids_BT = torch.searchsorted(firsts[1:], rows, right=True)[None]
    pos = rows - firsts[doc_ids_BT[0]]
    if sp_size == 1:
        return PackedBatch(**got, position_ids_BT=pos[None], doc_ids_BT=doc_ids_BT,
                           length_B=torch.tensor([T]))  # device: host (metadata, TrainBatch.length_B)
    return PackedSPTrainBatch(**got, position_ids_BT=pos[None, : end - start], num_rows=end - start, start=start,
                              doc_ids_BT=doc_ids_BT)


def _fields(samples: Sequence, T: int, pad_id: int, start: int, end: int, wend: int,
            place: Optional[Sequence[tuple[int, int]]] = None) -> dict[str, torch.Tensor]:
    """Batch rows ``[start, end)`` (aux) and ``[start, wend)`` (the rest) of the samples padded to ``T``.
    ``place[i] = (batch row, offset)`` of sample i (default: row i, offset 0; packed: row 0, its offset)."""
    place = [(b, 0) for b in range(len(samples))] if place is None else place
    B = 1 + max(b for b, _ in place)

    def stack(name: str, stop: int, fill) -> torch.Tensor:
        first = samples[0][name]
        dtype = first.dtype if first.is_floating_point() else torch.long
        out = torch.zeros((B, stop - start, *first.shape[1:]), dtype=dtype, device=first.device)
        if fill:
            out[:, : max(0, T - start)] = fill
        for (b, o), s in zip(place, samples):
            first_row = o + s.start  # the row position of the sample's first received token
            lo, hi = max(first_row, start), min(first_row + s[name].shape[0], stop)
            if hi > lo:
                out[b, lo - start : hi - start] = s[name][lo - first_row : hi - first_row]
        return out

    return {f: stack(k, end if k == "aux_hidden" else wend, pad_id if k == "input_ids" else 0)
            for k, f in SAMPLE_FIELDS.items()}
