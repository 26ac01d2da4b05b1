"""Online EAGLE-3 training with Ray: the driver.

    python -m specforge.ray_train --config configs/smollm2-135m-cpu.yaml [dotted.overrides=...]

The driver plans and records; it never touches a tensor. It tokenizes the data once into the
memory-mapped cache and writes the draft vocab file (workers re-open both from the config and
a path), spawns the workers, and runs THE loop (``runtime/loop.py``), which sends every worker
the same small ``StepPlan`` per step (and per periodic eval):

    colocated       train workers hold target + draft and compute their features in memory
    disaggregated   rollout workers (target) -> p2p features -> train workers (draft, FSDP2 x SP)

With sequence parallelism (parallel.sp_ulysses x parallel.sp_ring = P) a DP group is P consecutive
train ranks; each gets only its slice (+ halo) of every sample (``runtime/plan.py``).

Rollout may run ahead of training, bounded by ``placement.max_inflight_mb`` of features in
flight; completion is signalled by ObjectRefs (``gather``, with a timeout), never by polling.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

import ray

from specforge.cli import run_cli
from specforge.config import Config, load_config
from specforge.preflight import check_placement, check_resources, ray_resources
from specforge.runtime.actors import ActorGroup, WorkerError, gather, init_communicator, spawn_actors
from specforge.runtime.contracts import Layout, StepPlan, StepReport, assert_no_tensors
from specforge.runtime.loop import check, not_applied, train_loop
from specforge.runtime.plan import Planner, RunData, prepare, total_steps
from specforge.runtime.workers import RolloutWorker, TrainWorker

# ---------------------------------------------------------------- the cluster


@dataclass
class Cluster:
    """The Ray placement of THE loop: rollout actors (none when colocated) and train actors."""

    layout: Layout
    rollout: ActorGroup
    train: ActorGroup
    mailbox: object = None
    timeout_s: float = 300.0
    start_step: int = 0  # train workers resumed from the newest checkpoint

    def submit(self, plan: StepPlan, upcoming: Sequence[StepPlan], save: bool) -> tuple[list, list]:
        """Fan out one plan: every rollout worker forwards its batch, every train rank trains (or evaluates)."""
        rollout = [w.rollout_step.remote(plan) for w in self.rollout.actors]
        if plan.split == "train":
            return rollout, [w.train_step.remote(plan, upcoming, save) for w in self.train.actors]
        return rollout, [w.eval_step.remote(plan, upcoming) for w in self.train.actors]

    def collect(self, handle: tuple[list, list], what: str) -> tuple[list[StepReport], list[StepReport]]:
        rollout, train = handle
        return (collect(rollout, self.rollout.labels, self.timeout_s, f"rollout {what}"),
                collect(train, self.train.labels, self.timeout_s, f"train {what}"))

    def save(self, timeout_s: Optional[float] = None) -> Optional[str]:
        """Write the newest state (no-op on workers that already saved this step)."""
        refs = [w.save.remote() for w in self.train.actors]
        return collect(refs, self.train.labels, timeout_s or self.timeout_s, "save")[0]

    def shutdown(self) -> None:
        for g in (self.rollout, self.train):
            refs = [a.leave_communicator.remote() for a in g.actors]
            try:
                ray.get(refs, timeout=10)
            except Exception:  # a dead or stuck worker: killing it below is enough
                pass
            g.shutdown()
        if self.mailbox is not None:
            ray.kill(self.mailbox)


def num_rollout(cfg: Config) -> int:
    """Rollout workers of the placement: only disaggregated has its own."""
    return cfg.rollout.num_workers if cfg.placement.mode == "disaggregated" else 0


def spawn_cluster(cfg: Config, data: RunData, use_gpu: bool) -> Cluster:
    """Placement groups, one communicator (rollout ranks first), per-worker setup."""
    timeout = cfg.parallel.timeout_s
    gpus = 1 if use_gpu else 0
    n_roll = num_rollout(cfg)
    rollout = spawn_actors(RolloutWorker, n_roll, num_gpus=gpus, label="rollout", args=(cfg,), timeout_s=timeout,
                           resources=cfg.ray.rollout_resources) \
        if n_roll else ActorGroup([], [])
    train = spawn_actors(TrainWorker, cfg.train.num_workers, num_gpus=gpus, label="train", args=(cfg,), timeout_s=timeout,
                         resources=cfg.ray.train_resources)
    mailbox = mailbox_name = None
    if cfg.placement.transport == "object_store" and n_roll:
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
        actors, labels = rollout.actors + train.actors, rollout.labels + train.labels
        init_communicator(actors, labels, cfg.parallel.backend, timeout)
        # new_group is collective over the world: every rank sets up at once.
        horizon = total_steps(cfg, len(data.lengths))
        refs = [a.setup.remote(layout) for a in rollout.actors] + [a.setup.remote(layout, horizon) for a in train.actors]
        starts = collect(refs, labels, timeout + 60, "setup")
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


def fit(cfg: Config) -> Optional[str]:
    """Train; returns the newest checkpoint folder."""
    from specforge.tracking import MetricsLogger

    check(cfg)
    check_placement(cfg)  # the config against the target's config.json and, if Ray starts here, the cores
    if skipped := not_applied(cfg, cfg.placement.mode):
        print(f"{cfg.placement.mode}: not applying {', '.join(skipped)}")
    started = start_ray(cfg, cfg.train.num_workers + num_rollout(cfg))
    cluster = None
    try:
        use_gpu = cfg.model.device == "cuda" or (cfg.model.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
        check_resources(cfg, use_gpu, *ray_resources(cfg, started))  # before any worker starts
        data = prepare(cfg, use_gpu)
        cluster = spawn_cluster(cfg, data, use_gpu)
        plan = Planner(cfg, data, cluster.layout)
        logger = MetricsLogger(cfg.tracking, cfg.train.output_dir, cfg.to_dict())
        worker_failed = False
        try:
            train_loop(cfg, cluster, plan, logger)
        except WorkerError:
            worker_failed = True
            raise
        finally:
            # Normal end, Ctrl-C or a failed worker: keep what is trained if the workers can save
            # (after Ctrl-C the queued steps finish first). After a worker failure its peers may
            # sit in a collective until their group timeout: try, but do not wait that long.
            try:
                path = cluster.save(min(cluster.timeout_s, 30) if worker_failed else cluster.timeout_s)
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

    def body() -> int:
        print(f"checkpoint: {fit(load_config(args.config, args.overrides))}")
        return 0

    return run_cli(body, errors=(WorkerError,))


if __name__ == "__main__":
    sys.exit(main())
