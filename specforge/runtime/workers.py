"""The Ray worker roles: a rollout worker runs the frozen target, a train worker runs THE train step.

    RolloutWorker   target only; per step ONE batched forward over the union of the samples of
                    the DP groups it serves, then p2p sends of each train rank's features.
    TrainWorker     the draft (FSDP2 over the train ranks when there are several); in colocated
                    mode it also holds the target and computes its own features in memory.

Workers are given the run ``Config`` and paths (data cache, vocab file), never data or tensors;
they answer with ``StepReport`` records. Every rank joins one communicator (rollout ranks first,
the data plane) and every rank builds the train ranks' groups with ``ParallelDims.build``
(``dist.new_group`` is collective over the world, so all ranks call it, in the same order).
Sequence parallelism: a DP group is ``sp`` consecutive train ranks; each keeps only its slice
(+ halo) of every sample: received as such (disaggregated), or cut from the features it computed
for the whole sample (colocated: every SP rank of a group runs the target on the same samples).
Legend: B batch, T tokens, H target hidden, N draft vocab.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from specforge.config import Config
from specforge.device import pick_device, set_threads, torch_dtype
from specforge.runtime.actors import DistributedWorker
from specforge.runtime.contracts import StepPlan, StepReport
from specforge.runtime.dataplane import (
    ObjectStoreTransport,
    P2PTransport,
    Prefetcher,
    SendHandle,
    SendWindow,
)
from specforge.train.batch import TrainBatch, collate, pad_id
from specforge.train.slicing import batch_from_samples


@dataclass(frozen=True)
class Layout:
    """Who is who in the communicator (metadata only)."""

    mode: str  # "colocated" | "disaggregated"
    rollout_ranks: tuple[int, ...]  # empty when colocated
    train_ranks: tuple[int, ...]  # in ParallelDims order: DP group g = train_ranks[g*sp:(g+1)*sp]
    vocab_path: str
    mailbox: Optional[str] = None  # object-store transport: name of the mailbox actor


def parallel_dims(cfg: Config):
    """``ParallelDims`` of the train ranks: ``dp = train.num_workers / (sp_ulysses * sp_ring)``."""
    from specforge.parallel.dims import ParallelDims

    sp = cfg.parallel.sp_ulysses * cfg.parallel.sp_ring
    if sp < 1 or cfg.train.num_workers % sp:
        raise ValueError(
            f"config keys 'train.num_workers'={cfg.train.num_workers} and 'parallel.sp_ulysses'="
            f"{cfg.parallel.sp_ulysses} x 'parallel.sp_ring'={cfg.parallel.sp_ring}: the number of train "
            f"workers must be a multiple of the sequence-parallel degree {sp}")
    return ParallelDims(cfg.train.num_workers // sp, cfg.parallel.sp_ulysses, cfg.parallel.sp_ring)


def build_groups(cfg: Config, layout: Layout, my_rank: int, device: torch.device):
    """Every process group / mesh of the train ranks. Collective over the WORLD: every rank
    (rollout ranks too) calls it, in the same order; rollout ranks get None."""
    return parallel_dims(cfg).build(layout.train_ranks, my_rank, cfg.parallel.backend, cfg.parallel.timeout_s, device)


def micro_batches(plan: StepPlan, dp_rank: int, batch_size: int) -> list[list[int]]:
    """This DP rank's samples of the step, ``batch_size`` at a time (training order)."""
    ids = list(plan.group_samples[dp_rank])
    return [ids[s : s + batch_size] for s in range(0, len(ids), batch_size)]


def _open_data(cfg: Config):
    """Re-open the driver's memory-mapped token cache (a cache hit: nothing is re-tokenized)."""
    from specforge.data.prepare import prepare_dataset
    from specforge.models.target import load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    data = prepare_dataset(cfg.data, tokenizer, chat_template=cfg.model.chat_template,
                           cache_dir=cfg.model.cache_dir, progress=False)
    return tokenizer, data


def _transport(cfg: Config, layout: Layout, device: torch.device):
    if cfg.placement.transport == "object_store":
        return ObjectStoreTransport(layout.mailbox, cfg.parallel.timeout_s, rank=dist.get_rank())
    return P2PTransport(device=device)


# ------------------------------------------------------------------------------ rollout


