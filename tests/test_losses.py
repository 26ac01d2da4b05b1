"""The draft's row losses (``specforge/kernels/losses.py``, ``train.loss``): each kind's loss and logit
gradient against its plain fp64 torch form under autograd and against speculators 0.9.0's eager loss
of the same name; the TTT loss with each kind against the straightforward TTT reference; the config key.

Tolerances: the fast path computes in fp32 what the reference computes in fp64, so the two differ by
fp32 rounding of sums over the vocabulary (``tests/helpers/tolerance.py``: N terms a row, scaled by
the compared values). Each equality has a control: another kind's loss, or a gradient with one
term left out, fails the same comparison.
"""

import importlib.util
import sys

import pytest
import torch

from specforge.config import TrainConfig, load_config
from specforge.kernels.losses import DEFAULT, KINDS, kl_of_logs, log_teacher, loss_reference, loss_rows, tv_of_logs
from specforge.registry import get_algorithm
from tests.helpers.tolerance import close_tol

M, N = 24, 96


def _inputs(seed: int = 0, spread: float = 4.0, dtype=torch.float32):
    """Draft logits and the teacher's log-probs of M rows; half the rows near the teacher (high
    overlap), half far from it (low), so TV's both branches and LK's lambda range are reached."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(M, N, generator=g, dtype=torch.float64) * spread
    z = torch.randn(M, N, generator=g, dtype=torch.float64) * spread
    z[: M // 2] = t[: M // 2] + 0.3 * z[: M // 2]
    return z.to(dtype), torch.log_softmax(t, dim=-1).to(dtype)


def _fast(kind, z, logp):
    """``loss_rows`` on a copy of z, handed the teacher as ``kind`` takes it: (loss, pred, acc_p, G)."""
    teacher = logp if log_teacher(kind) else logp.exp()
    return loss_rows(kind, z.clone(), teacher, torch.arange(z.shape[0]))


def _reference(kind, z, logp):
    """fp64 loss and logit gradient by autograd of the plain form."""
    z64 = z.double().requires_grad_()
    loss = loss_reference(kind, z64, logp.double())
    (g,) = torch.autograd.grad(loss.sum(), z64)
    return loss.detach(), g


def _assert_close(got, want, what):
    tol = close_tol(torch.float32, N, want.abs().max().item())
    err = (got.double() - want).abs().max().item()
    assert err <= tol, f"{what}: {err:.3g} > {tol:.3g}"


def _fails(got, want) -> bool:
    return (got.double() - want).abs().max().item() > close_tol(torch.float32, N, want.abs().max().item())


def test_the_names_are_the_config_keys_values():
    """``train.loss`` offers exactly the kinds the module computes, and defaults to its default."""
    import typing

    assert typing.get_args(typing.get_type_hints(TrainConfig)["loss"]) == KINDS
    assert TrainConfig.loss == DEFAULT == "kl_div"


@pytest.mark.parametrize("kind", KINDS)
def test_each_loss_and_its_gradient_equal_the_fp64_reference(kind):
    """fp32 loss, argmax, teacher probability of the argmax and logit gradient of ``loss_rows`` equal
    the fp64 reference's; the control: every other kind's loss or gradient fails the comparison."""
    z, logp = _inputs()
    loss, pred, acc_p, G = _fast(kind, z, logp)
    want_loss, want_g = _reference(kind, z, logp)
    _assert_close(loss, want_loss, f"{kind} loss")
    _assert_close(G, want_g, f"{kind} gradient")
    assert torch.equal(pred, z.argmax(-1))
    torch.testing.assert_close(acc_p, logp.exp().gather(1, pred[:, None])[:, 0])
    for other in KINDS:
        if other != kind:
            o_loss, _, _, o_G = _fast(other, z, logp)
            assert _fails(o_loss, want_loss) or _fails(o_G, want_g), (kind, other)


@pytest.mark.parametrize("kind", KINDS)
def test_fp64_rows_equal_autograd(kind):
    """In fp64 the hand-written gradient is autograd's of the plain form to fp64 rounding."""
    z, logp = _inputs(1, dtype=torch.float64)
    loss, _, _, G = _fast(kind, z, logp)
    want_loss, want_g = _reference(kind, z, logp)
    torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(G, want_g, rtol=1e-10, atol=1e-13)


