"""The Ray worker roles: a rollout worker runs the frozen target, a train worker runs THE train step.

    RolloutWorker   target only; per step ONE batched forward over the union of the samples of
                    the DP groups it serves, then p2p sends of each train rank's features.
    TrainWorker     the draft (FSDP2 over the train ranks when there are several) and the feature
                    source picked at setup (``runtime/sources.py``); it never asks which one.

Workers are given the run ``Config`` and paths (data cache, vocab file), never data or tensors;
they answer with ``StepReport`` records and execute ``StepPlan``s without deriving anything.
Every rank joins one communicator (rollout ranks first, the data plane) and every rank builds
the train ranks' groups with ``ParallelDims.build`` (``dist.new_group`` is collective over the
world, so all ranks call it, in the same order).
A rank whose feature source fails (a rollout peer died: gloo reports the closed connection at
once) must not enter the step's collectives alone: every train rank first agrees, in one tiny
all-reduce over the train ranks, that all of them have their features (``TrainWorker._features``);
if one does not, all raise ``FeaturesLost`` at the same step and stay there, still consistent,
so the driver can save that state and replace the rollout side (``ray_train.recover``).
Legend: B batch, T tokens, H target hidden.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from specforge import failpoints
from specforge.config import Config
from specforge.contracts import MAX_STEPS_AHEAD, Layout, StepPlan, StepReport
from specforge.data.packing import target_packs
from specforge.data.vocab import load_draft_vocab
from specforge.device import StageClock, bind, pick_device, set_threads, synchronize
from specforge.models.features import TrainBatch, feature_flags, refuse_bad_features
from specforge.models.target import capture, engine_rows, load_target
from specforge.models.vllm_engine import EngineError, die_with_engine, engine_factory
from specforge.parallel.dims import ParallelDims
from specforge.parallel.parallelize import parallelize_draft, sum_over_train_ranks
from specforge.registry import bound_algorithm, feature_layers
from specforge.runtime.actors import DistributedWorker, control
from specforge.runtime.dataplane import SendHandle, SendWindow, wire_features
from specforge.runtime.sources import build_source, build_transport, open_data
from specforge.training.batch import collate, pad_id
from specforge.training.checkpoint import CheckpointManager
from specforge.training.init_from import apply_init_from, resumed_checkpoint
from specforge.training.trainer import DraftTrainer, checkpoint_root, run_identity


class FeaturesLost(RuntimeError):
    """A train rank (this or another) could not get a plan's features; no rank trained that plan."""


class FeaturesUnreadable(FeaturesLost, ValueError):
    """This rank's own read failed on bad input the user fixes (a corrupt or missing store shard): one
    ``error:`` line from the entry point, not a traceback."""


class FeaturesRefused(ValueError):
    """A plan's features hold NaN or inf, or a captured layer is all zeros, on some train rank: every
    train rank raises it at the same step, before any of them trained on them (``check_batches``)."""


def check_batches(batches: Sequence[TrainBatch], num_layers: int, device: torch.device) -> torch.Tensor:
    """``models.features.feature_flags`` of a rank's micro-batches, summed, on ``device`` (no host
    read): whatever computed them (a rollout worker, this rank's capture, a store, an engine), the
    train ranks check what they train on. Real tokens: ``length_B``'s where recorded (a padded
    capture's padding is the target's states of pad tokens), else every position (received and
    stored samples are zeros past their length)."""
    total = torch.zeros(2 * num_layers + 1, dtype=torch.float64, device=device)
    for b in batches:
        aux = b.aux_hidden_BTKH
        real = None
        if b.length_B is not None and b.length_B.shape[0] == aux.shape[0]:
            real = torch.arange(aux.shape[1])[None, :] < b.length_B[:, None]  # device: host (metadata), moved below
        total += feature_flags(aux, real, num_layers).to(device)
    return total


def build_groups(cfg: Config, layout: Layout, my_rank: int, device: torch.device):
    """Every process group / mesh of the train ranks. Collective over the WORLD: every rank
    (rollout ranks too) calls it, in the same order; rollout ranks get None."""
    dims = ParallelDims.from_config(cfg)
    return dims.build(layout.train_ranks, my_rank, cfg.parallel.backend, cfg.parallel.timeout_s, device)


