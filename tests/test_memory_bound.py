"""Bounded memory: feature bytes sent but not yet consumed never exceed ``placement.max_inflight_mb``.

Every transport logs when a rank posts a step's sends (+bytes) and when a rank's receives of a
step go to the train step (-bytes) (``dataplane.InflightLog``); ``inflight_peak`` merges the logs
of all ranks into the high-water mark. A disaggregated run with a budget of 2.5 steps stays
within it (a budget one step could exceed is refused before training: the loop always lets one
plan run); the same run with a budget that never binds lets the rollout worker run ahead, and
its peak goes past that budget (so the first run's bound is what held it).
"""

import collections
import os

import pytest

from specforge.runtime.dataplane import InflightLog, inflight_peak
from specforge.runtime.loop import MAX_STEPS_AHEAD
from tests.helpers.plan import planner
from tests.helpers.ray_run import make_cfg

STEPS = 12
# A starved box (benchmarks at normal priority, tests at idle) can take minutes to start a worker
# process; Ray's default (60 s) kills and retries it until actor creation fails.
os.environ.setdefault("RAY_worker_register_timeout_seconds", "900")


def test_inflight_peak_merges_the_ranks_logs():
    send, recv = InflightLog(), InflightLog()
    send.times.extend([1.0, 2.0, 3.0, 5.0])
    send.deltas.extend([10, 10, 10, 10])
    recv.times.extend([2.0, 4.0, 6.0, 7.0])  # a receive at the same instant as a send counts after it
    recv.deltas.extend([-10, -10, -10, -10])
    assert inflight_peak([send.snapshot(), recv.snapshot()]) == 20
    assert inflight_peak([send.snapshot()]) == 40 and inflight_peak([]) == 0
    send.record(0)  # nothing moved: no event
    assert len(send.times) == 4


def _step_bytes(cfg) -> list[int]:
    """Feature bytes of each step's transfers (rollout rank 0 -> train rank 1)."""
    plan = planner(cfg)
    return [plan.step_bytes(s) for s in range(STEPS)]


def test_has_room_admits_within_the_budget_only():
    from specforge.runtime.loop import InFlight, has_room

    def flying(*sizes):
        return collections.deque(InFlight(None, None, n) for n in sizes)

    assert has_room(flying(), 500, budget=100)  # one plan always: check_budget refused budgets below a step
    assert has_room(flying(60), 40, budget=100) and not has_room(flying(60), 41, budget=100)
    assert has_room(flying(30, 30, 30), 10, budget=100) and not has_room(flying(30, 30, 30), 11, budget=100)
    assert not has_room(flying(*[1] * MAX_STEPS_AHEAD), 1, budget=100)
    # plans that move no bytes (colocated, offline): two at a time
    assert has_room(flying(0), 0, budget=0) and not has_room(flying(0, 0), 0, budget=0)


def test_a_budget_smaller_than_one_step_is_refused_before_training(assets, tmp_path):
    common = ["placement.mode=disaggregated", "rollout.num_workers=1", "train.num_workers=2", "train.batch_size=2",
              f"train.max_steps={STEPS}", "train.eval_every=4"]
    plan = planner(make_cfg(assets, tmp_path, *common), train_ranks=(1, 2))
    largest = plan.largest_step_bytes()
    # a bound on every plan of the schedule, and not a loose one: the 2 x 2 longest samples padded to the longest
    every = [plan.recv_bytes(plan.task(t)) for t in plan.schedule(0)]
    assert max(every) <= largest < 2 * max(every), (largest, every)
    plan.check_budget(largest)
    with pytest.raises(ValueError, match=r"placement.max_inflight_mb'=.* smaller than one step's features: a step "
                                         r"of 4 samples of \d+ tokens"):
        plan.check_budget(largest - 1)


