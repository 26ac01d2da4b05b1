"""Online EAGLE-3 training with Ray: the driver.

    python -m specforge.ray_train --config configs/smollm2-135m-cpu.yaml [dotted.overrides=...]
    python -m specforge.ray_train --config configs/qwen3-30b-a3b.yaml --dry-run   (does it fit? specforge/dryrun.py)

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

Failures (every wait is bounded by ``parallel.timeout_s``; a dead actor is seen at once):

    rollout worker dies   the train ranks all stop at the same step (``workers.FeaturesLost``),
                          save it, and the placement is respawned around a new rollout worker
                          (torch.distributed cannot add a rank to a live communicator); the train
                          workers resume that checkpoint and the loop re-plans from its step, so
                          no sample is lost or trained twice (``recover``; ``rollout.max_restarts``)
    train worker dies     every actor goes and the placement is respawned, the train workers resuming
                          the last complete checkpoint; the loop re-plans from its step, each later
                          step trained again from it (``recover``; ``train.max_restarts``). Past that
                          the run ends, naming the worker and the last good checkpoint; rerunning the
                          same command resumes from it (a hard-killed driver too)
    rollout worker raises its peers are told at once, the train ranks stop at one step and save it;
                          the run ends with the worker's error (``RolloutFailed``, not replaced)
    features unsound      NaN or inf, or a captured layer all zeros, wherever they were computed:
                          every train rank refuses the plan before training on it (one all-reduce
                          it makes anyway; ``workers.FeaturesRefused``), saves, and the run ends
                          naming the layer
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import os
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

import ray

from specforge import device
from specforge.cli import check_flags, run_cli, with_dry_run_flags
from specforge.config import Config, load_config
from specforge.contracts import Layout, StepPlan, StepReport, assert_no_tensors
from specforge.dryrun import dry_run
from specforge.preflight import check_placement, check_resources, gpus_per_worker, ray_resources
from specforge.runtime.actors import (
    ActorDied,
    ActorGroup,
    WorkerError,
    dead_actors,
    exit_on_head_lost,
    gather,
    init_communicator,
    shutdown_ray,
    spawn_actors,
    start_ray,
)
from specforge.runtime.dataplane import MAILBOX_NAME, spawn_mailbox
from specforge.runtime.loop import not_applied, restore_rows, run_deadline, train_loop
from specforge.runtime.plan import Planner, RunData, prepare, run_facts, total_steps
from specforge.runtime.workers import FeaturesLost, FeaturesRefused, RolloutWorker, TrainWorker
from specforge.tracking import MetricsLogger
from specforge.training.checkpoint import latest_checkpoint
from specforge.training.trainer import checkpoint_root, keep_old_checkpoints


class RolloutLost(WorkerError):
    """Rollout workers died; the train ranks stopped at one consistent step (recoverable)."""


class TrainWorkerLost(WorkerError):
    """A train worker died; the run cannot continue without it (resume from the last checkpoint)."""


class RolloutFailed(WorkerError):
    """A rollout worker raised (it lives, but will not send a plan's features): the train ranks were
    told at once and stopped at one consistent step, which the final save keeps. Not replaced: the
    same batch would fail again (NaN features of a target, an engine refusing a request)."""

# ---------------------------------------------------------------- the cluster

_GENERATION = itertools.count()


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
        rollout = [w.rollout_step.remote(plan, upcoming) for w in self.rollout.actors]  # look-ahead: engines
        if plan.split == "train":
            return rollout, [w.train_step.remote(plan, upcoming, save) for w in self.train.actors]
        return rollout, [w.eval_step.remote(plan, upcoming, save) for w in self.train.actors]

    def collect(self, handle: tuple[list, list], what: str) -> tuple[list[StepReport], list[StepReport]]:
        """The plan's reports (the first failure of any worker ends the wait), a failure told
        apart: ``RolloutLost`` (recoverable), ``TrainWorkerLost``, or the worker's own error."""
        rollout, train = handle
        try:
            reports = collect(rollout + train, self.rollout.labels + self.train.labels, self.timeout_s, what)
            return reports[: len(rollout)], reports[len(rollout):]
        except ActorDied as err:
            if err.label not in self.rollout.labels:
                raise TrainWorkerLost(f"train worker {err.label} died", err.label) from err
            self.tell_peer_lost(f"rollout worker {err.label} died")
            try:  # it may have died once its sends were out: then this plan trained all the same
                return [], collect(train, self.train.labels, self.timeout_s, what)
            except WorkerError as train_err:
                raise self.diagnose(train_err) from err
        except WorkerError as err:
            if err.label in self.rollout.labels:
                raise self.rollout_failed(err, train, what) from err
            raise self.diagnose(err) from err

    def rollout_failed(self, err: WorkerError, train: list, what: str) -> RolloutFailed:
        """A rollout worker raised: its peers are told as of a death, so the train ranks end the
        plan now (``FeaturesLost``: every rank at the same step) rather than at ``parallel.timeout_s``,
        and are free for the final save; the run ends with the worker's own error."""
        self.tell_peer_lost(f"rollout worker {err.label} failed")
        with contextlib.suppress(WorkerError):  # FeaturesLost on every train rank: what telling them is for
            collect(train, self.train.labels, self.timeout_s, what)
        return RolloutFailed(str(err), err.label, err.cause)

    def tell_peer_lost(self, why: str) -> None:
        """Tell every train rank that a rollout worker died: their receives from it that have not
        completed fail now. Under NCCL nothing else would end them (a receive from a dead peer never
        fails; the watchdog would kill the train processes at parallel.timeout_s). Runs in each
        actor's control thread, beside the step it may be blocked in; a rank that is gone is skipped
        (the train reports name it)."""
        refs = [a.peer_lost.remote(why) for a in self.train.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=min(self.timeout_s, 60))
        for ref in ready:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(ref, timeout=0)

    def diagnose(self, err: WorkerError) -> WorkerError:
        """A train rank's failure: the death behind it, if an actor died, else ``err`` itself."""
        if err.label not in self.train.labels:
            return err
        if isinstance(err, ActorDied):
            return TrainWorkerLost(f"train worker {err.label} died", err.label)
        if isinstance(err.cause, FeaturesLost):
            if dead := dead_actors(self.rollout):
                return RolloutLost(f"rollout worker {', '.join(dead)} died; the train workers stopped at a "
                                   f"consistent step ({err.cause})", dead[0], err.cause)
        elif dead := dead_actors(self.train):  # a collective with a dead rank failed on the others
            return TrainWorkerLost(f"train worker {', '.join(dead)} died ({err.label}: {err.cause})", dead[0])
        return err

    def save(self, timeout_s: Optional[float] = None) -> Optional[str]:
        """Write the newest state (no-op on workers that already saved this step; None once shut down)."""
        if not self.train.actors:
            return None
        refs = [w.save.remote() for w in self.train.actors]
        return collect(refs, self.train.labels, timeout_s or self.timeout_s, "save")[0]

    def adopt(self, other: "Cluster") -> None:
        """Go on with ``other``'s actors (a respawned placement) under this handle."""
        self.__dict__.update(other.__dict__)

    def shutdown(self) -> None:
        """Every actor and placement group goes (a second call finds nothing left)."""
        for g in (self.rollout, self.train):
            refs = [a.leave_communicator.remote() for a in g.actors]
            try:
                ray.get(refs, timeout=10)
            except Exception:  # a dead or stuck worker: killing it below is enough
                pass
            g.shutdown()
        if self.mailbox is not None:
            ray.kill(self.mailbox)
            self.mailbox = None


def num_rollout(cfg: Config) -> int:
    """Rollout workers of the placement: only disaggregated has its own."""
    return cfg.rollout.num_workers if cfg.placement.mode == "disaggregated" else 0


def placement_layout(cfg: Config, data: RunData, mailbox: Optional[str] = None) -> Layout:
    """The ranks of the placement ``spawn_cluster`` starts (rollout ranks first): what a plan needs of it,
    known before any worker starts."""
    n_roll = num_rollout(cfg)
    return Layout(mode=cfg.placement.mode, rollout_ranks=tuple(range(n_roll)),
                  train_ranks=tuple(range(n_roll, n_roll + cfg.train.num_workers)), vocab_path=data.vocab_path,
                  mailbox=mailbox)


def spawn_cluster(cfg: Config, data: RunData, use_gpu: bool) -> Cluster:
    """Placement groups, one communicator (rollout ranks first), per-worker setup."""
    timeout, setup_timeout = cfg.parallel.timeout_s, max(cfg.parallel.setup_timeout_s, cfg.parallel.timeout_s)

    def gpus(kind: str) -> int:
        return gpus_per_worker(cfg, kind) if use_gpu else 0

    n_roll = num_rollout(cfg)
    rollout = spawn_actors(RolloutWorker, n_roll, num_gpus=gpus("rollout"), label="rollout", args=(cfg,),
                           timeout_s=setup_timeout, resources=cfg.ray.rollout_resources) \
        if n_roll else ActorGroup([], [])
    train = spawn_actors(TrainWorker, cfg.train.num_workers, num_gpus=gpus("train"), label="train", args=(cfg,),
                         timeout_s=setup_timeout, resources=cfg.ray.train_resources)
    mailbox = mailbox_name = None
    if cfg.placement.transport == "object_store" and n_roll:
        mailbox_name = f"{MAILBOX_NAME}-{os.getpid()}-{next(_GENERATION)}"  # a respawn's is new
        mailbox = spawn_mailbox(mailbox_name)
    layout = placement_layout(cfg, data, mailbox_name)
    cluster = Cluster(layout, rollout, train, mailbox, timeout)
    try:
        actors, labels = rollout.actors + train.actors, rollout.labels + train.labels
        init_communicator(actors, labels, cfg.parallel.backend, timeout)
        # new_group is collective over the world: every rank sets up at once.
        horizon, facts = total_steps(cfg, len(data.lengths), data.num_replay), run_facts(cfg, data)
        refs = [a.setup.remote(layout) for a in rollout.actors] + \
               [a.setup.remote(layout, horizon, facts) for a in train.actors]
        starts = collect(refs, labels, setup_timeout, "setup")  # model and checkpoint loading
        cluster.start_step = agreed_start(starts[n_roll:], train.labels)
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def agreed_start(starts: Sequence[int], labels: Sequence[str]) -> int:
    """The step every train rank resumed at; ranks that disagree (they read different checkpoint
    folders, e.g. a checkpoint.dir not shared between nodes) are refused, never reconciled."""
    if len(set(starts)) > 1:
        got = ", ".join(f"{label} at step {s}" for label, s in zip(labels, starts))
        raise WorkerError(f"train ranks resumed at different steps ({got}); every train rank must read the same "
                          "checkpoint: put checkpoint.dir on storage all nodes share")
    return starts[0]


def collect(refs: list, labels: list[str], timeout_s: float, what: str) -> list:
    """Every result the driver receives passes here: waited with a timeout, checked tensor-free."""
    results = gather(refs, labels, timeout_s, what=what)
    for label, r in zip(labels, results):
        assert_no_tensors(r, f"{what}<{label}>")
    return results


# ---------------------------------------------------------------- entry


def fit(cfg: Config) -> Optional[str]:
    """Train; returns the newest checkpoint folder."""
    check_placement(cfg)  # every check: the keys, the target's config.json and, if Ray starts here, the machine
    if skipped := not_applied(cfg, cfg.placement.mode):
        print(f"{cfg.placement.mode}: not applying {', '.join(skipped)}")
    started = start_ray(cfg, cfg.train.num_workers + num_rollout(cfg),
                        on_head_lost=exit_on_head_lost(lambda: kept(cfg)))
    cluster = None
    try:
        use_gpu = device.wants_gpu(cfg.model.device, ray.cluster_resources().get("GPU", 0))
        check_resources(cfg, use_gpu, *ray_resources(cfg, started))  # before any worker starts
        data = prepare(cfg, use_gpu)
        # the plan reads only the placement's ranks: made (and an in-flight budget below one step refused)
        # before any worker starts; a placement spawned later, or respawned by a recovery, has the same ranks
        plan = Planner(cfg, data, placement_layout(cfg, data))
        cluster = spawn_cluster(cfg, data, use_gpu)
        if cluster.start_step:
            print(f"resuming at step {cluster.start_step} from {latest_checkpoint(checkpoint_root(cfg))}")
        keep_old_checkpoints(cfg)  # every check passed: only now may a fresh start move old checkpoints aside
        logger = MetricsLogger(cfg.tracking, cfg.train.output_dir, cfg.to_dict())
        restore_rows(cfg, cluster, plan, logger, latest_checkpoint(checkpoint_root(cfg)))
        failed: Optional[WorkerError] = None
        try:
            train_with_recovery(cfg, cluster, plan, logger, lambda err: recover(cfg, data, use_gpu, err, cluster))
        except TrainWorkerLost as err:
            failed = err
            last = latest_checkpoint(checkpoint_root(cfg))
            raise TrainWorkerLost(f"{err}\nthe run stopped; last good checkpoint: {last or 'none yet'}"
                                  + ("; rerun the same command to resume from it" if last else ""), err.label) from err
        except WorkerError as err:
            failed = err
            raise
        finally:
            final_save(cluster, failed)
            logger.close()
        latest = latest_checkpoint(checkpoint_root(cfg))
        return str(latest) if latest else None
    finally:
        if cluster is not None:
            cluster.shutdown()
        if started:
            shutdown_ray()


def kept(cfg: Config) -> str:
    """What a stopped run keeps: its last good checkpoint and how to go on from it."""
    last = latest_checkpoint(checkpoint_root(cfg))
    return (f"last good checkpoint: {last}; rerun the same command to resume from it (the steps after it are "
            "trained again)") if last else "no checkpoint was saved yet: rerun the same command to start again"


def final_save(cluster: Optional[Cluster], failed: Optional[WorkerError]) -> None:
    """Normal end, Ctrl-C or a failed worker: keep what is trained if the workers can save (after
    Ctrl-C the queued steps finish first). Not after a train worker died: the save is collective
    over the train ranks. After a rollout worker raised (``RolloutFailed``) or the train ranks refused a
    plan's features (``FeaturesRefused``) they stopped together, so the save gets the normal bound
    (``parallel.timeout_s``). After another failure the
    peers may sit in a collective until their group timeout: try, but do not wait that long (30 s).
    A save that fails after a normal end is an error (the writer put the state in a rescue folder if
    it could: ``checkpoint.save_or_rescue``)."""
    if cluster is None or isinstance(failed, TrainWorkerLost):
        return
    stopped_together = failed is None or isinstance(failed, RolloutFailed) or isinstance(failed.cause, FeaturesRefused)
    try:
        path = cluster.save(cluster.timeout_s if stopped_together else min(cluster.timeout_s, 30))
        if path:
            print(f"saved {path}")
    except (WorkerError, KeyboardInterrupt) as err:
        if failed is None and isinstance(err, WorkerError):
            raise  # the run trained but its state is not where asked: never exit 0 (the error says where it went)
        print(f"could not save the final checkpoint: {err}", file=sys.stderr)


def train_with_recovery(cfg: Config, cluster: Cluster, plan: Planner, logger, recover_fn) -> None:
    """THE loop; after ``RolloutLost`` or ``TrainWorkerLost``, ``recover_fn(err)`` replaces the placement's
    actors and the loop goes on from the step they resumed at (at most ``rollout.max_restarts`` and
    ``train.max_restarts`` times; a failure during a recovery counts as the next one). The
    ``train.max_minutes`` clock runs from the first start: a recovery does not reset it."""
    deadline = run_deadline(cfg)
    restarts = {RolloutLost: 0, TrainWorkerLost: 0}
    while True:
        try:
            train_loop(cfg, cluster, plan, logger, deadline)
            return
        except (RolloutLost, TrainWorkerLost) as err:
            kind = type(err)
            if restarts[kind] >= (cfg.rollout.max_restarts if kind is RolloutLost else cfg.train.max_restarts):
                if kind is TrainWorkerLost:  # fit names the last good checkpoint
                    raise
                raise WorkerError(f"{err}; gave up after {restarts[kind]} replacements (rollout.max_restarts)") from err
            restarts[kind] += 1
            recover_fn(err)


def recover(cfg: Config, data: RunData, use_gpu: bool, err: WorkerError, cluster: Cluster) -> None:
    """Replace a placement whose rollout or train worker died, in place, whatever checkpoint.resume says.
    A rollout worker: the train ranks (stopped at one step) save it, every actor goes, new ones resume
    that checkpoint. A train worker: no save (it is collective over the train ranks), every actor goes,
    new ones resume the last complete checkpoint, and the steps after it are trained again."""
    if isinstance(err, TrainWorkerLost):
        last = latest_checkpoint(checkpoint_root(cfg))
        print(f"{err} ({why(err)}): restarting the train workers from {last or 'the start (no checkpoint yet)'} "
              f"(train.max_restarts={cfg.train.max_restarts})", file=sys.stderr)
    else:
        print(f"{err.label} died: saving, replacing it and resuming", file=sys.stderr)
        try:
            cluster.save(min(cluster.timeout_s, 60))
        except WorkerError as save_err:  # then the newest periodic checkpoint: exact all the same
            print(f"could not save at the failure ({save_err}); resuming the newest checkpoint", file=sys.stderr)
    cluster.shutdown()
    resume = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume=True))
    keep_old_checkpoints(resume)  # a save the dead worker was writing left its temp folder
    cluster.adopt(spawn_cluster(resume, data, use_gpu))
    print(f"resumed at step {cluster.start_step} with new {'train' if isinstance(err, TrainWorkerLost) else 'rollout'} "
          "workers", file=sys.stderr)


def why(err: BaseException) -> str:
    """The first cause under ``err`` that says more than that a worker died: its type and message."""
    cause = err.__cause__
    while cause is not None and cause.__cause__ is not None and not str(cause).strip():
        cause = cause.__cause__
    return f"{type(cause).__name__}: {' '.join(str(cause).split())[:300]}" if cause is not None else "no cause given"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specforge.ray_train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, help="run config YAML (default: built-in defaults)")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. train.max_steps=20")
    with_dry_run_flags(ap)
    args = ap.parse_args(argv)

    def body() -> int:
        check_flags(args)
        cfg = load_config(args.config, args.overrides)
        if args.dry_run:
            dry_run(cfg, args.target_config)
            return 0
        print(f"checkpoint: {fit(cfg)}")
        return 0

    return run_cli(body, errors=(WorkerError,))


if __name__ == "__main__":
    sys.exit(main())
