"""FSDP2 data parallelism (and DP x SP) against the single-process trainer, on gloo; rank layout."""

import math

import pytest
import torch

from specforge.parallel.dims import ParallelDims
from specforge.parallel.fsdp import full_state_dict
from specforge.parallel.launch import run_ranks
from specforge.parallel.parallelize import parallelize_draft, sum_over_train_ranks
from specforge.registry import bound_algorithm
from specforge.training.trainer import DraftTrainer
from tests.helpers.ranks import check_params, run_sp, sample_rows, setup_sp, sp_cfg


def _reference(path):
    """Single process, the two samples as two micro-batches; losses, gradients + params after each step."""
    draft, teacher, batches = setup_sp()
    cfg = sp_cfg()
    trainer = DraftTrainer(bound_algorithm(cfg), draft, teacher, cfg, torch.device("cpu"))
    out = {"loss": [], "grads": [], "params": []}
    for b in batches:
        out["loss"].append(trainer.step([sample_rows(b, 0), sample_rows(b, 1)])["loss"])
        out["grads"].append({k: p.grad.detach().clone() for k, p in draft.named_parameters() if p.grad is not None})
        out["params"].append({k: v.detach().clone() for k, v in draft.state_dict().items()})
    torch.save(out, path)


def _dp_rank(rank, world, ref_path):
    """Rank 0 plays a rollout rank: it joins group creation and nothing else."""
    from torch.distributed.tensor import DTensor

    train_ranks = [1, 2]
    groups = ParallelDims(dp=2).build(train_ranks, rank, timeout_s=90)
    if rank not in train_ranks:
        assert groups is None
        return
    assert (groups.dp_rank, groups.sp_size) == (train_ranks.index(rank), 1)
    cfg = sp_cfg()
    draft, teacher, batches = setup_sp()
    draft = parallelize_draft(draft, ParallelDims(dp=2), groups, cfg.train.precision, bound_algorithm(cfg))
    assert not isinstance(draft.embed_tokens.weight, DTensor)  # frozen: replicated, never gathered
    assert isinstance(draft.lm_head.weight, DTensor) and isinstance(draft.fc.weight, DTensor)
    trainer = DraftTrainer(bound_algorithm(cfg), draft, teacher, cfg, torch.device("cpu"),
                           reduce_sum=sum_over_train_ranks(groups))
    ref = torch.load(ref_path) if groups.dp_rank == 0 else None
    for step, b in enumerate(batches):
        m = trainer.step([sample_rows(b, groups.dp_rank)])
        state = full_state_dict(draft)  # collective; the full dict on the mesh's first rank
        if ref is not None:
            assert math.isclose(m["loss"], ref["loss"][step], rel_tol=1e-5), (step, m["loss"], ref["loss"][step])
            check_params(state, ref["params"][step], ref["grads"][: step + 1], cfg, what=f"step {step}")
        else:
            assert state == {}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fsdp_dp2_matches_single_process_with_a_rollout_rank(tmp_path):
    _reference(tmp_path / "ref.pt")
    run_ranks(_dp_rank, 3, str(tmp_path / "ref.pt"), workdir=tmp_path, timeout_s=150)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dp2_x_ulysses2_matches_single_process(tmp_path):
    """FSDP over dp*sp = 4 ranks with summed gradients: each DP rank one sample, split in 2 slices."""
    run_sp(tmp_path, (2, 2, 1))


def test_rank_layout_ulysses_innermost():
    d = ParallelDims(dp=2, sp_ulysses=2, sp_ring=2)
    assert d.world == 8 and d.sp == 4
    assert [d.coords(i) for i in (0, 1, 2, 3, 4, 7)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 1,
                                                                                                                 1)]
    lists = d._rank_lists([10, 11, 12, 13, 14, 15, 16, 17])  # train ranks need not start at 0
    assert lists[0] == list(range(10, 18))  # fsdp: all train ranks
    assert [10, 11] in lists and [10, 12] in lists  # a ulysses group, a ring group
    assert len(lists) == 1 + 4 + 4  # fsdp + 4 ulysses + 4 ring groups: no unused dp/sp groups
    with pytest.raises(ValueError):
        ParallelDims(dp=0)
    with pytest.raises(ValueError):
        d.build([0, 1, 2], 0)
