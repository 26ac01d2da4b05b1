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
import dataclasses
import time
from typing import Sequence

import torch
import torch.distributed as dist

from specforge.config import Config
from specforge.contracts import Layout, StepPlan
from specforge.data.prepare import prepare_dataset
from specforge.data.store import FeatureStore, check_store_target, fingerprint_kind, store_meta, store_root
from specforge.models.features import TrainBatch
from specforge.models.target import load_tokenizer
from specforge.registry import bound_algorithm
from specforge.runtime.completion import Completion
from specforge.runtime.dataplane import ObjectStoreTransport, P2PTransport, Prefetcher
from specforge.runtime.plan import ReplayStores, open_offline_store, store_split
from specforge.training.batch import collate, pad_id
from specforge.training.slicing import WholeSample, batch_from_samples, sp_slice_batch
from specforge.training.trainer import local_batches


def _halo(cfg: Config) -> int:
    """Rows past its slice a sequence-parallel rank reads (the algorithm's ``sp_halo``)."""
    return bound_algorithm(cfg).sp_halo()


def open_data(cfg: Config):
    """Re-open the driver's memory-mapped token cache (a cache hit: nothing is re-tokenized)."""
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
        S = groups.sp_size
        peers = [layout.train_ranks[groups.dp_rank * S + j] for j in range(S)]  # train index = dp_rank * S + sp_rank
        return CaptureSource(target, open_data(cfg), groups, cfg, peers=peers)
    if layout.mode == "offline":
        return StoreSource(open_store(cfg, target), groups, cfg, pad_id(target.tokenizer))
    return ReceiveSource(build_transport(cfg, layout, rank, groups.device), groups, rank, cfg, pad_id(target.tokenizer))


def open_store(cfg: Config, target):
    """The feature store (with ``store.replay_dir``'s beside it), refused (naming the field) if it
    was made by another target, tokenizer, aux layers or max_length than this run's. Each store's target
    fingerprint is compared in the kind it recorded (``target_fingerprint``)."""
    found = FeatureStore(store_root(cfg)).meta
    store = open_offline_store(cfg, expect=store_meta(cfg, target, source=found.source, like=found.target))
    # a reference store of the run's store's kind was compared with it (check_replay_meta), so with this
    # target too; one of the other kind is held against the target itself
    if isinstance(store, ReplayStores) and fingerprint_kind(store.ref.meta.target) != fingerprint_kind(found.target):
        check_store_target(store.ref, target, "store.replay_dir")
    return store


class StoreSource:
    """Offline: sample index i of a plan is the i-th sample of the store's split (``store_split``),
    read memory-mapped; several epochs are just steps past the first pass (data order = f(seed, step))."""

    wait_ms, bytes_recv = 0.0, 0  # no data plane

    def __init__(self, store, groups, cfg: Config, pad: int):
        self.store, self.groups, self.pad, self.halo = store, groups, pad, _halo(cfg)
        self.split = store_split(store, cfg)

    def next_batches(self, plan: StepPlan, upcoming: Sequence[StepPlan] = ()) -> list[TrainBatch]:
        ids, g = self.split[plan.split], self.groups
        return [batch_from_samples([WholeSample(self.store.read(ids[i])) for i in micro], T, self.pad, g.sp_rank,
                                   g.sp_size, self.halo, plan.row_offsets(micro))
                for micro, T in zip(plan.micro_batches[g.dp_rank], plan.padded_lengths[g.dp_rank])]


