"""Online EAGLE-3 training with Ray: the driver.

    python -m specforge.ray_train --config configs/smollm2-135m-cpu.yaml [dotted.overrides=...]

The driver plans and records; it never touches a tensor. It tokenizes the data once into the
memory-mapped cache and writes the draft vocab file (workers re-open both from the config and
a path), spawns the workers, and per step sends every worker the same small ``StepPlan``:

    colocated       train workers hold target + draft and compute their features in memory
    disaggregated   rollout workers (target) -> p2p features -> train workers (draft, FSDP2 x SP)

With sequence parallelism (parallel.sp_ulysses x parallel.sp_ring = P) a DP group is P consecutive
train ranks; each gets only its slice (+ halo) of every sample (``runtime/plan.py``).

Rollout may run ahead of training, bounded by ``placement.max_inflight_mb`` of features in
flight; completion is signalled by ObjectRefs (``gather``, with a timeout), never by polling.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Optional

import ray

from specforge.config import Config, load_config
from specforge.parallel.dims import ParallelDims
from specforge.runtime.actors import ActorGroup, WorkerError, gather, init_communicator, spawn_actors
from specforge.runtime.contracts import Layout, StepReport, assert_no_tensors
from specforge.runtime.plan import Planner, RunData, prepare
from specforge.runtime.workers import RolloutWorker, TrainWorker

MAX_STEPS_AHEAD = 8  # submitted-but-unfinished steps, whatever the byte budget allows


# ---------------------------------------------------------------- the cluster


@dataclass
class Cluster:
    layout: Layout
    rollout: Optional[ActorGroup]
    train: ActorGroup
    mailbox: object = None
    timeout_s: float = 300.0
    start_step: int = 0  # train workers resumed from the newest checkpoint

    @property
    def groups(self) -> list[ActorGroup]:
        return [g for g in (self.rollout, self.train) if g is not None]

    def shutdown(self) -> None:
        for g in self.groups:
            refs = [a.leave_communicator.remote() for a in g.actors]
            try:
                ray.get(refs, timeout=10)
            except Exception:  # a dead or stuck worker: killing it below is enough
                pass
            g.shutdown()
        if self.mailbox is not None:
            ray.kill(self.mailbox)


def spawn_cluster(cfg: Config, data: RunData, use_gpu: bool) -> Cluster:
    """Placement groups, one communicator (rollout ranks first), per-worker setup."""
    timeout = cfg.parallel.timeout_s
    gpus = 1 if use_gpu else 0
    disagg = cfg.placement.mode == "disaggregated"
    rollout = spawn_actors(RolloutWorker, cfg.rollout.num_workers, num_gpus=gpus, label="rollout",
                           args=(cfg,), timeout_s=timeout) if disagg else None
    train = spawn_actors(TrainWorker, cfg.train.num_workers, num_gpus=gpus, label="train", args=(cfg,), timeout_s=timeout)
    n_roll = cfg.rollout.num_workers if disagg else 0
    mailbox = mailbox_name = None
    if cfg.placement.transport == "object_store" and disagg:
        from specforge.runtime.dataplane import MAILBOX_NAME, spawn_mailbox

        mailbox_name = f"{MAILBOX_NAME}-{os.getpid()}"
        mailbox = spawn_mailbox(mailbox_name)
    layout = Layout(
        mode=cfg.placement.mode,
        rollout_ranks=tuple(range(n_roll)),
        train_ranks=tuple(range(n_roll, n_roll + cfg.train.num_workers)),
        vocab_path=data.vocab_path,
        mailbox=mailbox_name,
    )
    cluster = Cluster(layout, rollout, train, mailbox, timeout)
    try:
        actors = [a for g in cluster.groups for a in g.actors]
        labels = [lb for g in cluster.groups for lb in g.labels]
        init_communicator(actors, labels, cfg.parallel.backend, timeout)
        # new_group is collective over the world: every rank sets up at once.
        starts = collect([a.setup.remote(layout) for a in actors], labels, timeout + 60, "setup")
    except BaseException:
        cluster.shutdown()
        raise
    cluster.start_step = max(starts[n_roll:])
    return cluster


def collect(refs: list, labels: list[str], timeout_s: float, what: str) -> list:
    """Every result the driver receives passes here: waited with a timeout, checked tensor-free."""
    results = gather(refs, labels, timeout_s, what=what)
    for label, r in zip(labels, results):
        assert_no_tensors(r, f"{what}<{label}>")
    return results


# ---------------------------------------------------------------- the loop


@dataclass
class InFlight:
    step: int
    rollout: list
    train: list
    nbytes: int


def submit(cluster: Cluster, plan: Planner, step: int, last_step: int, save: bool) -> InFlight:
    """Fan out one step: every rollout worker forwards its batch, every train rank trains."""
    p = plan(step)
    upcoming = [plan(s) for s in range(step + 1, min(step + 2, last_step))]  # its receives go up early
    rollout = [w.rollout_step.remote(p) for w in cluster.rollout.actors] if cluster.rollout else []
    train = [w.train_step.remote(p, upcoming, save) for w in cluster.train.actors]
    return InFlight(step, rollout, train, plan.step_bytes(step))


def has_room(inflight: collections.deque, next_bytes: int, budget: int) -> bool:
    """Backpressure: two steps always (so rollout k+1 overlaps train k), more within the byte
    budget (colocated moves no bytes: two)."""
    if len(inflight) < 2:
        return True
    return 0 < next_bytes and len(inflight) < MAX_STEPS_AHEAD and sum(f.nbytes for f in inflight) + next_bytes <= budget


def step_metrics(rollout: list[StepReport], train: list[StepReport], seconds: float, inflight_bytes: int) -> dict:
    """One dashboard row: rank 0's global training metrics + where the time and bytes went."""
    m = dict(train[0].metrics)
    tokens = sum(r.metrics["tokens_local"] for r in train)
    m.pop("tokens_local", None)
    m.update(
        tokens=tokens,
        tokens_per_s=tokens / max(seconds, 1e-9),
        step_s=seconds,
        train_ms=max(r.timings_ms["train"] for r in train),
        train_wait_ms=max(r.timings_ms["train_wait"] for r in train),
        features_ms=max(r.timings_ms["features"] for r in train),
        recv_bytes=sum(r.bytes_recv for r in train),
        inflight_bytes=inflight_bytes,
    )
    if rollout:
        m.update(
            rollout_forward_ms=max(r.timings_ms["forward"] for r in rollout),
            transfer_ms=max(r.timings_ms["send_post"] + r.timings_ms["send_wait"] for r in rollout),
            transfer_bytes=sum(r.bytes_sent for r in rollout),
            rollout_forwards=sum(r.metrics["forwards"] for r in rollout),
            rollout_forwards_max=max(r.metrics["forwards"] for r in rollout),
            sender_inflight_bytes=sum(r.metrics["inflight_bytes"] for r in rollout),
        )
    else:
        m["rollout_forward_ms"] = m["features_ms"]  # colocated: the in-process capture
    return m


