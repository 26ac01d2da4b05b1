"""The one place that checks the parallel degrees and builds every process group / mesh.

Train-rank layout (``train_ranks`` is the ordered list of global ranks that train; the default
group may also hold rollout ranks, which are in no group built here)::

    index = train_ranks.index(rank) = dp_rank * (sp_ring * sp_ulysses) + ring_rank * sp_ulysses + uly_rank
    sp_rank = ring_rank * sp_ulysses + uly_rank      # which contiguous sequence slice the rank owns

Ulysses is innermost (neighbouring ranks: its all-to-all moves the most bytes, so on GPUs it
should stay inside a node), ring next, data parallel outermost. An SP group is a block of
``sp_ring * sp_ulysses`` consecutive train ranks; within it a Ulysses group = the ranks with the
same ``ring_rank``, a ring group = the ranks with the same ``uly_rank``. With this layout the
Ulysses all-to-all leaves each rank with the contiguous sequence range of its Ulysses group,
``[ring_rank * U * C, (ring_rank + 1) * U * C)``: ring block ``ring_rank``, which is what the ring
attention (``ring.py``: block r = the r-th contiguous range) expects.

FSDP shards over ALL train ranks (``dp * sp``; SP ranks hold the same weights and their
gradients are partial sums over their slices, so summing over dp*sp is exactly right):
``groups.fsdp_mesh``; the valid-token count and the metric counters are summed over ``fsdp_group``.
Only groups something uses are built (no separate dp or sp group: nothing reduces over them).

``torch.distributed.new_group`` is collective over the default group: EVERY rank of the default
group (rollout ranks too) must call :meth:`ParallelDims.build` with the same ``train_ranks``;
groups are created in one fixed order (fsdp, ulysses groups, ring groups).
Groups of size 1 are not created (``None``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from specforge.device import pick_backend, pick_device

__all__ = ["ParallelDims", "ParallelGroups"]


@dataclass(frozen=True)
class ParallelGroups:
    """What one train rank needs: its coordinates and its groups (``None`` = size 1)."""

    dims: "ParallelDims"
    rank: int  # global rank
    dp_rank: int
    ring_rank: int
    uly_rank: int
    device: torch.device
    fsdp_group: Optional[dist.ProcessGroup]  # all train ranks
    fsdp_mesh: Optional[object]  # DeviceMesh over fsdp_group (None with one train rank)
    ulysses_group: Optional[dist.ProcessGroup]
    ring_group: Optional[dist.ProcessGroup]

    @property
    def sp_rank(self) -> int:
        return self.ring_rank * self.dims.sp_ulysses + self.uly_rank

    @property
    def sp_size(self) -> int:
        return self.dims.sp


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of data parallelism and of the two sequence-parallel flavours."""

    dp: int = 1
    sp_ulysses: int = 1
    sp_ring: int = 1

    def __post_init__(self):
        for name in ("dp", "sp_ulysses", "sp_ring"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"parallel degree {name}={v!r}: expected an integer >= 1")

    @classmethod
    def from_config(cls, cfg) -> "ParallelDims":
        """The train ranks' degrees of a run ``Config``: ``dp = train.num_workers / (sp_ulysses * sp_ring)``."""
        sp = cfg.parallel.sp_ulysses * cfg.parallel.sp_ring
        if sp < 1 or cfg.train.num_workers % sp:
            raise ValueError(
                f"config keys 'train.num_workers'={cfg.train.num_workers} and 'parallel.sp_ulysses'="
                f"{cfg.parallel.sp_ulysses} x 'parallel.sp_ring'={cfg.parallel.sp_ring}: the number of train "
                f"workers must be a multiple of the sequence-parallel degree {sp}")
        return cls(cfg.train.num_workers // sp, cfg.parallel.sp_ulysses, cfg.parallel.sp_ring)

    def check_heads(self, num_heads: int) -> None:
        """Ulysses splits the draft's attention heads over ``sp_ulysses`` ranks. Heads that do not
        divide are padded with zero heads (``sp.py``, exact); more ranks than heads would leave
        ranks that hold padding only."""
        if self.sp_ulysses > num_heads:
            raise ValueError(
                f"config key 'parallel.sp_ulysses'={self.sp_ulysses} exceeds the draft's {num_heads} attention heads "
                f"(Ulysses splits heads over its ranks); use at most {num_heads}, or parallel.sp_ring for the rest")

    @property
    def sp(self) -> int:
        return self.sp_ulysses * self.sp_ring

    @property
    def world(self) -> int:
        return self.dp * self.sp

    def coords(self, index: int) -> tuple[int, int, int]:
        """Train-rank index -> (dp_rank, ring_rank, uly_rank) (see the module docstring)."""
        dp_rank, rest = divmod(index, self.sp)
        ring_rank, uly_rank = divmod(rest, self.sp_ulysses)
        return dp_rank, ring_rank, uly_rank

    def _rank_lists(self, train_ranks: Sequence[int]) -> list[list[int]]:
        """Every group's ranks, in the one creation order all ranks follow."""
        U, R, S = self.sp_ulysses, self.sp_ring, self.sp
        idx = lambda d, r, u: train_ranks[d * S + r * U + u]  # noqa: E731
        lists = [list(train_ranks)]  # fsdp
        lists += [[idx(d, r, u) for u in range(U)] for d in range(self.dp) for r in range(R)]  # ulysses
        lists += [[idx(d, r, u) for r in range(R)] for d in range(self.dp) for u in range(U)]  # ring
        return lists

    def build(
        self,
        train_ranks: Sequence[int],
        my_rank: int,
        backend: str = "auto",
        timeout_s: float = 300.0,
        device: Optional[torch.device] = None,
    ) -> Optional[ParallelGroups]:
        """Create the groups. Call on EVERY rank of the default group, same arguments except
        ``my_rank``; returns this rank's :class:`ParallelGroups`, or ``None`` on a non-train rank."""
        train_ranks = [int(r) for r in train_ranks]
        if len(train_ranks) != self.world or len(set(train_ranks)) != len(train_ranks):
            raise ValueError(
                f"{len(train_ranks)} train ranks {train_ranks} (distinct?) for dp={self.dp} x "
                f"sp_ring={self.sp_ring} x sp_ulysses={self.sp_ulysses} = {self.world}"
            )
        device = device or pick_device("auto", my_rank)
        backend = pick_backend(backend, device)
        timeout = timedelta(seconds=timeout_s)
        mine: list[Optional[dist.ProcessGroup]] = []
        for ranks in self._rank_lists(train_ranks):
            group = None
            if len(ranks) > 1:  # collective: every rank of the default group takes part
                group = dist.new_group(ranks, timeout=timeout, backend=backend)
            if my_rank in ranks:
                mine.append(group)
        if my_rank not in train_ranks:
            return None
        fsdp, uly_g, ring_g = mine
        mesh = None
        if fsdp is not None:
            mesh = DeviceMesh.from_group(fsdp, device.type)
        dp_rank, ring_rank, uly_rank = self.coords(train_ranks.index(my_rank))
        return ParallelGroups(self, my_rank, dp_rank, ring_rank, uly_rank, device, fsdp, mesh, uly_g, ring_g)