class CaptureSource:
    """The in-process target runs over each micro-batch. With sequence parallelism the target runs
    once per SP group, not on every SP rank: micro-batch m is captured by SP rank m mod P, which
    keeps its own slice and sends each other rank its slice (features only: every rank collates
    the ids and loss mask of the rows itself). One exchange per step, every send and receive in one
    ``batch_isend_irecv`` (under NCCL, transfers in separate batches run in stream order, and two
    ranks each receiving before they send would wait on each other for ever)."""

    wait_ms, bytes_recv = 0.0, 0  # time blocked on / bytes from the SP exchange

    def __init__(self, target, data, groups, cfg: Config, peers: Sequence[int] = ()):
        self.target, self.data, self.groups = target, data, groups
        self.halo, self.chunk, self.pack = _halo(cfg), cfg.model.argmax_chunk_tokens, cfg.rollout.pack_tokens
        self.peers = list(peers)  # global rank of each SP rank of this rank's group
        self.captured = 0  # micro-batches this rank ran the target over
        if groups is not None and groups.sp_size > 1:
            if len(self.peers) != groups.sp_size:
                raise ValueError(f"CaptureSource: {len(self.peers)} SP peers for sp_size={groups.sp_size}")
            self.completion = Completion.for_group(cfg.parallel.timeout_s)

    def next_batches(self, plan: StepPlan, upcoming: Sequence[StepPlan] = ()) -> list[TrainBatch]:
        rows, g = getattr(self.data, plan.split), self.groups
        ids_m = plan.micro_batches[g.dp_rank]
        micro = [[rows[i] for i in ids] for ids in ids_m]
        # a packed plan: each micro-batch's samples end to end in one row (captured padded, then laid out)
        packed = [[len(rows[i]["input_ids"]) for i in ids] if plan.packed else None for ids in ids_m]
        if g.sp_size == 1:
            self.captured += len(micro)
            full = [local_batches(self.target, r, len(r), self.chunk, self.pack)[0] for r in micro]
            return [b if p is None else sp_slice_batch(b, 0, 1, 0, p) for b, p in zip(full, packed)]
        return self._sp_exchange(plan, micro, packed)

    def _sp_exchange(self, plan: StepPlan, micro: list, packed: list) -> list[TrainBatch]:
        S, me = self.groups.sp_size, self.groups.sp_rank
        out, ops = [], []
        for m, rows_m in enumerate(micro):
            owner = m % S
            if owner == me:
                (full,) = local_batches(self.target, rows_m, len(rows_m), self.chunk, self.pack)
                self.captured += 1
                shapes = self._meta_batch(rows_m)
                for r in range(S):
                    part = sp_slice_batch(full, r, S, self.halo, packed[m])
                    if r == me:
                        out.append(part)
                        continue
                    want = sp_slice_batch(shapes, r, S, self.halo, packed[m])
                    for name in _FEATURES:  # the receiver's buffers are made from the same shapes
                        t, w = getattr(part, name), getattr(want, name)
                        if t.shape != w.shape or t.dtype != w.dtype:
                            raise RuntimeError(f"SP capture exchange: {name} is {t.dtype} {tuple(t.shape)}, the "
                                               f"receivers expect {w.dtype} {tuple(w.shape)}")
                        ops.append(dist.P2POp(dist.isend, t.contiguous(), self.peers[r]))
            else:
                shell = sp_slice_batch(self._meta_batch(rows_m), me, S, self.halo, packed[m])
                bufs = {name: torch.empty(getattr(shell, name).shape, dtype=getattr(shell, name).dtype,
                                          device=self.target.device) for name in _FEATURES}
                ops += [dist.P2POp(dist.irecv, bufs[name], self.peers[owner]) for name in _FEATURES]
                self.bytes_recv += sum(b.numel() * b.element_size() for b in bufs.values())
                out.append(dataclasses.replace(shell, **bufs))
        t0 = time.perf_counter()
        self.completion.finish(self.completion.post(ops), f"{plan.split} step {plan.step}: SP capture exchange")
        self.wait_ms += 1000 * (time.perf_counter() - t0)
        return out

    def _meta_batch(self, rows_m: list) -> TrainBatch:
        """These rows' batch with real ids and loss mask and the features as ``meta`` tensors of the
        shapes and dtypes the capture gives (nothing computed): sliced, what each SP rank receives."""
        ids, mask, _ = collate(rows_m, pad_id(self.target.tokenizer))
        B, T = ids.shape
        H = self.target.config.hidden_size
        dtype = self.target.model.get_input_embeddings().weight.dtype
        meta = dict(device="meta", dtype=dtype)
        return TrainBatch(ids, mask, torch.empty(B, T, len(self.target.aux_layer_ids) * H, **meta),
                          torch.empty(B, T, H, **meta), torch.empty(B, T, dtype=torch.long, device="meta"))


_FEATURES = ("aux_hidden_BTKH", "last_hidden_BTH", "target_ids_BT")  # what the SP exchange sends


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
        self.groups, self.pad, self.halo = groups, pad, _halo(cfg)
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
        return [batch_from_samples([fbs[s] for s in ids], T, self.pad, g.sp_rank, g.sp_size, self.halo,
                                   plan.row_offsets(ids))
                for ids, T in zip(plan.micro_batches[g.dp_rank], plan.padded_lengths[g.dp_rank])]