SPECULATORS = {"kl_div": "kl_div_loss", "tv": "tv_loss", "nla": "neg_log_acceptance_loss",
               "lk_hybrid": "lk_hybrid_loss", "rkl": "reverse_kl_div_loss", "jsd": "js_div_loss"}


@pytest.mark.parametrize("kind", list(SPECULATORS))
def test_each_loss_equals_speculators(kind):
    """speculators 0.9.0's eager loss of the same name (targets as logits: our log-probs are ones),
    its value and its autograd gradient, in fp32 as it computes. ``kl_div``: ours is the soft
    cross-entropy, theirs the KL itself: they differ by the teacher's entropy alone (same gradient).
    Control: the kind next in the list fails against it. (``opd``, Draft-OPD, is not in speculators 0.9.0:
    its parts are ``kl_div``'s KL and ``rkl``, checked here, and its fp64 reference above.)"""
    eager = pytest.importorskip("speculators.losses.eager")

    def theirs(name, z, logp):
        zz = z.clone()[None].requires_grad_()
        loss = getattr(eager, SPECULATORS[name])(zz, logp[None])[0]
        (g,) = torch.autograd.grad(loss.sum(), zz)
        return loss.detach().double(), g[0].double()

    z, logp = _inputs(2)
    loss, _, _, G = _fast(kind, z, logp)
    if kind == "kl_div":
        loss = loss - (-(logp.exp() * logp).sum(-1))
    want_loss, want_g = theirs(kind, z, logp)
    _assert_close(loss, want_loss, f"{kind} loss")
    _assert_close(G, want_g, f"{kind} gradient")
    names = list(SPECULATORS)
    o_loss, o_g = theirs(names[(names.index(kind) + 1) % len(names)], z, logp)
    assert _fails(loss, o_loss) or _fails(G, o_g)


def test_the_terms_from_logs_are_the_kinds_own():
    """``kl_of_logs`` (XPress's, DSpark's and DFlash2's KL term; LK's lambda form) is ``kl_div``'s row loss
    less H(p); ``tv_of_logs`` (XPress's TV term) is ``tv``'s."""
    z, logp = _inputs(3, dtype=torch.float64)
    ce = loss_reference("kl_div", z, logp)
    logq = torch.log_softmax(z, -1)
    torch.testing.assert_close(kl_of_logs(logq, logp), ce + (logp.exp() * logp).sum(-1), rtol=1e-12, atol=1e-12)
    assert (kl_of_logs(logq, logp) >= 0).all() and kl_of_logs(logp, logp).abs().max() < 1e-12
    torch.testing.assert_close(tv_of_logs(logq, logp), loss_reference("tv", z, logp), rtol=1e-12, atol=1e-12)


