"""Where the suite's Ray cluster starts its worker processes: forked from a process that imported torch once.

A Ray actor of ours spends most of its CPU before its first line of work: a fresh interpreter importing
torch, ``torch.distributed.tensor`` (sympy) and ``torch._dynamo`` (transformers' loading and masking code
reach both). The suite starts some 150 actors. Ray's raylet starts a worker as
``<python> default_worker.py <its arguments>``, or, for a worker with a runtime environment, as
``<python> setup_worker.py ... default_worker.py ...``; the suite's cluster (``ray_session`` in
tests/conftest.py) starts with ``<python>`` a script that hands both to this file's ``run``, which asks the
zygote (``serve``, one per pytest process) to fork the worker from its imports.

* ``serve SOCKET``: import ``PRELOAD`` (nothing else: no thread, no OpenMP pool, no CUDA), freeze what the
  imports left (``gc.freeze``: no child's garbage collection walks those objects again), then for each
  connection fork a child that takes the caller's stdin/stdout/stderr (passed over the socket), its
  environment, folder and arguments, and runs ``default_worker.py`` as ``python default_worker.py ...`` would.
  The zygote reaps it and sends the caller its exit status.
* ``run SOCKET SCRIPT ARGS...``: the process Ray started (what Ray kills and waits for). It stays until
  the forked worker exits and exits as it did; a SIGTERM, SIGINT or SIGHUP it gets goes to the worker, and a
  worker whose caller is gone (SIGKILLed by Ray) exits at once.

Only the preloaded modules differ from a spawned worker: what they read from the environment at import
(torch's OpenMP thread count, which ``_start_child`` sets again from the worker's environment) is the
pytest process', as it is for the workers themselves (Ray's local cluster inherits it). The few of our
modules in ``PRELOAD`` read nothing from the environment at import; the rest are imported by the worker
as usual. A runtime
environment that only sets variables is applied in the forked worker (``_as_worker``) instead of by
setup_worker.py, a process importing Ray that then execs the worker.
Runs of ours that start their own Ray cluster (the CLI tests, the chaos test) start their workers the usual
way, so that path stays tested.
"""

from __future__ import annotations

import array
import json
import os
import select
import signal
import socket
import struct
import sys

# the last one, as in our fork server's PRELOAD (specforge/forkserver.py), freezes what the others made: a
# worker's target from_pretrained took 0.45 CPU-s before, 0.13 after (its first full collections walked them).
# Between them, what nearly every worker imported after the fork (a dump of sys.modules in 76 workers of
# test_ray_train and test_failures): the tiny targets' Llama modeling, pydantic (Ray's serialization
# imports it), and our modules that import no Ray and read nothing from the environment at import
# (test_failures + test_ray_train: 145 and 162 CPU-s before, 134 and 141 after, alternating runs). Not Ray:
# a worker forked from a zygote that imported it fails as its core worker starts ("Check failed:
# !job_id_env.empty()"). Nor pyarrow: its import starts jemalloc's background thread (numpy's OpenBLAS pool,
# which re-creates itself after a fork, is the one other thread here), and its cost is small.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo", "transformers",
           "transformers.modeling_utils", "transformers.models.llama.modeling_llama",
           "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto",
           "transformers.generation.utils", "pydantic", "pydantic.v1", "specforge.training.trainer",
           "specforge.models.target", "specforge.models.vllm_engine", "specforge.parallel.parallelize",
           "specforge.registry", "specforge.data.prepare", "specforge.data.packing", "specforge.algorithms.eagle3",
           "specforge.frozen_imports")
READY = "ready"
OFF_ENV = "SPECFORGE_TEST_SPAWN_RAY_WORKERS"  # =1: the suite's cluster spawns its workers as Ray does
STATUS = struct.Struct("!i")


def _send(conn: socket.socket, data: bytes, fds=()) -> None:
    head = STATUS.pack(len(data))
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    conn.sendmsg([head + data], anc)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def wait_ready(server, timeout_s: float) -> str:
    """The zygote's first line (``READY`` once its imports are done), or what it said instead; bounded."""
    ready, _, _ = select.select([server.stdout], [], [], timeout_s)
    return server.stdout.readline().strip() if ready else f"nothing within {timeout_s:.0f} s"


def write_python(path, python: str, run: str, handed: str) -> str:
    """A ``python`` script at ``path`` that runs the command lines whose first argument matches the shell pattern
    ``handed`` with ``run`` (a zygote's caller, as a shell command) and the rest with ``python``."""
    import shlex
    from pathlib import Path

    path = Path(path)
    path.write_text(f'#!/bin/sh\ncase "$1" in\n  {handed}) exec {run} "$@" ;;\nesac\nexec {shlex.quote(python)} "$@"\n')
    path.chmod(0o755)
    return str(path)


def run(sock_path: str, argv: list[str]) -> int:
    """The caller: hand this process' stdio, environment, folder and arguments to the zygote, pass on
    the signals Ray sends, and exit as the forked worker did."""
    child, pending = [], []  # a signal before the worker's pid is here (it may already run and print) waits

    def forward(signum, _frame):
        if not child:
            pending.append(signum)
            return
        try:
            os.kill(child[0], signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(sock_path)
    msg = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "caller": os.getpid()}).encode()
    _send(conn, msg, fds=[0, 1, 2])
    child.extend(STATUS.unpack(_recv_exact(conn, STATUS.size)))
    while pending:
        forward(pending.pop(0), None)
    try:
        (status,) = STATUS.unpack(_recv_exact(conn, STATUS.size))
    except EOFError:
        return 1
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def take_over(conn: socket.socket, req: dict, fds: list[int]) -> None:
    """In the forked child: the caller's stdio, environment and folder, the default signal handlers, and no
    connection of the zygote's."""
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    conn.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    from specforge.forkserver import adopt_env  # stdlib only: nothing of ours read at import

    adopt_env(req["env"])
    os.chdir(req["cwd"])


