"""The suite's vLLM engines fork their engine core and workers instead of spawning them (tests only).

vLLM's CPU platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` whatever the environment says, so an
engine start imports vLLM three times: the API server, then its engine core, then the core's worker,
each a fresh interpreter (~15 CPU-s an import on 2 cores; an engine was ready in 42 s with 50 CPU-s,
forked in 16 s with 22 CPU-s). With ``FLAG=1`` in its environment and this folder first on its
``PYTHONPATH``, a process that has imported vLLM gets a fork context when it asks multiprocessing for a
spawn one: the core and the worker are forked from the server, in its process group as before (what
the engine's guard kills and sweeps). A process that has not imported vLLM (ours, pytest's), or that
has initialized CUDA (vLLM's own reason to spawn), is left alone. ``tests/test_vllm_backend.py`` sets
it for its engines, the session Ray cluster's actors have it off unless a test gives it to them (the
killed-engine test does), and the test of a starter killed while its engine starts runs vLLM's own spawn.
The same engines' queue readers spin for ``BUSY_LOOP_S`` after a read, not vLLM's 1 s (``_shorter_spin``).

Python imports one ``sitecustomize``: the one this shadows, if any, is run after it."""

import os
import sys

FLAG = "SPECFORGE_TEST_VLLM_FORK"
# how long an engine's queue reader spins after a read before it sleeps until notified (vLLM's default: 1 s).
# Three feature-equality engines, system-wide CPU: 65.2 and 64.9 CPU-s at 1 s, 54.5 and 53.0 at 0.01 s.
BUSY_LOOP_S = 0.01


def _install() -> None:
    import multiprocessing

    get_context = multiprocessing.get_context

    def forking_context(method=None):
        # read when asked, not at start-up: a process forked from one that started with the flag (the
        # suite's Ray zygote, if the session cluster started within the vLLM module) decides by its own
        if method == "spawn" and os.environ.get(FLAG) == "1" and "vllm" in sys.modules:
            torch = sys.modules.get("torch")
            if torch is None or not torch.cuda.is_initialized():
                method = "fork"
                _shorter_spin()
        return get_context(method)

    multiprocessing.get_context = forking_context


def _shorter_spin() -> None:
    """The engine's shared-memory queues: a reader spins for ``BUSY_LOOP_S`` after each read (vLLM: 1 s)
    before it waits on the writer's notification. The core spins so while its worker computes, the worker
    between steps: on 2 cores, beside the other pytest worker, a core's worth of spinning. Set in the
    process that forks the core and the worker, before either makes its queues."""
    if getattr(sys.modules["vllm"], "__file__", None) is None:  # not vLLM: the switch's test's stand-in
        return
    import functools

    from vllm.distributed.device_communicators import shm_broadcast

    cls = shm_broadcast.SpinCondition
    if getattr(cls.__init__, "specforge_spin", False):  # a forked child of a process that set it
        return
    init = cls.__init__

    @functools.wraps(init)
    def shorter(self, *args, busy_loop_s=BUSY_LOOP_S, **kwargs):  # a renamed parameter fails here, loudly
        init(self, *args, busy_loop_s=busy_loop_s, **kwargs)

    shorter.specforge_spin = True
    cls.__init__ = shorter


def _run_the_shadowed_one() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if __name__ == "sitecustomize":  # as Python's start-up runs it; imported by the tests for FLAG, it does nothing
    _install()
    _run_the_shadowed_one()
