"""Worker failures in a disaggregated Ray run (1 rollout worker -> 2 train ranks over gloo p2p).

A worker is SIGKILLed (its pid taken at spawn) right after the driver collected a given step, so
later plans are in flight when it dies. Judged by the exact per-step losses of the same run
without a failure:

* rollout worker killed: the run notices (the train ranks' receives fail at once; every wait is
  bounded by parallel.timeout_s), replaces it, re-plans from the step the train ranks stopped at,
  and finishes with every step trained and logged once and every loss unchanged.
* train worker killed: the driver restarts the train group from the last complete checkpoint and the
  run ends with every loss unchanged (``train.max_restarts``); with no restarts left the run ends
  with an error naming that worker and the last good checkpoint, and the same command resumes from
  it, with unchanged losses.
* rollout worker raising (alive, never sending), and NaN features (sent, refused by the train
  ranks): the run ends at once in one line, keeping every step trained and nothing trained on NaN.

Both also run with NCCL's completion semantics emulated on gloo (``SPECFORGE_EMULATE_NCCL=1``,
runtime/completion.py): a receive from the dead rollout worker then never fails by itself, and
the run recovers only because the driver tells the train ranks (``peer_lost``), well before
``parallel.timeout_s``.
"""

import os
import signal

import pytest

from tests.helpers.failures import STEPS, failure_cfg, killing
from tests.helpers.ray_run import losses

ON_RAY = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(params=["gloo", "nccl-semantics"])
def semantics(request, monkeypatch):
    """How transfers complete: gloo's blocking waits, or NCCL's (emulated on gloo)."""
    from specforge.device import EMULATE_NCCL_ENV

    if request.param == "nccl-semantics":
        monkeypatch.setenv(EMULATE_NCCL_ENV, "1")  # spawn_actors passes it to the workers
    return request.param


def on_ray(test):
    for mark in ON_RAY:
        test = mark(test)
    return test


@pytest.fixture(scope="module")
def straight(assets, ray_session, tmp_path_factory):
    """Per-step losses of the run with no failure."""
    from specforge.ray_train import fit

    out = tmp_path_factory.mktemp("straight")
    fit(failure_cfg(assets, out))
    return {r["step"]: r["loss"] for r in losses(out)}


@on_ray
def test_killed_rollout_worker_is_replaced_and_nothing_is_lost(assets, ray_session, straight, semantics, tmp_path,
                                                              monkeypatch):
    """The rollout worker SIGKILLed after step 1: the driver replaces it, and the run ends with the straight
    run's losses, each step once. Over 30 s beside the other pytest worker: two placements of three Ray
    actors each start (the first, then one around the new rollout worker), ~2.6 CPU-s an actor."""
    import specforge.ray_train as rt
    from specforge.ray_train import fit

    causes, real_recover = [], rt.recover
    monkeypatch.setattr(rt, "recover", lambda cfg, data, use_gpu, err, cluster: (
        causes.append(str(err)), real_recover(cfg, data, use_gpu, err, cluster)))
    out = tmp_path / "rollout-killed"
    with killing("rollout", 0, after_step=1) as spawned:
        path = fit(failure_cfg(assets, out))
    assert len(causes) == 1, causes
    # the train ranks stopped because the receive failed (gloo) or the driver said so (NCCL), not
    # because a wait ran into parallel.timeout_s
    assert "not completed within" not in causes[0], causes[0]
    assert len(spawned) == 2  # the first placement, then one around the new rollout worker
    assert spawned[1][0].start_step >= 2  # resumed where the train ranks stopped, not from scratch
    got = losses(out)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))  # each step trained (and logged) once
    for r in got:
        assert r["loss"] == straight[r["step"]], r["step"]
    assert path.endswith(f"step-{STEPS:06d}")