def _start_child(conn: socket.socket, req: dict, fds: list[int]) -> list[str]:
    """In the forked child: become the worker ``req`` describes; returns its argv."""
    take_over(conn, req, fds)
    from specforge.forkserver import die_with  # stdlib only: nothing of ours read at import

    argv = _as_worker(req["argv"])
    if "OMP_NUM_THREADS" in os.environ:
        import torch

        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
    die_with(req["caller"], signal.SIGKILL)  # as a spawned worker would have gone with the process Ray started
    return argv


def _as_worker(argv: list[str]) -> list[str]:
    """What to run for Ray's ``argv``. A worker with a runtime environment comes as ``setup_worker.py ...
    default_worker.py ...``: Ray's setup_worker.py sets the environment's variables and then execs the
    worker with the environment's Python. Where that is all it would do (variables only, none that an
    interpreter reads as it starts, this Python), they are set here and the worker runs in this forked
    process (an exec would lose the preloaded imports and this caller's watch); for anything more,
    setup_worker.py itself runs."""
    if not argv or os.path.basename(argv[0]) != "setup_worker.py":
        return argv
    import argparse
    import re

    parser = argparse.ArgumentParser(add_help=False)  # the two options setup_worker.py takes, as it parses them
    parser.add_argument("--serialized-runtime-env-context", type=str)
    parser.add_argument("--language", type=str)
    args, rest = parser.parse_known_args(argv[1:])
    # RuntimeEnvContext's fields, read without importing Ray here: Ray's extension reads the worker's
    # environment when it loads, so it must load in the worker after every variable is set
    ctx = json.loads(args.serialized_runtime_env_context or "{}")
    env_vars = ctx.get("env_vars") or {}
    if (args.language != "PYTHON" or ctx.get("command_prefix") or ctx.get("override_worker_entrypoint")
            or ctx.get("py_executable") not in (None, sys.executable)
            or not rest or os.path.basename(rest[0]) != "default_worker.py"
            or any(k.startswith("PYTHON") for k in env_vars)):  # read by an interpreter as it starts
        return argv
    for key, value in env_vars.items():  # as ray._private.utils.update_envs sets them
        os.environ[key] = re.sub(r"\$\{[A-Z0-9_]+\}", "", os.path.expandvars(value))
    return rest


def _request(conn: socket.socket) -> tuple[dict, list[int]]:
    """A caller's request (its JSON) and the stdio descriptors that came with its first bytes."""
    conn.settimeout(30.0)  # a caller sends at once; a stuck one must not stop the zygote
    data, anc, _, _ = conn.recvmsg(1 << 20, socket.CMSG_LEN(3 * array.array("i").itemsize))
    fds = []
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(array.array("i", payload[: len(payload) - len(payload) % 4]))
    try:
        if len(data) < STATUS.size:
            data += _recv_exact(conn, STATUS.size - len(data))
        size = STATUS.unpack(data[: STATUS.size])[0]
        data = data[STATUS.size:]
        if len(data) < size:
            data += _recv_exact(conn, size - len(data))
        req = json.loads(data)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    conn.settimeout(None)
    return req, fds


def serve(sock_path: str, preload=PRELOAD, start_child=_start_child) -> list[str]:
    """The zygote's loop; returns (in a forked child only) the argv the child is to run. ``start_child(conn, req,
    fds)`` makes the forked child what the request asks and returns that argv (by default a Ray worker:
    ``_start_child``); tests/helpers/vllm_zygote.py serves vLLM's processes with the same loop."""
    import importlib

    for name in preload:
        importlib.import_module(name)
    if os.path.exists(sock_path):
        os.unlink(sock_path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(sock_path)
    server.listen(64)
    parent = os.getppid()
    print(READY, flush=True)
    callers = {}  # forked worker pid -> the caller's connection, told the exit status
    while True:
        ready, _, _ = select.select([server], [], [], 0.2)
        while callers:  # reap without a thread or a SIGCHLD handler: the zygote forks single-threaded
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = callers.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(STATUS.pack(status))
                except OSError:
                    pass
                conn.close()
        if os.getppid() != parent:  # the pytest process is gone
            return []
        if not ready:
            continue
        conn, _ = server.accept()
        try:
            req, fds = _request(conn)
        except (OSError, EOFError, ValueError) as err:  # a caller that went or sent garbage: not the zygote's end
            print(f"ray_zygote: a request failed: {err!r}", file=sys.stderr, flush=True)
            conn.close()
            continue
        pid = os.fork()
        if pid == 0:
            server.close()
            for other in callers.values():
                other.close()
            return start_child(conn, req, fds)
        for fd in fds:
            os.close(fd)
        conn.sendall(STATUS.pack(pid))
        callers[pid] = conn


def main() -> None:
    mode, sock_path, *rest = sys.argv[1:]
    if mode == "run":
        sys.exit(run(sock_path, rest))
    argv = serve(sock_path)
    if not argv:
        sys.exit(0)
    import runpy

    sys.argv = argv
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
