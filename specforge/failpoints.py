"""Named moments where a test or the chaos harness (benchmarks/chaos.py) makes a process fail on purpose.

    SPECFORGE_FAILPOINTS="checkpoint.write:pause,eval:pause"   SPECFORGE_FAILPOINT_DIR=/tmp/marks

Off unless ``SPECFORGE_FAILPOINTS`` is set (a ``hit`` is then one dictionary lookup). Each entry is
``name[:action][@n]``: at the ``n``-th hit of ``name`` in a process (default the first), or with ``@armed``
at the first hit while the file ``$SPECFORGE_FAILPOINT_DIR/<name>.armed`` exists (which the hit removes:
a harness arms it at a moment of its choosing), it does

    pause    create ``$SPECFORGE_FAILPOINT_DIR/<name>`` and sleep (``PAUSE_S`` at most): the caller kills
             whatever it wants at that exact moment (the driver during a save, the Ray head during an eval)
    enospc   raise ``OSError(ENOSPC)``: the disk filled here
    kill     SIGKILL this process

The moments: ``checkpoint.write`` (a save's temp folder holds the served weights, not yet the training
state), ``checkpoint.publish`` (the step folder renamed into place, ``latest`` not yet moved), ``eval`` (a
train rank computed a held-out eval's metrics), ``store.index`` (a feature store's new index written to its
temp file, not yet renamed over the old one). The switches reach Ray workers (``worker_env``).
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections import Counter
from pathlib import Path

ENV, DIR_ENV = "SPECFORGE_FAILPOINTS", "SPECFORGE_FAILPOINT_DIR"
NAMES = ("checkpoint.write", "checkpoint.publish", "eval", "store.index")
ACTIONS = ("pause", "enospc", "kill")
PAUSE_S = 600.0
ARMED = "armed"

_hits: Counter = Counter()


def parse(spec: str) -> dict[str, tuple[str, int]]:
    """``{name: (action, n)}`` of a ``SPECFORGE_FAILPOINTS`` value (n 0: armed by a file); a ValueError names a
    bad entry."""
    out = {}
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        body, _, n = entry.partition("@")
        name, _, action = body.partition(":")
        action = action or "pause"
        if name not in NAMES or action not in ACTIONS or (n and not n.isdigit() and n != ARMED) or n == "0":
            raise ValueError(f"{ENV}: {entry!r} is not name[:action][@n] with a name of {', '.join(NAMES)} and "
                             f"an action of {', '.join(ACTIONS)}")
        out[name] = (action, 0 if n == ARMED else int(n or 1))
    return out


def hit(name: str) -> None:
    """The process reached moment ``name``: act if a failpoint is set there for this hit."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    point = parse(spec).get(name)
    if point is None:
        return
    _hits[name] += 1
    action, n = point
    folder = Path(os.environ.get(DIR_ENV) or ".")
    if n == 0:  # armed: fire once per arming
        try:
            (folder / f"{name}.armed").unlink()
        except FileNotFoundError:
            return
    elif _hits[name] != n:
        return
    if action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (failpoint {name})")
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(str(os.getpid()))
    time.sleep(PAUSE_S)


def worker_env() -> dict[str, str]:
    """The failpoint switches set in this (driver) process, for its Ray workers' environment."""
    return {k: os.environ[k] for k in (ENV, DIR_ENV) if k in os.environ}
