"""run_ranks: a rank that dies while working fails the run; a rank killed in torch's process-group
teardown after every rank finished (work and checks done) is a warning, not a failed run. Ranks are
forked from a fork server that imported torch once, and get the caller's environment at the call."""

import json
import os

import pytest
import torch
import torch.distributed as dist

from specforge.parallel.launch import run_ranks


def _sum_then(rank, world, how):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert t.item() == world * (world + 1) / 2
    if rank == 1 and how == "abort_working":
        os.abort()
    if rank == 1 and how == "abort_in_teardown":
        dist.destroy_process_group = lambda *a, **k: os.abort()  # this rank's teardown crashes


def test_a_finished_run_passes(tmp_path):
    run_ranks(_sum_then, 2, "finish", workdir=tmp_path, timeout_s=60)


def test_an_abort_in_teardown_after_all_ranks_finished_is_a_warning(tmp_path):
    with pytest.warns(UserWarning, match="SIGABRT after all 2 ranks finished"):
        run_ranks(_sum_then, 2, "abort_in_teardown", workdir=tmp_path, timeout_s=60)


def test_an_abort_while_working_fails_the_run(tmp_path):  # the control: same abort, before the end
    with pytest.raises(Exception, match="process 1 terminated with signal SIGABRT"):
        run_ranks(_sum_then, 2, "abort_working", workdir=tmp_path, timeout_s=60)


def _report(rank, world, out):
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"ppid": os.getppid(), "set": os.environ.get("SPECFORGE_TEST_LAUNCH_SET"),
                   "gone": os.environ.get("SPECFORGE_TEST_LAUNCH_GONE")}, f)


def test_ranks_come_from_the_fork_server_with_the_callers_environment(tmp_path, monkeypatch):
    """The fork server starts with the environment of its first caller; a rank still sees the caller's
    environment at its own call: a variable set since, and not one removed since (what a spawned
    rank inherits; tests/test_capture_sp.py sets SPECFORGE_EMULATE_NCCL so for its ranks)."""
    monkeypatch.setenv("SPECFORGE_TEST_LAUNCH_GONE", "1")
    run_ranks(_sum_then, 2, "finish", workdir=tmp_path, timeout_s=60)  # the fork server is up now (if not before)
    monkeypatch.setenv("SPECFORGE_TEST_LAUNCH_SET", "yes")
    monkeypatch.delenv("SPECFORGE_TEST_LAUNCH_GONE")
    run_ranks(_report, 2, str(tmp_path / "env"), workdir=tmp_path, timeout_s=60)
    got = [json.loads((tmp_path / f"env.{r}").read_text()) for r in range(2)]
    assert all(g["set"] == "yes" and g["gone"] is None for g in got), got
    assert all(g["ppid"] != os.getpid() for g in got), got  # forked by the server, not started by the caller
