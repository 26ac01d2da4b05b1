"""How the data plane learns that a transfer finished, on gloo and on NCCL alike.

gloo's ``Work.wait()`` blocks the CPU until the bytes are there and raises when the peer is gone.
NCCL's does neither: it makes the current CUDA stream wait and returns at once; a receive whose
peer died never fails, it only stalls the next host sync until the NCCL watchdog kills the process
(``parallel.timeout_s``). So the caller never relies on a blocking ``wait()``:

    works = completion.post(ops)          # batch_isend_irecv
    completion.finish(works, "step 3")    # returns once every op completed, raises ``PeerLost``
                                          # once the driver said a peer died (``abort``, which
                                          # wakes every waiter at once) or after ``timeout_s``

How ``finish`` learns of the completion: on gloo (and emulated NCCL) it sleeps on a condition that
a watcher thread signals once its blocking waits returned (gloo's point-to-point works have no
future to hang a callback on), and that ``abort`` signals too, so an abort ends a wait at once on
either backend and nothing spins while the peer computes. On NCCL the work's ``is_completed()`` (a
CUDA event query) is the only host-side signal, so there it is polled, backing off from 0.1 to 5 ms.
``finish`` calls ``wait()`` on a work only once it completed (on NCCL that orders the current stream
after the transfer and returns at once), so a lost receive never blocks this process's stream and
the train ranks can still agree, over their own groups, that the step's features were lost.

``SPECFORGE_EMULATE_NCCL=1`` (``device.stream_semantics``) wraps gloo's works in ``StreamWork``,
which behaves as NCCL's: ``wait()`` returns at once (reading a buffer after it alone reads
whatever is there), completion shows only through ``is_completed()``, and a failed receive (the
peer died) never completes and never raises. The CPU tests run the failure and in-flight-bound
tests under it.
"""

from __future__ import annotations

import threading
import time
from typing import Optional, Sequence

import torch.distributed as dist

from specforge.device import stream_semantics

_POLL_FIRST_S, _POLL_MAX_S = 1e-4, 5e-3  # polling backs off from 0.1 ms to 5 ms


class PeerLost(RuntimeError):
    """A transfer did not complete: the driver said its peer died, or ``parallel.timeout_s`` passed."""


class StreamWork:
    """A gloo ``Work`` with NCCL's completion semantics (see the module docstring). A watcher
    thread does gloo's blocking wait and marks the work complete only if it succeeded."""

    def __init__(self, work: Optional[dist.Work], error: Optional[BaseException] = None):
        self.error = error  # why it will never complete (kept for messages only: NCCL would not say)
        self._done = threading.Event()
        if work is not None:
            threading.Thread(target=self._watch, args=(work,), daemon=True, name="stream-work").start()

    def _watch(self, work: dist.Work) -> None:
        try:
            work.wait()
            self._done.set()
        except Exception as e:  # the peer is gone: NCCL would never report it
            self.error = e

    def wait(self) -> bool:
        return True  # NCCL: the stream waits, the CPU does not

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait_completed(self) -> None:
        """Block until the transfer completed (forever if it never will: the peer died)."""
        self._done.wait()


class Completion:
    """One process's way to post transfers and learn when they finished (see the module docstring).
    ``stream``: NCCL semantics (real or emulated); ``timeout_s``: the longest one ``finish`` waits."""

    def __init__(self, stream: bool, timeout_s: float, emulate: bool = False):
        self.stream, self.timeout_s, self.emulate = stream or emulate, timeout_s, emulate
        self._lost = threading.Event()
        self._why = ""
        self._changed = threading.Condition()  # a watcher finished, or an abort: waiters look again

    @classmethod
    def for_group(cls, timeout_s: float, group=None) -> "Completion":
        """How transfers on ``group`` (None: the default group) complete: NCCL's semantics on NCCL;
        on gloo the same, emulated, under ``SPECFORGE_EMULATE_NCCL=1`` (never on NCCL itself, whose
        ``wait()`` would mark a pending work complete); else gloo's blocking waits."""
        backend = dist.get_backend(group) if dist.is_initialized() else None
        nccl = backend == "nccl"
        return cls(stream=nccl, timeout_s=timeout_s, emulate=not nccl and stream_semantics("gloo"))

    def post(self, ops: Sequence[dist.P2POp]) -> list:
        """``batch_isend_irecv(ops)``; emulated, each gloo work as a ``StreamWork`` (an op that gloo
        refuses at once, its peer already gone, becomes one that never completes, as on NCCL)."""
        if not ops:
            return []
        if not self.emulate:
            return dist.batch_isend_irecv(list(ops))
        try:
            return [StreamWork(w) for w in dist.batch_isend_irecv(list(ops))]
        except RuntimeError as e:
            return [StreamWork(None, e)]

    def abort(self, why: str) -> None:
        """The driver saw a peer die: every ``finish`` not yet done (now or later) raises ``PeerLost``.
        Safe to call from another thread (a Ray actor's control method) while ``finish`` polls."""
        with self._changed:
            self._why = why
            self._lost.set()
            self._changed.notify_all()

    @property
    def aborted(self) -> bool:
        return self._lost.is_set()

    def finish(self, works: Sequence, what: str) -> None:
        """Return once every work completed; ``PeerLost`` after ``abort`` or ``timeout_s``."""
        if not works:
            return
        if self.stream and not self.emulate:
            self._poll(works, what)
            return
        outcome: dict = {}  # "done": True once every work completed; "error": gloo's, when a peer is gone

        def watch() -> None:
            try:
                for w in works:
                    w.wait_completed() if isinstance(w, StreamWork) else w.wait()
                outcome["done"] = True
            except Exception as e:  # gloo: the peer is gone (reraised by the waiter below)
                outcome["error"] = e
            with self._changed:
                self._changed.notify_all()

        threading.Thread(target=watch, daemon=True, name="completion-watch").start()
        deadline = time.monotonic() + self.timeout_s
        with self._changed:
            while not outcome and not self._lost.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerLost(f"{what}: not completed within parallel.timeout_s={self.timeout_s:g} s "
                                   "(a peer died or stalled)")
                self._changed.wait(left)
        if "error" in outcome:
            raise outcome["error"]
        if not outcome:
            raise PeerLost(f"{what}: {self._why}")

    def _poll(self, works: Sequence, what: str) -> None:
        """NCCL: ``is_completed()`` polled, backing off from 0.1 to 5 ms, until all completed."""
        deadline, pause = time.monotonic() + self.timeout_s, _POLL_FIRST_S
        while not all(w.is_completed() for w in works):
            if self._lost.is_set():
                raise PeerLost(f"{what}: {self._why}")
            if time.monotonic() > deadline:
                raise PeerLost(f"{what}: not completed within parallel.timeout_s={self.timeout_s:g} s "
                               "(a peer died or stalled)")
            time.sleep(pause)
            pause = min(2 * pause, _POLL_MAX_S)
        for w in works:
            w.wait()  # NCCL: the current stream now runs after the transfer (returns at once)
