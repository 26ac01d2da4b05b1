"""Sequence parallelism (Ulysses, ring, 2x2) against the single-process trainer, on gloo.

Every multi-rank test runs several optimizer steps of the real DraftTrainer on a sequence length
not divisible by the SP degree, batch size 2, fp32, and compares on rank 0: the loss metrics,
the full gradients (gathered from the FSDP shards) after every step, and the final parameters.
"""

import math

import pytest
import torch

from specforge.algorithms.eagle3.algorithm import Eagle3Options
from specforge.config import Config, TrainConfig
from specforge.algorithms.eagle3.attention import ttt_attention_eager
from specforge.algorithms.eagle3.model import Eagle3Draft, Eagle3DraftConfig
from specforge.parallel.dims import ParallelDims
from specforge.parallel.fsdp import full_state_dict, grads_full
from specforge.parallel.launch import run_ranks
from specforge.parallel.parallelize import parallelize_draft, sum_over_train_ranks
from specforge.parallel.sp import _flash_step0, _kv_repeat
from specforge.train.batch import TrainBatch
from specforge.train.slicing import slice_bounds, sp_slice_batch
from specforge.train.trainer import DraftTrainer
from specforge.algorithms.eagle3.loss import num_valid_rows, ttt_loss

V, N, H, T, L, STEPS = 300, 100, 64, 29, 4, 3


def _cfg() -> Config:
    return Config(draft=Eagle3Options(ttt_length=L), train=TrainConfig(precision="fp32", lr=1e-2, warmup_steps=0, max_grad_norm=10.0))


def _setup():
    """Draft, teacher and STEPS batches, identical in every process."""
    g = torch.Generator().manual_seed(0)
    cfg = Eagle3DraftConfig(hidden_size=H, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, vocab_size=V, draft_vocab_size=N)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        draft = Eagle3Draft(cfg)
        draft.reset_parameters(std=0.1)
    draft.set_vocab(torch.sort(torch.randperm(V, generator=g)[:N]).values - torch.arange(N))
    teacher = torch.randn(N, H, generator=g) * 0.5
    inv = draft.draft_to_target_ids()
    batches = []
    for _ in range(STEPS):
        mask = torch.zeros(2, T, dtype=torch.long)
        mask[0, 3:12] = 1
        mask[0, 15:22] = 1  # nothing counts past row 19: with 4 ranks, rank 3 has no valid rows
        mask[1, 6:20] = 1
        ids = torch.randint(0, V, (2, T), generator=g)
        ids[1, 21:] = 0  # right padding of row 1
        tgt = torch.where(torch.rand(2, T, generator=g) < 0.8, inv[torch.randint(0, N, (2, T), generator=g)],
                          torch.randint(0, V, (2, T), generator=g))
        batches.append(TrainBatch(ids, mask, torch.randn(2, T, 3 * H, generator=g), torch.randn(2, T, H, generator=g), tgt))
    return draft, teacher, batches


def _reference() -> dict:
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
    err = (a - b).abs().max().item()
    assert torch.allclose(a, b, atol=atol, rtol=rtol), f"{name}: max abs err {err}"


def _check_ulysses_head_plans(groups):
    """Core level, every rank checks its own rows: kv heads repeated (4q/1kv) and query heads
    padded (3q/1kv, 9q/3kv) over 2 Ulysses ranks, 2 TTT steps, forward and backward."""
    from specforge.parallel.sp import UlyssesAttention
    from specforge.algorithms.eagle3.attention import TTTAttentionCore

    core = UlyssesAttention(TTTAttentionCore("fast"), groups.ulysses_group)
    P, r = 2, groups.uly_rank
    for Hq, Hkv in ((4, 1), (3, 1), (9, 3)):
        g = torch.Generator().manual_seed(Hq)
        full = [torch.randn(2, h, 14, 8, generator=g, dtype=torch.float64) for h in (Hq, Hkv, Hkv, Hkv, Hkv)]
        w = torch.randn(2, Hq, 14, 8, generator=g, dtype=torch.float64)
        q, k0, v0, k1, v1 = [x.clone().requires_grad_() for x in full]
        (ttt_attention_eager(q, [k0, k1], [v0, v1]) * w).sum().backward()
        rows = slice(r * 7, (r + 1) * 7)
        lq, lk0, lv0, lk1, lv1 = [x[:, :, rows].clone().requires_grad_() for x in full]
        out = core(lq, [lk0, lk1], [lv0, lv1])
        (out * w[:, :, rows]).sum().backward()
        for a, b in ((out, ttt_attention_eager(q, [k0, k1], [v0, v1])[:, :, rows]), (lq.grad, q.grad[:, :, rows]),
                     (lk0.grad, k0.grad[:, :, rows]), (lv1.grad, v1.grad[:, :, rows])):
            assert torch.allclose(a, b, atol=1e-10), (Hq, Hkv, (a - b).abs().max())


