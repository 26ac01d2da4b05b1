"""Waiting for a file that another process renames into a folder, without polling for it.

The vLLM engine's connector (``models/vllm_connector.py``) writes each request's hidden states under
a temporary name and renames it to the path it returned; up to 64 client threads wait for their own
paths at once (``models/vllm_engine.VllmEngine.hidden_states``). Here one watcher thread per
``Arrivals`` reads Linux's inotify events for the folders waited on (a rename into the folder,
``IN_MOVED_TO``, or a file closed after writing, ``IN_CLOSE_WRITE``) and wakes the thread waiting for
that name; the waiters sleep on an event. A waiter still looks at the path itself every
``check_s`` (0.1 s): the only way to see a file written by another host into a shared folder (inotify
reports local writes only) and a guard against a lost event (a full inotify queue). Where inotify
cannot be had (not Linux, no free watches), waiters look every 2 ms, as before this module.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import struct
import threading
import time
from typing import Callable, Optional

IN_CLOSE_WRITE, IN_MOVED_TO, IN_Q_OVERFLOW = 0x8, 0x80, 0x4000
IN_NONBLOCK, IN_CLOEXEC = 0o4000, 0o2000000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of name)
POLL_S = 0.002  # the fallback's look interval


def _inotify():
    """libc's inotify functions, or None where there are none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        init, add = libc.inotify_init1, libc.inotify_add_watch
    except (OSError, AttributeError):
        return None
    add.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
    return init, add


class Arrivals:
    """Threads waiting for paths to appear (see the module docstring). ``wait`` is thread-safe."""

    def __init__(self, check_s: float = 0.1, notify: bool = True):
        """``notify=False``: the waiters look every 2 ms (the fallback; what the benchmark compares)."""
        self.check_s = check_s
        self._lock = threading.Lock()
        self._waiting: dict[str, threading.Event] = {}
        self._dirs: dict[int, str] = {}  # inotify watch descriptor -> folder
        self._watched: set[str] = set()
        self._closed = False
        self._fd: Optional[int] = None
        self._add = None
        lib = _inotify() if notify else None
        if lib is not None:
            fd = lib[0](IN_NONBLOCK | IN_CLOEXEC)
            if fd >= 0:
                self._fd, self._add = fd, lib[1]
                threading.Thread(target=self._watch, daemon=True, name="arrivals").start()

    @property
    def notified(self) -> bool:
        """Do waiters sleep until told (inotify), rather than look every 2 ms?"""
        return self._fd is not None

    def _watch_folder(self, folder: str) -> None:
        if folder in self._watched:
            return
        wd = self._add(self._fd, os.fsencode(folder), IN_MOVED_TO | IN_CLOSE_WRITE)
        if wd >= 0:  # else no such folder yet, or no free watch: the waiter finds its file at its looks
            self._dirs[wd] = folder
            self._watched.add(folder)

    def _watch(self) -> None:
        fd = self._fd
        while not self._closed:
            try:
                ready, _, _ = select.select([fd], [], [], 1.0)
                if not ready:
                    continue
                data = os.read(fd, 1 << 16)
            except (OSError, ValueError):  # closed under us
                return
            at = 0
            while at + _EVENT.size <= len(data):
                wd, mask, _cookie, n = _EVENT.unpack_from(data, at)
                name = data[at + _EVENT.size: at + _EVENT.size + n].rstrip(b"\0")
                at += _EVENT.size + n
                with self._lock:
                    if mask & IN_Q_OVERFLOW:  # events were lost: everyone looks for themselves
                        for ev in self._waiting.values():
                            ev.set()
                        continue
                    folder = self._dirs.get(wd)
                    ev = self._waiting.get(os.path.join(folder, os.fsdecode(name))) if folder else None
                    if ev is not None:
                        ev.set()

    def wait(self, path: str, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> bool:
        """True once ``path`` exists; False after ``timeout_s`` or once ``alive()`` is False (asked at
        each look, every ``check_s``)."""
        deadline = time.monotonic() + timeout_s
        if self._fd is None:
            while not os.path.exists(path):
                if time.monotonic() > deadline or not alive():
                    return False
                time.sleep(POLL_S)
            return True
        path = os.path.abspath(path)
        ev = threading.Event()
        with self._lock:
            self._waiting[path] = ev
            self._watch_folder(os.path.dirname(path))
        try:
            while True:
                if os.path.exists(path):  # after registering: an arrival before it is seen here
                    return True
                if time.monotonic() > deadline or not alive():
                    return False
                ev.wait(max(0.0, min(self.check_s, deadline - time.monotonic())))
                ev.clear()
        finally:
            with self._lock:
                self._waiting.pop(path, None)

    def close(self) -> None:
        self._closed = True
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
