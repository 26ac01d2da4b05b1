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


# What the reaper and the guard read from /proc (both run as ``-E -S`` scripts: no import of ours), and what
# they remove from /dev/shm once the processes they ended are gone: the POSIX shared-memory segments those
# processes mapped or held open (vLLM's message queues: ``psm_*``, hundreds of MiB each, unlinked only by an
# orderly shutdown) and Intel OpenMP's registration file, named by pid (vLLM's CPU build preloads libiomp5).
# Only files of this user directly under /dev/shm; never a folder's contents (our own hand-off folders are
# handoff.py's to sweep).
PROC = """
import os, signal, sys, time

def stat(pid):  # (state, ppid, pgrp, start time in clock ticks since boot) of pid, None once it is gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read().rsplit(")", 1)[1].split()
        return s[0], int(s[1]), int(s[2]), int(s[19])
    except (OSError, IndexError, ValueError):
        return None

def table():  # {pid: stat(pid)} of every process
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (s := stat(int(d))) is not None:
            out[int(d)] = s
    return out

def shm_of(pid):  # the files directly under /dev/shm that pid maps or holds open
    found = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                i = line.find(" /dev/shm/")
                if i >= 0:
                    found.add(line[i + 1:].rstrip().removesuffix(" (deleted)"))
    except OSError:
        pass
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                found.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                pass
    except OSError:
        pass
    return {p for p in found if p.startswith("/dev/shm/") and "/" not in p[len("/dev/shm/"):]}

def unlink_shm(paths, pids):  # what the ended pids left in /dev/shm (this user's files only)
    uid = os.getuid()
    registered = {f"/dev/shm/__KMP_REGISTERED_LIB_{pid}_{uid}" for pid in pids if (stat(pid) or "Z")[0] == "Z"}
    for p in set(paths) | registered:
        try:
            if os.stat(p).st_uid == uid:
                os.unlink(p)
        except OSError:
            pass
"""

# The reaper of a cluster this process started (``reaper``): it pins the given processes (a pidfd each, for
# the process of that pid and start time: a pid another process takes once they exit is never signalled)
# and, every REAP_POLL_S, every process under them and the /dev/shm files they hold. When its parent dies
# (PR_SET_PDEATHSIG's SIGTERM, set as the ``tied`` prelude does but once the handler is in place; a parent
# already gone by then is reaped for at once) it ends every live one of them: SIGTERM, up to REAP_GRACE_S
# for them to go, SIGKILL for the rest; then removes what they left in /dev/shm. A parent that ends
# normally SIGKILLs the reaper first (``stop``): nothing is signalled then.
REAPER = PROC + """
parent, grace, poll = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])

def pin(pid, ppid=None, start=None):  # a handle on pid if it is still ppid's child / started at start
    try:
        fd = os.pidfd_open(pid)
    except AttributeError:  # no pidfd here (Linux < 5.3): the pid itself, checked just before
        fd = None
    except OSError:
        return None
    s = stat(pid)
    if s is None or (ppid is not None and s[1] != ppid) or (start is not None and s[3] != start):
        if fd is not None:
            os.close(fd)
        return None
    return (pid, fd)

def send(h, sig):
    try:
        if h[1] is None:
            os.kill(h[0], sig)
        else:
            signal.pidfd_send_signal(h[1], sig)
        return True
    except OSError:
        return False

def alive(h):
    return send(h, 0) and (stat(h[0]) or "Z")[0] != "Z"

# pid:start (the start time names the process the parent meant, even once it is orphaned)
known = {h[0]: h for h in (pin(int(p), start=int(t)) for p, t in (a.split(":") for a in sys.argv[4:])) if h}
seen, segments = set(known), set()

def refresh():  # every live process under those known (pinned), and the /dev/shm files they hold
    kids = {}
    for pid, (_, ppid, _, _) in table().items():
        kids.setdefault(ppid, []).append(pid)
    for pid in [pid for pid, h in known.items() if not alive(h)]:  # gone: its pid may be another's soon
        h = known.pop(pid)
        if h[1] is not None:
            os.close(h[1])
    todo = list(known.values())
    while todo:
        h = todo.pop()
        segments.update(shm_of(h[0]))
        for c in kids.get(h[0], []):
            if c not in known and (k := pin(c, ppid=h[0])) is not None:
                known[c] = k
                seen.add(c)
                todo.append(k)

def reap(*_):
    # the newest members too; those seen earlier count even if their parent is gone (Ray's raylet dies with
    # the driver at once, leaving its agents orphaned: no longer found under it)
    refresh()
    handles = list(known.values())
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for h in handles:
            send(h, sig)
        deadline = time.monotonic() + grace
        while any(map(alive, handles)) and time.monotonic() < deadline:
            time.sleep(0.1)
    unlink_shm(segments, seen)
    os._exit(0)

signal.signal(signal.SIGTERM, reap)
signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the group is the parent's to handle (it stops us)
try:  # set here, not by the ``tied`` prelude: a SIGTERM before the handler would end us without reaping
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG (Linux)
except (OSError, AttributeError):
    pass
if os.getppid() != parent:  # the parent died before the signal was set: reap now
    reap()
while True:  # the processes under them change (Ray starts workers and agents): keep track
    refresh()
    time.sleep(poll)
"""
REAP_GRACE_S, REAP_POLL_S = 5.0, 2.0


