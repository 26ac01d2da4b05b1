"""DFlash with ring sequence parallelism (``specforge/algorithms/dflash/sp.py``) on gloo ranks
against one process.

One spawn of the ranks (ring 2, and ring 4: a block sees up to three earlier ranks' context whole,
and some ranks anchor nothing in a row) checks, on every rank:

* the forward: the blocks anchored in this rank's context rows (the single process's anchors:
  ``sample_anchors`` over the whole batch, then ``local_anchors``; at ring 2 every row has some on
  every rank; the kernel's row chunks hold two blocks) give the single process's hidden states, and
  the gradients of a weighted sum (the context features' rows of this rank, every parameter summed
  over the ranks) equal the single process's, in fp64 (1e-10);
* the same with a sliding window of 9 (``draft.sliding_window``): blocks see part of an earlier
  rank's context, or none of it;
* negative controls: a rank that skips one ring hop, a context mask that also shows the anchor
  itself, or a ring forward without the reference's window, fails the same comparison by far more
  than its tolerance;
* the train step: ``parallelize_draft`` (ring SP + FSDP2) and ``DraftTrainer`` over ``sp_slice_batch``
  slices (halo ``block_size - 1``, a micro-batch length that is not a multiple of the ring) give the
  single process's metrics and gradients at every step and its parameters after 3 AdamW steps at
  lr 1e-2 (eps = lr), fp32, to tolerances derived from the sums they run (tests/helpers/tolerance.py).

The measured max abs errors are written per rank and printed (``pytest -s``). A single-process
test pins what makes the anchors exactly the single process's: right padding moves none.
"""

import json
import math

import pytest
import torch

from tests.helpers.dflash import tiny_draft

T, B, K, STEPS = 29, 2, 4, 3
# The tiny draft's (tests/helpers/dflash.py) longest chain of sums into a gradient entry: the context
# rows and block rows (6 anchors a row) summed into it, and per layer, forward and backward, the widest
# dot products: fc's 3H, the projections' H, the MLP's I, a block's keys (T + K), the vocab's softmax.
GRAD_TERMS = B * T + B * 6 * K + 2 * 2 * (3 * 32 + 32 + 64 + T + K + 97)


def _cfg():
    from specforge.algorithms.dflash.algorithm import DFlashOptions
    from specforge.config import Config, TrainConfig

    return Config(draft=DFlashOptions(algorithm="dflash", block_size=K, num_anchors=6, num_layers=2),
                  train=TrainConfig(precision="fp32", lr=1e-2, warmup_steps=0, max_grad_norm=10.0, adam_eps=1e-2))


def _batches(F, dtype=torch.float32):
    """STEPS batches of B x T, identical in every process: assistant spans across the ring boundary
    (row 1 right-padded)."""
    from specforge.models.features import TrainBatch

    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        mask = torch.zeros(B, T, dtype=torch.long)
        mask[0, 2:12] = 1
        mask[0, 13:27] = 1
        mask[1, 5:22] = 1
        ids = torch.randint(0, 96, (B, T), generator=g)
        ids[1, 23:] = 0
        tgt = torch.randint(0, 96, (B, T), generator=g)
        out.append(TrainBatch(ids, mask, torch.randn(B, T, F, generator=g, dtype=torch.float64).to(dtype),
                              torch.zeros(B, T, 32, dtype=dtype), tgt))
    return out


def _setup():
    draft = tiny_draft(torch.float32)
    return draft, None, _batches(draft.config.context_width)


# ------------------------------------------------------------------------------ the forward, fp64


