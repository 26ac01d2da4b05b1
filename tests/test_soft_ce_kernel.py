"""The fused soft-CE kernel (``specforge/kernels/soft_ce.py``) against its torch reference, in Triton's
interpreter (``TRITON_INTERPRET=1``: the kernel runs in Python on CPU tensors, tile by tile).

Tolerances, measured in the interpreter (torch 2.13 CPU, triton 3.9): the statistics come out within
one fp32 ulp of the torch ops (the kernel sums tile by tile, rescaling the running sum when the max
grows): ``ce`` rel. <= 1.2e-7, ``acc_p`` exact, ``G`` fp32 abs. <= 1.8e-7, ``G`` bf16 within one bf16
ulp; ``pred`` is exact (the first maximum, as torch). The checks allow ``ce`` rtol 1e-6 / atol 1e-5,
``acc_p`` 1e-6, ``G`` atol 1e-6 (fp32) and one bf16 ulp (bf16). A GPU's ``exp`` is approximate: the
GPU comparison needs its own, looser figures (not measured yet).

Without triton the kernel's tests skip; the import test (triton blocked) always runs.
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specforge.algorithms.eagle3.loss import linear_soft_cross_entropy
from specforge.kernels import soft_ce

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed (pip install triton): these tests run the "
                                         "soft-CE kernel in Triton's interpreter")
KERNEL_MODULE = "specforge.kernels.soft_ce_triton"


def _forget_kernel_module() -> None:
    sys.modules.pop(KERNEL_MODULE, None)
    vars(sys.modules["specforge.kernels"]).pop("soft_ce_triton", None)  # else ``from ... import`` finds it


@pytest.fixture(scope="module")
def interpret():
    """``TRITON_INTERPRET=1`` while this module's tests run, and the kernel module imported under it
    (``triton.jit`` reads the variable when it decorates, at the module's import); forgotten after, so
    that nothing else in the process meets an interpreted kernel."""
    module = sys.modules.get(KERNEL_MODULE)
    if module is not None and not module.INTERPRETED:
        pytest.skip("the kernel module was compiled for a GPU earlier in this process")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        assert soft_ce.available("cpu")
        yield
    _forget_kernel_module()


def teacher_rows(P: int, N: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    if kind == "onehot":
        return F.one_hot(torch.randint(0, N, (P,), generator=gen), N).float()
    return torch.softmax(2 * torch.randn(P, N, generator=gen), -1)


def case(M: int, N: int, dtype: torch.dtype, scale: float, kind: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    z = (scale * torch.randn(M, N, generator=gen)).to(dtype)
    P = M + 3
    return z, teacher_rows(P, N, kind, gen), torch.randint(0, P, (M,), generator=gen)


def assert_matches(got, want):
    ce, pred, acc_p, G = got
    ce_r, pred_r, acc_r, G_r = want
    torch.testing.assert_close(ce, ce_r, rtol=1e-6, atol=1e-5)
    assert torch.equal(pred, pred_r)
    torch.testing.assert_close(acc_p, acc_r, rtol=1e-6, atol=1e-6)
    assert G.dtype == G_r.dtype
    if G.dtype == torch.bfloat16:
        torch.testing.assert_close(G, G_r, rtol=2**-8, atol=1e-6)
    else:
        torch.testing.assert_close(G, G_r, rtol=1e-5, atol=1e-6)


# shapes: one row; a vocabulary not a multiple of the interpreter's 64-column tile; exactly two
# tiles; many tiles. Logit scales: ordinary, and 3e4 (exp overflows fp32 without the max subtracted)
@needs_triton
@pytest.mark.parametrize("M, N", [(1, 200), (7, 130), (4, 128), (3, 1000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale, kind", [(3.0, "spread"), (3.0, "onehot"), (3e4, "spread"), (3e4, "onehot")])
def test_the_kernel_matches_the_torch_ops(interpret, M, N, dtype, scale, kind):
    z, teacher, tidx = case(M, N, dtype, scale, kind)
    want = soft_ce.soft_ce_rows_reference(z.clone(), teacher, tidx)
    got = soft_ce.soft_ce_rows(z.clone(), teacher, tidx)
    assert torch.isfinite(want[0]).all()
    assert_matches(got, want)


@needs_triton
def test_in_place_fp32_gradient_and_ties(interpret):
    """G written over the logits (the fused loss's layout), into slices of larger buffers; G in another
    dtype; a tie across two tiles gives the first maximum, as torch's max does."""
    z, teacher, tidx = case(5, 150, torch.float32, 3.0, "spread", seed=1)
    z[2, 10] = z[2, 140] = z[2].max() + 1  # tiles 0 and 2
    z[3, 70] = z[3, 71] = z[3].max() + 1  # one tile
    want = soft_ce.soft_ce_rows_reference(z.clone(), teacher, tidx)
    assert want[1][2] == 10 and want[1][3] == 70
    ce, pred, acc = torch.zeros(8), torch.zeros(8, dtype=torch.long), torch.zeros(8)
    zz = z.clone()
    soft_ce.soft_ce_rows(zz, teacher, tidx, out=(ce[2:7], pred[2:7], acc[2:7], zz))
    assert_matches((ce[2:7], pred[2:7], acc[2:7], zz), want)
    assert ce[:2].eq(0).all() and ce[7:].eq(0).all()
    got = soft_ce.soft_ce_rows(z.clone(), teacher, tidx, g_dtype=torch.bfloat16)
    assert_matches(got, soft_ce.soft_ce_rows_reference(z.clone(), teacher, tidx, g_dtype=torch.bfloat16))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_loss_with_the_kernel_equals_the_torch_path(interpret, dtype):
    """``linear_soft_cross_entropy`` forward and backward (loss, row losses, argmax, acceptance, grads
    of h and W) over several chunks, one of them ragged, with and without the kernel."""
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(20, 16, generator=gen).to(dtype)
    W = (0.5 * torch.randn(150, 16, generator=gen)).to(dtype)
    teacher = torch.softmax(2 * torch.randn(30, 150, generator=gen), -1)
    tidx = torch.randint(0, 30, (20,), generator=gen)
    runs = []
    for kernel in (False, True):
        h1, W1 = h.clone().requires_grad_(), W.clone().requires_grad_()
        loss, ce, pred, acc = linear_soft_cross_entropy(h1, W1, teacher, tidx, chunk=8, kernel=kernel)
        (2.5 * loss).backward()
        runs.append((loss, ce, pred, acc, h1.grad, W1.grad))
    (loss_t, ce_t, pred_t, acc_t, dh_t, dW_t), (loss_k, ce_k, pred_k, acc_k, dh_k, dW_k) = runs
    torch.testing.assert_close(loss_k, loss_t, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(ce_k, ce_t, rtol=1e-6, atol=1e-5)
    assert torch.equal(pred_k, pred_t)
    torch.testing.assert_close(acc_k, acc_t, rtol=1e-6, atol=1e-6)
    # the gradients are G @ W and G.T @ h in h's dtype: G within an ulp of h's dtype
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-3)
    torch.testing.assert_close(dh_k, dh_t, **tol)
    torch.testing.assert_close(dW_k, dW_t, **tol)


# ---------------------------------------------------------------- negative controls: the checks can fail

NO_MAX = [  # the kernel's text with the max subtraction removed (exact maths, overflows at large logits)
    ("ssum = ssum * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)", "ssum = ssum + tl.sum(tl.exp(z), 0)"),
    ("tl.store(ce_ptr + row, m + tl.log(ssum) - pz)", "tl.store(ce_ptr + row, tl.log(ssum) - pz)"),
    ("g = tl.exp(z - m) / ssum - p", "g = tl.exp(z) / ssum - p"),
]


def kernel_without_the_max(folder: Path):
    """A copy of the kernel module with ``NO_MAX`` applied, imported from ``folder`` (triton.jit reads a
    kernel's source from its file)."""
    text = Path(soft_ce.__file__).with_name("soft_ce_triton.py").read_text()
    for old, new in NO_MAX:
        assert old in text, f"the negative control no longer edits the kernel: {old!r} is gone"
        text = text.replace(old, new)
    path = folder / "soft_ce_no_max.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("soft_ce_no_max", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_triton
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_negative_control_a_kernel_without_the_max_fails_at_large_logits(interpret, tmp_path):
    variant = kernel_without_the_max(tmp_path)
    assert variant.INTERPRETED

    def run(z, teacher, tidx):
        outs = soft_ce.empty_outputs(z)
        variant.launch(z, teacher, tidx, *outs)
        return outs

    small = case(4, 130, torch.float32, 3.0, "spread")
    assert_matches(run(*small), soft_ce.soft_ce_rows_reference(small[0].clone(), *small[1:]))  # exact maths
    large = case(4, 130, torch.float32, 3e4, "spread")
    with pytest.raises(AssertionError):
        assert_matches(run(*large), soft_ce.soft_ce_rows_reference(large[0].clone(), *large[1:]))


@needs_triton
def test_negative_control_a_wrong_teacher_row_fails(interpret):
    z, teacher, tidx = case(6, 130, torch.float32, 3.0, "spread")
    want = soft_ce.soft_ce_rows_reference(z.clone(), teacher, tidx)
    with pytest.raises(AssertionError):
        assert_matches(soft_ce.soft_ce_rows(z.clone(), teacher, (tidx + 1) % teacher.shape[0]), want)


@needs_triton
def test_the_kernel_refuses_what_it_does_not_compute(interpret):
    z, teacher, tidx = case(3, 70, torch.float32, 3.0, "spread")
    with pytest.raises(ValueError, match="float64"):
        soft_ce.soft_ce_rows(z.double(), teacher, tidx)
    with pytest.raises(ValueError, match="unit stride"):
        soft_ce.soft_ce_rows(z.t().contiguous().t(), teacher, tidx)
    with pytest.raises(ValueError, match="kernel"):
        linear_soft_cross_entropy(torch.randn(3, 8, dtype=torch.float64), torch.randn(70, 8, dtype=torch.float64),
                                  teacher.double(), tidx, kernel=True)


def test_the_loss_imports_without_triton_and_says_the_kernel_is_unavailable():
    """Importing the kernels and the EAGLE-3 loss loads no triton (here triton is blocked: a machine
    without it); ``available`` is False on a CPU without the interpreter and the kernel refuses to run."""
    code = ("import os, sys\n"
            "os.environ.pop('TRITON_INTERPRET', None)\n"
            "import specforge.algorithms.eagle3.loss\n"
            "assert 'triton' not in sys.modules, 'importing the loss loads triton'\n"
            "sys.modules['triton'] = None\n"
            "import torch\n"
            "from specforge.kernels import soft_ce\n"
            "assert not soft_ce.available('cpu')\n"
            "os.environ['TRITON_INTERPRET'] = '1'\n"
            "assert not soft_ce.available('cpu'), 'triton is blocked'\n"
            "try:\n"
            "    soft_ce.soft_ce_rows(torch.zeros(2, 3), torch.zeros(1, 3), torch.zeros(2, dtype=torch.long))\n"
            "except ValueError as e:\n"
            "    assert 'triton' in str(e)\n"
            "else:\n"
            "    raise AssertionError('the kernel ran without triton')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
