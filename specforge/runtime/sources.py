"""Where a train rank's features come from: one feature source per train worker, picked at setup.

The interface (duck-typed; the train step never asks which source it has)::

    source.next_batches(plan, upcoming=()) -> list[TrainBatch]
        this rank's micro-batches of ``plan`` (``plan.micro_batches[dp_rank]``, padded to
        ``plan.padded_lengths[dp_rank]``, as its SP rank holds them), in training order;
        ``upcoming`` = the plans that follow, which a source may start fetching now
    source.wait_ms, source.bytes_recv   time blocked on, and bytes from, a data plane so far

    CaptureSource   colocated (and single process): the in-process target computes the features
    ReceiveSource   disaggregated: rollout workers send them over the data plane
    StoreSource     offline: read from the feature store (memory-mapped shards)

``build_source`` is the one place that picks (docs/ARCHITECTURE.md: how an offline store plugs in).
"""

from __future__ import annotations

import collections
from typing import Sequence

import torch

from specforge.config import Config
from specforge.runtime.contracts import Layout, StepPlan
from specforge.runtime.dataplane import ObjectStoreTransport, P2PTransport, Prefetcher
from specforge.train.batch import TrainBatch, pad_id
from specforge.train.slicing import WholeSample, batch_from_samples, sp_slice_batch


def open_data(cfg: Config):
    """Re-open the driver's memory-mapped token cache (a cache hit: nothing is re-tokenized)."""
    from specforge.data.prepare import prepare_dataset
    from specforge.models.target import load_tokenizer

    return prepare_dataset(cfg.data, load_tokenizer(cfg.model), chat_template=cfg.model.chat_template,
                           cache_dir=cfg.model.cache_dir, progress=False)


def build_transport(cfg: Config, layout: Layout, rank: int, device: torch.device):
    """The data plane of a rollout or train rank: p2p on the communicator (every wait bounded by
    ``parallel.timeout_s``), or the object-store baseline."""
    if cfg.placement.transport == "object_store":
        return ObjectStoreTransport(layout.mailbox, cfg.parallel.timeout_s, rank=rank)
    return P2PTransport(device=device, timeout_s=cfg.parallel.timeout_s)


def build_source(cfg: Config, layout: Layout, groups, target, rank: int):
    """THE choice of a train rank's feature source (``groups``: its ``ParallelGroups``)."""
    if layout.mode == "colocated":
        return CaptureSource(target, open_data(cfg), groups, cfg)
    if layout.mode == "offline":
        return StoreSource(open_store(cfg, target), groups, cfg, pad_id(target.tokenizer))
    return ReceiveSource(build_transport(cfg, layout, rank, groups.device), groups, rank, cfg, pad_id(target.tokenizer))


def open_store(cfg: Config, target):
    """The feature store, refused (naming the field) if it was made by another target, tokenizer,
    aux layers or max_length than this run's."""
    from specforge.data.store import FeatureStore, store_meta, store_root

    store = FeatureStore(store_root(cfg))
    FeatureStore(store_root(cfg), expect=store_meta(cfg, target, source=store.meta.source))
    return store


class StoreSource:
    """Offline: sample index i of a plan is the i-th sample of the store's split (``store_split``),
    read memory-mapped; several epochs are just steps past the first pass (data order = f(seed, step))."""

    wait_ms, bytes_recv = 0.0, 0  # no data plane

    def __init__(self, store, groups, cfg: Config, pad: int):
        from specforge.runtime.plan import store_split

        self.store, self.groups, self.pad, self.ttt_length = store, groups, pad, cfg.draft.ttt_length
        self.split = store_split(store, cfg)

    def next_batches(self, plan: StepPlan, upcoming: Sequence[StepPlan] = ()) -> list[TrainBatch]:
        ids, g = self.split[plan.split], self.groups
        return [batch_from_samples([WholeSample(self.store.read(ids[i])) for i in micro], T, self.pad, g.sp_rank,
                                   g.sp_size, self.ttt_length)
                for micro, T in zip(plan.micro_batches[g.dp_rank], plan.padded_lengths[g.dp_rank])]


class CaptureSource:
    """The in-process target runs over each micro-batch (every SP rank of a group runs the whole
    samples and keeps its slice)."""

    wait_ms, bytes_recv = 0.0, 0  # no data plane

    def __init__(self, target, data, groups, cfg: Config):
        self.target, self.data, self.groups = target, data, groups
        self.ttt_length, self.chunk = cfg.draft.ttt_length, cfg.model.argmax_chunk_tokens

    def next_batches(self, plan: StepPlan, upcoming: Sequence[StepPlan] = ()) -> list[TrainBatch]:
        from specforge.train.trainer import local_batches

        rows, g = getattr(self.data, plan.split), self.groups
        out = []
        for ids in plan.micro_batches[g.dp_rank]:
            (b,) = local_batches(self.target, [rows[i] for i in ids], len(ids), self.chunk)
            out.append(b if g.sp_size == 1 else sp_slice_batch(b, g.sp_rank, g.sp_size, self.ttt_length))
        return out


class _PlanQueue:
    """The plans a ``Prefetcher`` may post receives for, each once; refilled call by call (a
    generator could not resume after running dry)."""

    def __init__(self):
        self._q: collections.deque[StepPlan] = collections.deque()
        self._seen: collections.deque[tuple[str, int]] = collections.deque(maxlen=16)

    def push(self, plans: Sequence[StepPlan]) -> None:
        for p in plans:
            if (p.split, p.step) not in self._seen:
                self._q.append(p)
                self._seen.append((p.split, p.step))

    def __iter__(self):
        return self

    def __next__(self) -> StepPlan:
        if not self._q:
            raise StopIteration
        return self._q.popleft()


class ReceiveSource:
    """Features over the data plane; the next plan's receives are posted before this one's
    batches are handed out (double buffering), within ``placement.max_inflight_mb``."""

    def __init__(self, transport, groups, rank: int, cfg: Config, pad: int):
        self.groups, self.pad, self.ttt_length = groups, pad, cfg.draft.ttt_length
        self.plans = _PlanQueue()
        self.prefetcher = Prefetcher(transport, self.plans, int(cfg.placement.max_inflight_mb * 2**20), my_rank=rank)

    def abort(self, why: str) -> None:
        """A rollout peer died (the driver says so): receives not yet complete fail (``PeerLost``)."""
        self.prefetcher.transport.completion.abort(why)

    @property
    def aborted(self) -> bool:
        return self.prefetcher.transport.completion.aborted

    @property
    def wait_ms(self) -> float:
        return self.prefetcher.wait_ms

    @property
    def bytes_recv(self) -> int:
        return self.prefetcher.bytes_recv

    def next_batches(self, plan: StepPlan, upcoming: Sequence[StepPlan] = ()) -> list[TrainBatch]:
        self.plans.push([plan, *upcoming])
        got, fbs = next(self.prefetcher)
        assert (got.split, got.step) == (plan.split, plan.step), (got.split, got.step, plan.split, plan.step)
        g = self.groups
        return [batch_from_samples([fbs[s] for s in ids], T, self.pad, g.sp_rank, g.sp_size, self.ttt_length)
                for ids, T in zip(plan.micro_batches[g.dp_rank], plan.padded_lengths[g.dp_rank])]
