"""Child processes (engines, servers, a round's trainer) that go when the process that started them goes.

Linux's ``PR_SET_PDEATHSIG`` sends the child a signal when its parent dies, even by SIGKILL, where no
``__exit__`` or ``finally`` runs. It used to be set from ``Popen(preexec_fn=...)``: Python code between
fork and exec, which can deadlock in a process with threads (a Ray actor, our watcher threads: a lock
another thread held at the fork stays held in the child; ``ctypes.CDLL`` loads a library there). Now
the child execs a small prelude in a fresh interpreter (``tied``): it sets the signal, which exec keeps,
checks that its parent is still the process that started it (else that parent died before the signal
was set, and nothing would ever send it), and execs the command in place (the same pid). A new session,
where a caller wants one, is ``Popen(start_new_session=True)``, done by Popen in C.

The signal follows the parent *thread*: start children from a thread that outlives them (an actor's
method thread, the main thread), as the callers here do.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Sequence

PRELUDE = """
import ctypes, os, signal, sys
parent = int(sys.argv[1])
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG (Linux)
except (OSError, AttributeError):
    pass
if os.getppid() != parent:  # the parent died before the signal was set
    sys.exit(143)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def tied(cmd: Sequence[str], python: str = sys.executable) -> list[str]:
    """``cmd`` run so that it gets SIGTERM when this process dies (``python`` runs the prelude: this
    interpreter by default, without site packages or PYTHON* variables; the command gets the
    environment unchanged)."""
    return [python, "-E", "-S", "-c", PRELUDE, str(os.getpid()), *map(str, cmd)]


# The reaper of a cluster this process started (``reaper``): it sleeps until SIGTERM, which
# PR_SET_PDEATHSIG sends when its parent dies (the ``tied`` prelude), then ends the given processes and
# every process under them: SIGTERM, up to REAP_GRACE_S for them to go, SIGKILL for the rest. A parent
# that ends normally SIGKILLs the reaper first (``stop``): nothing is signalled then.
REAPER = """
import os, signal, sys, time
pids, grace = [int(p) for p in sys.argv[2:]], float(sys.argv[1])

def alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False

def family(roots):  # roots and every process under them (a raylet's agents and workers), from /proc
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    kids.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out

def reap(*_):
    global pids
    pids = family(pids)  # before any goes: an orphan's parent id is no longer its starter's
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace
        while any(map(alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.1)
    os._exit(0)

signal.signal(signal.SIGTERM, reap)
signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the group is the parent's to handle (it stops us)
while True:
    signal.pause()
"""
REAP_GRACE_S = 5.0


def reaper(pids: Sequence[int]):
    """A process that ends ``pids`` and their descendants (SIGTERM, then SIGKILL after ``REAP_GRACE_S``) if
    this process dies before calling ``stop(reaper)``, even by SIGKILL: a driver's own Ray cluster goes with
    it. Start it from the thread that outlives the cluster (the main thread)."""
    return subprocess.Popen(tied([sys.executable, "-E", "-S", "-c", REAPER, str(REAP_GRACE_S), *map(str, pids)]),
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)


def stop(proc) -> None:
    """End a ``reaper`` without it signalling anything (its cluster was shut down in order)."""
    proc.kill()
    proc.wait()
