"""Ring attention (``specforge/parallel/ring.py``) on gloo ranks against one process.

Each multi-rank test spawns the ranks once and checks, on every rank:

* the core: the TTT attention of three unroll steps (step 0 causal, then 1 and 2 diagonal keys,
  sharing one ``keys[0]`` as the draft does) equals the eager single-process reference on this
  rank's rows, forward and every input's gradient, in fp64 (1e-10) and fp32 (1e-5), with GQA
  (4 q / 2 kv, 4 q / 1 kv) and SmolLM2's 9 q / 3 kv heads (which Ulysses pads to MHA), and with
  query chunks smaller than a block (the kernel's chunk loop);
* never gathered: every key block the kernel attends to has exactly this rank's rows, and every
  tensor the ring receives is one block (K and V stacked: ``2 x B x Hkv x C x D``), ``P - 1`` of
  them per forward; the all-gather reference, watched the same way, shows the whole sequence
  (the check's negative control);
* the draft: one ``DraftTrainer`` step through ``parallelize_draft`` (FSDP2 x SP) gives the
  single process's loss and gradients within 1e-5 (fp32, before any optimizer step);
* negative controls (ring 2): a skipped earlier block, or the own block without its causal mask,
  makes the same comparison fail by far more than its tolerance;
* sliding windows (3, 5, 9 rows, fp32) against the windowed eager reference, bands inside one block
  and across block edges, earlier blocks skipped; the ring ignoring the window fails.

The measured max abs errors are written per rank and printed (``pytest -s``).
"""

import json
import math

import pytest
import torch

from tests.helpers.ranks import L, setup_sp, sp_cfg

HEADS = ((4, 2), (4, 1), (9, 3))
B, D, C = 2, 8, 6  # batch, head dim, rows per SP rank


