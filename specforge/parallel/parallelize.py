"""Apply data + sequence parallelism to a plain draft; the one reduction a train step needs.

The whole API (a Ray train worker, or any launcher with a default process group)::

    dims = ParallelDims(dp=..., sp_ulysses=cfg.parallel.sp_ulysses, sp_ring=cfg.parallel.sp_ring)
    groups = dims.build(train_ranks, dist.get_rank(), cfg.parallel.backend, cfg.parallel.timeout_s)
    #   ^ on EVERY rank of the default group (rollout ranks get None back)
    algo = get_algorithm(cfg.draft.algorithm)                     # the runtime looks it up, once
    draft = parallelize_draft(draft, dims, groups, cfg, algo)    # 1. SP core swap, 2. FSDP2
    trainer = DraftTrainer(algo, draft, algo.train_state(cfg, target, vocab), cfg, device,
                           reduce_sum=sum_over_train_ranks(groups))
    # each step, on each train rank, with this SP rank's slice of its DP group's micro-batches
    # (specforge/training/slicing.py says which rows + halo, so a data plane sends only those):
    metrics = trainer.step(local_batches)
    state = full_state_dict(draft)                               # collective; full dict on rank 0

Data assignment: all SP ranks of one DP rank get the SAME samples; each keeps its slice.
Gradients: FSDP shards over all dp*sp train ranks and SUMS gradients (each SP rank's gradient is
its slice's share of the global loss; each DP rank's its samples' share).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from specforge.device import autocast_dtype
from specforge.parallel.dims import ParallelDims, ParallelGroups
from specforge.parallel.fsdp import apply_fsdp, bf16_mp_policy, full_state_dict
from specforge.parallel.sp import apply_sp

__all__ = ["ParallelDims", "ParallelGroups", "parallelize_draft", "mixed_precision", "sum_over_train_ranks",
           "full_state_dict"]


def parallelize_draft(draft: nn.Module, dims: ParallelDims, groups: Optional[ParallelGroups], cfg, algo) -> nn.Module:
    """THE ordered parallelization of the draft (in place; returns it). ``cfg``: the full Config;
    ``algo``: the run's algorithm (its ``sp_cores`` name what sequence parallelism wraps)."""
    if groups is None or dims.world == 1:
        return draft
    # 1. sequence parallel: wrap the attention cores the algorithm names (no parameters, so before sharding)
    if dims.sp > 1:
        apply_sp(draft, algo.sp_cores(draft), groups.ulysses_group, groups.ring_group)
    # 2. FSDP2 over all dp*sp train ranks, gradients summed
    apply_fsdp(draft, groups.fsdp_mesh, mp_policy=mixed_precision(cfg.train.precision, groups.device),
               sum_gradients=True)
    return draft


def mixed_precision(precision: str, device: torch.device):
    """FSDP2's policy for ``train.precision`` on ``device``: bf16 params and compute with fp32
    gradient reduction on a GPU computing in bf16 (the all-gathers move half the bytes); None
    elsewhere: on the CPU the params stay fp32 and autocast does the bf16 compute (the policy
    itself works there too: tests/test_mixed_precision.py runs it on gloo against fp32)."""
    if device.type == "cuda" and autocast_dtype(precision, device) == torch.bfloat16:
        return bf16_mp_policy()
    return None


def sum_over_train_ranks(groups: Optional[ParallelGroups]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> the sum of x over all dp*sp train ranks`` (collective; identity with one rank): the
    ``reduce_sum`` of ``DraftTrainer`` (global valid count, metric counters)."""
    if groups is None or groups.fsdp_group is None:
        return lambda x: x

    def reduce(x: torch.Tensor) -> torch.Tensor:
        y = x.to(groups.device)
        dist.all_reduce(y, group=groups.fsdp_group)
        return y.to(x.device)

    return reduce