def _forward_err(groups, comm, skip_hop=-1, wrong_mask=False, window=None, ref_window=None):
    """Max abs difference of this rank's hidden states and gradients from the single process
    (``window``: the draft's sliding window; ``ref_window``: the reference's, if another)."""
    import torch.distributed as dist

    from specforge.algorithms.dflash import sp
    from specforge.algorithms.dflash.loss import build_block_ids, local_anchors, sample_anchors

    draft = tiny_draft(torch.float64, sliding_window=ref_window if ref_window is not None else window)
    batch = _batches(draft.config.context_width, torch.float64)[0]
    anchors, keep = sample_anchors(batch.loss_mask_BT, 6, torch.Generator().manual_seed(1))
    ids = build_block_ids(batch.input_ids_BT, anchors, K, 96)
    w = torch.randn(*ids.shape, draft.config.hidden_size, generator=torch.Generator().manual_seed(2),
                    dtype=torch.float64)
    ctx = batch.aux_hidden_BTKH.clone().requires_grad_()
    ref = draft(ctx, ids, anchors, keep)
    (ref * w).sum().backward()
    ref_grads = {k: p.grad.clone() for k, p in draft.named_parameters() if p.grad is not None}
    draft.zero_grad()
    draft.config.sliding_window = window

    P, r = comm.size, comm.rank
    C = -(-T // P)
    start = r * C
    rows = torch.zeros(B, C, ctx.shape[-1], dtype=torch.float64)
    rows[:, : max(0, min(T, start + C) - start)] = batch.aux_hidden_BTKH[:, start : start + C]
    rows.requires_grad_()
    la, lk = local_anchors(anchors, keep, start, start + C)
    lids = build_block_ids(torch.nn.functional.pad(batch.input_ids_BT, (0, P * C - T))[:, start : start + C], la, K, 96)
    # block j of row b here is global block (kept anchors before start) + j
    first = (keep & (anchors < start)).sum(1, keepdim=True)
    gidx = (first + torch.arange(la.shape[1])).clamp(max=anchors.shape[1] - 1)
    pick = lambda x: x[torch.arange(B).unsqueeze(1), gidx] * lk[:, :, None, None]  # noqa: E731
    pos = torch.arange(start, start + C).expand(B, C)
    if P == 2:
        assert lk.any(1).all(), "every row anchors a block on every rank (the check would be vacuous)"
    visible, chunk = sp.visible_context, sp.CHUNK_CPU
    sp.CHUNK_CPU = 2 * K  # the kernel's row-chunk loop: two blocks at a time
    if wrong_mask:  # the anchor itself visible too: the mask the training forward must not have
        sp.visible_context = lambda a, k, lo, hi, K, win=None: visible(a + 1, k, lo, hi, K, win)
    try:
        got = draft(rows, lids, la, lk, pos, ring=sp.RingBlocks(comm, start, skip_hop=skip_hop))
        (got * pick(w)).sum().backward()
    finally:
        sp.visible_context, sp.CHUNK_CPU = visible, chunk
    err = (got.detach() * lk[:, :, None, None] - pick(ref.detach())).abs().max().item()  # kept blocks
    end = min(T, start + C)
    if end > start:
        err = max(err, (rows.grad[:, : end - start] - ctx.grad[:, start:end]).abs().max().item())
    for k, p in draft.named_parameters():
        if p.grad is not None:
            g = p.grad.clone()
            dist.all_reduce(g, group=comm.group)
            err = max(err, (g - ref_grads[k]).abs().max().item())
    t = torch.tensor([err], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=comm.group)
    return t.item()


# ------------------------------------------------------------------------------ the train step, fp32


def _train_err(groups, dims, ref_path):
    from specforge.parallel.fsdp import full_state_dict, grads_full
    from specforge.parallel.parallelize import parallelize_draft, sum_over_train_ranks
    from specforge.registry import bound_algorithm
    from specforge.training.slicing import sp_slice_batch
    from specforge.training.trainer import DraftTrainer
    from tests.helpers.ranks import check_grads, check_params

    cfg = _cfg()
    algo = bound_algorithm(cfg)
    draft, _, batches = _setup()
    draft = parallelize_draft(draft, dims, groups, cfg.train.precision, algo)
    trainer = DraftTrainer(algo, draft, None, cfg, torch.device("cpu"), reduce_sum=sum_over_train_ranks(groups))
    ref = torch.load(ref_path)
    err, metric_err = 0.0, 0.0
    for step, full in enumerate(batches):
        m = trainer.step([sp_slice_batch(full, groups.sp_rank, groups.sp_size, algo.sp_halo())])
        rm = ref["metrics"][step]
        assert m["valid_tokens"] == rm["valid_tokens"] > 0, (step, m["valid_tokens"], rm["valid_tokens"])
        for key in ("loss", "acc_0", f"acc_{K - 2}", "tau", "grad_norm"):
            assert math.isclose(m[key], rm[key], rel_tol=1e-5, abs_tol=1e-6), (step, key, m[key], rm[key])
            metric_err = max(metric_err, abs(m[key] - rm[key]))
        grads = grads_full(draft)
        check_grads(step, grads, ref["grads"][step], GRAD_TERMS)
        err = max(err, *((g - ref["grads"][step][k]).abs().max().item() for k, g in grads.items()))
    state = full_state_dict(draft)
    if groups.rank == 0:
        check_params(state, ref["params"], ref["grads"], cfg, GRAD_TERMS)
    param_err = max((state[k] - v).abs().max().item() for k, v in ref["params"].items()) if groups.rank == 0 else 0.0
    return err, metric_err, param_err


def _rank(rank, world, ref_path, out_dir):
    from specforge.algorithms.dflash.sp import ring_comm
    from specforge.parallel.dims import ParallelDims
    from specforge.parallel.sp import apply_sp
    from specforge.registry import get_algorithm

    dims = ParallelDims(1, 1, world)
    groups = dims.build(list(range(world)), rank, timeout_s=90)
    d = tiny_draft(torch.float64)
    apply_sp(d, get_algorithm(_cfg().draft.algorithm).sp_cores(d), None, groups.ring_group)  # as parallelize_draft
    comm = ring_comm(d)
    report = {"forward": _forward_err(groups, comm), "skip_hop": _forward_err(groups, comm, skip_hop=1),
              "wrong_mask": _forward_err(groups, comm, wrong_mask=True),
              # a window of 9 cuts blocks off from part of an earlier rank's context (and from all of it)
              "window": _forward_err(groups, comm, window=9),
              "window_ignored": _forward_err(groups, comm, window=None, ref_window=9)}
    report["train_grads"], report["train_metrics"], report["train_params"] = _train_err(groups, dims, ref_path)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ring", [2, 4])
def test_ring_equals_the_single_process_with_negative_controls(tmp_path, ring):
    from specforge.parallel.launch import run_ranks
    from tests.helpers.ranks import sp_reference

    ref_path = tmp_path / "ref.pt"
    torch.save(sp_reference(_setup, _cfg), ref_path)
    run_ranks(_rank, ring, str(ref_path), tmp_path, workdir=tmp_path, timeout_s=200)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(ring)]
    print(f"dflash ring {ring}, max abs errors:", reports)
    for rep in reports:
        assert rep["forward"] < 1e-10 and rep["window"] < 1e-10, rep
        for control in ("skip_hop", "wrong_mask", "window_ignored"):  # the negative controls fail by far
            assert rep[control] > 1e-3, rep
        # fp32 training: each rank checked its gradients and weights at the derived tolerances (_train_err);
        # a broken ring is off by O(1) in the gradients (and the metrics, checked at rel 1e-5 there)


def test_right_padding_moves_no_anchor():
    """What lets a ring rank draw the single process's anchors from the ids and loss mask of its
    micro-batch padded to a multiple of the ring: the same anchors at any padded length (any pad id);
    a changed assistant token (the control) draws others."""
    from specforge.algorithms.dflash.algorithm import anchor_seed
    from specforge.algorithms.dflash.loss import anchor_keys, sample_anchors

    cfg = _cfg()
    b = _batches(8)[0]

    def anchors(ids, mask):
        return sample_anchors(mask, 6, keys_BT=anchor_keys(ids, mask, anchor_seed(cfg.train.seed, 3)))

    a0, k0 = anchors(b.input_ids_BT, b.loss_mask_BT)
    for pad, value in ((1, 0), (3, 7), (40, 0)):
        ids = torch.nn.functional.pad(b.input_ids_BT, (0, pad), value=value)
        a, k = anchors(ids, torch.nn.functional.pad(b.loss_mask_BT, (0, pad)))
        assert torch.equal(a, a0) and torch.equal(k, k0), pad
    ids = b.input_ids_BT.clone()
    ids[0, 5] += 1
    assert not torch.equal(anchors(ids, b.loss_mask_BT)[0], a0)
