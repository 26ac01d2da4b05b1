"""Data order and collation (the batch type itself, ``TrainBatch``, is ``models/features.py``'s).

Data order is a pure function of (seed, epoch, step), so a resumed run, the single-process
trainer and every distributed placement see the same samples at the same step.
Legend: B batch, T tokens, H target hidden.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch


def epoch_order(num_samples: int, seed: int, epoch: int) -> list[int]:
    """A permutation of sample indices that depends only on (seed, epoch)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=g).tolist()  # device: host (the data order)


def global_batch_ids(num_samples: int, global_batch: int, seed: int, step: int) -> list[int]:
    """Sample ids of optimizer-step ``step`` (all DP ranks and micro-batches together)."""
    return stream_ids(num_samples, seed, step * global_batch, global_batch)


def stream_ids(num_samples: int, seed: int, start: int, count: int) -> list[int]:
    """Positions ``[start, start + count)`` of the endless stream of epochs (each ``epoch_order``).

    Epochs follow each other without a partial last batch (it rolls over into the next epoch).
    A batch that rolls over holds no sample twice while the data allows it (a plan needs distinct
    samples per DP group): the next epoch's samples already in the batch are passed over.
    """
    if num_samples < 1:
        raise ValueError("no training samples")
    ids: list[int] = []
    epoch, offset = divmod(start, num_samples)
    while len(ids) < count:
        order = epoch_order(num_samples, seed, epoch)[offset:]
        taken = set(ids)
        order = [i for i in order if i not in taken] + [i for i in order if i in taken]
        ids.extend(order[: count - len(ids)])
        epoch, offset = epoch + 1, 0
    return ids


def replayed_before(share: float, global_batch: int, step: int) -> int:
    """Replayed samples in the steps before ``step``: floor(share * global_batch * step), so any K
    consecutive steps replay share * global_batch * K samples, within one."""
    return math.floor(share * global_batch * step)


def replay_batch_ids(num_own: int, num_replay: int, share: float, global_batch: int, seed: int,
                     step: int) -> list[int]:
    """``global_batch_ids`` of a run that replays a reference store: indices ``< num_own`` are the
    run's own samples, ``num_own + j`` the j-th replayed one. Each side is its own endless stream of
    epochs (the reference's with another seed) and step ``step`` takes the next
    ``replayed_before(step + 1) - replayed_before(step)`` replayed samples, spread evenly through
    the batch (every DP group gets its part): a pure function of (seed, step)."""
    r0, r1 = (replayed_before(share, global_batch, s) for s in (step, step + 1))
    ref = [num_own + j for j in stream_ids(num_replay, seed + _REPLAY_SEED, r0, r1 - r0)] if r1 > r0 else []
    own = stream_ids(num_own, seed, step * global_batch - r0, global_batch - len(ref))
    slots = {(k * global_batch) // len(ref) + global_batch // (2 * len(ref)) for k in range(len(ref))} if ref else set()
    own_it, ref_it = iter(own), iter(ref)
    return [next(ref_it) if k in slots else next(own_it) for k in range(global_batch)]


_REPLAY_SEED = 7_919  # the replayed stream's seed offset (its order is independent of the run's own)


def split_for_ranks(ids: Sequence[int], dp_size: int, grad_accum: int) -> list[list[list[int]]]:
    """``ids`` -> [dp_rank][micro_step] -> sample ids (contiguous, equal shares)."""
    per_rank = len(ids) // dp_size
    assert per_rank * dp_size == len(ids) and per_rank % grad_accum == 0
    micro = per_rank // grad_accum
    return [
        [list(ids[r * per_rank + m * micro : r * per_rank + (m + 1) * micro]) for m in range(grad_accum)]
        for r in range(dp_size)
    ]


def pad_id(tokenizer) -> int:
    """The id right padding uses: the tokenizer's pad token, else 0 (padding is never in the loss)."""
    return tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0


def collate(rows: Sequence[dict], pad_id: int) -> tuple[torch.Tensor, ...]:
    """Rows with ``input_ids``/``loss_mask`` -> right-padded (input_ids, loss_mask, attention_mask)."""
    T = max(len(r["input_ids"]) for r in rows)
    # on the host, all of it: the trainer moves each micro-batch once (DraftTrainer.on_device)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)  # device: host
    mask = torch.zeros((len(rows), T), dtype=torch.long)  # device: host
    attn = torch.zeros((len(rows), T), dtype=torch.long)  # device: host
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.as_tensor(r["input_ids"], dtype=torch.long)  # device: host
        mask[i, :n] = torch.as_tensor(r["loss_mask"], dtype=torch.long)  # device: host
        attn[i, :n] = 1
    return ids, mask, attn
