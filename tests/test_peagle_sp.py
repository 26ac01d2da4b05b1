"""P-EAGLE under sequence parallelism: the SP path (owned rows + halo, untrimmed) gives the single
process's loss and gradients; on gloo, Ulysses and ring ranks train like the single process.

P-EAGLE reuses EAGLE-3's SP hooks (halo = parallel_tokens + 1, the midlayer's attention core) with
its own forward (depths >= 1 read the mask, not the previous step): these tests are what says the
hooks still fit. Tiny random draft (hidden 64, vocab 300, draft vocab 100), fp32.
"""

import math

import pytest
import torch

from specforge.algorithms import get_algorithm
from specforge.algorithms.eagle3.loss import ttt_loss
from specforge.algorithms.peagle.algorithm import PEagleOptions
from specforge.algorithms.peagle.model import PEagleDraft, PEagleDraftConfig
from specforge.config import Config, TrainConfig
from specforge.train.batch import TrainBatch
from specforge.train.slicing import sp_slice_batch

V, N, H, T, K, STEPS = 300, 100, 64, 29, 4, 3
ALGO = get_algorithm("peagle")


def _cfg() -> Config:
    return Config(draft=PEagleOptions(algorithm="peagle", parallel_tokens=K),
                  train=TrainConfig(precision="fp32", lr=1e-2, warmup_steps=0, max_grad_norm=10.0))


def _setup():
    """Draft, teacher and STEPS batches, identical in every process."""
    g = torch.Generator().manual_seed(0)
    cfg = PEagleDraftConfig(hidden_size=H, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, vocab_size=V, draft_vocab_size=N, mask_token_id=V - 1, parallel_tokens=K)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        draft = PEagleDraft(cfg)
        draft.reset_parameters(std=0.1)
    draft.set_vocab(torch.sort(torch.randperm(V, generator=g)[:N]).values - torch.arange(N))
    teacher = torch.randn(N, H, generator=g) * 0.5
    inv = draft.draft_to_target_ids()
    batches = []
    for _ in range(STEPS):
        mask = torch.zeros(2, T, dtype=torch.long)
        mask[0, 3:12] = 1
        mask[0, 15:22] = 1
        mask[1, 6:20] = 1
        ids = torch.randint(0, V, (2, T), generator=g)
        ids[0, 7] = V - 1  # the mask token as an input: its trained row
        ids[1, 21:] = 0  # right padding of row 1
        tgt = torch.where(torch.rand(2, T, generator=g) < 0.8, inv[torch.randint(0, N, (2, T), generator=g)],
                          torch.randint(0, V, (2, T), generator=g))
        batches.append(TrainBatch(ids, mask, torch.randn(2, T, 3 * H, generator=g), torch.randn(2, T, H, generator=g), tgt))
    return draft, teacher, batches


def test_one_slice_without_trimming_equals_full_loss():
    """sp_size 1: the SP path (halo rows, every depth computes every owned row) gives the trimmed
    path's loss and gradients, the mask's included."""
    draft, teacher, batches = _setup()
    b = batches[0]
    params = [p for p in draft.parameters() if p.requires_grad]
    l_ref, c_ref = ttt_loss(draft, b, teacher, K)
    g_ref = torch.autograd.grad(l_ref, params)
    l_sp, c_sp = ttt_loss(draft, sp_slice_batch(b, 0, 1, ALGO.sp_halo(_cfg())), teacher, K)
    g_sp = torch.autograd.grad(l_sp, params)
    assert torch.allclose(l_sp, l_ref, atol=1e-6) and torch.equal(c_sp[:, 0], c_ref[:, 0])
    for (name, _), a, c in zip([(n, p) for n, p in draft.named_parameters() if p.requires_grad], g_sp, g_ref):
        assert torch.allclose(a, c, atol=1e-6), name
    mask_grad = dict(zip([n for n, p in draft.named_parameters() if p.requires_grad], g_ref))
    assert mask_grad["mask_hidden"].abs().max() > 0 and mask_grad["mask_embed"].abs().max() > 0


def _reference() -> dict:
    from specforge.train.trainer import DraftTrainer

    draft, teacher, batches = _setup()
    trainer = DraftTrainer(draft, teacher, _cfg(), torch.device("cpu"))
    out = {"metrics": [], "grads": []}
    for b in batches:
        out["metrics"].append(trainer.step([b]))
        out["grads"].append({k: p.grad.detach().clone() for k, p in draft.named_parameters() if p.grad is not None})
    out["params"] = {k: v.detach().clone() for k, v in draft.state_dict().items()}
    return out


def _close(name, a, b, atol=2e-5, rtol=1e-4):
    assert a.shape == b.shape, (name, a.shape, b.shape)
    if not a.is_floating_point():
        assert torch.equal(a, b), name
        return
    assert torch.allclose(a, b, atol=atol, rtol=rtol), f"{name}: max abs err {(a - b).abs().max().item()}"


def _sp_rank(rank, world, dims_tuple, ref_path):
    """One train rank of an SP run; rank 0 compares with the single process every step."""
    from specforge.parallel.dims import ParallelDims
    from specforge.parallel.fsdp import full_state_dict, grads_full
    from specforge.parallel.parallelize import parallelize_draft, sum_over_train_ranks
    from specforge.train.trainer import DraftTrainer

    dims = ParallelDims(*dims_tuple)
    groups = dims.build(list(range(world)), rank, timeout_s=90)
    cfg = _cfg()
    draft, teacher, batches = _setup()
    draft = parallelize_draft(draft, dims, groups, cfg)
    trainer = DraftTrainer(draft, teacher, cfg, torch.device("cpu"), reduce_sum=sum_over_train_ranks(groups))
    ref = torch.load(ref_path) if rank == 0 else None
    for step, full in enumerate(batches):
        m = trainer.step([sp_slice_batch(full, groups.sp_rank, groups.sp_size, ALGO.sp_halo(cfg))])
        grads = grads_full(draft)
        if rank == 0:
            rm = ref["metrics"][step]
            for key in ("loss", "acc_0", f"acc_{K - 1}", "tau", "valid_tokens"):
                assert math.isclose(m[key], rm[key], rel_tol=1e-5, abs_tol=1e-6), (step, key, m[key], rm[key])
            assert grads.keys() == ref["grads"][step].keys()
            for k, g in grads.items():
                # step 0: 2e-5; later steps start from weights AdamW moved, which magnifies fp32 noise of
                # gradient entries near its epsilon (a ring's different summation order): 5e-5
                _close(f"step {step} grad {k}", g, ref["grads"][step][k], atol=2e-5 if step == 0 else 5e-5)
    state = full_state_dict(draft)
    if rank == 0:  # the gradients were checked tightly every step; AdamW's first steps turn fp32 noise on a
        # gradient entry near its eps (|g| ~ 1e-7) into up to ~lr/10 of difference: 1e-3 is a tenth of lr
        for k, v in ref["params"].items():
            _close(f"param {k}", state[k], v, atol=1e-3)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dims_tuple", [(1, 2, 1), (1, 1, 2)], ids=["ulysses2", "ring2"])
def test_sp_ranks_match_the_single_process(tmp_path, dims_tuple):
    from specforge.parallel.dims import ParallelDims
    from specforge.parallel.launch import run_ranks

    ref_path = tmp_path / "ref.pt"
    torch.save(_reference(), ref_path)
    run_ranks(_sp_rank, ParallelDims(*dims_tuple).world, dims_tuple, str(ref_path), workdir=tmp_path, timeout_s=150)