# ------------------------------------------------------------------------------ rollout


@dataclasses.dataclass
class _Batch:
    """A rollout worker's batch of one plan, collated; ``pending``: its engine requests, once asked."""

    key: tuple
    ids: Sequence[int]
    lengths: list[int]
    input_ids_BT: torch.Tensor
    loss_mask_BT: torch.Tensor
    attn_BT: torch.Tensor
    pending: Optional[list] = None


class RolloutWorker(DistributedWorker):
    """The frozen target. ``rollout_step`` returns once the sends are posted, so the worker can
    run ahead of training; its ``SendWindow`` bounds the bytes in flight (backpressure).

    With an engine that computes on devices of its own (``VllmEngine.computes_apart``: vLLM on GPUs) the
    worker is a pipeline, not a batch barrier: before it waits for a plan's hidden states it asks for the
    next plan's (``upcoming``, the loop's look-ahead), so the engine prefills those while this worker
    reads, norms, argmaxes and sends. The engine client's pool (``handoff.MAX_INFLIGHT`` requests, what the
    hand-off folder is sized for) bounds what is in flight, whatever the padded batch's size; the next
    plan's requests queue behind this one's."""

    _ahead: Optional[_Batch] = None  # the next plan's batch, its requests already sent

    def __init__(self, cfg: Config):
        super().__init__(cfg.train.num_threads)
        self.cfg = cfg

    def setup(self, layout: Layout) -> int:
        cfg = self.cfg
        set_threads(cfg.train.num_threads)
        self.rank = dist.get_rank()
        device = pick_device(cfg.model.device)
        bind(device)
        build_groups(cfg, layout, self.rank, device)  # collective: this rank is in none of them
        self.data = open_data(cfg)
        # over model.num_gpus GPUs when one cannot hold it; device (the first of them) gets the features
        self.target = load_target(cfg.model, layers=lambda n: feature_layers(cfg, n),
                                  packed=cfg.rollout.pack_tokens is not None, engine_for=engine_factory(cfg),
                                  head_only=True)
        self.transport = build_transport(cfg, layout, self.rank, self.target.device)
        self.device = self.target.device
        self.window = SendWindow(int(cfg.placement.max_inflight_mb * 2**20))
        return self.rank

    def rollout_step(self, plan: StepPlan, upcoming: Sequence[StepPlan] = ()) -> StepReport:
        forwards0, clock = self.target.forwards, StageClock(self.device)
        clock.mark("start")
        feats = self._forward(plan, upcoming)
        clock.mark("forward")  # no sync: the sends are posted behind the forward (stream order on NCCL)
        t1 = time.perf_counter()
        handle = self.transport.send_step(plan, feats, my_rank=self.rank)
        t2 = time.perf_counter()
        # The window holds the features alive until their sends are out (isend reads them); its
        # waits return when the sends completed (runtime/completion.py), on NCCL too.
        kept = SendHandle(handle.wait, handle.nbytes)
        kept.features = feats
        self.window.push(kept)
        t3 = time.perf_counter()
        return StepReport(
            self.rank, plan.step,
            metrics={"forwards": float(self.target.forwards - forwards0), "samples": float(len(feats)),
                     "tokens": float(sum(int(f["input_ids"].shape[0]) for f in feats.values())),
                     "inflight_bytes": float(self.window.inflight_bytes)},
            # forward: the device's time between the marks (read now, the sends already posted)
            timings_ms={"forward": clock.ms("start", "forward"), "send_post": (t2 - t1) * 1e3,
                        "send_wait": (t3 - t2) * 1e3},
            bytes_sent=handle.nbytes,
        )

    def _batch(self, plan: StepPlan) -> Optional[_Batch]:
        """This worker's batch of ``plan``, collated (host data); None when it has no samples."""
        ids = plan.batch_of(self.rank)
        if not ids:
            return None
        rows = getattr(self.data, plan.split)[list(ids)]
        rows = [{"input_ids": a, "loss_mask": b} for a, b in zip(rows["input_ids"], rows["loss_mask"])]
        input_ids_BT, loss_mask_BT, attn_BT = collate(rows, pad_id(self.target.tokenizer))
        return _Batch(self._key(plan), ids, [len(r["input_ids"]) for r in rows], input_ids_BT, loss_mask_BT, attn_BT)

    def _key(self, plan: StepPlan) -> tuple:
        """What tells one plan's batch of this worker from another's (a look-ahead is used only for its own)."""
        return plan.split, plan.step, tuple(plan.batch_of(self.rank))

    def _requests(self, plan: StepPlan, upcoming: Sequence[StepPlan]) -> Optional[_Batch]:
        """``plan``'s batch; with an engine that computes apart, its requests sent (unless they went out
        with the last step), then the next plan's. A look-ahead that does not match (another plan came:
        a replaced peer, the end of a split) is dropped: its requests finish and their files go."""
        ahead, self._ahead = self._ahead, None
        batch = ahead if ahead is not None and ahead.key == self._key(plan) else self._batch(plan)
        engine = self.target.engine
        if engine is None or not engine.computes_apart:
            return batch  # on our own cores one batch at a time (measured faster there: benchmarks/README.md)
        if batch is not None and batch.pending is None:
            batch.pending = engine.submit(engine_rows(batch.input_ids_BT, batch.attn_BT))
        nxt = self._batch(upcoming[0]) if upcoming else None
        if nxt is not None:
            nxt.pending = engine.submit(engine_rows(nxt.input_ids_BT, nxt.attn_BT))
            self._ahead = nxt
        return batch

    @torch.no_grad()
    def _forward(self, plan: StepPlan, upcoming: Sequence[StepPlan] = ()) -> dict[int, dict[str, torch.Tensor]]:
        """ONE right-padded target forward over this worker's batch of ``plan`` (packed rows with
        ``rollout.pack_tokens``); per-sample full-length wire tensors (none when the batch is empty)."""
        try:
            b = self._requests(plan, upcoming)
            if b is None:
                return {}
            f = capture(self.target, b.input_ids_BT, b.attn_BT, self.cfg.model.argmax_chunk_tokens,
                        target_packs(b.attn_BT, self.cfg.rollout.pack_tokens), pending=b.pending)
        except EngineError as e:  # its engine is gone: this worker goes too, and is replaced as a dead one is
            die_with_engine(self.target.engine, e)
        fields = {"aux_hidden": f.aux_hidden_BTKH, "last_hidden": f.last_hidden_BTH, "target_ids": f.target_ids_BT,
                  "input_ids": b.input_ids_BT, "loss_mask": b.loss_mask_BT}
        per_sample = wire_features(plan.feature_spec, fields, b.lengths, self.transport.device)
        return dict(zip(b.ids, per_sample))

    def forward_only(self, plan: StepPlan) -> StepReport:
        """Benchmark probe: the rollout stage alone (the batched forward, nothing sent)."""
        t0 = time.perf_counter()
        tokens = float(sum(int(f["input_ids"].shape[0]) for f in self._forward(plan).values()))
        synchronize(self.device)
        return StepReport(self.rank, plan.step, metrics={"tokens": tokens},
                          timings_ms={"forward": (time.perf_counter() - t0) * 1e3})

    def leave_communicator(self) -> None:
        """Let every posted send leave before the communicator goes (the driver bounds the wait)."""
        if hasattr(self, "window"):
            self.window.drain()
        if getattr(getattr(self, "target", None), "engine", None) is not None:
            self.target.engine.close()  # its whole process group: vLLM's core and workers too
        super().leave_communicator()


