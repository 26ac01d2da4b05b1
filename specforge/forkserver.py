"""multiprocessing's fork server: where this process starts its short-lived Python processes.

A fresh interpreter spends ~1 s of CPU importing torch and ~1 s more on transformers before its
first line of work, and ~3 s more where it loads a model or wraps one with FSDP (transformers' loading
code reaches ``torch.distributed.tensor``, and with it sympy; its masking code ``torch._dynamo``); the
fork server (one per process, started on first use) imports them once (``PRELOAD``) and forks each
child from there. It is a fresh interpreter that has run nothing but
those imports (no thread but numpy's OpenBLAS pool, which re-creates itself after a fork; no OpenMP
pool, no CUDA context), so forking it is as safe as spawning
(Python 3.14 made it Linux's default start method). What a child does not get from it is the
caller's environment at the time of the call: callers hand it over (``adopt_env``), as a spawned
process would inherit it. What a preloaded module read from the environment at its import (torch's
``TORCH_*`` switches, huggingface_hub's ``HF_HUB_OFFLINE``) stays what it was when the server started.

Users: ``parallel.launch.run_ranks`` (local ranks of the tests and benchmarks), ``engines.llamacpp``'s
converter runs (``run_script``) and adapt's rounds (``start_module``: ``python -m specforge.train``, ~5 CPU-s
of imports saved a round). Every child imports the caller's ``__main__`` again, as a spawned one would: a
call under a script that lacks ``if __name__ == "__main__"`` takes a fresh interpreter instead
(``main_is_rerun_safe``).
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Optional, Sequence

from specforge.children import tied

# what the fork server imports once, in this order; a module that fails to import is skipped by
# multiprocessing. The last one freezes what the others made (specforge/frozen_imports.py). The server's
# start takes ~3 CPU-s more for the distributed, dynamo and modeling imports (5.8 against 2.7); a child
# that loads a model or an FSDP rank saves ~2.5 (four of the suite's SP modules: 95 -> 47 CPU-s), and so
# does a converter run, whose transformers imports reach the same modules (test_targets_export's ~34
# conversions in a suite run: 33 -> 13 CPU-s). The Llama modeling code: the embedded default's family.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp", "torch._dynamo",
           "transformers", "transformers.modeling_utils", "transformers.models.llama.modeling_llama",
           "specforge.device", "specforge.frozen_imports")


def context():
    """The fork-server context, told what to preload (which applies when the server starts: the
    first use in this process)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def adopt_env(env: dict) -> None:
    """In a child: the caller's environment at the call, not the fork server's from its start; and the
    temporary folder it names (``tempfile`` caches the one it found first: the server's imports asked)."""
    os.environ.clear()
    os.environ.update(env)
    if "tempfile" in sys.modules:
        sys.modules["tempfile"].tempdir = None  # read again from TMPDIR (TEMP, TMP) at the next use


def _redirect(log: str, append: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    fd = os.open(log, flags, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def run_script(script: str, argv: list[str], env: dict, log: str) -> None:
    """In a child: ``python script *argv`` as the interpreter would run it (``__main__``, the
    script's folder first on ``sys.path``), stdout and stderr to the file ``log``. Its exit status
    is the child's (an uncaught exception: 1, its traceback in ``log``)."""
    adopt_env(env)
    _redirect(log, append=False)
    sys.argv = [script, *argv]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


def main_is_rerun_safe() -> bool:
    """Can a child of the fork server import this process' ``__main__`` again? multiprocessing
    re-imports it in every child (as ``__mp_main__``): a module run with ``-m`` (pytest, our CLIs) is
    imported by name, its ``if __name__ == "__main__"`` block skipped; ``-c`` and an interactive session
    have no file to import. A script run by path (``python my_script.py``) would be run again from its
    top, and one without that guard would start the child again from inside the child."""
    main = sys.modules.get("__main__")
    return getattr(main, "__spec__", None) is not None or getattr(main, "__file__", None) is None


def run_script_in_child(script: str, argv: list[str], log: str) -> int:
    """``run_script`` in a child forked from the fork server; its exit status once it ended. Under a
    caller's ``__main__`` that a child cannot import again safely (``main_is_rerun_safe``): a fresh
    interpreter, ``python script *argv``, with the same log."""
    if not main_is_rerun_safe():
        with open(log, "wb") as out:
            return subprocess.run([sys.executable, script, *argv], stdout=out, stderr=subprocess.STDOUT).returncode
    p = context().Process(target=run_script, args=(script, list(argv), dict(os.environ), log))
    p.start()
    p.join()
    return p.exitcode


def die_with(pid: int, sig: int = signal.SIGTERM) -> None:
    """In a child: signal ``sig`` to itself once process ``pid`` (its caller) has exited, as ``children.tied``
    gives a spawned child SIGTERM (whose parent the caller is; a forked one's is the fork server, which outlives
    its caller while a child holds its pipe). A caller already gone: at once."""
    try:
        fd: Optional[int] = os.pidfd_open(pid)  # Linux 5.3+: readable once pid has exited
    except ProcessLookupError:
        os.kill(os.getpid(), sig)
        return
    except (AttributeError, OSError):
        fd = None

    def watch():
        if fd is not None:
            select.select([fd], [], [])
        else:  # no pidfd: look every half second
            while True:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                except PermissionError:
                    pass
                select.select([], [], [], 0.5)
        os.kill(os.getpid(), sig)

    threading.Thread(target=watch, name="specforge-caller-watch", daemon=True).start()


def run_module(module: str, argv: list[str], env: dict, cwd: str, log: str, caller: int) -> None:
    """In a child: ``python -m module *argv`` as the interpreter would run it (``__main__``, the caller's
    folder first on ``sys.path``), in the caller's environment, stdout and stderr appended to the file
    ``log``, SIGTERM when the caller exits. Its exit status is the child's (``sys.exit(n)``: n; an uncaught
    exception: 1, its traceback in ``log``). ``sys.path`` is otherwise the fork server's: a ``PYTHONPATH``
    the caller set after the server started does not reach it."""
    adopt_env(env)
    os.chdir(cwd)
    sys.path.insert(0, cwd)
    _redirect(log, append=True)
    die_with(caller)
    sys.argv = [module, *argv]  # run_module puts the module's file first
    runpy.run_module(module, run_name="__main__", alter_sys=True)


class _Forked:
    """A fork-server child behind ``subprocess.Popen``'s calls that its callers use."""

    def __init__(self, process) -> None:
        self.process = process
        self.pid = process.pid

    @property
    def returncode(self) -> Optional[int]:
        return self.process.exitcode

    def poll(self) -> Optional[int]:
        return self.process.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(f"-m {self.process.name}", timeout)
        return self.process.exitcode

    def terminate(self) -> None:
        self.process.terminate()

    def kill(self) -> None:
        self.process.kill()


def start_module(module: str, argv: Sequence[str], log: str):
    """``python -m module *argv``, started now, forked from the fork server (``run_module``): a handle
    with Popen's ``poll``, ``wait``, ``terminate``, ``kill``, ``returncode`` and ``pid``. It gets SIGTERM
    when this process exits (by SIGKILL too). Under a ``__main__`` a child cannot import again
    (``main_is_rerun_safe``): a fresh interpreter (``children.tied``), with the same log, appended."""
    if not main_is_rerun_safe():
        with open(log, "ab") as out:
            return subprocess.Popen(tied([sys.executable, "-m", module, *argv]), stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    p = context().Process(target=run_module, name=module,
                          args=(module, list(argv), dict(os.environ), os.getcwd(), log, os.getpid()))
    p.start()
    return _Forked(p)
