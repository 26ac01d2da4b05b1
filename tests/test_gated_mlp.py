"""models/layers.GatedMLP's ``silu(g) * u`` (``_SiluMulFn``): values and gradients bit for bit autograd's
through the two ops, and it keeps ``g`` and ``u`` only for backward (not ``silu(g)`` as well): the memory
model's MLP term (``algorithms/eagle3/memory.py``, 3 I-wide tensors a row with down_proj's input)."""

import pytest
import torch
import torch.nn.functional as F

from specforge.models.layers import GatedMLP, _SiluMulFn


def _run(fn, g, u, dp):
    g, u = g.detach().requires_grad_(), u.detach().requires_grad_()
    p = fn(g, u)
    p.backward(dp)
    return p, g.grad, u.grad


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_values_and_gradients_are_autograds_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(0)
    g, u, dp = (torch.randn(2, 7, 40, generator=gen, dtype=torch.float64).mul(3).to(dtype) for _ in range(3))
    ours = _run(_SiluMulFn.apply, g, u, dp)
    ref = _run(lambda a, b: F.silu(a) * b, g, u, dp)
    for a, b in zip(ours, ref):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # control: the same comparison sees a wrong backward (silu's derivative taken as sigmoid)
    wrong = torch.sigmoid(g.double()) * (dp.double() * u.double())
    assert not torch.allclose(wrong.to(dtype), ref[1])


def test_only_the_needed_gradient_is_computed():
    g, u = torch.randn(3, 8, requires_grad=True), torch.randn(3, 8)
    _SiluMulFn.apply(g, u).sum().backward()
    assert g.grad is not None and u.grad is None


def _saved(fn, *args) -> set:
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, seen


def test_it_keeps_g_and_u_only():
    g, u = torch.randn(4, 16, requires_grad=True), torch.randn(4, 16, requires_grad=True)
    _, ours = _saved(_SiluMulFn.apply, g, u)
    assert set(ours) == {g.untyped_storage().data_ptr(), u.untyped_storage().data_ptr()}
    # control: autograd through the two ops also keeps silu(g), a third tensor of the same size
    _, ref = _saved(lambda a, b: F.silu(a) * b, g, u)
    assert len(ref) == 3 and sum(t.nbytes for t in ref.values()) == 3 * g.nbytes


def test_the_mlp_keeps_three_inner_tensors_a_row_under_autocast():
    """What the memory model counts for the MLP under 16-bit autocast: gate, up and down_proj's input
    (16-bit, ``I`` each per row) beside the MLP's input; the reference MLP keeps a fourth (silu(gate))."""
    torch.manual_seed(0)
    H, inner, rows = 16, 48, 10
    mlp = GatedMLP(H, inner)
    x = torch.randn(rows, H, requires_grad=True)

    def inner_bytes(fn):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, seen = _saved(fn, x)
        return sum(t.nbytes for t in seen.values() if t.shape[-1] == inner and t.shape[0] == rows)

    assert inner_bytes(mlp) == 3 * 2 * inner * rows
    ref = lambda a: mlp.down_proj(F.silu(mlp.gate_proj(a)) * mlp.up_proj(a))  # noqa: E731
    assert inner_bytes(ref) == 4 * 2 * inner * rows
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(mlp(x), ref(x))


# ---------------------------------------------------------------- train.recompute_mlp


def _mlp_pair(seed=0, dtype=torch.float32):
    from specforge.models.layers import set_mlp_recompute

    torch.manual_seed(seed)
    plain = GatedMLP(16, 48).to(dtype)
    again = GatedMLP(16, 48).to(dtype)
    again.load_state_dict(plain.state_dict())
    assert set_mlp_recompute(again, True) == 1
    return plain, again


