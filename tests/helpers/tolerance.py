"""Tolerances derived from the dtype and the number of summed terms, not fitted to one CPU's kernels.

Two computations of one value that sum in different orders (another CPU's vector width or
blocking, a ring's rank order, a packed row) differ by their rounding. A sum of n terms in ANY
order is within gamma_n * sum|terms| of the exact sum, gamma_n = n u / (1 - n u), u = eps / 2 the
unit roundoff (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., section 4.2), so
two orders are within twice that of each other. Chained operations (a forward, then its
backward) add their relative errors, gamma_a + gamma_b <= gamma_(a+b) (Higham, Lemma 3.3): for a
model's loss or gradient, n counts the terms of every sum on its longest path (each layer's
condition number taken as O(1)).

A test sees the compared tensor, not the sum of its terms' magnitudes: ``scale`` defaults to the
reference's max |entry|, standing in for them (an entry that cancels to near zero keeps its terms'
rounding, so the scale is the tensor's, not the entry's; gamma_n's worst case covers the rest).

AdamW divides a step by sqrt(v) + eps: near-zero gradients make a 1e-9 rounding a step of ~lr. Runs
compared weight by weight set ``train.adam_eps`` to lr so that ``adamw_tol`` bounds the weights.
"""

import torch


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2  # round to nearest: half the spacing above 1


def sum_tol(dtype: torch.dtype, n_terms: int) -> float:
    """gamma_n: the rounding of a sum of ``n_terms`` terms in ``dtype`` in any order, relative to the
    sum of the terms' magnitudes (a worst case: every rounding of one sign)."""
    nu = n_terms * unit_roundoff(dtype)
    if nu >= 0.5:  # the bound stops meaning anything: the sum is too long for the dtype
        raise ValueError(f"{n_terms} terms in {dtype}: n * u = {nu:.3g}, no rounding bound")
    return nu / (1 - nu)


def close_tol(dtype: torch.dtype, n_terms: int, scale: float) -> float:
    """The absolute gap two orders of the same sums may show: each is within gamma_n * scale of the exact."""
    return 2 * sum_tol(dtype, n_terms) * scale


def assert_close_sum(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, n_terms: int,
                     scale: float | None = None, what: str = "") -> None:
    """``got`` equals ``want`` up to the rounding of ``n_terms`` summed terms in ``dtype`` (``close_tol``);
    integer tensors exactly. ``scale``: the terms' magnitude (default max |want|)."""
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if not want.is_floating_point():
        assert torch.equal(got, want), what
        return
    if scale is None:
        scale = want.abs().max().item() if want.numel() else 0.0
    tol = close_tol(dtype, n_terms, scale)
    err = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
    assert err <= tol, f"{what}: max abs err {err:.3g} > {tol:.3g} (2 gamma_{n_terms} in {dtype} x scale {scale:.3g})"


def adamw_tol(lrs: list[float], grad_tols: list[float], eps: float, dtype: torch.dtype, w_scale: float) -> float:
    """How far AdamW steps at learning rates ``lrs`` may move two copies of a weight apart when step s's
    gradients agree to ``grad_tols[s]``. A step is lr * m / (sqrt(v) + eps): m (an average of the
    gradients) moves by at most the gradient's gap, sqrt(v) too, and |m| <= ~sqrt(v) (Cauchy-Schwarz
    over betas (0.9, 0.95) and a few steps), so the step moves by at most 2 * lr / eps times it. Each
    step also rounds the weight itself (``w_scale``: its magnitude)."""
    assert len(lrs) == len(grad_tols)
    return sum(2 * lr / eps * g for lr, g in zip(lrs, grad_tols)) + close_tol(dtype, len(lrs), w_scale)


def step_terms(step: int, n_terms: int) -> int:
    """Step ``step``'s gradients (from 0) also carry the earlier steps' rounding through the weights
    (lr / eps = 1 passes it on unamplified): each earlier step's chain of sums counts again."""
    return (step + 1) * n_terms


def assert_grads_close(step: int, grads: dict, want: dict, n_terms: int, dtype=torch.float32) -> None:
    """Step ``step``'s gradients by name, each a chain of ``n_terms`` sums a step (``step_terms``)."""
    assert grads.keys() == want.keys(), (sorted(grads), sorted(want))
    for k, g in grads.items():
        assert_close_sum(g, want[k], dtype, step_terms(step, n_terms), what=f"step {step} grad {k}")


def assert_weights_close(state: dict, want: dict, grads: list[dict], lr: float, eps: float, n_terms: int,
                         dtype=torch.float32, what: str = "param") -> None:
    """Weights after ``len(grads)`` AdamW steps (at most ``lr``) whose gradients were ``grads`` (the
    reference's, per step, by name): trained ones within ``adamw_tol`` of ``assert_grads_close``'s
    tolerances, the rest (frozen, buffers: no step touches them) bit for bit."""
    assert state.keys() == want.keys(), (sorted(state), sorted(want))
    for k, v in want.items():
        if all(k not in g for g in grads):
            assert torch.equal(state[k], v), f"{what} {k}"
            continue
        gtols = [close_tol(dtype, step_terms(s, n_terms), g[k].abs().max().item() if k in g else 0.0)
                 for s, g in enumerate(grads)]
        tol = adamw_tol([lr] * len(grads), gtols, eps, dtype, v.abs().max().item())
        err = (state[k].double() - v.double()).abs().max().item()
        assert err <= tol, f"{what} {k}: max abs err {err:.3g} > {tol:.3g} (adamw_tol, {n_terms} terms a step)"
