"""The draft's distillation losses, row by row: one place computes every kind, with its logit gradient.

Legend: ``M`` rows, ``N`` the (draft) vocabulary, ``P`` teacher rows. ``q = softmax(z)`` is the draft's
distribution over the draft vocabulary, ``p`` the target's (renormalized over the same vocabulary), and
``alpha = sum_v min(p_v, q_v)`` their overlap: the acceptance rate of speculative sampling.

=============  =====================================================  ===========================================
kind           per-row loss                                           logit gradient
=============  =====================================================  ===========================================
``kl_div``     forward KL, computed as the soft cross-entropy         ``q - p``
               ``-sum p log q`` (KL plus the teacher's entropy, a
               constant of the data: the same gradient; the
               default and the only kind the Triton kernel runs)
``tv``         total variation ``1 - alpha``                          ``q * (sum_{q<p} q - [q < p])``
``nla``        LK's alpha form, negative log-acceptance               ``tv``'s over ``alpha`` (0 where
               ``-log(max(alpha, 1e-5))``                              ``alpha <= 1e-5``, as the clamp has)
``lk_hybrid``  LK's lambda form ``lam KL + (1 - lam) TV``,             ``lam (q - p) + (1 - lam) tv's``
               ``lam = exp(-3 sg(alpha))`` (sg: no gradient)
``rkl``        reverse KL ``sum q (log q - log p)``                    ``q * (log q - log p - loss)``
``jsd``        Jensen-Shannon ``(KL(p||m) + KL(q||m)) / 2``,           ``q * (g - sum q g)``,
               ``m = (p + q) / 2``                                     ``g = log(q / m) / 2``
``opd``        Draft-OPD's acceptance-aware row (arXiv 2605.29343):    ``q - p`` where accepted, ``rkl``'s
               ``KL(p || q)`` where the target accepts the draft's     where rejected
               argmax (it equals ``verify``, the target's greedy
               token in the draft vocabulary; default the teacher's
               argmax), ``rkl``'s where it rejects it
=============  =====================================================  ===========================================

``opd`` is a row's part of Draft-OPD; the other part, which rows count (a chain's later rows only while
every earlier draft was accepted: the states the draft's own policy reaches), is the TTT loss's
(``algorithms/eagle3/loss.py``, ``reached``), as is the target's verification it reads (``verify``).
The names, the clamp of ``nla`` (1e-5) and ``lk_hybrid``'s eta (3, the LK paper's best hybrid, arXiv
2602.23881) are speculators' (``speculators.losses``), so a recipe moves between the two trainers as it is.
Every gradient is the chain rule through the softmax, ``dz_k = q_k (g_k - sum_j q_j g_j)`` for
``g = dloss/dq``; ``kl_div``'s is that rule simplified. TV's ``[q < p]`` is its subgradient (a tie, a set
of measure zero, takes none).

:func:`loss_rows` (fp32 statistics, in place over chunks of the fused ``lm_head`` + loss of
``algorithms/eagle3/loss.py``) writes ``(loss, pred, acc_p, G)`` as ``soft_ce.soft_ce_rows_reference``
does (``kl_div`` is that function). The teacher rows are probabilities for ``kl_div`` (what the Triton
kernel reads) and log-probabilities for every other kind (:func:`log_teacher`: a log of an underflowed
probability would be -inf). :func:`loss_reference` is the plain, differentiable torch form of each
kind (the tests run it in fp64 under autograd; the reference TTT loss runs it in the step's dtype).
:func:`loss_rows_fused` is the same as one Triton kernel a call for every kind (``kl_div``: the soft-CE
kernel, ``soft_ce_triton.py``; the others: ``losses_triton.py``), three passes over the vocabulary per
row with an online max: no fp32 ``[rows x N]`` tensor besides ``G``. It runs where ``soft_ce.available``
says (CUDA with triton, or ``TRITON_INTERPRET=1`` on any device); off by default until a GPU measures it.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from specforge.kernels import soft_ce
from specforge.kernels.soft_ce import Outputs, empty_outputs, soft_ce_rows_reference

__all__ = ["KINDS", "DEFAULT", "WORKSET", "NLA_EPS", "LK_ETA", "log_teacher", "verified", "loss_rows",
           "loss_rows_fused", "loss_reference", "kl_of_logs", "tv_of_logs"]

KINDS = ("kl_div", "tv", "nla", "lk_hybrid", "rkl", "jsd", "opd")
DEFAULT = "kl_div"
NLA_EPS = 1e-5  # nla's floor on alpha (speculators' _NLA_EPS)
LK_ETA = 3.0  # lk_hybrid's lam = exp(-LK_ETA * alpha)
_TV_FAMILY = ("tv", "nla", "lk_hybrid")
# fp32 [rows x N] tensors one chunk of ``loss_rows`` holds at its peak, read off the code below (z or its
# fp32 copy, the teacher rows, log q, q, p, and each kind's temporaries; bool masks as a quarter): what the
# memory model counts for the fused loss's chunk. kl_div: the logits and the teacher rows.
WORKSET = {"kl_div": 2, "tv": 7, "nla": 7, "lk_hybrid": 8, "rkl": 6, "jsd": 7, "opd": 8}


def _unknown(kind: object) -> str:
    return f"{kind!r} is not a loss: use one of {', '.join(KINDS)} (train.loss)"


def log_teacher(kind: str) -> bool:
    """Are the teacher rows of ``kind`` log-probabilities (True for all but ``kl_div``)?"""
    return kind != "kl_div"


def verified(teacher_PN: torch.Tensor, tidx_M: torch.Tensor, verify_M: Optional[torch.Tensor]) -> torch.Tensor:
    """``opd``'s verification token of each row (a draft-vocabulary index; -1: none accepted): ``verify_M``,
    or by default the teacher row's argmax (the target's greedy token as the teacher has it)."""
    return teacher_PN.argmax(dim=-1).index_select(0, tidx_M) if verify_M is None else verify_M


def loss_rows(kind: str, z_MN: torch.Tensor, teacher_PN: torch.Tensor, tidx_M: torch.Tensor,
              out: Optional[Outputs] = None, g_dtype: Optional[torch.dtype] = None,
              verify_M: Optional[torch.Tensor] = None) -> Outputs:
    """``(loss, pred, acc_p, G)`` of each row of ``z_MN`` against ``teacher_PN[tidx_M]``: the row's loss
    (fp32 at least), the draft's argmax, the teacher's probability of it and the logit gradient ``G`` (in
    ``g_dtype``, default z's). ``z_MN`` is scratch, as in ``soft_ce_rows_reference``. ``verify_M``: ``opd``'s
    verification tokens (:func:`verified`); the other kinds ignore it."""
    if kind == "kl_div":
        return soft_ce_rows_reference(z_MN, teacher_PN, tidx_M, out=out, g_dtype=g_dtype)
    if kind not in KINDS:
        raise ValueError(_unknown(kind))
    loss, pred, acc_p, G = empty_outputs(z_MN, g_dtype) if out is None else out
    f32 = torch.promote_types(z_MN.dtype, torch.float32)
    z = z_MN.to(f32)
    logp = teacher_PN.index_select(0, tidx_M).to(f32)
    pred.copy_(z.argmax(dim=-1))
    logq = torch.log_softmax(z, dim=-1)
    del z
    q, p = logq.exp(), logp.exp()
    acc_p.copy_(p.gather(1, pred.unsqueeze(1)).squeeze(1))
    if kind in _TV_FAMILY:
        below = q < p  # where min(p, q) is q: alpha's gradient w.r.t. q is [q < p]
        q_below = torch.where(below, q, 0.0)
        alpha = torch.where(below, 0.0, p).sum(-1) + q_below.sum(-1)
        g_tv = q * q_below.sum(-1, keepdim=True) - q_below  # d(1 - alpha)/dz
        if kind == "tv":
            loss.copy_(1.0 - alpha)
            grad = g_tv
        elif kind == "nla":
            a = alpha.clamp_min(NLA_EPS)
            loss.copy_(-torch.log(a))
            grad = g_tv * torch.where(alpha > NLA_EPS, 1.0 / a, 0.0).unsqueeze(-1)
        else:
            lam = torch.exp(-LK_ETA * alpha)
            kl = torch.where(p > 0, p * (logp - logq), 0.0).sum(-1)
            loss.copy_(lam * kl + (1.0 - lam) * (1.0 - alpha))
            grad = (q - p).mul_(lam.unsqueeze(-1)).add_(g_tv.mul_((1.0 - lam).unsqueeze(-1)))
    elif kind in ("rkl", "opd"):
        d = logq - logp
        row = (q * d).sum(-1)
        grad = d.sub_(row.unsqueeze(-1)).mul_(q)
        if kind == "opd":  # accepted rows: forward KL and its gradient instead
            ok = (pred == verified(teacher_PN, tidx_M, verify_M)).unsqueeze(-1)
            kl = torch.where(p > 0, p * (logp - logq), 0.0).sum(-1)
            row = torch.where(ok.squeeze(-1), kl, row)
            grad = torch.where(ok, q - p, grad)
        loss.copy_(row)
    else:  # jsd
        logm = torch.logaddexp(logq, logp) - math.log(2.0)
        kl_pm = torch.where(p > 0, p * (logp - logm), 0.0).sum(-1)
        g = (logq - logm).mul_(0.5)
        loss.copy_(0.5 * kl_pm + (q * g).sum(-1))
        grad = g.sub_((q * g).sum(-1, keepdim=True)).mul_(q)
    G.copy_(grad)
    return loss, pred, acc_p, G


def _logs(z_MN: torch.Tensor, logp_MN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    f = torch.promote_types(z_MN.dtype, torch.float32)
    return torch.log_softmax(z_MN.to(f), dim=-1), logp_MN.to(f)


def kl_of_logs(logq: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """Each row's ``KL(p || q)`` itself from both log-distributions (differentiable): ``kl_div``'s loss less
    the teacher's entropy. For a caller that holds ``log q`` already (no second log-softmax)."""
    return (logp.exp() * (logp - logq)).sum(-1)


def tv_of_logs(logq: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """Each row's total variation ``1 - sum min(p, q)`` from both log-distributions (differentiable)."""
    return 1.0 - torch.minimum(logq.exp(), logp.exp()).sum(-1)


def loss_rows_fused(kind: str, z_MN: torch.Tensor, teacher_PN: torch.Tensor, tidx_M: torch.Tensor,
                    out: Optional[Outputs] = None, g_dtype: Optional[torch.dtype] = None,
                    verify_M: Optional[torch.Tensor] = None) -> Outputs:
    """:func:`loss_rows` as one Triton kernel (fp32 maths; z, the teacher and G in fp32, bf16 or fp16)."""
    if kind == "kl_div":
        return soft_ce.soft_ce_rows(z_MN, teacher_PN, tidx_M, out=out, g_dtype=g_dtype)
    if kind not in KINDS:
        raise ValueError(_unknown(kind))
    if not soft_ce.available(z_MN.device):
        raise ValueError(f"the {kind} loss kernel cannot run on {z_MN.device}: it needs triton and a CUDA device "
                         "(or TRITON_INTERPRET=1); use loss_rows")
    outs = empty_outputs(z_MN, g_dtype) if out is None else out
    soft_ce.check_launch(z_MN, teacher_PN, tidx_M, outs)
    if z_MN.shape[0]:
        try:
            from specforge.kernels import losses_triton  # lazy: optional (ImportError handled)
        except ImportError as e:
            raise ValueError(f"the {kind} loss kernel needs triton ({e}): pip install triton") from e
        verify = verified(teacher_PN, tidx_M, verify_M) if kind == "opd" else tidx_M  # read only by opd
        losses_triton.launch(kind, z_MN, teacher_PN, tidx_M.contiguous(), *outs, NLA_EPS, LK_ETA,
                             verify.to(torch.int64).contiguous())
    return outs


def loss_reference(kind: str, z_MN: torch.Tensor, logp_MN: torch.Tensor,
                   verify_M: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each row's loss of ``kind`` as plain torch ops (differentiable, in the wider of z's dtype and
    fp32): the definitions of the module docstring, written as they read, nothing fused. ``verify_M``
    (``opd`` only): the target's greedy token of each row, in the draft vocabulary (default: the
    teacher's argmax)."""
    logq, logp = _logs(z_MN, logp_MN)
    p = logp.exp()
    if kind == "kl_div":  # what the reference TTT loss (bench_ttt.py's baseline) computed before the kinds
        return -(p * logq).sum(-1)  # the soft cross-entropy: KL + H(p)
    q = logq.exp()
    alpha = torch.minimum(p, q).sum(-1) if kind in _TV_FAMILY else None
    if kind == "tv":
        return 1.0 - alpha
    if kind == "nla":
        return -torch.log(alpha.clamp_min(NLA_EPS))
    if kind == "lk_hybrid":
        lam = torch.exp(-LK_ETA * alpha.detach())
        return lam * kl_of_logs(logq, logp) + (1.0 - lam) * (1.0 - alpha)
    if kind == "rkl":
        return (q * (logq - logp)).sum(-1)
    if kind == "opd":
        verify = logp_MN.argmax(-1) if verify_M is None else verify_M
        accepted = z_MN.detach().argmax(-1) == verify
        return torch.where(accepted, kl_of_logs(logq, logp), (q * (logq - logp)).sum(-1))
    if kind == "jsd":
        m = (p + q) / 2
        return 0.5 * (p * (p / m).log()).sum(-1) + 0.5 * (q * (q / m).log()).sum(-1)
    raise ValueError(_unknown(kind))