@on_ray
def test_killed_train_worker_is_restarted_in_the_run(assets, ray_session, straight, semantics, tmp_path, capsys):
    """A train worker SIGKILLed after step 3: the driver says so in one line naming the worker and the
    checkpoint, restarts every actor from the last complete checkpoint, and the run ends with the straight run's
    losses at every step (steps past the checkpoint trained again from it). Over 30 s beside the other
    pytest worker: two placements of three Ray actors each, ~2.6 CPU-s an actor to start."""
    from specforge.ray_train import fit

    out = tmp_path / f"train-restarted-{semantics}"
    with killing("train", 1, after_step=3) as spawned:
        path = fit(failure_cfg(assets, out))
    assert path.endswith(f"step-{STEPS:06d}") and len(spawned) == 2
    start = spawned[1][0].start_step  # the last complete checkpoint: step 2, or 4 if it was saved before the kill
    assert start in (2, 4), start
    said = [line for line in capsys.readouterr().err.splitlines() if "restarting the train workers" in line]
    assert len(said) == 1 and "train worker train[1] died" in said[0] and f"step-{start:06d}" in said[0], said
    got = {r["step"]: r["loss"] for r in losses(out)}  # a step logged twice: the later row is the one kept
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, loss in got.items():
        assert loss == straight[step], step


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_train_worker_killed_while_a_lost_rollout_worker_is_replaced_is_survived(assets, ray_session, straight,
                                                                                  tmp_path, capsys):
    """Two faults close together: the rollout worker SIGKILLed after step 1, then, while the driver recovers
    (the new placement just spawned, nothing resumed yet), a train worker of it SIGKILLed too. The driver
    sees the second loss, restarts the train group from the last complete checkpoint, and the run ends with
    the straight run's losses at every step, each step in the final history once. Over 30 s: three placements
    of three Ray actors (the first, the one around the new rollout worker, the restarted one), ~2.6 CPU-s an
    actor to start."""
    import ray

    import specforge.ray_train as rt
    from specforge.ray_train import fit

    out = tmp_path / "two-faults"
    with killing("rollout", 0, after_step=1) as spawned:
        during = rt.spawn_cluster

        def spawn(*args, **kw):
            cluster = during(*args, **kw)
            if len(spawned) == 2:  # the placement replacing the lost one has just spawned: a train worker of it
                pid = ray.get(cluster.train.actors[1].__ray_call__.remote(lambda self: os.getpid()), timeout=60)
                os.kill(pid, signal.SIGKILL)  # goes before it resumed a step
            return cluster

        rt.spawn_cluster = spawn
        path = fit(failure_cfg(assets, out))
    assert path.endswith(f"step-{STEPS:06d}") and len(spawned) >= 3, len(spawned)
    said = [line for line in capsys.readouterr().err.splitlines() if "restarting the train workers" in line]
    assert len(said) == 1 and "train[1] died" in said[0], said
    got = {r["step"]: r["loss"] for r in losses(out)}  # a step logged twice: the later row is the one kept
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, loss in got.items():
        assert loss == straight[step], step


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_killed_train_worker_with_no_restart_left_ends_the_run_naming_it_and_resume_works(assets, ray_session,
                                                                                         straight, tmp_path):
    """``train.max_restarts=0``: a train worker SIGKILLed after step 1 ends the run naming it and the
    checkpoint; the same command resumes to the straight run's losses. Over 30 s beside the other pytest
    worker: two runs (the killed and the resumed) of three Ray actors each, ~2.6 CPU-s an actor to start."""
    from specforge.ray_train import TrainWorkerLost, fit

    out = tmp_path / "train-killed"
    cfg = failure_cfg(assets, out, "train.max_restarts=0")
    with killing("train", 1, after_step=1):
        with pytest.raises(TrainWorkerLost, match=r"(?s)train worker train\[1\] died.*last good checkpoint: "
                                                  r"\S+step-00000[2-6]; rerun the same command"):
            fit(cfg)
    path = fit(cfg)  # the same command resumes
    assert path.endswith(f"step-{STEPS:06d}")
    got = losses(out)
    assert {r["step"] for r in got} == set(range(1, STEPS + 1)) and got[-1]["step"] == STEPS
    for r in got:  # before the kill and after the resume alike
        assert r["loss"] == straight[r["step"]], r["step"]