class RolloutWorker(DistributedWorker):
    """The frozen target. ``rollout_step`` returns once the sends are posted, so the worker can
    run ahead of training; its ``SendWindow`` bounds the bytes in flight (backpressure)."""

    def __init__(self, cfg: Config):
        super().__init__(cfg.train.num_threads)
        self.cfg = cfg

    def setup(self, layout: Layout) -> int:
        from specforge.models.target import load_target

        cfg = self.cfg
        set_threads(cfg.train.num_threads)
        self.rank = dist.get_rank()
        device = pick_device(cfg.model.device)
        build_groups(cfg, layout, self.rank, device)  # collective: this rank is in none of them
        self.tokenizer, self.data = _open_data(cfg)
        self.target = load_target(cfg.model, device)
        self.transport = _transport(cfg, layout, self.target.device)
        self.window = SendWindow(int(cfg.placement.max_inflight_mb * 2**20))
        return self.rank

    def rollout_step(self, plan: StepPlan) -> StepReport:
        from specforge.models.target import capture

        ids = plan.batch_of(self.rank)
        t0 = time.perf_counter()
        feats, forwards = {}, 0
        if ids:
            feats = self._forward(ids, capture, torch_dtype(plan.feature_spec.fields[0].dtype))
            forwards = 1
        t1 = time.perf_counter()
        handle = self.transport.send_step(plan, feats, my_rank=self.rank)
        t2 = time.perf_counter()
        # The window holds the features alive until their sends are out (isend reads them).
        kept = SendHandle(handle.wait, handle.nbytes)
        kept.features = feats
        self.window.push(kept)
        t3 = time.perf_counter()
        return StepReport(
            self.rank, plan.step,
            metrics={"forwards": float(forwards), "samples": float(len(ids)),
                     "tokens": float(sum(int(f["input_ids"].shape[0]) for f in feats.values())),
                     "inflight_bytes": float(self.window.inflight_bytes)},
            timings_ms={"forward": (t1 - t0) * 1e3, "send_post": (t2 - t1) * 1e3, "send_wait": (t3 - t2) * 1e3},
            bytes_sent=handle.nbytes,
        )

    @torch.no_grad()
    def _forward(self, ids: Sequence[int], capture, hidden_dtype: torch.dtype) -> dict[int, dict[str, torch.Tensor]]:
        """ONE right-padded target forward over ``ids``; per-sample full-length wire tensors."""
        rows = self.data.train[list(ids)]
        rows = [{"input_ids": a, "loss_mask": b} for a, b in zip(rows["input_ids"], rows["loss_mask"])]
        input_ids_BT, loss_mask_BT, attn_BT = collate(rows, pad_id(self.tokenizer))
        f = capture(self.target, input_ids_BT, attn_BT, self.cfg.model.argmax_chunk_tokens)
        out = {}
        for b, sid in enumerate(ids):
            n = len(rows[b]["input_ids"])
            out[sid] = {
                "aux_hidden": f.aux_hidden_BT3H[b, :n].to(hidden_dtype),
                "last_hidden": f.last_hidden_BTH[b, :n].to(hidden_dtype),
                "target_ids": f.target_ids_BT[b, :n],
                "input_ids": input_ids_BT[b, :n],
                "loss_mask": loss_mask_BT[b, :n].to(torch.int8),
            }
        return out

    def forward_only(self, plan: StepPlan) -> StepReport:
        """Benchmark probe: the rollout stage alone (the batched forward, nothing sent)."""
        from specforge.models.target import capture

        ids = plan.batch_of(self.rank)
        t0 = time.perf_counter()
        feats = self._forward(ids, capture, torch_dtype(plan.feature_spec.fields[0].dtype)) if ids else {}
        tokens = float(sum(int(f["input_ids"].shape[0]) for f in feats.values()))
        return StepReport(self.rank, plan.step, metrics={"tokens": tokens}, timings_ms={"forward": (time.perf_counter() - t0) * 1e3})

    def leave_communicator(self) -> None:
        """Let every posted send leave before the communicator goes (the driver bounds the wait)."""
        if hasattr(self, "window"):
            self.window.drain()
        super().leave_communicator()


# ------------------------------------------------------------------------------ training


class _PlanQueue:
    """The plans a ``Prefetcher`` may post receives for; refilled call by call (a generator
    could not resume after running dry)."""

    def __init__(self):
        self._q: collections.deque[StepPlan] = collections.deque()
        self.last = -1

    def push(self, plans: Sequence[StepPlan]) -> None:
        for p in plans:
            if p.step > self.last:
                self._q.append(p)
                self.last = p.step

    def __iter__(self):
        return self

    def __next__(self) -> StepPlan:
        if not self._q:
            raise StopIteration
        return self._q.popleft()


