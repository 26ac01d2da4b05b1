"""THE training loop, for every placement, and the single-process placement.

``train_loop`` walks the ``Planner``'s schedule (train steps, periodic evals) until the stop rule
(``Planner.total_steps``, ``train.max_minutes``): it submits plans ahead within the in-flight
byte budget, collects the reports in order, logs, and asks for periodic checkpoints. What it
needs from a placement (``ray_train.Cluster`` on Ray actors; ``LocalCluster`` in this process)::

    cluster.start_step                         the step the train workers resumed at
    cluster.submit(plan, upcoming, save)       start a plan on every worker (Ray: returns refs)
    cluster.collect(handle, what)              -> (rollout StepReports, train StepReports)
    cluster.save(timeout_s)                    the final checkpoint (no-op if this step is saved)
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

from tqdm import tqdm

from specforge.config import Config
from specforge.contracts import MAX_STEPS_AHEAD, Layout, StepPlan, StepReport
from specforge.parallel.dims import ParallelDims
from specforge.runtime.plan import Planner, RunData, run_facts, total_steps
from specforge.runtime.workers import TrainWorker
from specforge.tracking import RECENT_STEPS, end_summary
from specforge.training.checkpoint import recorded_rows

# Keys that say how a run is distributed, not what it computes: a placement names the ones it
# does not apply when they are set (never ignores them silently).
DISTRIBUTION_KEYS = ("placement.mode", "placement.transport", "placement.max_inflight_mb", "rollout.num_workers",
                     "rollout.max_restarts", "train.max_restarts", "parallel.backend", "parallel.timeout_s",
                     "parallel.setup_timeout_s", "ray.address",
                     "ray.num_cpus", "ray.temp_dir", "ray.rollout_resources", "ray.train_resources")
_NO_DATA_PLANE = ("placement.transport", "ray.rollout_resources", "placement.max_inflight_mb", "rollout.num_workers",
                  "rollout.max_restarts")
NOT_APPLIED = {"single": DISTRIBUTION_KEYS, "colocated": _NO_DATA_PLANE, "offline": _NO_DATA_PLANE, "disaggregated": ()}
# Offline training runs no target forward: how many GPUs the target would span does not apply.
_NO_TARGET_FORWARD = ("model.num_gpus",)


def check(cfg: Config) -> None:
    """What no placement can run yet: a ValueError naming the key."""
    ParallelDims.from_config(cfg)  # train.num_workers must be a multiple of sp_ulysses * sp_ring
    if cfg.model.num_gpus > 1 and cfg.model.device == "cpu":
        raise ValueError(f"config key 'model.num_gpus'={cfg.model.num_gpus}: a target split over GPUs needs "
                         "model.device cuda or auto; on the CPU one process holds the whole target (use 1)")


def not_applied(cfg: Config, placement: str) -> list[str]:
    """``key=value`` of the set keys ``placement`` ("single" or a placement.mode) does not apply;
    the entry points print them."""
    default = Config()

    def get(c: Config, key: str) -> Any:
        section, name = key.split(".")
        return getattr(getattr(c, section), name)

    keys = [k for k in NOT_APPLIED[placement] if not (k == "placement.mode" and cfg.placement.mode == "offline")]
    keys += _NO_TARGET_FORWARD if cfg.placement.mode == "offline" else ()
    return [f"{k}={get(cfg, k)!r}" for k in keys if get(cfg, k) != get(default, k)]


def single_process(cfg: Config) -> Config:
    """The same run on one in-process train rank: the DP groups' micro-batches become that rank's
    gradient-accumulation micro-batches, in the same order (same global batch, same loss)."""
    dp = ParallelDims.from_config(cfg).dp
    return replace(cfg, train=replace(cfg.train, num_workers=1, grad_accum=cfg.train.grad_accum * dp),
                   parallel=replace(cfg.parallel, sp_ulysses=1, sp_ring=1),
                   placement=replace(cfg.placement, mode="offline" if cfg.placement.mode == "offline" else "colocated"))


class LocalCluster:
    """The single-process placement: one ``TrainWorker`` in this process (target + draft, features
    captured in memory or read from the store), no Ray, no process group; a plan runs when submitted."""

    def __init__(self, cfg: Config, data: RunData):
        self.layout = Layout(cfg.placement.mode, (), (0,), data.vocab_path)
        self.worker = TrainWorker(cfg)
        self.start_step = self.worker.setup(self.layout, total_steps(cfg, len(data.lengths), data.num_replay),
                                            run_facts(cfg, data))

    def submit(self, plan: StepPlan, upcoming: Sequence[StepPlan], save: bool):
        w = self.worker
        return [], [w.train_step(plan, upcoming, save) if plan.split == "train" else w.eval_step(plan, upcoming, save)]

    def collect(self, handle, what: str) -> tuple[list[StepReport], list[StepReport]]:
        return handle

    def save(self, timeout_s: Optional[float] = None) -> Optional[str]:
        return self.worker.save()


# ---------------------------------------------------------------- the loop


@dataclass
class InFlight:
    plan: StepPlan
    handle: Any
    nbytes: int


def has_room(inflight: collections.deque, next_bytes: int, budget: int) -> bool:
    """Backpressure: the next plan goes up if its feature bytes fit in the budget beside those of
    the plans in flight (one plan always: the ``Planner`` refused a budget smaller than a step
    when it was built). Plans that move no bytes (colocated, offline): two at a time,
    so step k+1's work is queued while step k runs."""
    if not inflight:
        return True
    if not next_bytes and not any(f.nbytes for f in inflight):
        return len(inflight) < 2
    return len(inflight) < MAX_STEPS_AHEAD and sum(f.nbytes for f in inflight) + next_bytes <= budget