def _poison_after_step_1(monkeypatch, poison):
    """Run ``poison`` in the rollout worker's process once the driver collected train step 1;
    returns the list its time (``time.monotonic``) goes into."""
    import time

    import ray

    import specforge.ray_train as rt

    poisoned, real_collect = [], rt.Cluster.collect

    def collect(self, handle, what):
        got = real_collect(self, handle, what)
        if what == "train step 1" and not poisoned:
            ray.get(self.rollout.actors[0].__ray_call__.remote(poison), timeout=60)
            poisoned.append(time.monotonic())
        return got

    monkeypatch.setattr(rt.Cluster, "collect", collect)
    return poisoned


def _raising_captures():
    """A poison (pickled by value: a local function) after which every capture raises."""

    def poison(worker):
        import specforge.models.target as target

        def refuse(*args, **kw):
            raise ValueError("the target's forward failed (the test's poison)")

        target._capture_rows = refuse

    return poison


def _nan_captures():
    """A poison (pickled by value: a local function) after which every capture's features are NaN."""

    def poison(worker):
        import specforge.models.target as target

        rows = target._capture_rows

        def nan_rows(*args, **kw):
            feats = rows(*args, **kw)
            feats.aux_hidden_BTKH.fill_(float("nan"))
            return feats

        target._capture_rows = nan_rows

    return poison


def _every_step_kept(out):
    """The steps logged are 1..n with 2 <= n < STEPS, each loss finite, and the newest checkpoint is
    step n with finite weights: what was trained is kept, and nothing was trained on refused features."""
    import math

    from safetensors.torch import load_file

    from specforge.training.checkpoint import latest_checkpoint

    got = losses(out)
    trained = [r["step"] for r in got]
    assert trained == list(range(1, len(trained) + 1)) and 2 <= len(trained) < STEPS, trained
    assert all(math.isfinite(r["loss"]) for r in got), got
    newest = latest_checkpoint(out / "checkpoints")
    assert newest.name == f"step-{trained[-1]:06d}"
    assert all(w.isfinite().all() for w in load_file(newest / "model.safetensors").values())


@on_ray
def test_a_rollout_worker_that_raises_ends_the_run_at_once_keeping_every_step_trained(
        assets, ray_session, semantics, tmp_path, monkeypatch):
    """The rollout worker's captures raise once the driver collected step 1 (the worker lives, so no
    death is seen): the driver tells the train ranks at once, the run ends with the worker's own error
    in one line well before parallel.timeout_s (90 s here: what the train ranks sat in their receives
    before), and the final checkpoint holds every step trained. Over 30 s beside the other pytest worker
    (31.8 s once at b32880d): a placement of three Ray actors, ~2.6 CPU-s an actor to start, and the final save."""
    import time

    import specforge.ray_train as rt

    poisoned = _poison_after_step_1(monkeypatch, _raising_captures())
    out = tmp_path / f"rollout-raised-{semantics}"
    with pytest.raises(rt.RolloutFailed) as raised:
        rt.fit(failure_cfg(assets, out))
    stopped_s = time.monotonic() - poisoned[0]
    line = str(raised.value)
    assert "\n" not in line and "rollout[0]" in line and "the test's poison" in line, line
    assert stopped_s < 45, stopped_s  # told at once: not parallel.timeout_s (90 s) in the receives
    _every_step_kept(out)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_nan_features_are_refused_by_every_train_rank_before_any_trains_on_them(assets, ray_session, tmp_path,
                                                                              monkeypatch):
    """The rollout worker's captures turn NaN once the driver collected step 1. The rollout worker reads
    nothing back (no host sync in its step) and sends them; both train ranks refuse the plan in the
    all-reduce every step makes (``workers.FeaturesRefused``), so neither trains on them: the run ends
    in one line naming the layer, within the same bound, and the checkpoint holds every step trained
    with finite losses and weights. gloo only: the features arrive; how transfers complete is not what
    this tests. Over 30 s beside the other pytest worker: a placement of three Ray actors, ~2.6 CPU-s an actor
    to start, and the final save."""
    import time

    import specforge.ray_train as rt
    from specforge.runtime.actors import WorkerError
    from specforge.runtime.workers import FeaturesRefused

    poisoned = _poison_after_step_1(monkeypatch, _nan_captures())
    out = tmp_path / "nan-features"
    with pytest.raises(WorkerError) as raised:
        rt.fit(failure_cfg(assets, out))
    stopped_s = time.monotonic() - poisoned[0]
    line = str(raised.value)
    assert isinstance(raised.value.cause, FeaturesRefused), repr(raised.value)
    assert "\n" not in line and "train[" in line and "captured target layer" in line and "holds NaN" in line, line
    assert stopped_s < 45, stopped_s
    _every_step_kept(out)


