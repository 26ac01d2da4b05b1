"""THE slice rule of sequence parallelism, stdlib arithmetic: the data plane's planner
(``runtime/plan.plan_step``) and the train side (``training/slicing.py``) both import it.

A sequence is padded to a multiple of the parts; slice r owns ``[r*C, (r+1)*C)`` and reads a right
halo of rows past it (how many: the algorithm's ``sp_halo``; EAGLE-3's TTT shifts need
``ttt_length + 1``).
"""

from __future__ import annotations


def slice_bounds(seq_len: int, rank: int, parts: int, halo: int = 0) -> tuple[int, int, int]:
    """``(start, end, window_end)`` of slice ``rank`` of ``parts`` over a sequence padded to a
    multiple of ``parts``: ``C = ceil(seq_len / parts)`` rows each, ``[rank * C, rank * C + C)``
    owned, ``window_end = end + halo``. Any of them may lie past ``seq_len`` (padding). THE slice
    rule of sequence parallelism: the data plane (``plan_step``) and the train side
    (``specforge.training.slicing.sp_slice_batch``) both use it."""
    if parts < 1 or halo < 0:
        raise ValueError(f"slice_bounds: parts must be >= 1 and halo >= 0, got {parts}, {halo}")
    if not 0 <= rank < parts:
        raise ValueError(f"sp_rank {rank} outside 0..{parts - 1}")
    C = -(-seq_len // parts)
    start = rank * C
    return start, start + C, start + C + halo


def split_slices(length: int, parts: int, halo: int = 0, padded_length: int | None = None,
                 offset: int = 0) -> list[tuple[int, int, int]]:
    """The ``parts`` slices ``(start, end, stop)``, in the sample's own tokens, of a sample of
    ``length`` tokens that sits at ``offset`` of a row of ``padded_length`` tokens (default:
    ``offset + length``; a padded micro-batch: offset 0; a packed row, ``train.pack_tokens``: the
    tokens of the samples before it): :func:`slice_bounds` over the row, clipped to the sample's
    tokens (a slice past it is empty, ``start == stop == length``; one before it, ``0 == 0``).
    ``stop = min(end + halo, length)``."""
    T = offset + length if padded_length is None else padded_length
    if T < offset + length or offset < 0:
        raise ValueError(f"split_slices: a sample of {length} tokens at offset {offset} does not fit "
                         f"padded_length {T}")
    out = []
    for r in range(parts):
        out.append(tuple(min(max(x - offset, 0), length) for x in slice_bounds(T, r, parts, halo)))
    return out

