"""specforge.children: a child started with ``tied`` goes when the process that started it dies, even by
SIGKILL, and is started without ``preexec_fn`` (Python between fork and exec, unsafe with threads)."""

import contextlib
import os
import signal
import subprocess
import sys
import time
import types

from specforge.children import PRELUDE, tied
from tests.helpers.processes import gone

STARTER = """
import subprocess, sys
from specforge.children import tied
cmd = ["sleep", "120"]
child = subprocess.Popen(tied(cmd) if sys.argv[1] == "tied" else cmd, start_new_session=True)
print(child.pid, flush=True)
sys.stdin.read()  # until killed
"""


def _start(how: str) -> tuple[subprocess.Popen, int]:
    starter = subprocess.Popen([sys.executable, "-c", STARTER, how], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return starter, int(starter.stdout.readline())


def test_a_tied_child_dies_with_its_starter_killed_by_sigkill_and_an_untied_one_does_not():
    starter, child = _start("tied")
    deadline = time.monotonic() + 10
    while open(f"/proc/{child}/cmdline").read().split("\0")[:2] != ["sleep", "120"]:  # the prelude execs in place
        assert time.monotonic() < deadline, open(f"/proc/{child}/cmdline").read()
        time.sleep(0.02)
    starter.kill()
    starter.wait()
    assert gone(child, 10), "the tied child outlived its starter"
    starter, child = _start("plain")  # the control: nothing sends it a signal
    try:
        starter.kill()
        starter.wait()
        assert not gone(child, 1.0)
    finally:
        os.kill(child, signal.SIGKILL)


def test_a_child_whose_starter_died_before_the_signal_was_set_does_not_run():
    """The prelude checks its parent is the starter: one whose starter already died exits, never runs."""
    marker = f"/tmp/specforge-children-{os.getpid()}"
    out = subprocess.run([sys.executable, "-E", "-S", "-c", PRELUDE, "1", "touch", marker], timeout=30)
    assert out.returncode == 143 and not os.path.exists(marker)
    out = subprocess.run(tied(["touch", marker]), timeout=30)  # this process is the parent: it runs
    try:
        assert out.returncode == 0 and os.path.exists(marker)
    finally:
        os.remove(marker)


def _preexec_calls(source: str) -> list[int]:
    import ast

    return [node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.keyword)
            and node.arg == "preexec_fn"]


def test_no_child_process_of_the_package_is_started_with_preexec_fn():
    """The rule over every module of specforge/; the control: a snippet that passes one is caught."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "specforge"
    found = {str(p.relative_to(root)): lines for p in sorted(root.rglob("*.py"))
             if (lines := _preexec_calls(p.read_text()))}
    assert found == {}, found
    assert _preexec_calls("import subprocess\nsubprocess.Popen(['x'], preexec_fn=print)\n") == [2]


def test_engines_are_started_without_preexec_fn(monkeypatch, tmp_path):
    """llama-server and vLLM's server: Popen gets ``tied`` commands and no ``preexec_fn`` (the vLLM
    server in a new session: its group is what close() kills)."""
    import specforge.engines.llamacpp as llamacpp
    import specforge.models.vllm_engine as vllm_engine

    seen = []

    class Stop(Exception):
        pass

    real = subprocess.Popen

    def popen(args, **kw):
        if not any("llama-server" in str(a) or "vllm.entrypoints" in str(a) for a in args):
            return real(args, **kw)  # what imports run on the way (ctypes' ldconfig)
        seen.append((args, kw))
        raise Stop

    monkeypatch.setattr(subprocess, "Popen", popen)
    srv = llamacpp.LlamaServer.__new__(llamacpp.LlamaServer)
    srv.args = ["llama-server", "-m", "t.gguf"]
    monkeypatch.setattr(llamacpp.tempfile, "TemporaryDirectory", lambda **kw: types.SimpleNamespace(name=str(tmp_path)))
    try:
        srv.__enter__()
    except Stop:
        pass
    spec = vllm_engine.EngineSpec(model_path="m", layer_ids=[1, 2], dtype=__import__("torch").float32, max_model_len=8)
    monkeypatch.setattr(vllm_engine, "engine_python", lambda configured: tmp_path / "python")
    try:
        vllm_engine.VllmEngine(spec, storage_root=str(tmp_path), log_dir=str(tmp_path))
    except Stop:
        pass
    assert len(seen) == 2
    for args, kw in seen:
        assert "preexec_fn" not in kw and args[:5] == tied([])[:5], args
    assert seen[1][1].get("start_new_session") is True


# ---------------------------------------------------------------- the guard and the reaper: nothing left behind

# What a killed vLLM leaves: a POSIX shared-memory segment it maps (created as vLLM's message queues are,
# without Python's resource tracker, which would unlink it itself) and Intel OpenMP's registration file;
# plus a process under it in its group.
ENGINE = """
import _posixshmem, mmap, multiprocessing, os, subprocess, sys, time
lock = multiprocessing.get_context("spawn").Lock()  # a named semaphore, which Python's resource tracker unlinks
name = f"/psm_sftest_{os.getpid()}"
fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
os.ftruncate(fd, 1 << 20)
seg = mmap.mmap(fd, 1 << 20)
os.close(fd)
open(f"/dev/shm/__KMP_REGISTERED_LIB_{os.getpid()}_{os.getuid()}", "w").write("x")
kid = subprocess.Popen(["sleep", "120"])
print(os.getpid(), kid.pid, "/dev/shm" + name, f"/dev/shm/__KMP_REGISTERED_LIB_{os.getpid()}_{os.getuid()}",
      "/dev/shm/sem." + lock._semlock.name.lstrip("/"), flush=True)