def test_a_recovery_keeps_the_max_minutes_clock(monkeypatch):
    """``train.max_minutes`` bounds the whole run: the loop after a replaced rollout worker gets the
    first start's deadline, not a fresh one."""
    import time

    import specforge.ray_train as rt
    from specforge.config import load_config

    deadlines, recoveries = [], []

    def loop(cfg, cluster, plan, logger, deadline=None):
        deadlines.append(deadline)
        if len(deadlines) < 3:
            raise rt.RolloutLost("rollout<0> died", "rollout<0>")

    monkeypatch.setattr(rt, "train_loop", loop)
    t0 = time.time()
    rt.train_with_recovery(load_config(None, ["train.max_minutes=5"]), None, None, None,
                           lambda err: (recoveries.append(err.label), time.sleep(0.2)))
    assert recoveries == ["rollout<0>", "rollout<0>"]
    assert len(set(deadlines)) == 1 and abs(deadlines[0] - (t0 + 300)) < 5, deadlines


def test_a_joined_heads_loss_is_told_once_after_its_grace_and_not_before():
    """A joined cluster's head (``HeadWatch``, its GCS address): while it accepts connections nothing is
    told; once it refuses them for ``grace_s`` the loss is told once, naming the address. Our own
    cluster's head is watched through its processes (tests/test_resume.py kills its GCS)."""
    import socket
    import threading
    import time

    from specforge.runtime.actors import HeadWatch

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    address = f"127.0.0.1:{server.getsockname()[1]}"
    told, lost = [], threading.Event()
    watch = HeadWatch(lambda what: (told.append(what), lost.set()), own=False, grace_s=1.0, poll_s=0.1,
                      address=address)
    try:
        time.sleep(1.5)
        assert told == []  # the control: a head that answers
        server.close()
        t0 = time.monotonic()
        assert lost.wait(10)
        assert time.monotonic() - t0 >= 1.0  # not before its grace
        time.sleep(0.5)
        assert len(told) == 1 and address in told[0] and "refused connections" in told[0], told
    finally:
        watch.stop()
        server.close()


def test_a_group_call_that_fails_tells_the_rank_that_names_the_bad_input(ray_session, tmp_path):
    """Train ranks agree to stop together (one flag all-reduced) when one rank's own read fails (a corrupt
    store shard): the others know only that some rank failed, and may be told first. The group call
    waits ``SIBLINGS_S`` for its siblings and tells the one whose cause names the bad input, in one line.
    Control: a sibling failing later than that is not waited for (the first failure is told)."""
    import time

    from specforge.runtime.actors import SIBLINGS_S, WorkerError, gather

    ray = ray_session

    @ray.remote
    def agreed(mark):  # fails first, knowing only that another rank failed
        deadline = time.monotonic() + 30  # once its sibling runs: a worker slow to start is no late failure
        while not os.path.exists(mark + ".started") and time.monotonic() < deadline:
            time.sleep(0.01)
        open(mark, "w").close()
        raise RuntimeError("train rank 0 trained nothing since train step 3: another train rank's features "
                           "were lost")

    @ray.remote
    def unreadable(mark, delay):  # fails after it, naming the shard
        open(mark + ".started", "w").close()
        while not os.path.exists(mark):
            time.sleep(0.01)
        time.sleep(delay)
        raise ValueError("feature store shard shard-00002.safetensors is corrupt (sha256 differs)")

    for n, (delay, told) in enumerate([(0.3, "train[1]"), (SIBLINGS_S + 2, "train[0]")]):
        mark = str(tmp_path / f"first-{n}")
        with pytest.raises(WorkerError) as e:
            gather([agreed.remote(mark), unreadable.remote(mark, delay)], ["train[0]", "train[1]"], 60, "train step 3")
        assert e.value.label == told, str(e.value)
        if told == "train[1]":
            assert "shard-00002.safetensors is corrupt" in str(e.value) and "\n" not in str(e.value)