# ------------------------------------------------------------------------------ training


class TrainWorker(DistributedWorker):
    """A train rank of the draft: ``DraftTrainer.step`` on the micro-batches its feature source
    hands it, whatever that source is."""

    def __init__(self, cfg: Config):
        super().__init__(cfg.train.num_threads)
        self.cfg = cfg
        # The metric rows of the last plans, written into every checkpoint: the driver may not
        # have logged them yet when it dies (it collects up to MAX_STEPS_AHEAD plans behind).
        self.recent_rows: collections.deque[dict] = collections.deque(maxlen=2 * MAX_STEPS_AHEAD)

    def setup(self, layout: Layout, total_steps: int, facts: Optional[dict] = None) -> int:
        """Groups, the draft and its trainer (LR schedule over ``total_steps``), the feature source;
        resume from the newest checkpoint of the same run (``facts``: ``plan.run_facts``, what the
        checkpoints record about the data). Returns the step to start from. Without a process
        group (the single-process placement) this is rank 0 of one."""
        cfg = self.cfg
        set_threads(cfg.train.num_threads)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        device = self.device = pick_device(cfg.model.device)
        bind(device)
        groups = build_groups(cfg, layout, self.rank, device)
        # The draft needs the target's embedding and lm_head (teacher rows of the draft vocab); only
        # a capture source (colocated) runs the target, over model.num_gpus GPUs. Fed by rollout
        # workers or a store, a train rank keeps it memory-mapped in host memory: it reads the few
        # tensors it copies (and the fingerprint's samples), and no GPU holds the target.
        colocated = layout.mode == "colocated"
        target = load_target(cfg.model, None if colocated else device, layers=lambda n: feature_layers(cfg, n),
                             on_host=not colocated, packed=colocated and cfg.rollout.pack_tokens is not None,
                             engine_for=engine_factory(cfg) if colocated else None)
        vocab = load_draft_vocab(layout.vocab_path)
        algo = bound_algorithm(cfg)
        draft = algo.build_draft(target, vocab)
        if cfg.draft.init_from is not None and resumed_checkpoint(cfg) is None:  # a resume takes its checkpoint
            apply_init_from(algo, cfg, draft)
        draft = parallelize_draft(draft.to(device), ParallelDims.from_config(cfg), groups, cfg.train.precision, algo)
        self.trainer = DraftTrainer(algo, draft, algo.train_state(target, vocab), cfg, device,
                                    reduce_sum=sum_over_train_ranks(groups), total_steps=total_steps)
        self.source = build_source(cfg, layout, groups, target, self.rank)
        self.layer_ids = list(target.aux_layer_ids)  # what the features hold, for check_batches' refusals
        self.lost: Optional[str] = None  # set once the train ranks agreed a plan's features were lost
        identity = run_identity(algo, cfg, target, vocab, facts or {}, total_steps)
        self.checkpoints = CheckpointManager(checkpoint_root(cfg), cfg.checkpoint.keep_last,
                                             writer=self.rank == layout.train_ranks[0],  # the FSDP mesh's first rank
                                             identity=identity)
        return self.checkpoints.load(self.trainer) if cfg.checkpoint.resume else 0

    def _features(self, plan: StepPlan, upcoming: Sequence[StepPlan]) -> list[TrainBatch]:
        """This rank's batches of ``plan``, once every train rank has its own and every rank's hold
        sound hidden states (one all-reduce of a flag and the feature counts, one host read); else
        ``FeaturesLost`` (or ``FeaturesRefused``) on every train rank, for this plan and every later one."""
        err = batches = None
        if self.lost is None:
            K = len(self.layer_ids)
            try:
                batches = self.source.next_batches(plan, upcoming)
                counts = check_batches(batches, K, self.trainer.device)
            except Exception as e:  # a data-plane peer is gone (or a store read failed): tell the others
                err, counts = e, torch.zeros(2 * K + 1, dtype=torch.float64, device=self.trainer.device)
            flag = torch.tensor([float(err is not None)], dtype=torch.float64, device=self.trainer.device)
            failed, *summed = self.trainer.reduce_sum(torch.cat([flag, counts])).tolist()
            if failed:
                why = f"{type(err).__name__}: {err}" if err is not None else "another train rank's features were lost"
                self.lost = f"{plan.split} step {plan.step}: {why}"
            else:
                try:  # summed over the train ranks: every rank refuses the same plan, none trained on it
                    refuse_bad_features(summed, self.layer_ids, f"{plan.split} step {plan.step}: ")
                except ValueError as bad:
                    self.lost = f"{plan.split} step {plan.step}: its features were refused"
                    raise FeaturesRefused(str(bad)) from None
        if self.lost is not None:  # every later plan fails alike, with no collective
            lost = FeaturesUnreadable if isinstance(err, ValueError) else FeaturesLost
            raise lost(f"train rank {self.rank} trained nothing since {self.lost}") from err
        return batches

    @control
    def peer_lost(self, why: str) -> bool:
        """The driver saw a data-plane peer (a rollout worker) die. Runs beside a busy ``train_step``
        (the actor's control thread): every receive not yet complete now fails (``PeerLost``), so
        the train ranks agree on ``FeaturesLost`` at once instead of waiting, as NCCL would, for
        the watchdog. True if this rank had a data plane to stop."""
        abort = getattr(getattr(self, "source", None), "abort", None)
        if abort is not None:
            abort(why)
        return abort is not None

    def peer_was_lost(self) -> bool:
        return bool(getattr(getattr(self, "source", None), "aborted", False)) or getattr(self, "lost", None) is not None

    def train_step(self, plan: StepPlan, upcoming: Sequence[StepPlan] = (), save: bool = False) -> StepReport:
        t0, wait0, recv0 = time.perf_counter(), self.source.wait_ms, self.source.bytes_recv
        # features_ms is finished work with no sync of its own: _features' one host read follows the
        # check of every feature (after a colocated capture's forward, after the receives)
        self._last_batches = self._features(plan, upcoming)
        t1 = time.perf_counter()
        metrics = self.trainer.step(self._last_batches)
        self._record("train", plan.step + 1, metrics)
        if save:
            self.save()
        timings = {"features": (t1 - t0) * 1e3, "train": metrics.pop("train_ms"),
                   "train_wait": self.source.wait_ms - wait0, "step": (time.perf_counter() - t0) * 1e3}
        metrics["tokens_local"] = metrics.pop("tokens")
        if "useful_tokens" in metrics:
            metrics["useful_tokens_local"] = metrics.pop("useful_tokens")
        return StepReport(self.rank, plan.step, metrics=metrics, timings_ms=timings,
                          bytes_recv=self.source.bytes_recv - recv0)

    def eval_step(self, plan: StepPlan, upcoming: Sequence[StepPlan] = (), save: bool = False) -> StepReport:
        """Metrics of ``plan``'s held-out micro-batches, summed over all train ranks; no update.
        ``save``: checkpoint afterwards (the loop saves after the eval that follows a save step)."""
        t0 = time.perf_counter()
        metrics = self.trainer.evaluate(self._features(plan, upcoming))  # ends in a host copy: finished work
        failpoints.hit("eval")
        self._record("eval", plan.step, metrics)
        if save:
            self.save()
        return StepReport(self.rank, plan.step, metrics=metrics, timings_ms={"eval": (time.perf_counter() - t0) * 1e3})

    def train_repeat(self, reps: int) -> StepReport:
        """Benchmark probe: the train stage alone, on the last step's already-received features."""
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            m = self.trainer.step(self._last_batches)
            synchronize(self.device)
            times.append((time.perf_counter() - t0) * 1e3)
        return StepReport(self.rank, -1, metrics={"tokens_local": m["tokens"]},
                          timings_ms={f"train_{i}": t for i, t in enumerate(times)})

    def _record(self, kind: str, step: int, metrics: dict) -> None:
        """Keep the run-wide part of a plan's metrics (this rank's token count and timings are not)."""
        self.recent_rows.append({"kind": kind, "step": step,
                                 **{k: float(v) for k, v in metrics.items()
                                    if k not in ("tokens", "train_ms") and isinstance(v, (int, float))}})

    def save(self) -> Optional[str]:
        """Write the newest state (collective over the train ranks; the first one writes) with the
        recent metric rows. After ``FeaturesLost`` that is still a consistent state: every rank
        stopped at the same step."""
        path = self.checkpoints.save(self.trainer, rows=list(self.recent_rows))
        return None if path is None else str(path)