def _sp_rank(rank, world, dims_tuple, ref_path):
    """One train rank of an SP (x DP) run; rank 0 compares with the reference every step."""
    dims = ParallelDims(*dims_tuple)
    groups = dims.build(list(range(world)), rank, timeout_s=90)
    cfg = _cfg()
    draft, teacher, batches = _setup()
    if dims_tuple == (1, 2, 1):
        _check_ulysses_head_plans(groups)
    draft = parallelize_draft(draft, dims, groups, cfg)
    trainer = DraftTrainer(draft, teacher, cfg, torch.device("cpu"), reduce_sum=sum_over_train_ranks(groups))
    ref = torch.load(ref_path) if rank == 0 else None
    for step, full in enumerate(batches):
        if dims.dp > 1:  # each DP rank takes its share of the samples
            per = full.input_ids_BT.shape[0] // dims.dp
            full = TrainBatch(*(getattr(full, f)[groups.dp_rank * per : (groups.dp_rank + 1) * per]
                                for f in ("input_ids_BT", "loss_mask_BT", "aux_hidden_BTKH", "last_hidden_BTH", "target_ids_BT")))
        local = [sp_slice_batch(full, groups.sp_rank, groups.sp_size, L + 1) if groups.sp_size > 1 else full]
        m = trainer.step(local)
        grads = grads_full(draft)  # all-gather of every gradient shard
        if rank == 0:
            rm = ref["metrics"][step]
            for key in ("loss", "acc_0", f"acc_{L - 1}", "tau", "valid_tokens"):
                assert math.isclose(m[key], rm[key], rel_tol=1e-5, abs_tol=1e-6), (step, key, m[key], rm[key])
            assert math.isclose(m["grad_norm"], rm["grad_norm"], rel_tol=1e-4), (m["grad_norm"], rm["grad_norm"])
            assert grads.keys() == ref["grads"][step].keys()
            for k, g in grads.items():
                _close(f"step {step} grad {k}", g, ref["grads"][step][k])
    state = full_state_dict(draft)
    if rank == 0:
        for k, v in ref["params"].items():
            _close(f"param {k}", state[k], v)


def _run_sp(tmp_path, dims_tuple):
    ref_path = tmp_path / "ref.pt"
    torch.save(_reference(), ref_path)
    run_ranks(_sp_rank, ParallelDims(*dims_tuple).world, dims_tuple, str(ref_path), workdir=tmp_path, timeout_s=150)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ulysses2_matches_single_process(tmp_path):
    _run_sp(tmp_path, (1, 2, 1))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ring2_matches_single_process(tmp_path):
    _run_sp(tmp_path, (1, 1, 2))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ulysses2_x_ring2_matches_single_process(tmp_path):
    _run_sp(tmp_path, (1, 2, 2))


# ------------------------------------------------------------------------------ single process


def test_slice_bounds_pad_to_a_multiple():
    assert [slice_bounds(29, r, 4, 5) for r in range(4)] == [(0, 8, 13), (8, 16, 21), (16, 24, 29), (24, 32, 37)]
    assert slice_bounds(5, 3, 4, 8)[0] == 6  # a slice may lie entirely in the padding
    with pytest.raises(ValueError):
        slice_bounds(10, 2, 2, 2)


