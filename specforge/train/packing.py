"""Packing (``train.pack_tokens``): a rank's samples laid end to end in rows of at most that many tokens.

Real chat data is short and uneven: a micro-batch padded to its longest sample wastes most of its
rows, and on a GPU a row of a few hundred tokens runs matrices too small to fill it. With packing
the trainer takes the step's micro-batches of this rank (whole samples, whatever source brought
them), strips their right padding and lays the samples end to end in rows of at most
``train.pack_tokens`` tokens, in order (a new row starts when the next sample would not fit); each
row is one micro-batch of batch size 1 with no padding at all.

Each sample keeps what makes its loss its own (the algorithm's loss reads these fields):

* ``position_ids_BT``: its RoPE positions restart at 0;
* ``doc_ids_BT``: which sample a token belongs to (0, 1, ... along the row): the attention cores
  let no query see another sample's keys, and the loss counts no row whose shifted target (or
  input token) lies in the next sample;
* its loss mask, ids and features, copied as they were.

The loss is a sum over samples normalized by the global count of counted rows, so regrouping the
same samples into other micro-batches leaves it unchanged: packed equals unpacked (exact up to the
order of float sums; ``tests/test_packing.py``). Packing is deterministic in the step's micro-batches,
so exact resume is unaffected; the planner, the data plane and the store still move samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specforge.models.features import TrainBatch

__all__ = ["PackedBatch", "pack_micro_batches", "pack_rows"]

_TOKEN_FIELDS = ("input_ids_BT", "loss_mask_BT", "aux_hidden_BTKH", "last_hidden_BTH", "target_ids_BT")


@dataclass
class PackedBatch(TrainBatch):
    """One packed row (B = 1): samples end to end, each with positions from 0 and its own doc id."""

    position_ids_BT: torch.Tensor
    doc_ids_BT: torch.Tensor  # (TrainBatch.to moves these two as well: it rebuilds type(self) from its fields)


def pack_rows(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Sample indices per row, in order: a new row starts when the next sample would not fit."""
    rows: list[list[int]] = []
    used = budget
    for i, n in enumerate(lengths):
        if n > budget:
            raise ValueError(f"config key 'train.pack_tokens'={budget}: a sample of {n} tokens does not fit one row; "
                             "raise train.pack_tokens to at least data.max_length")
        if used + n > budget:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


def pack_micro_batches(micro_batches: Sequence[TrainBatch], budget: int) -> list[PackedBatch]:
    """The samples of ``micro_batches`` (whole samples with ``length_B`` recorded) packed into rows
    of at most ``budget`` tokens, each row its own micro-batch."""
    samples = []  # (micro-batch, row, length)
    for mb in micro_batches:
        if mb.length_B is None:
            raise RuntimeError("train.pack_tokens: a micro-batch without length_B (its source did not record the "
                               "samples' lengths); packing needs whole samples")
        samples += [(mb, b, int(n)) for b, n in enumerate(mb.length_B.tolist())]
    out = []
    for row in pack_rows([n for _, _, n in samples], budget):
        parts = [samples[i] for i in row]
        cat = {name: torch.cat([getattr(mb, name)[b, :n] for mb, b, n in parts])[None] for name in _TOKEN_FIELDS}
        device = cat["input_ids_BT"].device
        pos = torch.cat([torch.arange(n, device=device) for _, _, n in parts])[None]
        doc = torch.cat([torch.full((n,), d, dtype=torch.long, device=device) for d, (_, _, n) in enumerate(parts)])[None]
        total = sum(n for _, _, n in parts)
        out.append(PackedBatch(**cat, position_ids_BT=pos, doc_ids_BT=doc,
                               length_B=torch.tensor([total])))  # device: host (metadata, TrainBatch.length_B)
    return out
