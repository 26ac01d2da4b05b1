"""specforge.forkserver.run_script_in_child: a script run from the fork server behaves as
``python script args`` would (llama.cpp's converter runs so, specforge/engines/llamacpp.py): its
``__main__``, its argv, its folder first on sys.path, the caller's environment at the call, its
output in the log, its exit status; and it comes from the fork server, not the caller, with the server's
imports frozen out of its garbage collection."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specforge.forkserver import run_script_in_child
from tests.helpers.processes import gone

SCRIPT = """\
import gc, json, os, sys, tempfile
import helper  # a module beside the script: its folder is on sys.path
env = os.environ.get
print(json.dumps({"name": __name__, "argv": sys.argv[1:], "helper": helper.X, "ppid": os.getppid(),
                  "set": env("SPECFORGE_TEST_FORK_SET"), "gone": env("SPECFORGE_TEST_FORK_GONE"),
                  "frozen": gc.get_freeze_count(), "tmp": tempfile.gettempdir()}))
print("to stderr", file=sys.stderr)
if "--fail" in sys.argv:
    sys.exit(3)
if "--raise" in sys.argv:
    raise RuntimeError("boom")
"""


@pytest.fixture
def script(tmp_path):
    (tmp_path / "helper.py").write_text("X = 7\n")
    (tmp_path / "main.py").write_text(SCRIPT)
    return str(tmp_path / "main.py")


def test_a_script_runs_as_python_would_run_it(script, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFORGE_TEST_FORK_GONE", "1")
    assert run_script_in_child(script, ["--warm"], str(tmp_path / "warm.log")) == 0  # the server is up now
    monkeypatch.setenv("SPECFORGE_TEST_FORK_SET", "yes")
    monkeypatch.delenv("SPECFORGE_TEST_FORK_GONE")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # set after the server started (and its imports asked tempfile)
    log = tmp_path / "ok.log"
    assert run_script_in_child(script, ["a", "--b=1"], str(log)) == 0
    out, err = log.read_text().splitlines()
    got = json.loads(out)
    # the same script run by a fresh interpreter: the reference
    ref = json.loads(subprocess.run([sys.executable, script, "a", "--b=1"], capture_output=True, text=True,
                                    check=True).stdout)
    for k in ("name", "argv", "helper", "set", "gone", "tmp"):
        assert got[k] == ref[k], k
    assert got["tmp"] == str(tmp_path)  # the caller's TMPDIR at the call, not the one the server cached
    assert got["name"] == "__main__" and got["argv"] == ["a", "--b=1"] and got["helper"] == 7
    assert got["set"] == "yes" and got["gone"] is None  # the caller's environment at the call
    assert got["ppid"] != os.getpid()  # forked by the fork server, not started by the caller
    # the server's imports frozen (specforge/frozen_imports.py): no collection in the child walks them;
    # the fresh interpreter, the control, has nothing frozen
    assert got["frozen"] > 100_000 and ref["frozen"] == 0, (got["frozen"], ref["frozen"])
    assert err == "to stderr"


def test_exit_status_and_a_traceback_reach_the_caller(script, tmp_path):
    assert run_script_in_child(script, ["--fail"], str(tmp_path / "fail.log")) == 3
    log = tmp_path / "raise.log"
    assert run_script_in_child(script, ["--raise"], str(log)) == 1
    assert "RuntimeError: boom" in log.read_text()


def test_a_caller_run_as_a_script_without_a_main_guard_gets_its_script_run(script, tmp_path):
    """multiprocessing imports the caller's ``__main__`` again in each child: a user's script calling
    the exporter (llama.cpp's converter) without ``if __name__ == "__main__"`` would start itself again
    inside the child and fail. There the script runs in a fresh interpreter instead."""
    caller = tmp_path / "caller.py"  # no main guard, as a user's quick script is often written
    caller.write_text(f"import sys\nfrom specforge.forkserver import run_script_in_child\n"
                      f"rc = run_script_in_child({script!r}, ['x'], {str(tmp_path / 'c.log')!r})\n"
                      f"print('rc', rc, open({str(tmp_path / 'c.log')!r}).read().splitlines()[0])\n")
    done = subprocess.run([sys.executable, str(caller)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.returncode == 0, done.stderr[-2000:]
    rc, first = done.stdout.split(None, 2)[1:]
    assert rc == "0" and json.loads(first)["argv"] == ["x"]


# ---------------------------------------------------------------- a module run as ``python -m`` (adapt's rounds)

MODULE = """\
import json, os, sys, time
print(json.dumps({"name": __name__, "argv": sys.argv[1:], "cwd": os.getcwd(), "ppid": os.getppid(),
                  "set": os.environ.get("SPECFORGE_TEST_FORK_SET")}), flush=True)
if "--sleep" in sys.argv:
    time.sleep(300)
sys.exit(int(sys.argv[-1]) if sys.argv[-1].isdigit() else 0)
"""


def test_a_module_runs_as_python_m_would_run_it(tmp_path, monkeypatch):
    """``start_module``: ``python -m forkmod`` in the caller's folder (the module is found there, as
    ``-m`` finds it), with the caller's environment at the call, its output appended to the log, its exit
    status through Popen's calls; forked by the fork server, not started by the caller."""
    from specforge.forkserver import start_module

    (tmp_path / "forkmod.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPECFORGE_TEST_FORK_SET", "yes")
    log = tmp_path / "round.log"
    log.write_text("kept\n")
    p = start_module("forkmod", ["a", "3"], str(log))
    assert p.wait(timeout=120) == 3 and p.returncode == 3 and p.poll() == 3
    kept, out = log.read_text().splitlines()
    got = json.loads(out)
    assert kept == "kept"  # appended, as adapt's round log is across a resumed round
    assert got == {"name": "__main__", "argv": ["a", "3"], "cwd": str(tmp_path), "ppid": got["ppid"], "set": "yes"}
    assert got["ppid"] != os.getpid()  # the fork server's child
    p = start_module("forkmod", ["--sleep"], str(tmp_path / "slow.log"))
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(timeout=0.5)
    p.terminate()
    assert p.wait(timeout=60) == -15


def test_a_forked_module_goes_when_its_caller_is_killed(tmp_path):
    """The caller SIGKILLed (no ``finally`` of its runs): the module it started goes too, as one
    started through ``children.tied`` does, though the fork server, not the caller, is its parent."""
    import signal
    import time

    (tmp_path / "forkmod.py").write_text(MODULE)
    log = tmp_path / "slow.log"
    code = (f"import time\nfrom specforge.forkserver import start_module\n"
            f"p = start_module('forkmod', ['--sleep'], {str(log)!r})\nprint(p.pid, flush=True)\ntime.sleep(300)\n")
    caller = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    child = 0
    try:
        child = int(caller.stdout.readline())
        deadline = time.monotonic() + 120
        while not log.exists() or not log.read_text().strip():  # the module is running
            assert time.monotonic() < deadline and caller.poll() is None, "the module never started"
            time.sleep(0.05)
        assert not gone(child, within_s=0.5) and json.loads(log.read_text())["ppid"] != caller.pid
        caller.send_signal(signal.SIGKILL)
        caller.wait(timeout=30)
        assert gone(child, within_s=30), "the module outlived its killed caller"
    finally:
        caller.kill()
        if child and not gone(child, within_s=0.1):
            os.kill(child, signal.SIGKILL)
