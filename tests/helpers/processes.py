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
