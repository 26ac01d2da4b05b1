"""tests/helpers/ray_zygote.py, where the suite's Ray cluster forks its workers from: a worker forked there
is the process Ray asked for (its arguments, environment, folder, stdio, exit status, signals and death),
and the session cluster's actors are forked there with their own environment and thread count."""

import os
import shlex
import signal
import subprocess
import sys

import pytest

from tests.helpers import ray_zygote
from tests.helpers.processes import gone

SCRIPT = """import gc, json, os, signal, sys, time
preloaded, frozen = "torch" in sys.modules, gc.get_freeze_count()
signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "set": os.environ.get("SPECFORGE_TEST_ZYGOTE"),
                  "preloaded": preloaded, "frozen": frozen, "pid": os.getpid(), "ppid": os.getppid()}), flush=True)
if sys.argv[1] == "wait":
    time.sleep(120)
sys.exit(int(sys.argv[2]))
"""


@pytest.fixture
def zygote(_ray_zygote):
    if not _ray_zygote:
        pytest.skip(f"the suite's Ray workers are spawned here ({ray_zygote.OFF_ENV}=1 or the GPU suite)")
    return shlex.split(_ray_zygote.run)


def _start(command, script, tmp_path, *args):
    env = {**os.environ, "SPECFORGE_TEST_ZYGOTE": "yes"}
    return subprocess.Popen([*command, str(script), *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            text=True)


def _first_line(proc, timeout_s=60):
    import json
    import select

    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, f"nothing from the worker within {timeout_s} s"
    return json.loads(proc.stdout.readline())


def test_a_forked_worker_runs_as_the_spawned_one_with_torch_already_imported(zygote, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    forked = _start(zygote, script, tmp_path, "exit", "3")
    spawned = _start([sys.executable], script, tmp_path, "exit", "3")  # the control: as Ray spawns
    got, want = _first_line(forked), _first_line(spawned)
    assert forked.wait(timeout=60) == spawned.wait(timeout=60) == 3
    for key in ("argv", "cwd", "set"):
        assert got[key] == want[key], key
    assert want["set"] == "yes" and want["argv"] == ["exit", "3"]
    assert got["preloaded"] and not want["preloaded"]  # what the zygote is for
    # the imports' objects frozen (no collection in the worker walks them again); a spawned one has none
    assert got["frozen"] > 100_000 and want["frozen"] == 0, (got["frozen"], want["frozen"])
    assert got["pid"] != forked.pid and got["ppid"] != forked.pid  # forked by the zygote, not its caller


def test_a_signal_to_the_caller_reaches_the_worker_and_a_killed_caller_takes_it(zygote, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    caller = _start(zygote, script, tmp_path, "wait", "0")
    worker = _first_line(caller)["pid"]
    caller.send_signal(signal.SIGTERM)  # as Ray stops a worker
    assert caller.wait(timeout=60) == 7  # the worker's handler ran and its status came back
    assert gone(worker, 10)

    caller = _start(zygote, script, tmp_path, "wait", "0")
    worker = _first_line(caller)["pid"]
    os.kill(worker, 0)  # alive
    caller.kill()  # SIGKILL, as Ray kills a worker it gave up on: nothing can be forwarded
    caller.wait(timeout=60)
    assert gone(worker, 10), "a worker outlived the process Ray started for it"


def test_a_caller_that_sends_garbage_or_goes_does_not_end_the_zygote(zygote, tmp_path):
    import socket

    sock_path = zygote[-1]
    for garbage in (b"", b"\x00\x00", b"\x00\x00\x00\x05{oops"):
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(sock_path)
        conn.sendall(garbage)
        conn.close()  # gone before a whole request
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    after = _start(zygote, script, tmp_path, "exit", "0")
    assert _first_line(after)["preloaded"] and after.wait(timeout=60) == 0  # still forking


@pytest.mark.ray
def test_the_session_clusters_actors_are_forked_with_their_own_environment(ray_session, zygote):
    """An actor of the session cluster is a child of the zygote, sees the environment Ray gave it (the
    actor's own runtime environment included) and computes on the threads that environment asks for."""
    import psutil
    import ray
    import torch

    @ray.remote(num_cpus=1)
    class Probe:
        def seen(self):
            return {"ppid": os.getppid(), "set": os.environ.get("SPECFORGE_TEST_ZYGOTE"),
                    "omp": os.environ.get("OMP_NUM_THREADS"), "threads": torch.get_num_threads()}

    probe = Probe.options(runtime_env={"env_vars": {"SPECFORGE_TEST_ZYGOTE": "actor", "OMP_NUM_THREADS": "3"}})
    actor = probe.remote()
    try:
        seen = ray.get(actor.seen.remote(), timeout=120)
    finally:
        ray.kill(actor)
    assert "serve" in psutil.Process(seen["ppid"]).cmdline()
    assert seen["set"] == "actor" and seen["omp"] == "3" and seen["threads"] == 3, seen


@pytest.mark.ray
def test_the_session_cluster_runs_without_the_monitors(ray_session):
    """tests/conftest.py's ``lean_cluster``: the session's cluster runs (its GCS and raylet are this
    process' children) without a log monitor or an autoscaler monitor. The control, a cluster of ours started
    the product's way, has both: checked in tests/test_caller_state.py."""
    from specforge.runtime.actors import ray_processes
    from tests.helpers.processes import ray_monitors

    assert ray_session.is_initialized() and ray_processes()
    assert ray_monitors() == []
