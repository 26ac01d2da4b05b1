"""run_ranks: a rank that dies while working fails the run; a rank killed in torch's process-group
teardown after every rank finished (work and checks done) is a warning, not a failed run."""

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
