"""What a run leaves of its caller's process as it found it: the environment after Ray started
(``runtime/actors.start_ray``), and the torch thread count after a single-process run
(``specforge.train.run``). Both are the caller's; the run's own settings go to Ray's processes through
Ray and are undone in the caller."""

import os

import pytest
import torch

from tests.helpers.ray_run import make_cfg


def test_a_single_process_run_gives_the_thread_count_back(assets, tmp_path, monkeypatch):
    from specforge.train import run

    threads = {"n": 3, "seen": []}  # torch's setting, observed (the suite's workers clamp the real one)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads["n"])
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (threads.update(n=n), threads["seen"].append(n)))
    run(make_cfg(assets, tmp_path, "train.num_workers=1", "train.num_threads=2", "train.max_steps=1"))
    assert 2 in threads["seen"]  # the control: the run did set its own
    assert threads["n"] == 3  # and the caller has its own back


@pytest.mark.ray
def test_starting_ray_leaves_the_callers_environment(no_ray, monkeypatch):
    """Ray starts without token authentication where the caller said nothing (Ray's processes get
    RAY_AUTH_MODE=disabled, the workers TOKENIZERS_PARALLELISM through the runtime environment), and the
    caller's os.environ has none of them afterwards."""
    import ray

    from specforge.config import load_config
    from specforge.runtime.actors import RAY_START_ENV, start_ray

    for k in RAY_START_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    before = dict(os.environ)
    assert start_ray(load_config(None, []), 1)
    try:
        seen = ray.get(ray.remote(lambda: {k: os.environ.get(k) for k in ("RAY_AUTH_MODE",
                                                                          "TOKENIZERS_PARALLELISM")}).remote(),
                       timeout=120)
        assert seen == {"RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}, seen
        ours = [*RAY_START_ENV, "TOKENIZERS_PARALLELISM"]  # (Ray writes keys of its own, e.g. PYTHONBREAKPOINT)
        assert {k: os.environ.get(k) for k in ours} == {k: before.get(k) for k in ours} == dict.fromkeys(ours)
    finally:
        ray.shutdown()