def reaper(pids: Sequence[int], script: str = REAPER):
    """A process that ends ``pids`` and their descendants (SIGTERM, then SIGKILL after ``REAP_GRACE_S``) if
    this process dies before calling ``stop(reaper)``, even by SIGKILL, and removes the shared-memory files
    they left: a driver's own Ray cluster goes with it. ``pids`` must be this process' children. Start it
    from the thread that outlives the cluster (the main thread)."""
    return subprocess.Popen([sys.executable, "-E", "-S", "-c", script, str(os.getpid()), str(REAP_GRACE_S),
                             str(REAP_POLL_S), *(f"{pid}:{start_time(pid)}" for pid in pids)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)


def start_time(pid: int) -> int:
    """When ``pid`` started (clock ticks since boot, /proc/PID/stat's field 22): with the pid, the process."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


def stop(proc) -> None:
    """End a ``reaper`` without it signalling anything (its cluster was shut down in order)."""
    proc.kill()
    proc.wait()


# What ends a process group (the guard's, and the suite's vLLM zygote's watcher: tests/helpers/vllm_zygote.py):
# each process of the group SIGKILLed at once (vLLM's server catches SIGTERM and, while it starts, neither exits
# nor stops its engine core and workers, which an orphaned server leaves running) but for Python's resource
# trackers, which then unlink the named semaphores they were told of and exit; up to ``grace`` s for the group to
# go, SIGKILL for what is left.
GROUP = PROC + """
def group(pgrp):  # the live processes of process group pgrp
    return [pid for pid, (state, _, g, _) in table().items() if g == pgrp and state != "Z"]

def tracker(pid):  # Python's resource tracker: it unlinks the semaphores and segments it was told of once
    try:  # every process holding its pipe is gone (it ignores SIGTERM and SIGINT); SIGKILLed, it leaks them
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.resource_tracker" in f.read()
    except OSError:
        return False

def end_group(pgrp, grace):
    deadline = time.monotonic() + grace
    while (left := [pid for pid in group(pgrp) if not tracker(pid)]) and time.monotonic() < deadline:
        for pid in left:  # all at once (the server's start-up ignores SIGTERM), but its trackers
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.05)
    while group(pgrp) and time.monotonic() < deadline:  # the trackers clean up and exit on their own
        time.sleep(0.05)
    try:
        os.killpg(pgrp, signal.SIGKILL)
    except OSError:
        pass
    while group(pgrp) and time.monotonic() < deadline + 1:
        time.sleep(0.05)
"""

# The guard of an engine (``guarded``): it runs the command in a process group of its own and watches it.
# When the command exits, or the guard gets SIGTERM (its front died, or forwarded one: see FRONT), it ends the
# whole group (``end_group``, GUARD_GRACE_S at most) and removes the shared-memory files the group's processes
# had mapped or open (recorded every GUARD_POLL_S while they ran, and once more before the kill). It exits with
# the command's status (143 after SIGTERM). A signal before the command started still ends it: the handlers
# come first.
GUARD = GROUP + """
grace, poll = float(sys.argv[1]), float(sys.argv[2])
import subprocess
segments, seen, stopped = set(), set(), False

def ignore():
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)

def end(*_):
    global stopped
    stopped = True
    ignore()

for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
    signal.signal(sig, end)
child = subprocess.Popen(sys.argv[3:], start_new_session=True)  # its own group: what the guard kills

def record():
    for pid in group(child.pid):
        seen.add(pid)
        segments.update(shm_of(pid))

due = 0.0
# the child is not reaped until its group is killed: its pid, the group's id, cannot be taken meanwhile
while not stopped and os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
    if time.monotonic() >= due:
        record()
        due = time.monotonic() + poll
    time.sleep(0.1)
ignore()
record()
end_group(child.pid, grace)
status = child.wait()
unlink_shm(segments, seen)
os._exit(143 if stopped else status if status >= 0 else 128 - status)
"""
GUARD_GRACE_S, GUARD_POLL_S = 10.0, 2.0

# The guard's front: the process its starter holds. Ray SIGKILLs an actor's child processes when the actor
# exits in order (``ray.kill``, a placement shut down for a restart: Ray's kill_child_processes_on_worker_exit),
# before any parent-death signal could reach them, so the process that cleans up must not be the starter's
# child: the front starts the guard (``tied`` to the front: argv[1] is the prelude) in a session of its own,
# forwards SIGTERM, SIGHUP and SIGINT to it, and exits with its status; the front SIGKILLed, the guard's
# parent-death signal starts the same clean-up.
FRONT = """
import os, signal, subprocess, sys
pending, guard = [], None

def forward(sig, _):
    pending.append(sig)
    if guard is not None:
        try:
            os.kill(guard.pid, sig)
        except OSError:
            pass

for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
    signal.signal(sig, forward)
guard = subprocess.Popen([sys.executable, "-E", "-S", "-c", sys.argv[1], str(os.getpid()), *sys.argv[2:]],
                         start_new_session=True)
for sig in pending[:1]:  # one that came before the guard existed
    try:
        os.kill(guard.pid, sig)
    except OSError:
        pass
status = guard.wait()
os._exit(status if status >= 0 else 128 - status)
"""


def guarded(cmd: Sequence[str], poll_s: float = GUARD_POLL_S) -> list[str]:
    """``cmd`` run by a guard (behind its front, ``tied`` to this process) that, when the command exits or this
    process goes (even by SIGKILL) or the front is sent SIGTERM or SIGKILLed, kills the command's whole process
    group and removes the shared-memory files it left. Start it with ``start_new_session=True``: signalling
    that group signals the front, which tells the guard."""
    return tied([sys.executable, "-E", "-S", "-c", FRONT, PRELUDE,
                 sys.executable, "-E", "-S", "-c", GUARD, str(GUARD_GRACE_S), str(poll_s), *map(str, cmd)])