class TrainWorker(DistributedWorker):
    """A DP rank of the draft. Runs ``DraftTrainer.step`` unchanged; features come from the
    in-process target (colocated) or from the data plane (disaggregated)."""

    def __init__(self, cfg: Config):
        super().__init__(cfg.train.num_threads)
        self.cfg = cfg

    def setup(self, layout: Layout) -> int:
        """Build groups, the draft and its trainer; resume from the newest checkpoint. Returns
        the step to start from."""
        from specforge.data.vocab import load_draft_vocab
        from specforge.models.target import load_target
        from specforge.parallel.parallelize import parallelize_draft, sum_over_train_ranks
        from specforge.train.checkpoint import CheckpointManager
        from specforge.train.trainer import DraftTrainer, build_draft, checkpoint_root, teacher_weight

        cfg = self.cfg
        set_threads(cfg.train.num_threads)
        self.layout, self.rank = layout, dist.get_rank()
        self.device = pick_device(cfg.model.device)
        self.groups = build_groups(cfg, layout, self.rank, self.device)
        self.dp_rank = self.groups.dp_rank  # the DP group = the plan's group index
        self.sp_rank, self.sp_size = self.groups.sp_rank, self.groups.sp_size
        self.colocated = layout.mode == "colocated"
        self.tokenizer, self.data = _open_data(cfg) if self.colocated else (None, None)
        vocab = load_draft_vocab(layout.vocab_path)
        # The draft needs the target's embedding and lm_head (teacher rows of the draft vocab).
        # Disaggregated: load the target once, copy them, drop it. On a GPU that briefly costs a
        # whole target's memory per train rank; at scale read just those two tensors instead.
        target = load_target(cfg.model, self.device)
        if self.tokenizer is None:
            self.tokenizer = target.tokenizer
        draft = build_draft(cfg, target, vocab).to(self.device)
        teacher = teacher_weight(target, vocab)
        self.target = target if self.colocated else None
        del target
        self.draft = parallelize_draft(draft, parallel_dims(cfg), self.groups, cfg)  # SP core swap, FSDP2
        self.trainer = DraftTrainer(draft, teacher, cfg, self.device, reduce_sum=sum_over_train_ranks(self.groups))
        if not self.colocated:
            self.transport = _transport(cfg, layout, self.device)
            self.plans = _PlanQueue()
            self.prefetcher = Prefetcher(self.transport, self.plans, int(cfg.placement.max_inflight_mb * 2**20), my_rank=self.rank)
        self.checkpoints = CheckpointManager(checkpoint_root(cfg), cfg.checkpoint.keep_last,
                                             writer=self.rank == layout.train_ranks[0])  # the FSDP mesh's first rank
        return self.checkpoints.load(self.trainer) if cfg.checkpoint.resume else 0

    # ---------------------------------------------------------------- one step

    def train_step(self, plan: StepPlan, upcoming: Sequence[StepPlan] = (), save: bool = False) -> StepReport:
        t0 = time.perf_counter()
        wait0, recv0 = self._wait_and_bytes()
        batches = self._local_batches(plan) if self.colocated else self._received_batches(plan, upcoming)
        t1 = time.perf_counter()
        wait1, recv1 = self._wait_and_bytes()
        metrics = self._step(batches)
        t2 = time.perf_counter()
        if save:
            self.save()
        timings = {"features": (t1 - t0) * 1e3, "train": metrics.pop("train_ms"), "train_wait": wait1 - wait0,
                   "step": (t2 - t0) * 1e3}
        metrics["tokens_local"] = metrics.pop("tokens")
        return StepReport(self.rank, plan.step, metrics=metrics, timings_ms=timings, bytes_recv=recv1 - recv0)

    def _step(self, batches: list[TrainBatch]) -> dict[str, float]:
        """THE train step on this rank's (SP-local) batches, with the loss normalized by the
        valid count of ALL train ranks."""
        self._last_batches = batches
        return self.trainer.step(batches)

    def train_repeat(self, reps: int) -> StepReport:
        """Benchmark probe: the train stage alone, on the last step's already-received features."""
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            m = self._step(self._last_batches)
            times.append((time.perf_counter() - t0) * 1e3)
        return StepReport(self.rank, -1, metrics={"tokens_local": m["tokens"]}, timings_ms={f"train_{i}": t for i, t in enumerate(times)})

    def _wait_and_bytes(self) -> tuple[float, int]:
        if self.colocated:
            return 0.0, 0
        return self.prefetcher.wait_ms, self.prefetcher.bytes_recv

    def _local_batches(self, plan: StepPlan) -> list[TrainBatch]:
        from specforge.train.slicing import sp_slice_batch
        from specforge.train.trainer import local_batches

        out = []
        for ids in micro_batches(plan, self.dp_rank, self.cfg.train.batch_size):
            rows = [self.data.train[i] for i in ids]
            # SP: the whole samples' features (as every SP rank of the group does), keep the slice
            out += [b if self.sp_size == 1 else sp_slice_batch(b, self.sp_rank, self.sp_size, self.cfg.draft.ttt_length)
                    for b in local_batches(self.target, rows, len(rows), self.cfg.model.argmax_chunk_tokens)]
        return out

    def _received_batches(self, plan: StepPlan, upcoming: Sequence[StepPlan]) -> list[TrainBatch]:
        self.plans.push([plan, *upcoming])  # step k+1's receives get posted before step k runs
        got_plan, fbs = next(self.prefetcher)
        assert got_plan.step == plan.step, (got_plan.step, plan.step)
        pad = pad_id(self.tokenizer)
        lengths = dict(plan.lengths)
        out = []
        for ids in micro_batches(plan, self.dp_rank, self.cfg.train.batch_size):
            T = max(lengths[s] for s in ids)  # the micro-batch's padded length: SP slices split it
            out.append(batch_from_samples([fbs[s] for s in ids], T, pad, self.sp_rank, self.sp_size,
                                          self.cfg.draft.ttt_length))
        return out

    def save(self) -> Optional[str]:
        """Write the newest state (collective over the train ranks; the first one writes)."""
        path = self.checkpoints.save(self.trainer)
        return None if path is None else str(path)