def _run_peak(cfg) -> int:
    """Train ``cfg`` on a Ray cluster of the driver's own pieces; the merged in-flight peak."""
    from specforge.ray_train import Planner, collect, prepare, spawn_cluster, train_loop
    from specforge.runtime.dataplane import inflight_snapshot
    from specforge.tracking import MetricsLogger

    data = prepare(cfg, use_gpu=False)
    cluster = spawn_cluster(cfg, data, use_gpu=False)
    try:
        logger = MetricsLogger(cfg.tracking, cfg.train.output_dir)
        assert train_loop(cfg, cluster, Planner(cfg, data, cluster.layout), logger) == STEPS
        logger.close()
        actors, labels = cluster.rollout.actors + cluster.train.actors, cluster.rollout.labels + cluster.train.labels
        logs = collect([a.__ray_call__.remote(inflight_snapshot) for a in actors], labels, 60, "inflight log")
    finally:
        cluster.shutdown()
    assert sum(sum(d) for _, d in logs) == 0  # every byte sent was consumed
    return inflight_peak(logs)


# 1 rollout worker -> 1 train worker; a 7-step TTT unroll makes training slower than the tiny
# target's forward, so without a bound the rollout worker runs ahead of training.
COMMON = ["placement.mode=disaggregated", "rollout.num_workers=1", "train.num_workers=1", f"train.max_steps={STEPS}",
          "draft.ttt_length=7"]


def _bounded_run(assets, tmp_path) -> tuple[int, int, list[int]]:
    """The run with a budget of 2.5 of its largest steps: ``(its in-flight peak, budget, step bytes)``;
    the peak is checked to lie between the largest step and the budget."""
    per_step = _step_bytes(make_cfg(assets, tmp_path / "plan", *COMMON))
    budget = int(2.5 * max(per_step))
    bounded = _run_peak(make_cfg(assets, tmp_path / "bounded", *COMMON, f"placement.max_inflight_mb={budget / 2**20}"))
    assert max(per_step) <= bounded <= budget, (bounded, budget, per_step)
    return bounded, budget, per_step


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_inflight_bytes_stay_within_the_budget_and_the_budget_binds(assets, ray_session, tmp_path):
    """A disaggregated run with a budget of 2.5 of its largest steps keeps its in-flight peak between the
    largest step and the budget; the same run with a budget it never reaches (the control) goes over that
    budget, so the bound is what held it. Over 30 s: two Ray runs of two actors each, 7 TTT steps a step."""
    bounded, budget, per_step = _bounded_run(assets, tmp_path)
    unbounded = _run_peak(make_cfg(assets, tmp_path / "unbounded", *COMMON, "placement.max_inflight_mb=1024"))
    print(f"in-flight peak: bounded {bounded}, unbounded {unbounded}, budget {budget}, largest step {max(per_step)}")
    assert unbounded > budget, (unbounded, budget, per_step)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_budget_holds_under_nccl_completion_semantics(assets, ray_session, tmp_path, monkeypatch):
    """The same bounded run with NCCL's semantics emulated (``wait()`` returns at once; completion
    only through ``is_completed()``): the log's receive events are finished transfers, not posted
    ones, and the budget still holds."""
    from specforge.device import EMULATE_NCCL_ENV

    monkeypatch.setenv(EMULATE_NCCL_ENV, "1")  # spawn_actors passes it to the workers
    _bounded_run(assets, tmp_path)


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_fit_refuses_a_budget_below_one_step_before_any_worker_starts(assets, ray_session, tmp_path, monkeypatch):
    import specforge.ray_train as rt

    spawned = []
    monkeypatch.setattr(rt, "spawn_cluster", lambda *a, **k: spawned.append(a))
    cfg = make_cfg(assets, tmp_path, "placement.mode=disaggregated", "rollout.num_workers=1",
                   "placement.max_inflight_mb=0.001")
    with pytest.raises(ValueError, match=r"placement\.max_inflight_mb'=0\.001 is smaller than one step's features"):
        rt.fit(cfg)
    assert not spawned  # planned from the placement's ranks alone: no worker started, none to stop
    assert not list(tmp_path.rglob("step-*"))  # nothing trained, nothing saved
