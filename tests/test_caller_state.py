"""What a run leaves of its caller's process as it found it: the environment after Ray started
(``runtime/actors.start_ray``), and the torch thread count after a single-process run
(``specforge.train.run``). Both are the caller's; the run's own settings go to Ray's processes through
Ray and are undone in the caller."""

import os

import pytest
import torch

from tests.helpers.processes import MONITORS, ray_monitors
from tests.helpers.ray_run import make_cfg


def test_a_single_process_run_gives_the_thread_count_back(assets, tmp_path, monkeypatch):
    from specforge.train import run

    threads = {"n": 3, "seen": []}  # torch's setting, observed (the suite's workers clamp the real one)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads["n"])
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (threads.update(n=n), threads["seen"].append(n)))
    run(make_cfg(assets, tmp_path, "train.num_workers=1", "train.num_threads=2", "train.max_steps=1"))
    assert 2 in threads["seen"]  # the control: the run did set its own
    assert threads["n"] == 3  # and the caller has its own back


@pytest.mark.ray
def test_starting_ray_leaves_the_callers_environment(no_ray, monkeypatch):
    """Ray starts without token authentication where the caller said nothing (Ray's processes get
    RAY_AUTH_MODE=disabled, the workers TOKENIZERS_PARALLELISM), and the caller's os.environ has none of them
    afterwards. The cluster inherits those and our switches at its start: an actor spawned there gets no
    runtime environment for them (with one, Ray starts each worker through its setup_worker.py, a process
    importing Ray); a switch set after the start (the control) reaches the next actor through one."""
    import ray

    from specforge import device
    from specforge.config import load_config
    from specforge.runtime.actors import RAY_START_ENV, shutdown_ray, spawn_actors, start_ray

    for k in RAY_START_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    monkeypatch.setenv(device.FORCE_ENV, "cpu")
    monkeypatch.delenv(device.EMULATE_NCCL_ENV, raising=False)
    before = dict(os.environ)
    keys = ("RAY_AUTH_MODE", "TOKENIZERS_PARALLELISM", device.FORCE_ENV, device.EMULATE_NCCL_ENV)

    class Probe:
        def seen(self):
            return {k: os.environ.get(k) for k in keys}, dict(ray.get_runtime_context().runtime_env)

    assert start_ray(load_config(None, []), 1)
    try:
        assert _workers_beside_two_actors() == 0  # no idle worker started ahead (RAY_START_ENV)
        # the product's cluster keeps Ray's monitors (a run's workers log to its driver): the control of
        # tests/test_ray_zygote.py's check that the suite's session cluster runs without them
        assert ray_monitors() == sorted(MONITORS)
        ours = [*RAY_START_ENV, "TOKENIZERS_PARALLELISM"]  # (Ray writes keys of its own, e.g. PYTHONBREAKPOINT)
        assert {k: os.environ.get(k) for k in ours} == {k: before.get(k) for k in ours} == dict.fromkeys(ours)
        env, runtime_env = ray.get(spawn_actors(Probe, 1, num_cpus=0.5, timeout_s=120).actors[0].seen.remote(),
                                   timeout=120)
        assert env == {"RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", device.FORCE_ENV: "cpu",
                       device.EMULATE_NCCL_ENV: None}, env
        assert "env_vars" not in runtime_env, runtime_env
        monkeypatch.setenv(device.EMULATE_NCCL_ENV, "1")
        env, runtime_env = ray.get(spawn_actors(Probe, 1, num_cpus=0.5, timeout_s=120).actors[0].seen.remote(),
                                   timeout=120)
        assert env[device.EMULATE_NCCL_ENV] == "1" and runtime_env["env_vars"] == {device.EMULATE_NCCL_ENV: "1"}
    finally:
        shutdown_ray()


def _workers_beside_two_actors(at_least: int = 0, timeout_s: float = 30) -> int:
    """Start two actors, then count the Python workers of the cluster this process started (the raylet's
    children, less its two agents) that are not theirs, once there are ``at_least`` of them or ``timeout_s``
    has passed. The actors have a runtime environment of their own, which no worker started ahead has: such
    a worker stays idle and is counted (a plain actor could take one, and hide it)."""
    import time

    import psutil
    import ray

    @ray.remote(num_cpus=0)
    class Actor:
        def pid(self) -> int:
            return os.getpid()

    actors = [Actor.options(runtime_env={"env_vars": {"SPECFORGE_TEST_OWN_ENV": "1"}}).remote() for _ in range(2)]
    theirs = set(ray.get([a.pid.remote() for a in actors], timeout=120))

    def count() -> int:
        raylets = [p for p in psutil.Process().children(recursive=True) if p.name() == "raylet"]
        return sum(c.pid not in theirs and c.name() not in ("ray::DashboardAgent", "ray::RuntimeEnvAgent")
                   for r in raylets for c in r.children())

    deadline = time.monotonic() + timeout_s
    while (n := count()) < at_least and time.monotonic() < deadline:
        time.sleep(0.2)
    return n


@pytest.mark.ray
def test_a_caller_that_asks_for_prestarted_ray_workers_gets_them(no_ray, monkeypatch):
    """The control of the count above: RAY_prestart_worker_first_driver=1 set by the caller (it wins over
    our default) gives the cluster Ray's idle workers, which the actors do not use, and the count sees them."""
    import ray

    from specforge.config import load_config
    from specforge.runtime.actors import start_ray

    monkeypatch.setenv("RAY_prestart_worker_first_driver", "1")
    assert start_ray(load_config(None, []), 1)
    try:
        assert _workers_beside_two_actors(at_least=1) >= 1
    finally:
        ray.shutdown()
