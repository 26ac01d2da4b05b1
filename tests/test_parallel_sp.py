"""Sequence parallelism (Ulysses, ring, 2x2) against the single-process trainer, on gloo.

Every multi-rank test runs several optimizer steps of the real DraftTrainer on a sequence length
not divisible by the SP degree, batch size 2, fp32, and compares on rank 0: the loss metrics,
the full gradients (gathered from the FSDP shards) after every step, and the final parameters.
"""

import pytest
import torch

from specforge.algorithms.eagle3.loss import num_valid_rows, ttt_loss
from specforge.parallel.sp import _kv_repeat
from specforge.training.slicing import slice_bounds, sp_slice_batch
from tests.helpers.ranks import H, L, T, run_sp, setup_sp


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ulysses2_matches_single_process(tmp_path):
    run_sp(tmp_path, (1, 2, 1))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ring2_matches_single_process(tmp_path):
    run_sp(tmp_path, (1, 1, 2))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ulysses2_x_ring2_matches_single_process(tmp_path):
    run_sp(tmp_path, (1, 2, 2))


# ------------------------------------------------------------------------------ single process


def test_slice_bounds_pad_to_a_multiple():
    assert [slice_bounds(29, r, 4, 5) for r in range(4)] == [(0, 8, 13), (8, 16, 21), (16, 24, 29), (24, 32, 37)]
    assert slice_bounds(5, 3, 4, 8)[0] == 6  # a slice may lie entirely in the padding
    with pytest.raises(ValueError):
        slice_bounds(10, 2, 2, 2)


def test_slices_partition_rows_and_valid_count():
    draft, _, batches = setup_sp()
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
    from specforge.parallel.bounds import split_slices
    from specforge.training.slicing import batch_from_samples

    _, _, batches = setup_sp()
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
    draft, teacher, batches = setup_sp()
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