def step_metrics(rollout: list[StepReport], train: list[StepReport], seconds: float, inflight_bytes: int) -> dict:
    """One dashboard row: rank 0's global training metrics + where the time and bytes went."""
    m = dict(train[0].metrics)
    tokens = sum(r.metrics["tokens_local"] for r in train)
    m.pop("tokens_local", None)
    if all("useful_tokens_local" in r.metrics for r in train):  # the samples' own tokens (padding left out)
        m.pop("useful_tokens_local")
        m["useful_tokens"] = sum(r.metrics["useful_tokens_local"] for r in train)
        m["useful_tokens_per_s"] = m["useful_tokens"] / max(seconds, 1e-9)
    features_ms = max(r.timings_ms["features"] for r in train)
    m.update(
        tokens=tokens,
        tokens_per_s=tokens / max(seconds, 1e-9),
        step_s=seconds,
        train_ms=max(r.timings_ms["train"] for r in train),
        train_wait_ms=max(r.timings_ms["train_wait"] for r in train),
        features_ms=features_ms,
        recv_bytes=sum(r.bytes_recv for r in train),
        inflight_bytes=inflight_bytes,
        # colocated: the in-process capture is the rollout forward
        rollout_forward_ms=max((r.timings_ms["forward"] for r in rollout), default=features_ms),
    )
    if rollout:
        m.update(
            transfer_ms=max(r.timings_ms["send_post"] + r.timings_ms["send_wait"] for r in rollout),
            transfer_bytes=sum(r.bytes_sent for r in rollout),
            rollout_forwards=sum(r.metrics["forwards"] for r in rollout),
            rollout_forwards_max=max(r.metrics["forwards"] for r in rollout),
            sender_inflight_bytes=sum(r.metrics["inflight_bytes"] for r in rollout),
        )
    return m


def logged(cfg: Config, done: int, total: int) -> bool:
    """Whether the training row after ``done`` steps goes to the metrics log."""
    return done % cfg.train.log_every == 0 or done == 1 or done == total


