"""Packing (``train.pack_tokens``): a rank's samples laid end to end in rows of at most that many tokens.

Real chat data is short and uneven: a micro-batch padded to its longest sample wastes most of its
rows, and on a GPU a row of a few hundred tokens runs matrices too small to fill it. With packing a
rank's samples of a step are laid end to end, in order, in rows of at most ``train.pack_tokens``
tokens (THE rule: :func:`pack_rows`; a new row starts when the next sample would not fit); each row
is one micro-batch of batch size 1 with no padding at all.

:func:`packed_rows` makes the rows of every placement, once, from the samples' lengths: the step
planner (``runtime/plan.plan_step``) calls it for the single process, colocated, disaggregated and
offline placements alike, so a packed plan's micro-batches ARE the rows; the data plane sends each
rank its part of each sample and the sources assemble the row (``training/slicing.batch_from_samples``
with the row's offsets; with sequence parallelism the row is what is sliced over the group's ranks,
``PackedSPTrainBatch``, and the SP cores gather the sample ids). The train step gets its micro-batches
in their final layout and never asks whether they are packed. ``training/slicing.pack_micro_batches``
lays padded batches out the same way (tests and benchmarks), and :func:`target_packs` gives the target
forward's packed rows (``rollout.pack_tokens``) by the same rule.

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

from dataclasses import dataclass
from typing import Optional, Sequence

from specforge.contracts import row_offsets

__all__ = ["PackedRow", "pack_rows", "packed_rows", "row_offsets", "target_packs"]


@dataclass(frozen=True)
class PackedRow:
    """One packed row: which samples (indices into the lengths it was made from, in order), where
    each starts in the row, and the row's tokens (no padding)."""

    samples: tuple[int, ...]
    offsets: tuple[int, ...]
    tokens: int


def pack_rows(lengths: Sequence[int], budget: int, key: str = "train.pack_tokens") -> list[list[int]]:
    """THE packing rule (``train.pack_tokens``; ``rollout.pack_tokens``'s target rows too, ``key``):
    sample indices per row, in order; a new row starts when the next sample would not fit ``budget`` tokens."""
    rows: list[list[int]] = []
    used = budget
    for i, n in enumerate(lengths):
        if n > budget:
            raise ValueError(f"config key {key!r}={budget}: a sample of {n} tokens does not fit one row; "
                             f"raise {key} to at least data.max_length")
        if used + n > budget:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


def packed_rows(lengths: Sequence[int], budget: int) -> list[PackedRow]:
    """The packed rows of samples of ``lengths`` (``train.pack_tokens`` = ``budget``), for every placement."""
    out = []
    for row in pack_rows(lengths, budget):
        size = [lengths[i] for i in row]
        out.append(PackedRow(tuple(row), tuple(row_offsets(size)), sum(size)))
    return out


def target_packs(attention_mask_BT, pack_tokens: Optional[int]) -> Optional[list[list[int]]]:
    """``rollout.pack_tokens``: the rows of a right-padded batch per packed target forward, by the
    same rule as the train rows (what ``models.target.capture`` takes as ``packs``); None: padded."""
    if pack_tokens is None:
        return None
    return pack_rows(attention_mask_BT.sum(dim=1).tolist(), pack_tokens, key="rollout.pack_tokens")
