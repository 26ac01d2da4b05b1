"""models/layers.apply_rotary through torch.compile (``COMPILE_ROTARY``; on a GPU only) equals the eager
ops, compiled here by inductor for the CPU, forward and gradients."""

import pytest
import torch

from specforge.models.layers import apply_rotary, rope_cos_sin, rope_inv_freq


@pytest.mark.usefixtures("kernels_keyed_by_torch_build")  # tests/conftest.py: any venv path reuses them
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_the_compiled_rotary_equals_the_eager_ops(dtype, tol):
    pytest.importorskip("torch._inductor")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, 9, 16, generator=g).to(dtype)
    cos, sin = rope_cos_sin(torch.arange(9).expand(2, 9), rope_inv_freq(16, 10000.0))
    dy = torch.randn(2, 4, 9, 16, generator=g).to(dtype)
    out = {}
    for compiled in (False, True):
        xx = x.clone().requires_grad_()
        y = apply_rotary(xx, cos, sin, compiled=compiled)
        y.backward(dy)
        out[compiled] = (y.detach().float(), xx.grad.float())
    for a, b in zip(out[True], out[False]):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    # control: positions shifted by one are told apart
    cos1, sin1 = rope_cos_sin(torch.arange(1, 10).expand(2, 9), rope_inv_freq(16, 10000.0))
    assert not torch.allclose(apply_rotary(x, cos1, sin1, compiled=True).float(), out[False][0], atol=1e-2)
