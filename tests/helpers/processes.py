"""Waiting for a process to be gone (tests of what dies with what)."""

import os
import time


def gone(pid: int, within_s: float) -> bool:
    """Whether ``pid`` has exited within ``within_s`` seconds: no such process, or a zombie (exited, not yet
    reaped: it still answers ``kill(pid, 0)``)."""
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


MONITORS = ("log_monitor.py", "autoscaler/_private/monitor.py")  # what tests/conftest.py's lean_cluster leaves out


def ray_monitors() -> list[str]:
    """The Ray log monitor and autoscaler monitor among this process' children (a cluster it started)."""
    import psutil

    found = []
    for p in psutil.Process().children():
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        found += [m for m in MONITORS if m in cmd]
    return sorted(found)