def test_opd_rows_take_forward_kl_where_accepted_and_reverse_kl_where_rejected():
    """Draft-OPD's row: where the draft's argmax is the verification token, ``kl_div``'s KL (its gradient
    q - p); elsewhere ``rkl``'s loss and gradient, bit for bit. ``verify`` -1 (no token accepted) gives
    ``rkl`` on every row; the default verification is the teacher's argmax. Control: both kinds occur."""
    z, logp = _inputs(4)
    idx = torch.arange(M)
    pred = z.argmax(-1)
    verify = torch.where(idx % 3 == 0, pred, (pred + 1) % N)  # a third accepted
    loss, _, _, G = loss_rows("opd", z.clone(), logp, idx, verify_M=verify)
    r_loss, _, _, r_G = loss_rows("rkl", z.clone(), logp, idx)
    kl = kl_of_logs(torch.log_softmax(z, -1), logp)
    ok = pred == verify
    assert 0 < ok.sum() < M
    torch.testing.assert_close(loss[ok], kl[ok], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(G[ok], (torch.softmax(z, -1) - logp.exp())[ok], rtol=1e-5, atol=1e-7)
    assert torch.equal(loss[~ok], r_loss[~ok]) and torch.equal(G[~ok], r_G[~ok])
    none = loss_rows("opd", z.clone(), logp, idx, verify_M=torch.full((M,), -1))
    assert torch.equal(none[0], r_loss) and torch.equal(none[3], r_G)
    default = loss_rows("opd", z.clone(), logp, idx)
    by_teacher = loss_rows("opd", z.clone(), logp, idx, verify_M=logp.argmax(-1))
    assert torch.equal(default[0], by_teacher[0]) and torch.equal(default[3], by_teacher[3])


def test_nla_has_no_gradient_below_its_floor():
    """Rows whose overlap is below 1e-5 (disjoint supports) get the clamp's zero gradient, as
    speculators' ``clamp_min`` gives; the loss there is -log(1e-5)."""
    z = torch.full((2, 4), -60.0, dtype=torch.float64)
    z[:, 0] = 60.0
    logp = torch.log_softmax(torch.tensor([[-60.0, 60, 60, -60]] * 2, dtype=torch.float64), -1)
    loss, _, _, G = _fast("nla", z, logp)
    torch.testing.assert_close(loss, torch.full((2,), 11.512925464970229, dtype=torch.float64))
    assert G.abs().max() == 0


# ---------------------------------------------------------------- the fused kernel (Triton's interpreter)

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed: the loss kernels run in Triton's interpreter")


@pytest.fixture(scope="module")
def interpret():
    """``TRITON_INTERPRET=1`` with both kernel modules imported under it (``triton.jit`` reads it when it
    decorates), forgotten after; as tests/test_soft_ce_kernel.py does."""
    names = ("specforge.kernels.losses_triton", "specforge.kernels.soft_ce_triton")
    for name in names:
        if name in sys.modules and not sys.modules[name].INTERPRETED:
            pytest.skip("a kernel module was compiled for a GPU earlier in this process")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield
    for name in names:
        sys.modules.pop(name, None)
        vars(sys.modules["specforge.kernels"]).pop(name.rsplit(".", 1)[1], None)


@needs_triton
@pytest.mark.parametrize("kind", KINDS)
def test_the_fused_kernel_equals_loss_rows(kind, interpret):
    """One kernel a call (a vocabulary of 150: two full 64-column tiles and a ragged one; logits at
    ordinary and at 3e4 scale, where exp overflows without the max): loss, argmax, acceptance and the
    logit gradient in fp32 equal ``loss_rows``'s to fp32 rounding of the vocabulary's sums, in bf16 G
    within a bf16 ulp; the teacher read through ``tidx`` in place. Control: another kind's kernel fails."""
    from specforge.kernels.losses import loss_rows_fused

    g = torch.Generator().manual_seed(5)
    for scale in (3.0, 3e4):
        z = torch.randn(7, 150, generator=g) * scale
        logp = torch.log_softmax(torch.randn(9, 150, generator=g) * 3, -1)
        teacher = logp if log_teacher(kind) else logp.exp()
        tidx = torch.randint(0, 9, (7,), generator=g)
        want = loss_rows(kind, z.clone(), teacher, tidx)
        got = loss_rows_fused(kind, z.clone(), teacher, tidx)
        tol = close_tol(torch.float32, 150, 1.0)
        torch.testing.assert_close(got[0], want[0], rtol=tol, atol=tol * max(1.0, want[0].abs().max().item()))
        assert torch.equal(got[1], want[1])
        torch.testing.assert_close(got[2], want[2], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got[3], want[3], rtol=tol, atol=tol)
        bf = loss_rows_fused(kind, z.clone(), teacher, tidx, g_dtype=torch.bfloat16)[3]
        torch.testing.assert_close(bf, want[3].to(torch.bfloat16), rtol=2**-8, atol=1e-6)
    other = KINDS[(KINDS.index(kind) + 1) % len(KINDS)]
    o = loss_rows_fused(other, z.clone(), logp if log_teacher(other) else logp.exp(), tidx)
    assert not (torch.allclose(o[0], want[0]) and torch.allclose(o[3], want[3]))


@needs_triton
@pytest.mark.parametrize("kind", ["tv", "jsd"])
def test_the_fused_head_with_the_kernel_equals_it_without(kind, interpret):
    """``linear_soft_cross_entropy`` (the TTT loss's fused lm_head + loss) with the kernel: loss, row losses,
    argmax, acceptance and both gradients as without it."""
    from specforge.algorithms.eagle3.loss import linear_soft_cross_entropy

    g = torch.Generator().manual_seed(6)
    h, W = torch.randn(12, 16, generator=g), torch.randn(150, 16, generator=g) * 0.5
    teacher = torch.log_softmax(torch.randn(5, 150, generator=g) * 3, -1)
    tidx = torch.randint(0, 5, (12,), generator=g)
    outs, grads = [], []
    for kernel in (False, True):
        h1, W1 = h.clone().requires_grad_(), W.clone().requires_grad_()
        loss, *rest = linear_soft_cross_entropy(h1, W1, teacher, tidx, chunk=5, kernel=kernel, kind=kind)
        loss.backward()
        outs.append((loss.detach(), *rest))
        grads.append((h1.grad, W1.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "kl_div"])
def test_ttt_loss_with_each_kind_equals_the_reference(kind):
    """The whole TTT loss (fast path: chunked fused head, gathered rows) with ``loss_kind`` equals the
    straightforward TTT reference with the same kind in fp64: loss, every gradient, every counter.
    Control: the default kind's loss differs from it."""
    from specforge.algorithms.eagle3.loss import ttt_loss, ttt_loss_reference
    from tests.helpers.ttt import HT, tiny_draft, ttt_batch
    from tests.helpers.ttt import N as DRAFT_N

    torch.manual_seed(3)
    d = tiny_draft(torch.float64)
    b = ttt_batch(dtype=torch.float64, draft=d)
    W = torch.randn(DRAFT_N, HT, dtype=torch.float64)
    params = [p for p in d.parameters() if p.requires_grad]
    l1, c1 = ttt_loss(d, b, W, ttt_length=4, loss_kind=kind)
    g1 = torch.autograd.grad(l1, params)
    l2, c2 = ttt_loss_reference(d, b, W, ttt_length=4, loss_kind=kind)
    g2 = torch.autograd.grad(l2, params)
    torch.testing.assert_close(l1, l2, rtol=1e-10, atol=1e-12)
    for a, c in zip(g1, g2):
        torch.testing.assert_close(a, c, rtol=1e-8, atol=1e-12)
    torch.testing.assert_close(c1, c2, rtol=1e-9, atol=1e-12)
    l0, _ = ttt_loss(d, b, W, ttt_length=4)
    assert abs(l0.item() - l1.item()) > 1e-3


def _greedy_batch(d):
    """A TTT batch whose data follow the target (target_ids[p] = ids[p + 1]) and whose tokens at the
    even positions are the draft's own greedy drafts (step 0 accepted there), random elsewhere: so
    Draft-OPD's chains end at different steps."""
    from specforge.algorithms.eagle3.loss import ttt_logits
    from tests.helpers.ttt import ttt_batch

    b = ttt_batch(dtype=torch.float64, draft=d)
    ids = b["input_ids_BT"]
    T = ids.shape[1]
    with torch.no_grad():
        for t in range(0, T - 2, 2):  # ids[t + 2] := step 0's argmax at row t (reads ids <= t + 1 only)
            pred = ttt_logits(d, b, 1)[0][:, t].argmax(-1)
            ids[:, t + 2] = pred + d.d2t[pred]
    b["target_ids_BT"] = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
    b["loss_mask_BT"][:] = 1
    return b


def test_opd_trains_only_the_chains_the_drafts_reach():
    """``ttt_loss`` with ``opd`` (fast path: chunked head, gathered rows) equals the TTT reference (fp64:
    loss, every gradient, every counter) and equals the Draft-OPD loss written out here from the draft's
    logits: step i of row t weighs 1 only if every step before it drafted the target's token (and the
    data's next token is it), forward KL where step i's draft is accepted, reverse KL where not. Control:
    the same rows without the chain rule (every counted row weighing 1) give another loss, and the batch
    has chains ending at step 0, at step 1 and going on."""
    from specforge.algorithms.eagle3.loss import teacher_probs, ttt_logits, ttt_loss, ttt_loss_reference
    from tests.helpers.ttt import HT, tiny_draft
    from tests.helpers.ttt import N as DRAFT_N

    torch.manual_seed(4)
    L = 3
    d = tiny_draft(torch.float64)
    b = _greedy_batch(d)
    W = torch.randn(DRAFT_N, HT, dtype=torch.float64)
    params = [p for p in d.parameters() if p.requires_grad]
    l1, c1 = ttt_loss(d, b, W, ttt_length=L, loss_kind="opd")
    g1 = torch.autograd.grad(l1, params)
    l2, c2 = ttt_loss_reference(d, b, W, ttt_length=L, loss_kind="opd")
    g2 = torch.autograd.grad(l2, params)
    torch.testing.assert_close(l1, l2, rtol=1e-10, atol=1e-12)
    for a, c in zip(g1, g2):
        torch.testing.assert_close(a, c, rtol=1e-8, atol=1e-12)
    torch.testing.assert_close(c1, c2, rtol=1e-9, atol=1e-12)

    ids, tgt = b["input_ids_BT"], b["target_ids_BT"]
    B, T = ids.shape
    with torch.no_grad():
        logits = ttt_logits(d, b, L)
        logp = teacher_probs(b["last_hidden_BTH"].reshape(B * T, -1), W, log=True).view(B, T, -1)
    to_draft = {int(t): k for k, t in enumerate((torch.arange(DRAFT_N) + d.d2t).tolist())}
    total, flat, ends = 0.0, 0.0, {}
    for bb in range(B):
        for t in range(T):
            on = True
            for i in range(L):
                p = t + 1 + i  # the teacher's position; the drafted token is x_{p+1}
                if p + 1 >= T or int(tgt[bb, p]) not in to_draft:
                    break
                z = logits[i][bb, t]
                ok = int(z.argmax()) == to_draft[int(tgt[bb, p])]
                row = loss_reference("kl_div" if ok else "rkl", z[None], logp[bb, p][None])[0]
                if ok:
                    row = row + (logp[bb, p].exp() * logp[bb, p]).sum()  # the KL itself, not the soft CE
                flat += 0.8**i * row.item()
                if on:
                    total += 0.8**i * row.item()
                    on = ok and int(ids[bb, p + 1]) == int(tgt[bb, p])
                    if not on:
                        ends[i] = ends.get(i, 0) + 1
    n0 = c1[0, 0].item()
    assert abs(l1.item() - total / n0) < 1e-9
    assert abs(flat - total) / n0 > 1e-3
    assert ends.get(0, 0) > 0 and ends.get(1, 0) > 0, ends


def test_train_loss_config():
    """An unknown kind names the key and the kinds; a kind an algorithm's loss does not compute names
    the key and the algorithm; the TTT family takes every kind; the resume identity records a kind
    off the default only (older checkpoints resume)."""
    with pytest.raises(ValueError, match=r"'train\.loss': got 'kl'.*'kl_div', 'tv', 'nla', 'lk_hybrid', 'rkl'"):
        load_config(None, ["train.loss=kl"])
    for algo in ("dflash", "dspark", "mtp", "xpress"):
        with pytest.raises(ValueError, match=rf"'train\.loss'='tv' is refused for draft\.algorithm={algo}"):
            load_config(None, ["train.loss=tv", f"draft.algorithm={algo}"])
    for algo in ("eagle3", "eagle31", "peagle"):
        for kind in KINDS:
            cfg = load_config(None, [f"train.loss={kind}", f"draft.algorithm={algo}"])
            assert get_algorithm(algo).bind(cfg).run.loss == kind


@pytest.mark.parametrize("kind", KINDS)
def test_the_trainer_trains_with_each_kind(kind):
    """``train.loss`` reaches the trainer's step: on a peaked tiny target, 10 steps with each kind raise
    step 0's acceptance (the overlap every kind drives up) and lower that kind's own logged loss; the
    first step's logged loss is the kind's (a TV loss lies in [0, 1], a soft CE well above it here)."""
    from tests.helpers.trainer import feature_batch, setup_trainer

    target, rows, trainer = setup_trainer(loss=kind)
    assert trainer.algorithm.run.loss == kind
    batch = feature_batch(target, rows)
    first = trainer.step([batch])
    for _ in range(9):
        last = trainer.step([batch])
    assert last["accept_rate_0"] > first["accept_rate_0"] + 0.1, (first, last)
    assert last["loss_0"] < first["loss_0"]
    if kind == "tv":
        assert 0 <= last["loss_0"] < first["loss_0"] <= 1


def test_the_memory_model_counts_each_kinds_chunk():
    """The dry run's loss-chunk term grows by the kind's extra fp32 [rows x N] tensors (``WORKSET``)."""
    from pathlib import Path

    from specforge.dryrun import memory_plan
    from specforge.kernels.losses import WORKSET

    config = Path(__file__).parent.parent / "configs" / "smollm2-135m-cpu.yaml"

    def chunk(kind):
        plan = memory_plan(load_config(config, ["data.max_length=512", f"train.loss={kind}"]))[0]
        return max(t.nbytes for ts in plan.phases.values() for t in ts if t.name.startswith("loss head chunk"))

    base = chunk("kl_div")
    for kind in ("tv", "lk_hybrid"):
        assert chunk(kind) == base * WORKSET[kind] // WORKSET["kl_div"] > base
