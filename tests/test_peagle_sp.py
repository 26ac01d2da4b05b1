"""P-EAGLE under sequence parallelism: the SP path (owned rows + halo, untrimmed) gives the single
process's loss and gradients; on gloo, Ulysses and ring ranks train like the single process.

P-EAGLE reuses EAGLE-3's SP hooks (halo = parallel_tokens + 1, the midlayer's attention core) with
its own forward (depths >= 1 read the mask, not the previous step): these tests are what says the
hooks still fit. Tiny random draft (hidden 64, vocab 300, draft vocab 100), fp32.
"""

import math

import pytest
import torch

from specforge.algorithms.eagle3.loss import ttt_loss
from specforge.algorithms.peagle.algorithm import PEagleOptions
from specforge.algorithms.peagle.model import PEagleDraft, PEagleDraftConfig
from specforge.config import Config, TrainConfig
from specforge.registry import bound_algorithm, get_algorithm
from specforge.training.slicing import sp_slice_batch
from tests.helpers.ranks import ADAM_EPS, LR, H, I, N, V, check_grads, check_params, draft_and_batches, run_sp

K = 4  # = the harness' L: T = 29 tokens, STEPS = 3 steps (tests/helpers/ranks.py)
ALGO = get_algorithm("peagle")


def _cfg() -> Config:
    return Config(draft=PEagleOptions(algorithm="peagle", parallel_tokens=K),
                  train=TrainConfig(precision="fp32", lr=LR, warmup_steps=0, max_grad_norm=10.0, adam_eps=ADAM_EPS))


def _setup():
    """Draft, teacher and STEPS batches, identical in every process (the mask token an input of row 0)."""
    cfg = PEagleDraftConfig(hidden_size=H, intermediate_size=I, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, vocab_size=V, draft_vocab_size=N, mask_token_id=V - 1, parallel_tokens=K)
    return draft_and_batches(lambda: PEagleDraft(cfg), mask_token_id=V - 1)


def test_one_slice_without_trimming_equals_full_loss():
    """sp_size 1: the SP path (halo rows, every depth computes every owned row) gives the trimmed
    path's loss and gradients, the mask's included."""
    draft, teacher, batches = _setup()
    b = batches[0]
    params = [p for p in draft.parameters() if p.requires_grad]
    l_ref, c_ref = ttt_loss(draft, b, teacher, K)
    g_ref = torch.autograd.grad(l_ref, params)
    l_sp, c_sp = ttt_loss(draft, sp_slice_batch(b, 0, 1, ALGO.bind(_cfg()).sp_halo()), teacher, K)
    g_sp = torch.autograd.grad(l_sp, params)
    assert torch.allclose(l_sp, l_ref, atol=1e-6) and torch.equal(c_sp[:, 0], c_ref[:, 0])
    for (name, _), a, c in zip([(n, p) for n, p in draft.named_parameters() if p.requires_grad], g_sp, g_ref):
        assert torch.allclose(a, c, atol=1e-6), name
    mask_grad = dict(zip([n for n, p in draft.named_parameters() if p.requires_grad], g_ref))
    assert mask_grad["mask_hidden"].abs().max() > 0 and mask_grad["mask_embed"].abs().max() > 0


def _sp_rank(rank, world, dims_tuple, ref_path):
    """One train rank of an SP run; rank 0 compares with the single process every step."""
    from specforge.parallel.dims import ParallelDims
    from specforge.parallel.fsdp import full_state_dict, grads_full
    from specforge.parallel.parallelize import parallelize_draft, sum_over_train_ranks
    from specforge.training.trainer import DraftTrainer

    dims = ParallelDims(*dims_tuple)
    groups = dims.build(list(range(world)), rank, timeout_s=90)
    cfg = _cfg()
    draft, teacher, batches = _setup()
    draft = parallelize_draft(draft, dims, groups, cfg.train.precision, bound_algorithm(cfg))
    trainer = DraftTrainer(bound_algorithm(cfg), draft, teacher, cfg, torch.device("cpu"),
                           reduce_sum=sum_over_train_ranks(groups))
    ref = torch.load(ref_path) if rank == 0 else None
    for step, full in enumerate(batches):
        m = trainer.step([sp_slice_batch(full, groups.sp_rank, groups.sp_size, ALGO.bind(cfg).sp_halo())])
        grads = grads_full(draft)
        if rank == 0:
            rm = ref["metrics"][step]
            for key in ("loss", "acc_0", f"acc_{K - 1}", "tau", "valid_tokens"):
                assert math.isclose(m[key], rm[key], rel_tol=1e-5, abs_tol=1e-6), (step, key, m[key], rm[key])
            check_grads(step, grads, ref["grads"][step])  # the harness' chain of sums: K = its L, same sizes
    state = full_state_dict(draft)
    if rank == 0:
        check_params(state, ref["params"], ref["grads"], cfg)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dims_tuple", [(1, 2, 1), (1, 1, 2)], ids=["ulysses2", "ring2"])
def test_sp_ranks_match_the_single_process(tmp_path, dims_tuple):
    run_sp(tmp_path, dims_tuple, _sp_rank, _setup, _cfg)
