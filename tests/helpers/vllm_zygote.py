"""Where the suite's vLLM processes start: forked from a process of vLLM's venv that imported vLLM once.

A vLLM engine of the suite spends ~15 CPU-s of its start on 2 cores importing vLLM in its API server (its
engine core and worker are forked from the server: tests/helpers/vllm_fork), and each script the suite runs
in vLLM's venv (tests/helpers/vllm_venv.py, the connector's contract) as much before its first line. The
zygote (``serve SOCKET``, one per pytest process that asks for it: ``vllm_python`` in tests/conftest.py)
imports ``PRELOAD`` with the environment an engine starts with (Intel OpenMP preloaded, this repository and
tests/helpers/vllm_fork on ``PYTHONPATH``), then forks each ``python -m MODULE ...`` or ``python -c CODE ...``
the suite runs with vLLM's venv. The ``python`` the suite gives as vLLM's (``SPECFORGE_VLLM_PYTHON``) is a
script that hands those two to ``run`` (tests/helpers/ray_zygote.py's caller: this process' stdio,
environment, folder and arguments; the child's exit status back) and runs anything else with vLLM's python.

A forked API server is not in the process group of the command its guard started (``children.guarded``
kills that group and removes what it held in /dev/shm), nor are the core and workers it forks: it starts a
session of its own, and a watcher (``watch_script``) ends that group as the guard ends its own (``children.GROUP``)
and removes what the group held in /dev/shm, once the caller (the command the guard started) is gone. The
guard's own clean-up of an engine's group is tested where the engines start as vLLM starts them: the test of
a starter killed while its engine starts, and the killed-engine test (whose engines a Ray actor starts, with
vLLM's python). A ``-c`` script goes with its caller (``forkserver.die_with``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

# what the suite's engines and scripts import, in this order (the last one freezes what the others made, as
# in our fork server: specforge/frozen_imports.py): the API server with the engine core, the CPU worker and
# the models of the suite's tiny targets, and what the venv scripts read (tests/helpers/vllm_venv.py)
PRELOAD = ("torch", "safetensors.torch", "vllm", "vllm.entrypoints.openai.api_server", "vllm.v1.engine.core",
           "vllm.v1.executor.multiproc_executor", "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner",
           "vllm.v1.spec_decode.eagle", "vllm.model_executor.models.llama", "vllm.model_executor.models.qwen3",
           "vllm.model_executor.models.qwen3_moe", "vllm.model_executor.models.llama_eagle3",
           "vllm.model_executor.models.registry", "vllm.model_executor.model_loader.utils", "vllm.engine.arg_utils",
           "vllm.transformers_utils.configs.speculators.base",
           "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector", "specforge.frozen_imports")
WATCH_POLL_S = 2.0  # how often the watcher records what the group holds in /dev/shm (the guard's GUARD_POLL_S)


def watch_script() -> str:
    """The watcher of a forked server's group (argv: the caller's pid, the group's id, grace s, poll s): it
    records the group's /dev/shm files while the caller lives, then ends the group and removes them."""
    from specforge.children import GROUP

    return GROUP + """
caller, leader, grace, poll = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
import select
segments, seen = set(), set()

def record():
    for pid in group(leader):
        seen.add(pid)
        segments.update(shm_of(pid))

try:
    gone = os.pidfd_open(caller)  # readable once the caller has exited
except ProcessLookupError:
    gone = None
while gone is not None:
    record()
    if select.select([gone], [], [], poll)[0]:
        break
record()
end_group(leader, grace)
unlink_shm(segments, seen)
"""


def _start_child(conn, req: dict, fds: list[int]) -> list[str]:
    """In the forked child: become the process ``req`` describes (a server: the leader of a session of its
    own, watched); returns its argv (``-m MODULE ...`` or ``-c CODE ...``)."""
    from specforge.children import GUARD_GRACE_S
    from specforge.forkserver import die_with
    from tests.helpers.ray_zygote import take_over

    argv = req["argv"]
    take_over(conn, req, fds)
    if argv[0] == "-m":
        os.setsid()
        subprocess.Popen([sys.executable, "-E", "-S", "-c", watch_script(), str(req["caller"]), str(os.getpid()),
                          str(GUARD_GRACE_S), str(WATCH_POLL_S)], start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL)
    else:  # the caller killed (subprocess.run's timeout) ends the script, as it ends vLLM's python
        signal.signal(signal.SIGTERM, lambda *_: _quit(143))
        die_with(req["caller"], signal.SIGTERM)
    return argv


def _run(argv: list[str]) -> None:
    """``python -m MODULE ARGS`` / ``python -c CODE ARGS`` as the interpreter runs them, in this process."""
    import runpy
    import types

    if argv[0] == "-m":
        sys.path.insert(0, os.getcwd())
        sys.argv = argv[1:]  # runpy puts the module's file first
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    sys.path.insert(0, "")
    sys.argv = ["-c", *argv[2:]]
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    exec(compile(argv[1], "<string>", "exec"), main.__dict__)


def wrapper(folder, real_python: str, sock: str) -> str:
    """A ``python`` under ``folder/bin`` that hands ``-m`` and ``-c`` runs to the zygote at ``sock`` and runs the
    rest with ``real_python``; ``folder/lib`` links vLLM's Intel OpenMP, which an engine preloads from there
    (``EngineSpec.env``)."""
    import shlex
    from pathlib import Path

    from specforge.models.vllm_engine import intel_openmp
    from tests.helpers.ray_zygote import write_python

    folder, real = Path(folder), Path(real_python)
    python = folder / "bin" / "python"
    python.parent.mkdir(parents=True, exist_ok=True)
    if (iomp := intel_openmp(real)).exists():  # where EngineSpec.env looks for it beside this python
        intel_openmp(python).parent.mkdir(exist_ok=True)
        intel_openmp(python).symlink_to(iomp)
    run = shlex.join([str(real), "-E", "-S", os.path.abspath(__file__), "run", sock])
    return write_python(python, str(real), run, "-m|-c")


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    mode, sock, *rest = sys.argv[1:]
    if mode == "run":  # the caller: ``-E -S``, the standard library only (its sibling ray_zygote is one)
        import ray_zygote

        sys.exit(ray_zygote.run(sock, rest))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]  # no helper shadows a module
    from tests.helpers import ray_zygote

    signal.signal(signal.SIGTERM, lambda *_: _quit(0))  # the fixture's terminate

    argv = ray_zygote.serve(sock, PRELOAD, _start_child)
    if not argv:
        sys.exit(0)
    _quit(_exit_status(argv))


def _exit_status(argv: list[str]) -> int:
    """Run ``argv`` and say its exit status as the interpreter would, without the interpreter's teardown: the
    final collection over vLLM's imports took ~3 s of each forked child (its caller waits for it); what a run
    leaves behind, the watcher (a server's group) or die_with (a script) ends."""
    import traceback

    try:
        _run(argv)
        status = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            status = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException:
        traceback.print_exc()
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return status


def _quit(status: int) -> None:
    """``os._exit(status)``, once what Intel OpenMP removes as its process exits is removed: its registration
    file in /dev/shm, named by the pid."""
    with contextlib.suppress(OSError):
        os.unlink(f"/dev/shm/__KMP_REGISTERED_LIB_{os.getpid()}_{os.getuid()}")
    os._exit(status)


if __name__ == "__main__":
    main()
