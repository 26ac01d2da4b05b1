"""models/layers.RMSNorm: its own backward equals autograd through the reference ops, and it keeps
only its input and the fp32 row scale for backward (the memory model's ``norm_saved``)."""

import pytest
import torch

from specforge.memory import StepPrecision, norm_saved
from specforge.models.layers import RMSNorm, _RMSNormFn


def reference(x, w, eps):
    """The ops RMSNorm ran before its backward of its own (autograd differentiates them)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype) if w.dtype == x.dtype else (w * xf).to(x.dtype)


def _grads(fn, x, w, dy):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = fn(x, w)
    y.backward(dy)
    return y, x.grad, w.grad


@pytest.mark.parametrize("xd, wd, tol", [(torch.float64, torch.float64, 1e-12), (torch.float32, torch.float32, 2e-6),
                                         (torch.bfloat16, torch.float32, 2e-2), (torch.bfloat16, torch.bfloat16, 2e-2),
                                         (torch.float32, torch.bfloat16, 2e-2)])
def test_backward_equals_autograd_through_the_reference_ops(xd, wd, tol):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 5, 48, generator=g, dtype=torch.float64) * 3).to(xd)
    w = (1 + torch.randn(48, generator=g, dtype=torch.float64) * 0.2).to(wd)
    dy = torch.randn(2, 5, 48, generator=g, dtype=torch.float64).to(xd)
    ours = _grads(lambda a, b: _RMSNormFn.apply(a, b, 1e-5), x, w, dy)
    ref = _grads(lambda a, b: reference(a, b, 1e-5), x, w, dy)
    assert torch.equal(ours[0], ref[0])  # the forward: the same ops, bit for bit
    for a, b in zip(ours[1:], ref[1:]):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol * b.double().abs().max().item())


def test_a_frozen_weight_gets_no_gradient_and_the_input_still_does():
    norm = RMSNorm(16)
    norm.weight.requires_grad_(False)
    x = torch.randn(3, 16, requires_grad=True)
    norm(x).sum().backward()
    assert norm.weight.grad is None and x.grad is not None and torch.isfinite(x.grad).all()


def _saved_bytes(fn, x) -> int:
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return sum(seen.values())


def test_it_keeps_its_input_and_the_row_scale_as_the_memory_model_counts():
    """bf16 rows under a fp32 weight (autocast's layout): 2 bytes per element + 4 per row, what
    ``norm_saved`` counts; control: autograd through the reference ops keeps the fp32 input copy and
    the fp32 normalized value, 8 bytes per element, what the model counted before."""
    rows, H = 64, 256
    norm = RMSNorm(H)
    x = torch.randn(rows, H).to(torch.bfloat16).requires_grad_()
    ours = _saved_bytes(norm, x) - norm.weight.numel() * 4  # the weight is a parameter: not activation memory
    assert ours == rows * norm_saved(H, StepPrecision(compute=2)) == rows * (2 * H + 4)
    ref = _saved_bytes(lambda a: reference(a, norm.weight, norm.eps), x) - norm.weight.numel() * 4
    assert ref == rows * (8 * H + 4)


@pytest.mark.usefixtures("kernels_keyed_by_torch_build")  # tests/conftest.py: any venv path reuses them
@pytest.mark.parametrize("xd, wd", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
def test_the_compiled_math_equals_the_eager_math(xd, wd):
    """``COMPILE_NORM``'s path (torch.compile of the forward and backward math; on a GPU only), compiled
    here by inductor for the CPU: outputs and gradients equal the eager math's (bf16 to one rounding).
    Control: the compiled forward of another eps is told apart."""
    pytest.importorskip("torch._inductor")
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 7, 64, generator=g) * 2).to(xd)
    w = (1 + 0.1 * torch.randn(64, generator=g)).to(wd)
    dy = torch.randn(3, 7, 64, generator=g).to(xd)
    out = {}
    for compiled in (False, True):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = _RMSNormFn.apply(xx, ww, 1e-5, compiled)
        y.backward(dy)
        out[compiled] = (y.detach(), xx.grad, ww.grad)
    tol = 0 if xd == torch.float32 else 1e-2
    for a, b in zip(out[True], out[False]):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol or 1e-5, atol=tol or 1e-5)
    y_other = _RMSNormFn.apply(x, w, 1e-1, True)
    assert not torch.allclose(y_other.float(), out[False][0].float(), rtol=1e-3, atol=1e-3)
