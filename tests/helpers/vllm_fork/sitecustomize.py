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

Python imports one ``sitecustomize``: the one this shadows, if any, is run after it."""

import os
import sys

FLAG = "SPECFORGE_TEST_VLLM_FORK"


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
        return get_context(method)

    multiprocessing.get_context = forking_context


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
