"""The driver's planner of a disaggregated run (from tests/test_memory_bound.py, which tests/test_failures.py
shares)."""

import os

# A starved box (benchmarks at normal priority, tests at idle) can take minutes to start a worker
# process; Ray's default (60 s) kills and retries it until actor creation fails. (As in
# tests/test_memory_bound.py: tests/test_failures.py got it by importing that module.)
os.environ.setdefault("RAY_worker_register_timeout_seconds", "900")


def planner(cfg, train_ranks=(1,)):
    """The driver's planner of a disaggregated ``cfg`` (rollout rank 0 -> ``train_ranks``)."""
    from specforge.contracts import Layout
    from specforge.runtime.plan import Planner, prepare

    data = prepare(cfg, use_gpu=False)
    return Planner(cfg, data, Layout(cfg.placement.mode, (0,), tuple(train_ranks), data.vocab_path))
