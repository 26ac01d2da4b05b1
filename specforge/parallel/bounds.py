"""THE slice rule of sequence parallelism, stdlib arithmetic: the data plane's planner
(``runtime/contracts.plan_step``) and the train side (``train/slicing.py``) both import it.

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
    (``specforge.train.slicing.sp_slice_batch``) both use it."""
    if parts < 1 or halo < 0:
        raise ValueError(f"slice_bounds: parts must be >= 1 and halo >= 0, got {parts}, {halo}")
    if not 0 <= rank < parts:
        raise ValueError(f"sp_rank {rank} outside 0..{parts - 1}")
    C = -(-seq_len // parts)
    start = rank * C
    return start, start + C, start + C + halo


def split_slices(length: int, parts: int, halo: int = 0, padded_length: int | None = None) -> list[tuple[int, int, int]]:
    """The ``parts`` slices ``(start, end, stop)`` of a sample of ``length`` tokens that sits in a
    micro-batch padded to ``padded_length`` (default: ``length``): :func:`slice_bounds` over the
    padded length, clipped to the tokens that exist (a slice in the padding is empty,
    ``start == stop == length``). ``stop = min(end + halo, length)``."""
    T = length if padded_length is None else padded_length
    if T < length:
        raise ValueError(f"split_slices: padded_length {T} < length {length}")
    out = []
    for r in range(parts):
        start, end, wend = slice_bounds(T, r, parts, halo)
        out.append((min(start, length), min(end, length), min(wend, length)))
    return out
