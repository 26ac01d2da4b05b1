"""Apply data + sequence parallelism to a plain draft, and the per-step helpers a train rank needs.

The whole API (a Ray train worker, or any launcher with a default process group)::

    dims = ParallelDims(dp=..., sp_ulysses=cfg.parallel.sp_ulysses, sp_ring=cfg.parallel.sp_ring)
    groups = dims.build(train_ranks, dist.get_rank(), cfg.parallel.backend, cfg.parallel.timeout_s)
    #   ^ on EVERY rank of the default group (rollout ranks get None back)
    draft = parallelize_draft(draft, dims, groups, cfg)          # 1. SP core swap, 2. FSDP2
    trainer = DraftTrainer(draft, teacher, cfg, device, loss_fn=ttt_loss_fn(draft))
    # each step, on each train rank, with the full (or halo-sliced) batches of its DP rank:
    local = [sp_local_batch(b, groups, L) for b in batches]      # this SP rank's rows + halo
    n = global_valid_count(local, draft.t2d, L, groups)          # valid rows over dp*sp ranks
    metrics = trainer.step(local, num_valid_global=n, all_reduce_counts=counts_reducer(groups))
    state = full_state_dict(draft)                               # collective; full dict on rank 0

Data assignment: all SP ranks of one DP rank get the SAME samples; each keeps its slice
(``sp_slice_bounds`` says which rows + halo, so a data plane can send only those).
Gradients: FSDP shards over all dp*sp train ranks and SUMS gradients (each SP rank's gradient is
its slice's share of the global loss; each DP rank's its samples' share).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from specforge.device import autocast_dtype
from specforge.parallel.dims import ParallelDims, ParallelGroups
from specforge.parallel.fsdp import apply_fsdp, bf16_mp_policy, full_state_dict, ttt_loss_fn
from specforge.parallel.sp import apply_sp, sp_slice_batch, sp_slice_bounds
from specforge.train.batch import TrainBatch
from specforge.train.ttt import num_valid_rows

__all__ = [
    "ParallelDims",
    "ParallelGroups",
    "parallelize_draft",
    "sp_local_batch",
    "sp_slice_bounds",
    "global_valid_count",
    "counts_reducer",
    "ttt_loss_fn",
    "full_state_dict",
]


def parallelize_draft(draft: nn.Module, dims: ParallelDims, groups: Optional[ParallelGroups], cfg) -> nn.Module:
    """THE ordered parallelization of the draft (in place; returns it). ``cfg``: the full Config."""
    if groups is None or dims.world == 1:
        return draft
    # 1. sequence parallel: swap the TTT attention core (no parameters, so before sharding)
    if dims.sp > 1:
        apply_sp(draft, groups.ulysses_group, groups.ring_group)
    # 2. FSDP2 over all dp*sp train ranks, gradients summed
    mp = None
    if groups.device.type == "cuda" and autocast_dtype(cfg.train.precision, groups.device) == torch.bfloat16:
        mp = bf16_mp_policy()
    apply_fsdp(draft, groups.fsdp_mesh, mp_policy=mp, sum_gradients=True)
    return draft


def sp_local_batch(batch: TrainBatch, groups: Optional[ParallelGroups], ttt_length: int) -> TrainBatch:
    """This rank's slice (owned rows + halo) of a full batch; the batch itself without SP."""
    if groups is None or groups.sp_size == 1:
        return batch
    return sp_slice_batch(batch, groups.sp_rank, groups.sp_size, ttt_length)


def _all_reduce_sum(x: torch.Tensor, groups: Optional[ParallelGroups]) -> torch.Tensor:
    if groups is None or groups.fsdp_group is None:
        return x
    y = x.to(groups.device)
    dist.all_reduce(y, group=groups.fsdp_group)
    return y.to(x.device)


def global_valid_count(batches: Sequence[TrainBatch], t2d: torch.Tensor, ttt_length: int,
                       groups: Optional[ParallelGroups]) -> int:
    """Step-0 valid rows summed over this rank's batches and all dp*sp train ranks (collective)."""
    local = sum(num_valid_rows(b, t2d, ttt_length) for b in batches)
    return int(_all_reduce_sum(torch.tensor([float(local)], dtype=torch.float64), groups).item())


def counts_reducer(groups: Optional[ParallelGroups]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``all_reduce_counts`` for ``DraftTrainer.step``: sums metric counters over train ranks."""
    return lambda counts: _all_reduce_sum(counts, groups)
