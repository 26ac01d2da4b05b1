"""tests/helpers/tolerance.py: the derived tolerance accepts the same sums in another order and
catches a real error (negative controls: a dropped term, a perturbation of 100x the bound)."""

import pytest
import torch

from tests.helpers.tolerance import adamw_tol, assert_close_sum, close_tol, sum_tol

N = 4096


def _sequential(x: torch.Tensor) -> torch.Tensor:
    """Left to right, one rounding per term (torch.sum blocks and vectorizes instead)."""
    acc = torch.zeros((), dtype=x.dtype)
    for v in x:
        acc = acc + v
    return acc


def test_sum_tol_is_gamma_n():
    u = torch.finfo(torch.float32).eps / 2
    assert sum_tol(torch.float32, N) == pytest.approx(N * u / (1 - N * u), rel=1e-12)
    assert sum_tol(torch.float64, N) < 1e-12 < sum_tol(torch.float32, N) < sum_tol(torch.bfloat16, 8)
    with pytest.raises(ValueError, match="no rounding bound"):
        sum_tol(torch.bfloat16, 256)  # n u >= 1/2 in bf16 (u = 2^-8)


def test_a_reordered_float32_sum_passes_and_a_wrong_one_fails():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, generator=g) * torch.rand(N, generator=g) * 10  # magnitudes over two decades
    want = _sequential(x)
    scale = x.abs().sum().item()  # the terms' magnitudes: what gamma_n is relative to
    reordered = [x.sum(), x[torch.randperm(N, generator=g)].sum(), _sequential(x.flip(0)), x.double().sum().float()]
    assert any(r.item() != want.item() for r in reordered)  # the orders do round differently (fp64: surely)
    for r in reordered:
        assert_close_sum(r, want, torch.float32, N, scale=scale, what="reordered")
    big = x.abs().argmax()
    dropped = x.sum() - x[big]  # a term left out (the largest: one of 4096)
    with pytest.raises(AssertionError, match="dropped"):
        assert_close_sum(dropped, want, torch.float32, N, scale=scale, what="dropped")
    off = want + 100 * close_tol(torch.float32, N, scale)
    with pytest.raises(AssertionError, match="perturbed"):
        assert_close_sum(off, want, torch.float32, N, scale=scale, what="perturbed")


def test_a_blocked_matmul_passes_at_the_default_scale_and_a_dropped_term_fails():
    """Inner dimension 4096: one fp32 matmul, and blocks of 100 summed last to first, against the fp64
    product (rounded once); the default scale is max |want|."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(32, N, generator=g), torch.randn(N, 24, generator=g)
    want = (a.double() @ b.double()).float()
    blocked = sum(a[:, i : i + 100] @ b[i : i + 100] for i in reversed(range(0, N, 100)))
    assert not torch.equal(a @ b, want) and not torch.equal(blocked, want)  # fp32 sums round, on any CPU
    assert_close_sum(a @ b, want, torch.float32, N, what="matmul")
    assert_close_sum(blocked, want, torch.float32, N, what="blocked")
    k = (a[0] * b[:, 0]).abs().argmax()
    dropped = blocked.clone()
    dropped[0, 0] -= a[0, k] * b[k, 0]  # one term of one entry left out
    with pytest.raises(AssertionError, match="dropped"):
        assert_close_sum(dropped, want, torch.float32, N, what="dropped")
    assert_close_sum(torch.tensor([3, 4]), torch.tensor([3, 4]), torch.float32, N)  # integers: exactly
    with pytest.raises(AssertionError):
        assert_close_sum(torch.tensor([3, 5]), torch.tensor([3, 4]), torch.float32, N)


def test_adamw_tol_bounds_the_weights_of_gradients_that_agree_to_their_tolerance():
    """Two AdamW runs (eps = lr) fed gradients that differ by up to ``gtol`` (random signs, every
    entry's gradient near zero included) stay within adamw_tol; at torch's default eps (1e-8) the
    same gradients move some weights apart by ~lr, far outside it."""
    g = torch.Generator().manual_seed(2)
    lrs, gtol, steps = [1e-2, 5e-3, 1e-3], 1e-6, 3
    grads = [torch.randn(1000, generator=g, dtype=torch.float64) * 0.01 for _ in range(steps)]
    for gr in grads:
        gr[:100] *= 1e-6  # near zero: where eps = 1e-8 amplifies
    noise = [(torch.rand(1000, generator=g, dtype=torch.float64) * 2 - 1) * gtol for _ in range(steps)]

    def run(eps, perturbed):
        w = torch.nn.Parameter(torch.ones(1000, dtype=torch.float64))
        opt = torch.optim.AdamW([w], lr=lrs[0], betas=(0.9, 0.95), eps=eps, weight_decay=0.0)
        for lr, gr, dn in zip(lrs, grads, noise):
            opt.param_groups[0]["lr"] = lr
            w.grad = gr + dn if perturbed else gr.clone()
            opt.step()
        return w.detach()

    tol = adamw_tol(lrs, [gtol] * steps, lrs[0], torch.float64, 1.0)
    assert (run(lrs[0], True) - run(lrs[0], False)).abs().max() <= tol
    assert (run(1e-8, True) - run(1e-8, False)).abs().max() > 100 * tol