def train_loop(cfg: Config, cluster: Cluster, plan: Planner, logger) -> int:
    """Steps until max_steps or max_minutes; returns the last trained step count."""
    from tqdm import tqdm

    timeout = cluster.timeout_s
    budget = int(cfg.placement.max_inflight_mb * 2**20)
    every = cfg.checkpoint.every_steps
    deadline = time.time() + 60 * cfg.train.max_minutes if cfg.train.max_minutes else math.inf
    step = done = cluster.start_step
    inflight: collections.deque[InFlight] = collections.deque()
    bar = tqdm(total=cfg.train.max_steps, initial=done, desc=f"train ({cfg.placement.mode})", dynamic_ncols=True)
    t_last = time.perf_counter()
    try:
        while True:
            while step < cfg.train.max_steps and time.time() < deadline and has_room(inflight, plan.step_bytes(step), budget):
                inflight.append(submit(cluster, plan, step, cfg.train.max_steps, save=bool(every) and (step + 1) % every == 0))
                step += 1
            if not inflight:
                return done
            f = inflight.popleft()
            rollout = collect(f.rollout, cluster.rollout.labels if cluster.rollout else [], timeout, f"rollout step {f.step}")
            train = collect(f.train, cluster.train.labels, timeout, f"train step {f.step}")
            now = time.perf_counter()
            m = step_metrics(rollout, train, now - t_last, f.nbytes + sum(x.nbytes for x in inflight))
            t_last, done = now, f.step + 1
            bar.update(1)
            bar.set_postfix(loss=f"{m['loss']:.3f}", acc0=f"{m.get('acc_0', 0):.2f}", tau=f"{m.get('tau', 0):.2f}")
            if done % cfg.train.log_every == 0 or done == 1 or done == cfg.train.max_steps:
                logger.log(done, m)
    finally:
        bar.close()