def _inputs(Hq, Hkv, T, dtype, seed):
    """Step 0..2's queries, keys, values and output weights, identical in every process."""
    g = torch.Generator().manual_seed(seed)
    r = lambda h: torch.randn(B, h, T, D, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return {"q": [r(Hq) for _ in range(3)], "k": [r(Hkv) for _ in range(3)], "v": [r(Hkv) for _ in range(3)],
            "w": [r(Hq) for _ in range(3)]}


def _unroll(core, x, rows=slice(None)):
    """Three TTT steps through ``core`` on ``rows``: outputs and the inputs (leaves) to read grads from."""
    leaves = {k: [t[:, :, rows].clone().requires_grad_() for t in x[k]] for k in ("q", "k", "v")}
    outs, loss = [], 0
    for i in range(3):
        o = core(leaves["q"][i], leaves["k"][: i + 1], leaves["v"][: i + 1])
        outs.append(o)
        loss = loss + (o * x["w"][i][:, :, rows]).sum()
    loss.backward()
    return outs, leaves


def _max_err(core, groups, x, P, window=None):
    """Max abs difference of this rank's outputs and gradients from the eager reference's rows."""
    import functools

    from specforge.algorithms.eagle3.attention import ttt_attention_eager

    rows = slice(groups.sp_rank * C, (groups.sp_rank + 1) * C)
    want, ref = _unroll(functools.partial(ttt_attention_eager, window=window), x)
    got, mine = _unroll(core, x, rows)
    err = max((a - b[:, :, rows]).abs().max().item() for a, b in zip(got, want))
    for k in ("q", "k", "v"):
        err = max(err, *((a.grad - b.grad[:, :, rows]).abs().max().item() for a, b in zip(mine[k], ref[k])))
    return err


def _core(groups, ring_cls=None, kernel=None, window=None):
    from specforge.algorithms.eagle3.attention import TTTAttentionCore
    from specforge.parallel.sp import RingAttention, UlyssesAttention

    core = (ring_cls or RingAttention)(TTTAttentionCore("fast", window=window), groups.ring_group)
    if kernel is not None:
        core.kernel = kernel
    if groups.ulysses_group is not None:
        core = UlyssesAttention(core, groups.ulysses_group)
    return core


def _ring_of(core):
    from specforge.parallel.sp import UlyssesAttention

    return core.inner if isinstance(core, UlyssesAttention) else core


def _all_max(x: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _check_core(groups, P, report):
    from specforge.parallel.ring import TorchKernel

    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        for Hq, Hkv in HEADS:
            for kernel in (None, TorchKernel(chunk=4)):  # default chunk (one per block), 4 of 6 rows
                err = _all_max(_max_err(_core(groups, kernel=kernel), groups, _inputs(Hq, Hkv, P * C, dtype, Hq), P))
                name = f"core {str(dtype)[6:]} {Hq}q/{Hkv}kv chunk {'4' if kernel else 'default'}"
                report[name] = err
                assert err < tol, (name, err)


def _check_window(groups, P, report):
    """Sliding windows (3: at step 2 a query sees its own step-0 key only, so every earlier block is
    skipped; 5 and 9: bands that cross one or two block edges) against the windowed eager reference,
    fp32; negative control: the ring ignoring the window fails the same comparison."""
    from specforge.parallel import ring
    from specforge.parallel.ring import TorchKernel

    for W in (3, 5, 9):
        for Hq, Hkv in ((4, 2), (9, 3)):
            for kernel in (None, TorchKernel(chunk=4)):
                x = _inputs(Hq, Hkv, P * C, torch.float32, W)
                err = _all_max(_max_err(_core(groups, kernel=kernel, window=W), groups, x, P, window=W))
                name = f"window {W} {Hq}q/{Hkv}kv chunk {'4' if kernel else 'default'}"
                report[name] = err
                assert err < 1e-5, (name, err)
    good = ring._left
    ring._left = lambda window, kd: None  # the ring attends every earlier key: full attention
    try:
        err = _all_max(_max_err(_core(groups, window=5), groups, _inputs(4, 2, P * C, torch.float32, 5), P, window=5))
    finally:
        ring._left = good
    report["negative control: window ignored by the ring"] = err
    assert err > 1e-2, err


def _check_never_gathered(groups, P, report):
    """The kernel sees this rank's block only; each receive is one block; the all-gather reference
    fails the same check (its inner core reads the whole sequence's keys)."""
    from specforge.parallel import ring
    from specforge.parallel.sp import AllGatherRingAttention, _kv_repeat

    seen = []
    fwd, bwd = ring.TorchKernel.forward, ring.TorchKernel.backward

    def spy_fwd(self, q, k, v, *a):
        seen.append(("fwd", k.shape[2], v.shape[2]))
        return fwd(self, q, k, v, *a)

    def spy_bwd(self, dout, q, k, v, *a):
        seen.append(("bwd", k.shape[2], v.shape[2]))
        return bwd(self, dout, q, k, v, *a)

    ring.TorchKernel.forward, ring.TorchKernel.backward = spy_fwd, spy_bwd
    try:
        Hq, Hkv = 4, 2
        U, R = groups.dims.sp_ulysses, groups.dims.sp_ring
        x = _inputs(Hq, Hkv, P * C, torch.float32, 0)
        core = _core(groups)
        rc = _ring_of(core)
        _max_err(core, groups, x, P)
        block_rows = U * C  # the ring's block: this rank's Ulysses group's rows (all of them after the all-to-all)
        kv_heads = Hkv * _kv_repeat(Hq, Hkv, U) // U  # kv heads per rank after Ulysses (sp.py's repeat rule)
        assert seen and all(rows == block_rows for _, *kv in seen for rows in kv), seen
        block = (2, B, kv_heads, block_rows, D)
        steps = 3
        # per TTT step: R-1 K/V blocks in forward, R-1 again in backward, R dK/dV accumulators (fp32, same shape)
        assert rc.comm.recv_shapes == [block] * (steps * (3 * R - 2)), rc.comm.recv_shapes
        assert rc.comm.largest_recv == 4 * math.prod(block)
        report["ring bytes received per TTT step (fwd+bwd)"] = rc.comm.bytes_recv // steps
        report["ring key rows seen by the kernel"] = block_rows
        # negative control: the all-gather reference's inner core reads P*C rows of step-0 keys
        rows_seen = []
        ref = _core(groups, ring_cls=AllGatherRingAttention)
        inner = _ring_of(ref).inner
        orig = inner.forward
        inner.forward = lambda q, keys, values, q_offset=0: (rows_seen.append(keys[0].shape[2]),
                                                             orig(q, keys, values, q_offset))[1]
        assert _max_err(ref, groups, x, P) < 1e-5  # the reference itself is exact...
        assert set(rows_seen) == {R * block_rows}  # ...but holds the whole sequence's keys
        report["all-gather reference key rows"] = R * block_rows
    finally:
        ring.TorchKernel.forward, ring.TorchKernel.backward = fwd, bwd


def _check_negative_controls(groups, P, report):
    """A wrong block rule must fail the comparison by far more than its tolerance."""
    from specforge.parallel import ring

    good = ring.block_role
    bad_rules = {
        "skips the previous block": lambda src, rank: None if src == rank - 1 else good(src, rank),
        "own block without causal mask": lambda src, rank: "full" if src <= rank else None,
    }
    x = _inputs(4, 2, P * C, torch.float32, 0)
    try:
        for name, rule in bad_rules.items():
            ring.block_role = rule
            err = _all_max(_max_err(_core(groups), groups, x, P))
            report[f"negative control: {name}"] = err
            assert err > 1e-2, (name, err)
    finally:
        ring.block_role = good


def _check_draft_step(groups, dims, ref_path, report):
    """One DraftTrainer step through parallelize_draft: loss and full gradients vs the single process."""
    from specforge.parallel.fsdp import grads_full
    from specforge.parallel.parallelize import parallelize_draft, sum_over_train_ranks
    from specforge.registry import bound_algorithm
    from specforge.training.slicing import sp_slice_batch
    from specforge.training.trainer import DraftTrainer

    cfg = sp_cfg()
    draft, teacher, batches = setup_sp()
    draft = parallelize_draft(draft, dims, groups, cfg.train.precision, bound_algorithm(cfg))
    trainer = DraftTrainer(bound_algorithm(cfg), draft, teacher, cfg, torch.device("cpu"),
                           reduce_sum=sum_over_train_ranks(groups))
    m = trainer.step([sp_slice_batch(batches[0], groups.sp_rank, groups.sp_size, L + 1)])
    grads = grads_full(draft)
    ref = torch.load(ref_path)
    assert grads.keys() == ref["grads"][0].keys()
    err = max((g - ref["grads"][0][k]).abs().max().item() for k, g in grads.items())
    report["draft step: loss rel err"] = abs(m["loss"] - ref["metrics"][0]["loss"]) / abs(ref["metrics"][0]["loss"])
    report["draft step: max abs grad err"] = err
    assert err < 1e-5, err
    assert math.isclose(m["loss"], ref["metrics"][0]["loss"], rel_tol=1e-6)


def _rank(rank, world, dims_tuple, ref_path, out_dir):
    from specforge.parallel.dims import ParallelDims

    dims = ParallelDims(*dims_tuple)
    groups = dims.build(list(range(world)), rank, timeout_s=90)
    P, report = dims.sp, {}
    _check_core(groups, P, report)
    _check_window(groups, P, report)
    _check_never_gathered(groups, P, report)
    if dims.sp_ulysses == 1:
        _check_negative_controls(groups, P, report)
    _check_draft_step(groups, dims, ref_path, report)
    with open(f"{out_dir}/report{rank}.json", "w") as f:
        json.dump(report, f, indent=1)


def _run(tmp_path, dims_tuple):
    from specforge.parallel.dims import ParallelDims
    from specforge.parallel.launch import run_ranks
    from tests.helpers.ranks import sp_reference

    ref_path = tmp_path / "ref.pt"
    torch.save(sp_reference(), ref_path)
    world = ParallelDims(*dims_tuple).world
    run_ranks(_rank, world, dims_tuple, str(ref_path), str(tmp_path), workdir=tmp_path, timeout_s=200)
    reports = [json.loads((tmp_path / f"report{r}.json").read_text()) for r in range(world)]
    print(f"\nring attention, dims (dp, ulysses, ring) = {dims_tuple}:")
    for key in reports[0]:
        print(f"  {key}: {max(r[key] for r in reports):.3g}")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ring2_exact_never_gathered_and_negative_controls(tmp_path):
    _run(tmp_path, (1, 1, 2))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ulysses2_x_ring2_exact_and_never_gathered(tmp_path):
    _run(tmp_path, (1, 2, 2))


# ------------------------------------------------------------------------------ single process


def test_block_roles_of_a_causal_ring():
    from specforge.parallel.ring import block_role

    assert [block_role(s, 2) for s in range(4)] == ["full", "full", "causal", None]
    assert [block_role(s, 0) for s in range(3)] == ["causal", None, None]


@pytest.mark.gpu
def test_flash_block_kernel_matches_torch_kernel():
    """yunchang's flash-attn wrappers (the GPU block kernel) against the torch block kernel, bf16,
    GQA, causal and full blocks, forward (out, lse) and backward with a foreign final lse."""
    pytest.importorskip("flash_attn")
    from specforge.parallel.ring import FlashKernel, TorchKernel

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 2, 2, 128, 64, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(2, 2, 128, 64, device="cuda", generator=g).bfloat16() for _ in range(2))
    dout = torch.randn(q.shape, device="cuda", generator=g).bfloat16()
    assert FlashKernel.available(q)
    for causal in (True, False):
        (of, lf), (ot, lt) = (FlashKernel().forward(q, k, v, causal, 0.125),
                              TorchKernel().forward(q, k, v, causal, 0.125))
        assert (of - ot).abs().max() < 2e-2 and (lf - lt).abs().max() < 1e-2
        lse = lt + 0.5  # the union's lse is larger than one block's
        out = ot.bfloat16()
        delta = (dout.float() * out.float()).sum(-1)
        for a, b in zip(FlashKernel().backward(dout, q, k, v, out, lse, delta, causal, 0.125),
                        TorchKernel().backward(dout, q, k, v, out, lse, delta, causal, 0.125)):
            assert (a - b).abs().max() < 5e-2