def restore_rows(cfg: Config, cluster, plan: Planner, logger, checkpoint) -> None:
    """A resumed run first logs the rows its checkpoint recorded that the log lacks (the last run
    stopped between a save and its log line), and says which."""
    if not cluster.start_step or checkpoint is None:
        return
    owed = lambda kind, step: kind == "eval" or logged(cfg, step, plan.total_steps)  # noqa: E731
    if done := logger.restore(recorded_rows(checkpoint), cluster.start_step, owed):
        print(f"metrics.jsonl: restored the rows of {', '.join(f'{k} step {s}' for k, s in done)} from {checkpoint} "
              "(the last run stopped after saving them, before logging them)")


def saves_after(p: StepPlan, following: Optional[StepPlan], every: int) -> bool:
    """Whether the train workers checkpoint once ``p`` is done: after every ``every``-th train step,
    or after the held-out eval that follows it (so that eval's row is in the checkpoint too:
    ``TrainWorker.recent_rows``)."""
    if not every:
        return False
    if p.split == "eval":
        return p.step % every == 0
    evals_next = following is not None and following.split == "eval" and following.step == p.step + 1
    return (p.step + 1) % every == 0 and not evals_next


def run_deadline(cfg: Config) -> float:
    """When ``train.max_minutes`` ends the run (``time.time()`` clock), from now."""
    return time.time() + 60 * cfg.train.max_minutes if cfg.train.max_minutes else math.inf


def train_loop(cfg: Config, cluster, plan: Planner, logger, deadline: Optional[float] = None) -> int:
    """Run the schedule from ``cluster.start_step`` until the stop rule; returns the last trained
    step count. Checkpoints every ``checkpoint.every_steps``; the caller saves the final one.
    ``deadline`` (default: ``train.max_minutes`` from now) is the same across a recovery."""
    todo = plan.schedule(cluster.start_step)
    budget = int(cfg.placement.max_inflight_mb * 2**20)  # the Planner refused one a step could exceed
    every = cfg.checkpoint.every_steps
    deadline = run_deadline(cfg) if deadline is None else deadline
    inflight: collections.deque[InFlight] = collections.deque()
    done, i = cluster.start_step, 0
    # a time-bounded phase says so
    limit = f", or {cfg.train.max_minutes:g} min if sooner" if cfg.train.max_minutes else ""
    bar = tqdm(total=plan.total_steps, initial=done, desc=f"train ({cfg.placement.mode}{limit})", dynamic_ncols=True)
    t_last = time.perf_counter()
    recent, heldout = collections.deque(maxlen=RECENT_STEPS), None  # for the end-of-training line
    try:
        while True:
            while (i < len(todo) and time.time() < deadline
                   and has_room(inflight, plan.recv_bytes(plan.task(todo[i])), budget)):
                p, i = plan.task(todo[i]), i + 1
                upcoming = [plan.task(todo[i])] if i < len(todo) else []  # its receives go up early
                save = saves_after(p, upcoming[0] if upcoming else None, every)
                inflight.append(InFlight(p, cluster.submit(p, upcoming, save), plan.recv_bytes(p)))
            if not inflight:
                bar.close()
                if recent:
                    print(end_summary(list(recent), heldout))
                return done
            f = inflight.popleft()
            rollout, train = cluster.collect(f.handle, f"{f.plan.split} step {f.plan.step}")
            if f.plan.split == "eval":
                logger.log(f.plan.step, train[0].metrics, kind="eval")
                heldout = {**train[0].metrics, "step": f.plan.step}
                continue
            now = time.perf_counter()
            m = step_metrics(rollout, train, now - t_last, f.nbytes + sum(x.nbytes for x in inflight))
            t_last, done = now, f.plan.step + 1
            m["epoch"] = plan.epochs_done(done)  # passes over the run's own data: plots mark epochs
            if plan.data.num_replay:
                m["replay_share"] = plan.replayed_share(done)
            recent.append(m)
            bar.update(1)
            bar.set_postfix(loss=f"{m['loss']:.3f}", acc0=f"{m.get('acc_0', 0):.2f}", tau=f"{m.get('tau', 0):.2f}")
            if logged(cfg, done, plan.total_steps):
                logger.log(done, m)
    finally:
        bar.close()