def save_final(cluster: Cluster, timeout_s: float) -> Optional[str]:
    """Write the newest state (no-op on workers that already saved this step)."""
    paths = collect([w.save.remote() for w in cluster.train.actors], cluster.train.labels, timeout_s, "save")
    return paths[0]


# ---------------------------------------------------------------- entry


def start_ray(cfg: Config, num_actors: int) -> bool:
    """Join or start Ray; True if we started it (and so must shut it down)."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}
    if cfg.ray.address:
        ray.init(address=cfg.ray.address, runtime_env=env)
    else:  # one CPU per actor bundle, oversubscribed if the machine has fewer cores
        num_cpus = cfg.ray.num_cpus or max(os.cpu_count() or 1, num_actors + 1)
        ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env=env,
                 _temp_dir=cfg.ray.temp_dir or f"/tmp/sfray-{os.getuid()}")
    return True


def check(cfg: Config) -> None:
    if cfg.placement.mode == "offline":
        raise ValueError("config key 'placement.mode': 'offline' is not run by ray_train; use 'colocated' or 'disaggregated'")
    ParallelDims.from_config(cfg)  # train.num_workers must be a multiple of sp_ulysses * sp_ring
    if cfg.rollout.tp_size != 1:
        raise ValueError(f"config key 'rollout.tp_size'={cfg.rollout.tp_size}: tensor-parallel rollout is not "
                         "supported (one target replica per rollout worker, e.g. on CPU); use 1")


def fit(cfg: Config) -> Optional[str]:
    """Train; returns the newest checkpoint folder."""
    from specforge.tracking import MetricsLogger

    check(cfg)
    disagg = cfg.placement.mode == "disaggregated"
    started = start_ray(cfg, cfg.train.num_workers + (cfg.rollout.num_workers if disagg else 0))
    cluster = None
    try:
        use_gpu = cfg.model.device == "cuda" or (cfg.model.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
        data = prepare(cfg, use_gpu)
        cluster = spawn_cluster(cfg, data, use_gpu)
        logger = MetricsLogger(cfg.tracking, cfg.train.output_dir, cfg.to_dict())
        worker_failed = False
        try:
            train_loop(cfg, cluster, Planner(cfg, data, cluster.layout), logger)
        except WorkerError:
            worker_failed = True
            raise
        finally:
            # Normal end, Ctrl-C or a failed worker: keep what is trained if the workers can save
            # (after Ctrl-C the queued steps finish first). After a worker failure its peers may
            # sit in a collective until their group timeout: try, but do not wait that long.
            try:
                path = save_final(cluster, min(cluster.timeout_s, 30) if worker_failed else cluster.timeout_s)
                if path:
                    print(f"saved {path}")
            except (WorkerError, KeyboardInterrupt) as err:
                print(f"could not save the final checkpoint: {err}", file=sys.stderr)
            logger.close()
        from specforge.train.checkpoint import latest_checkpoint
        from specforge.train.trainer import checkpoint_root

        latest = latest_checkpoint(checkpoint_root(cfg))
        return str(latest) if latest else None
    finally:
        if cluster is not None:
            cluster.shutdown()
        if started:
            ray.shutdown()


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specforge.ray_train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, help="run config YAML (default: built-in defaults)")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. train.max_steps=20")
    args = ap.parse_args(argv)
    try:
        path = fit(load_config(args.config, args.overrides))
    except (ValueError, WorkerError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    print(f"checkpoint: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
