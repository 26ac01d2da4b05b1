"""train.pack_tokens with sequence parallelism: a step's samples end to end in ONE row, the row
sliced over the SP ranks (Ulysses, ring), each core masking other samples' keys from the gathered
sample ids. Compared on gloo with the UNPACKED single process (the same samples, the same global
batch): losses, counters, gradients after every step and the final weights (tests/helpers/ranks.py);
the ring kernel without the ids mixes the samples (a control)."""

import pytest
import torch

from specforge.algorithms.eagle3.attention import ttt_attention_eager
from specforge.contracts import FeatureSpec, SampleRef, row_offsets
from specforge.parallel.bounds import split_slices
from specforge.runtime.plan import plan_step
from specforge.training.slicing import WholeSample, batch_from_samples, sp_slice_batch
from tests.helpers.ranks import SAMPLE_LENGTHS, L, run_sp, setup_sp, sp_cfg, sp_rank


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("dims", [(1, 2, 1), (1, 1, 2)], ids=["ulysses2", "ring2"])
def test_packed_sp_matches_the_unpacked_single_process(tmp_path, dims):
    run_sp(tmp_path, dims, sp_rank, setup_sp, sp_cfg, True)  # packed=True


# ------------------------------------------------------------------------------ single process


def test_packed_slices_are_the_packed_row_cut():
    """The slices of a packed row cover it: ids, features and positions restarting per sample; the
    sample ids of the owned rows + halo; rows past the row's tokens are a padding sample."""
    _, _, batches = setup_sp()
    b = batches[0]
    n0, n1 = SAMPLE_LENGTHS
    parts = [sp_slice_batch(b, r, 2, L + 1, list(SAMPLE_LENGTHS)) for r in range(2)]
    C = -(-(n0 + n1) // 2)
    assert [p.num_rows for p in parts] == [C, C] and parts[1].start == C
    ids = torch.cat([p.input_ids_BT[:, : p.num_rows] for p in parts], 1)[0]
    assert torch.equal(ids, torch.cat([b.input_ids_BT[0], b.input_ids_BT[1, :n1]]))
    aux = torch.cat([p.aux_hidden_BTKH for p in parts], 1)[0]
    assert torch.equal(aux, torch.cat([b.aux_hidden_BTKH[0], b.aux_hidden_BTKH[1, :n1]]))
    pos = torch.cat([p.position_ids_BT for p in parts], 1)[0]
    assert torch.equal(pos, torch.cat([torch.arange(n0), torch.arange(n1)]))
    doc = parts[0].doc_ids_BT[0]  # owned rows + halo
    assert doc.shape[0] == C + L + 1 and torch.equal(doc, (torch.arange(C + L + 1) >= n0).long())
    assert parts[1].doc_ids_BT[0, -1] == 2  # past the row's 50 tokens: the padding sample


def test_packed_plan_sends_each_rank_its_part_of_each_sample():
    """The planner packs a DP group's samples in order into rows; rank j of an SP group receives,
    of each sample, the part lying in its slice of the row (+ halo), in the sample's own tokens;
    assembled, the received windows equal slicing the packed row of whole samples."""
    spec = FeatureSpec.hidden_states(8, "float32", 3)
    refs = [SampleRef(i, n) for i, n in enumerate((10, 7, 12, 5))]
    plan = plan_step(0, [refs], [9], [[1, 2]], spec, halo=3, pack_tokens=20)
    assert plan.packed and plan.micro_batches == (((0, 1), (2, 3)),) and plan.padded_lengths == ((17, 17),)
    assert plan.row_offsets((2, 3)) == [0, 12]
    got = {(t.sample_id, t.dst_rank): (t.start, t.end, t.stop) for t in plan.transfers}
    assert got[(0, 1)] == (0, 9, 10) and got[(0, 2)] == (9, 10, 10)  # row [0, 9) + halo 3 / [9, 18)
    assert got[(1, 1)] == (0, 0, 2) and got[(1, 2)] == (0, 7, 7)  # sample 1 sits at 10: halo only on rank 1
    assert split_slices(5, 2, 3, 17, 12) == [(0, 0, 0), (0, 5, 5)]
    assert row_offsets([10, 7]) == [0, 10]

    g = torch.Generator().manual_seed(0)
    whole = [WholeSample({"input_ids": torch.randint(1, 50, (n,), generator=g),
                          "loss_mask": torch.ones(n, dtype=torch.long),
                          "aux_hidden": torch.randn(n, 24, generator=g), "last_hidden": torch.randn(n, 8, generator=g),
                          "target_ids": torch.randint(0, 50, (n,), generator=g)}) for n in (10, 7)]
    for rank in (1, 2):
        windows = []
        for sid, s in enumerate(whole):
            start, end, stop = got[(sid, rank)]
            w = WholeSample({k: v[start : end if k == "aux_hidden" else stop] for k, v in s.items()})
            w.start = start
            windows.append(w)
        a = batch_from_samples(windows, 17, 0, rank - 1, 2, 3, plan.row_offsets((0, 1)))
        b = batch_from_samples(whole, 17, 0, rank - 1, 2, 3, [0, 10])
        for f in ("input_ids_BT", "loss_mask_BT", "aux_hidden_BTKH", "last_hidden_BTH", "target_ids_BT",
                  "position_ids_BT", "doc_ids_BT"):
            assert torch.equal(getattr(a, f), getattr(b, f)), (rank, f)


def test_ring_kernel_masks_other_samples_keys():
    """The ring's torch block kernel with sample ids equals the eager TTT core on a packed row
    (one rank: the whole row is its own block), forward and backward; without ids it differs."""
    import torch.distributed as dist

    from specforge.parallel.ring import RingComm, ring_ttt_attention

    g = torch.Generator().manual_seed(3)
    T = 19
    q, k0, v0, k1, v1 = [torch.randn(1, h, T, 8, generator=g, dtype=torch.float64, requires_grad=True)
                         for h in (4, 2, 2, 2, 2)]
    doc = torch.tensor([[0] * 7 + [1] * 9 + [2] * 3])
    ref = ttt_attention_eager(q, [k0, k1], [v0, v1], doc_ids_BT=doc)
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        comm = RingComm(dist.group.WORLD)
        out = ring_ttt_attention(q, [k0, k1], [v0, v1], comm, kernel="torch", doc_ids_BT=doc)
        plain = ring_ttt_attention(q, [k0, k1], [v0, v1], comm, kernel="torch")
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad((out * w).sum(), [q, k0, v0, k1]),
                    torch.autograd.grad((ref * w).sum(), [q, k0, v0, k1])):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    assert not torch.allclose(plain[:, :, 7:], ref[:, :, 7:])  # control: without ids the samples mix
