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
