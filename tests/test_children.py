"""specforge.children: a child started with ``tied`` goes when the process that started it dies, even by
SIGKILL, and is started without ``preexec_fn`` (Python between fork and exec, unsafe with threads)."""

import os
import signal
import subprocess
import sys
import time
import types

from specforge.children import PRELUDE, tied

STARTER = """
import subprocess, sys
from specforge.children import tied
cmd = ["sleep", "120"]
child = subprocess.Popen(tied(cmd) if sys.argv[1] == "tied" else cmd, start_new_session=True)
print(child.pid, flush=True)
sys.stdin.read()  # until killed
"""


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # reaped by init once orphaned; a zombie still answers kill(0)
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


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
    assert _gone(child, 10), "the tied child outlived its starter"
    starter, child = _start("plain")  # the control: nothing sends it a signal
    try:
        starter.kill()
        starter.wait()
        assert not _gone(child, 1.0)
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
