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
