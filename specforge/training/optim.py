"""The optimizer (``train.optimizer``: AdamW, or Muon for the hidden matrices with AdamW for the rest) with
linear warmup then cosine decay to ``min_lr_ratio`` of each group's learning rate.

Muon (Keller Jordan's; speculators' default optimizer) orthogonalizes each hidden weight matrix's
momentum by Newton-Schulz iterations; embeddings, vocabulary heads and factors, norms and biases stay
with AdamW (:func:`muon_params`, speculators' split plus XPress's ``readout``). Its constants are
speculators': momentum 0.95 (Nesterov), 5 iterations, the update scaled to AdamW's RMS
(``match_rms_adamw``: 0.2 sqrt(max(A, B))), so ``train.muon_lr`` defaults to ``train.lr``.

:class:`Muon` is ``torch.optim.Muon`` (its groups, state and step: bit for bit with its iterations in bf16,
tests/test_muon.py) with one change: torch runs the iterations in bf16, which a CPU without bf16
instructions computes ~45x slower than fp32 (a 576 x 1728 matrix: 4.6 s against 0.1 s here, 26 s a step
for SmolLM2's draft), so on a CPU they run in fp32 (:func:`orthogonalize`).

Under FSDP2 a matrix is a DTensor sharded on its rows: Muon's iterations run as DTensor ops, whose
sharding rules gather what each product needs (the Gram matrix ``X X^T`` of a row-sharded X is a
contraction over the unsharded dim, reduced across ranks), so every rank orthogonalizes the whole
matrix, not its shard (``tests/test_muon.py`` checks two gloo ranks against one process).

Both run as ONE ``torch.optim.Optimizer`` (:class:`MuonAdamW`): one state dict for checkpoints and DCP,
one schedule over both groups' learning rates.
"""

from __future__ import annotations

import math

import torch

from specforge.config import TrainConfig


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


MUON_MOMENTUM, MUON_NS_STEPS, MUON_ADJUST_LR = 0.95, 5, "match_rms_adamw"
# 2-D parameters that stay with AdamW by name: token tables and vocabulary-sized heads and factors
ADAMW_NAMES = ("embed", "lm_head", "markov", "codebook", "readout")


def muon_params(named) -> tuple[list, list]:
    """``(muon, adamw)``: the trainable parameters of ``named`` (name, parameter) split for Muon: a 2-D
    matrix (both dims > 1) whose name has none of ``ADAMW_NAMES`` goes to Muon, the rest to AdamW."""
    muon, adamw = [], []
    for name, p in named:
        if not p.requires_grad:
            continue
        hidden = p.ndim == 2 and min(p.shape) > 1 and not any(h in name for h in ADAMW_NAMES)
        (muon if hidden else adamw).append(p)
    return muon, adamw


def orthogonalize(m: torch.Tensor, dtype: torch.dtype, coefficients=(3.4445, -4.775, 2.0315), steps: int = 5,
                  eps: float = 1e-7) -> torch.Tensor:
    """Muon's Newton-Schulz iterations on matrix ``m`` in ``dtype`` (torch's ``_zeropower_via_newtonschulz``,
    whose dtype is bf16): scaled to a spectral norm of at most 1, then ``X <- a X + (b A + c A^2) X`` with
    ``A = X X^T``, on the wide orientation."""
    a, b, c = coefficients
    x = m.to(dtype)
    tall = m.size(0) > m.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def ns_dtype(device: torch.device) -> torch.dtype:
    """The iterations' dtype: torch's bf16 on a GPU, fp32 on a CPU (the module docstring)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _closure_loss(closure):
    """An optimizer step's ``closure()`` under grad mode (None without one), as torch's optimizers call it."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class Muon(torch.optim.Muon):
    """``torch.optim.Muon`` whose iterations run in ``ns_dtype`` of each parameter's device (the same step
    otherwise: momentum, Nesterov, decoupled weight decay, the adjusted learning rate; the same state)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)
            lr, mu = group["lr"], group["momentum"]
            for p, g, buf in zip(params, grads, bufs):
                buf.lerp_(g, 1 - mu)
                update = g.lerp(buf, mu) if group["nesterov"] else buf
                update = orthogonalize(update, ns_dtype(p.device), group["ns_coefficients"], group["ns_steps"],
                                       group["eps"])
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-_adjusted_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss


def _adjusted_lr(lr: float, fn, shape) -> float:
    """Muon's learning rate for a matrix of ``shape`` (torch's ``_adjust_lr``)."""
    A, B = shape[:2]
    if fn is None or fn == "original":
        return lr * math.sqrt(max(1, A / B))
    return lr * 0.2 * math.sqrt(max(A, B)) if fn == "match_rms_adamw" else lr


class MuonAdamW(torch.optim.Optimizer):
    """:class:`Muon` over ``muon`` and ``torch.optim.AdamW`` over ``adamw``, as one optimizer: its
    ``param_groups`` are theirs (Muon's first) and its ``state`` is theirs too (one dict, shared), so a
    state dict, DCP's full optimizer state and a scheduler see every parameter once."""

    def __init__(self, muon: list, adamw: list, muon_kw: dict, adamw_kw: dict):
        self.parts = [opt(ps, **kw) for opt, ps, kw in ((Muon, muon, muon_kw),
                                                         (torch.optim.AdamW, adamw, adamw_kw)) if ps]
        if not self.parts:
            raise ValueError("no trainable parameter to optimize")
        super().__init__([g for part in self.parts for g in part.param_groups], {})
        self._link()

    def _link(self) -> None:
        """Point each part at its slice of this optimizer's groups and at its one state dict (again after
        a load, which replaces both)."""
        i = 0
        for part in self.parts:
            n = len(part.param_groups)
            part.param_groups, part.state = self.param_groups[i:i + n], self.state
            i += n

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for part in self.parts:
            part.step()
        return loss


def build_optimizer(named_params, cfg: TrainConfig,
                    total_steps: int) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """``train.optimizer`` over the trainable parameters of ``named_params`` ((name, parameter) pairs, or
    bare parameters for AdamW alone); the schedule spans ``total_steps``."""
    named = [np if isinstance(np, tuple) else ("", np) for np in named_params]
    adamw_kw = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "muon":
        muon, adamw = muon_params(named)
        muon_kw = dict(lr=cfg.lr if cfg.muon_lr is None else cfg.muon_lr, weight_decay=cfg.muon_weight_decay,
                       momentum=MUON_MOMENTUM, nesterov=True, ns_steps=MUON_NS_STEPS, adjust_lr_fn=MUON_ADJUST_LR)
        opt = MuonAdamW(muon, adamw, muon_kw, adamw_kw)
    else:
        opt = torch.optim.AdamW([p for _, p in named if p.requires_grad], **adamw_kw)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)
    )
    return opt, sched