def _three_uses(mlp, x, autocast: bool):
    """Three TTT-like uses of the same weights, each feeding the next; the output's gradients."""
    x = x.detach().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        h, outs = x, []
        for _ in range(3):
            h = h + mlp(h).to(h.dtype)
            outs.append(h)
        y = sum(o.float().square().mean() for o in outs)
    y.backward()
    return [y, x.grad] + [p.grad for p in mlp.parameters()]


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-13), (torch.float32, 1e-6)])
def test_recomputed_mlp_is_the_mlp(dtype, tol):
    """The same output; gradients equal up to the order of one sum (the input's: the MLP's two matmul
    gradients are added inside the recompute, then to the residual's, not one at a time)."""
    plain, again = _mlp_pair(dtype=dtype)
    x = torch.randn(5, 16, dtype=dtype)
    ref, got = _three_uses(plain, x, False), _three_uses(again, x, False)
    assert torch.equal(ref[0], got[0])
    for a, b in zip(ref[1:], got[1:]):
        torch.testing.assert_close(b, a, rtol=tol, atol=tol * a.abs().max().item())
    # control: the same comparison sees a gradient that lost the MLP's up projection
    assert not torch.allclose(got[1], _three_uses(GatedMLP(16, 48).to(dtype), x, False)[1], rtol=tol)


def test_recomputed_mlp_under_autocast_matches_to_bf16_rounding():
    """Same forward; weight gradients summed over the uses in fp32 (autocast's cached cast sums them in
    bf16 first), so gradients agree to bf16 rounding."""
    plain, again = _mlp_pair()
    x = torch.randn(5, 16)
    ref, got = _three_uses(plain, x, True), _three_uses(again, x, True)
    assert torch.equal(ref[0], got[0])
    for a, b in zip(ref[1:], got[1:]):
        torch.testing.assert_close(b, a, rtol=2e-2, atol=1e-2 * a.abs().max().item())


def test_recomputed_mlp_keeps_its_input_and_no_inner_tensor():
    plain, again = _mlp_pair()
    x = torch.randn(10, 16, requires_grad=True)

    def inner(mlp):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, seen = _saved(mlp, x)
        return sum(1 for t in seen.values() if t.shape[-1] == 48 and t.shape[0] == 10)

    assert inner(again) == 0 and inner(plain) == 3  # control: the plain MLP keeps gate, up, product
    with torch.no_grad():  # no graph: no recompute either
        assert torch.equal(again(x), plain(x))


def test_a_run_with_the_mlp_recomputed_trains_as_without(assets, tmp_path):
    """Three fp32 steps of EAGLE-3 with train.recompute_mlp: the same losses and grad norms (to fp32
    rounding: one gradient sum runs in another order)."""
    import json
    from pathlib import Path

    from specforge.config import load_config
    from specforge.train import run
    from tests.helpers.ray_run import cfg_overrides

    def losses(flag):
        out = tmp_path / flag
        base = [a for a in cfg_overrides(assets, out) if not a.startswith(("train.num_workers", "train.max_steps"))]
        run(load_config(None, [*base, "train.num_workers=1", "train.max_steps=3", f"train.recompute_mlp={flag}"]))
        recs = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        return [(r["loss"], r["grad_norm"]) for r in recs if r["kind"] == "train"]

    got, want = losses("true"), losses("false")
    assert len(got) == len(want) == 3
    for a, b in zip(got, want):
        assert a == pytest.approx(b, rel=1e-5)


def test_the_memory_model_counts_the_recompute_and_the_peak_drops():
    """bench_memory's method at a tiny EAGLE-3 shape: the model's peak with the MLP recomputed within 20%
    of the measured one, which is below the measured peak without it (the control)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_memory.py"
    spec = importlib.util.spec_from_file_location("bench_memory", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    peaks = {}
    for flag in (False, True):
        case = bench.Case("tiny", B=2, T=96, H=128, I=640, Hq=4, Hkv=2, D=32, V=2000, N=500, ttt=4, recompute=flag)
        measured = bench.measure(case)
        predicted, _ = bench.predicted_peak(bench.predict(case))
        assert abs(predicted / measured - 1) < 0.20, (flag, predicted, measured)
        peaks[flag] = measured
    assert peaks[True] < peaks[False], peaks