def test_slices_partition_rows_and_valid_count():
    draft, _, batches = _setup()
    b = batches[0]
    parts = [sp_slice_batch(b, r, 4, L + 1) for r in range(4)]
    assert all(p.aux_hidden_BTKH.shape == (2, 8, 3 * H) and p.input_ids_BT.shape == (2, 8 + L + 1) for p in parts)
    assert torch.equal(torch.cat([p.aux_hidden_BTKH for p in parts], 1)[:, :T], b.aux_hidden_BTKH)
    assert torch.equal(torch.cat([p.position_ids_BT for p in parts], 1)[0], torch.arange(32))
    assert torch.equal(parts[1].input_ids_BT, b.input_ids_BT[:, 8:21])  # owned rows + halo
    assert parts[3].loss_mask_BT[:, T - 24 :].sum() == 0  # padding never counts
    assert sum(num_valid_rows(p, draft.t2d, L) for p in parts) == num_valid_rows(b, draft.t2d, L) > 0
    assert num_valid_rows(parts[3], draft.t2d, L) == 0


def test_batch_from_samples_equals_slicing_the_full_batch():
    """Received windows (slice + halo, as the planner cuts them) and whole samples (a disk store)
    assemble into exactly the batch that slicing the full right-padded micro-batch gives."""
    from specforge.runtime.contracts import split_slices
    from specforge.train.slicing import batch_from_samples

    _, _, batches = _setup()
    b, lengths = batches[0], [T, 21]  # row 1 is right-padded after 21 tokens
    names = {"input_ids": "input_ids_BT", "loss_mask": "loss_mask_BT", "aux_hidden": "aux_hidden_BTKH",
             "last_hidden": "last_hidden_BTH", "target_ids": "target_ids_BT"}
    for v in names.values():  # a sample's features end with it (the pad id is 0 here)
        getattr(b, v)[1, lengths[1]:] = 0

    class Sample(dict):
        def __init__(self, row, start, stop):
            super().__init__({k: getattr(b, v)[row, start:stop] for k, v in names.items()})
            self.start = start

    whole = [Sample(r, 0, n) for r, n in enumerate(lengths)]
    for P in (1, 2, 3):
        for r in range(P):
            got_whole = batch_from_samples(whole, T, 0, r, P, L + 1)
            cut = [split_slices(n, P, L + 1, padded_length=T)[r] for n in lengths]
            got_recv = batch_from_samples([Sample(i, s, w) for i, (s, _, w) in enumerate(cut)], T, 0, r, P, L + 1)
            want = b if P == 1 else sp_slice_batch(b, r, P, L + 1)
            for name in names.values():
                assert torch.equal(getattr(got_whole, name), getattr(want, name)), (P, r, name)
                assert torch.equal(getattr(got_recv, name), getattr(want, name)), (P, r, name)


def test_one_slice_without_trimming_equals_full_loss():
    """sp_size 1: the SP path (halo, no per-step trimming) gives the trimmed path's loss and grads."""
    draft, teacher, batches = _setup()
    b = batches[0]
    l_ref, c_ref = ttt_loss(draft, b, teacher, L)
    g_ref = torch.autograd.grad(l_ref, [p for p in draft.parameters() if p.requires_grad])
    l_sp, c_sp = ttt_loss(draft, sp_slice_batch(b, 0, 1, L + 1), teacher, L)
    g_sp = torch.autograd.grad(l_sp, [p for p in draft.parameters() if p.requires_grad])
    assert torch.allclose(l_sp, l_ref, atol=1e-6) and c_sp[0, 0] == c_ref[0, 0]
    for a, c in zip(g_sp, g_ref):
        assert torch.allclose(a, c, atol=1e-6)


def test_ulysses_head_plans():
    assert _kv_repeat(4, 2, 2) == 1
    assert _kv_repeat(4, 2, 4) == 2  # kv heads repeated so they split over 4 ranks
    assert _kv_repeat(12, 3, 4) == 4
    assert _kv_repeat(9, 3, 2) is None  # SmolLM2: query heads padded to a multiple of the degree


@pytest.mark.gpu
def test_flash_step0_matches_eager():
    pytest.importorskip("flash_attn")
    q = torch.randn(2, 4, 64, 32, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 256, 32, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = _flash_step0(q, k, v, q_offset=128)
    ref = ttt_attention_eager(q.float(), [k.float()], [v.float()], q_offset=128)
    assert torch.allclose(out.float(), ref, atol=2e-2)