time.sleep(120)
"""

GUARDED = """
import subprocess, sys
from specforge.children import guarded
p = subprocess.Popen(guarded([sys.executable, "-c", sys.argv[1]], poll_s=0.1), start_new_session=True,
                     stdout=subprocess.PIPE, text=True)
print(p.pid, p.stdout.readline().strip(), flush=True)
sys.stdin.read()  # until killed
"""

REAPED = """
import os, subprocess, sys
from specforge.children import REAP_GRACE_S, REAPER, start_time
engine = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
line = engine.stdout.readline().strip()
other = int(sys.argv[2])  # a pid whose process is not the one meant ("stale": it started at another time)
other_start = start_time(other) - (sys.argv[3] == "stale")
subprocess.Popen([sys.executable, "-E", "-S", "-c", REAPER, str(os.getpid()), str(REAP_GRACE_S), "0.1",
                  f"{engine.pid}:{start_time(engine.pid)}", f"{other}:{other_start}"])  # as children.reaper does
print(line, flush=True)
sys.stdin.read()
"""


def _starter(script: str, *args) -> tuple[subprocess.Popen, list[str]]:
    starter = subprocess.Popen([sys.executable, "-c", script, ENGINE, *map(str, args)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True,
                               cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return starter, starter.stdout.readline().split()


def _remove(*files) -> None:
    for f in files:
        with contextlib.suppress(FileNotFoundError):
            os.remove(f)


def _left(pids, files) -> list:
    return [p for p in pids if not gone(int(p), 0.01)] + [f for f in files if os.path.exists(f)]


def _settled(pids, files, within_s: float) -> list:
    deadline = time.monotonic() + within_s
    while (left := _left(pids, files)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def test_a_guarded_engine_leaves_no_process_or_shared_memory_when_its_starter_dies_or_it_dies():
    """The engine's starter SIGKILLed, or the engine itself, or the guard's front (the starter's child: what
    Ray SIGKILLs when an actor exits in order): its group is gone and so are its segment, its OpenMP
    registration and its named semaphore. The control: the same engine's group SIGKILLed without the
    guard leaves all three."""
    for victim in ("starter", "engine", "front"):
        starter, (guard, engine, kid, seg, kmp, sem) = _starter(GUARDED)
        try:
            assert all(map(os.path.exists, (seg, kmp, sem)))
            # the guard records what its group maps every 0.1 s here; a SIGKILLed engine maps nothing more, so
            # before killing it give the guard 20 looks (a loaded machine may hold it off the CPU for a while)
            time.sleep(2.0 if victim == "engine" else 0.5)
            os.kill({"starter": starter.pid, "engine": int(engine), "front": int(guard)}[victim], signal.SIGKILL)
            assert _settled([guard, engine, kid], [seg, kmp, sem], 20) == [], victim
        finally:
            starter.kill()
            starter.wait()
            _remove(seg, kmp, sem)
    engine = subprocess.Popen([sys.executable, "-c", ENGINE], stdout=subprocess.PIPE, text=True, start_new_session=True)
    _, kid, seg, kmp, sem = engine.stdout.readline().split()
    try:
        os.killpg(engine.pid, signal.SIGKILL)
        engine.wait()
        assert _settled([kid], [], 10) == []
        assert all(map(os.path.exists, (seg, kmp, sem))), "the control: an unguarded engine leaves its files"
    finally:
        _remove(seg, kmp, sem)


def test_the_reaper_ends_only_the_processes_it_was_given_and_removes_what_they_left():
    """A driver SIGKILLed: its reaper ends the child it was given (and the child's own child) and removes
    the child's segment, OpenMP registration and named semaphore. A pid it was given whose process started
    at another time than the one meant (the pid was taken by another process) is never signalled; the
    control: the same process named with its own start time is."""
    for how in ("stale", "same"):
        other = subprocess.Popen(["sleep", "120"])
        starter, (engine, kid, seg, kmp, sem) = _starter(REAPED, other.pid, how)
        try:
            starter.kill()
            starter.wait()
            assert _settled([engine, kid], [seg, kmp, sem], 20) == [], how
            # the reaper removes the files last, after its SIGTERM and SIGKILL to every pid it was given: by
            # now a signal it sent has landed, and a SIGKILLed process is gone or a zombie at once
            assert gone(other.pid, 0.5) == (how == "same"), how
        finally:
            other.kill()
            other.wait()
            _remove(seg, kmp, sem)


def test_an_engine_started_by_a_ray_actor_goes_when_the_actor_is_killed(ray_session):
    """``ray.kill`` of an actor that started a guarded engine (as a placement shut down for a restart is): Ray
    SIGKILLs the actor's child processes at once, the guard's front among them; the engine and its own child
    go all the same. (Before the front, Ray's kill took the guard itself and left the engine running.)"""
    ray = ray_session
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    @ray.remote(num_cpus=0)
    class Starter:
        def start(self) -> tuple[int, list[str]]:
            sys.path.insert(0, repo)
            from specforge.children import guarded

            self.p = subprocess.Popen(guarded([sys.executable, "-c", ENGINE], poll_s=0.1), start_new_session=True,
                                      stdout=subprocess.PIPE, text=True, cwd=repo)
            return self.p.pid, self.p.stdout.readline().split()

    actor = Starter.remote()
    front, (engine, kid, seg, kmp, sem) = ray.get(actor.start.remote(), timeout=120)
    try:
        assert all(map(os.path.exists, (seg, kmp, sem)))
        time.sleep(0.5)
        ray.kill(actor)
        assert _settled([front, engine, kid], [seg, kmp, sem], 20) == []
    finally:
        for pid in (engine, kid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        _remove(seg, kmp, sem)
