"""Packing (``train.pack_tokens``): a rank's samples laid end to end in rows of at most that many tokens.

Real chat data is short and uneven: a micro-batch padded to its longest sample wastes most of its
rows, and on a GPU a row of a few hundred tokens runs matrices too small to fill it. With packing a
rank's samples of a step are laid end to end, in order, in rows of at most ``train.pack_tokens``
tokens (THE rule: ``parallel/bounds.pack_rows``; a new row starts when the next sample would not
fit); each row is one micro-batch of batch size 1 with no padding at all. Two places pack by it:

* the Ray placements' planner (``runtime/plan.plan_step``): a plan's micro-batches ARE the
  rows, the data plane sends each rank its part of each sample, and the sources assemble the row
  (``training/slicing.batch_from_samples`` with offsets); with sequence parallelism the row is what
  is sliced over the group's ranks (``PackedSPTrainBatch``; the SP cores gather the sample ids);
* the single process (``python -m specforge.train``): the trainer packs the padded micro-batches
  its capture made (``pack_micro_batches``; a source's packed rows pass through as they are).

Each sample keeps what makes its loss its own (the algorithm's loss reads these fields):

* ``position_ids_BT``: its RoPE positions restart at 0;
* ``doc_ids_BT``: which sample a token belongs to (0, 1, ... along the row): the attention cores
  let no query see another sample's keys, and the loss counts no row whose shifted target (or
  input token) lies in the next sample;
* its loss mask, ids and features, copied as they were.

Every algorithm packs (its ``packs`` flag): EAGLE-3, EAGLE-3.1 and P-EAGLE through the TTT loss and
attention cores above; DFlash and DSpark keep a block, its labels and its anchor inside one sample,
let a block see its own sample's context only, and draw each sample's random anchors as a function
of the sample (``algorithms/dflash/loss.anchor_keys``), so a sample draws the same anchors packed or
not. With sequence parallelism only EAGLE-3 and EAGLE-3.1 pack (``packs_sp``).

The loss is a sum over samples normalized by the global count of counted rows, so regrouping the
same samples into other micro-batches leaves it unchanged: packed equals unpacked (exact up to the
order of float sums; ``tests/test_packing.py``, ``tests/test_packing_blocks.py``, with SP
``tests/test_packing_sp.py``). Packing is a pure function of the step's samples in order, so exact
resume is unaffected (``test_a_packed_run_resumes_exactly``); the store keeps samples.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from specforge.contracts import row_offsets
from specforge.models.features import TrainBatch
from specforge.parallel.bounds import pack_rows
from specforge.training.slicing import SAMPLE_FIELDS, PackedBatch, WholeSample, batch_from_samples

__all__ = ["PackedBatch", "pack_micro_batches", "pack_rows", "target_packs"]


def target_packs(attention_mask_BT: torch.Tensor, pack_tokens: Optional[int]) -> Optional[list[list[int]]]:
    """``rollout.pack_tokens``: the rows of a right-padded batch per packed target forward, by the
    same rule as the train rows (what ``models.target.capture`` takes as ``packs``); None: padded."""
    if pack_tokens is None:
        return None
    return pack_rows(attention_mask_BT.sum(dim=1).tolist(), pack_tokens, key="rollout.pack_tokens")


def pack_micro_batches(micro_batches: Sequence[TrainBatch], budget: int) -> list[PackedBatch]:
    """The samples of ``micro_batches`` (whole samples with ``length_B`` recorded) packed into rows
    of at most ``budget`` tokens, each row its own micro-batch."""
    samples, lengths = [], []
    for mb in micro_batches:
        if mb.length_B is None:
            raise RuntimeError("train.pack_tokens: a micro-batch without length_B (its source did not record the "
                               "samples' lengths); packing needs whole samples")
        for b, n in enumerate(mb.length_B.tolist()):
            samples.append(WholeSample({k: getattr(mb, f)[b, :n] for k, f in SAMPLE_FIELDS.items()}))
            lengths.append(int(n))
    out = []
    for row in pack_rows(lengths, budget):
        size = [lengths[i] for i in row]
        out.append(batch_from_samples([samples[i] for i in row], sum(size), 0, offsets=row_offsets(size)))
    return out
