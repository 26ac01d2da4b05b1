"""Layers every draft algorithm shares: RMSNorm, the gated (SwiGLU) MLP (each with a backward of its own
that keeps less than autograd would), ONE rotary embedding, and
``cast_once`` (a weight read by every step of an unroll cast to the autocast dtype once, not per use).

Legend: B batch, T tokens, H hidden, D head dim, I the MLP's inner width.

RoPE: ``rope_inv_freq`` takes a head dim, a base and an HF ``rope_scaling`` dict (the variants the
draft families need: none, ``linear``, ``llama3``; ``specforge.targets.draft_rope`` refuses the
others before a run starts), computed in fp64 and rounded once to fp32 (transformers computes the
powers in fp32: the two differ by at most one fp32 rounding per frequency, ~1e-7 relative).
``rope_cos_sin`` turns positions into fp32 ``cos``/``sin`` tables and ``apply_rotary`` applies them
(the rotate-half convention of Llama/Qwen).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


def _rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm's forward math: ``(y, rstd)``, statistics in fp32, the result in ``x``'s dtype."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xf = xf * rstd
    return (weight * xf.to(x.dtype) if weight.dtype == x.dtype else (weight * xf).to(x.dtype)), rstd


def _rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, need_dx: bool,
                  need_dw: bool) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """RMSNorm's backward math from the input and the row scale (the normalized value recomputed)."""
    f32 = rstd.dtype
    xhat = x.to(f32) * rstd
    if weight.dtype == x.dtype:  # y = w * xhat.to(x.dtype): the product in x's dtype
        xh = xhat.to(x.dtype)
        dw = (dy * xh).reshape(-1, xh.shape[-1]).sum(0) if need_dw else None
        dxhat = (dy * weight).to(f32)
    else:  # y = (w * xhat).to(x.dtype): the product in fp32 (or w's wider dtype)
        wide = torch.promote_types(weight.dtype, f32)
        dyw = dy.to(wide)
        dw = (dyw * xhat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype) if need_dw else None
        dxhat = (dyw * weight).to(f32)
    dx = (rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))).to(x.dtype) if need_dx else None
    return dx, dw


# RMSNorm's math compiled (torch.compile, inductor: one or two fused kernels each way instead of ~8 and
# ~13 launches) on a CUDA device when True. Off by default: not yet measured on a GPU. On other devices
# the eager math runs whatever this says (tests/test_rmsnorm.py checks compiled == eager on the CPU).
COMPILE_NORM = False


@functools.lru_cache(maxsize=None)
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=True)


def _norm_math(device_type: str, compiled: Optional[bool] = None) -> tuple[Callable, Callable]:
    """``(forward, backward)`` of RMSNorm's math on ``device_type``: compiled on CUDA with ``COMPILE_NORM``."""
    if compiled if compiled is not None else (COMPILE_NORM and device_type == "cuda"):
        return _compiled(_rms_norm_fwd), _compiled(_rms_norm_bwd)
    return _rms_norm_fwd, _rms_norm_bwd


class _RMSNormFn(torch.autograd.Function):
    """Llama's RMSNorm with a backward of its own that keeps only the input (as it came: 16-bit under
    autocast) and the fp32 row scale ``rstd``, and recomputes the normalized value from them; autograd
    through the forward's ops would keep an fp32 copy of the input and the normalized value besides
    (6-8 bytes per element, not 2-4). The forward is the same ops as before, bit for bit."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, compiled: Optional[bool] = None):
        ctx.compiled = compiled
        y, rstd = _norm_math(x.device.type, compiled)[0](x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        backward = _norm_math(x.device.type, ctx.compiled)[1]
        dx, dw = backward(dy, x, weight, rstd, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return dx, dw, None, None


class RMSNorm(nn.Module):
    """Llama RMSNorm: statistics in fp32, result in the input dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))  # device: module init
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFn.apply(x, self.weight, self.eps)


class GatedMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, no biases (the checkpoint names of Llama/Qwen)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    recompute = False  # train.recompute_mlp (set_mlp_recompute): keep the input only, recompute in backward

    def forward(self, x):
        if self.recompute and torch.is_grad_enabled():
            return _RecomputedMLP.apply(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
        return self.down_proj(_SiluMulFn.apply(self.gate_proj(x), self.up_proj(x)))


def _mlp(x, Wg, Wu, Wd):
    return F.linear(_SiluMulFn.apply(F.linear(x, Wg), F.linear(x, Wu)), Wd)


class _RecomputedMLP(torch.autograd.Function):
    """The gated MLP keeping only its input (and its weights, which autograd keeps anyway) for backward,
    where it runs the forward again, under the forward's autocast, and differentiates that:
    ``train.recompute_mlp``. Saves the MLP's three I-wide tensors a row (gate, up, down_proj's input)
    at the cost of its three matmuls once more in backward. The forward is GatedMLP's ops, bit for bit;
    gradients are autograd's through them, except that under autocast each use's weight gradient is
    cast to fp32 before the uses are summed (autocast's cached cast sums them in 16 bits first):
    tests/test_gated_mlp.py."""

    @staticmethod
    def forward(ctx, x, Wg, Wu, Wd):
        dev = x.device.type
        ctx.amp = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        ctx.save_for_backward(x, Wg, Wu, Wd)
        return _mlp(x, Wg, Wu, Wd)

    @staticmethod
    def backward(ctx, dy):
        need = ctx.needs_input_grad
        inputs = [t.detach().requires_grad_(n) for t, n in zip(ctx.saved_tensors, need)]
        amp = (torch.autocast(inputs[0].device.type, dtype=ctx.amp) if ctx.amp is not None
               else contextlib.nullcontext())
        with torch.enable_grad(), amp:
            y = _mlp(*inputs)
        grads = iter(torch.autograd.grad(y, [t for t, n in zip(inputs, need) if n], dy))
        return tuple(next(grads) if n else None for n in need)


def set_mlp_recompute(module: nn.Module, on: bool) -> int:
    """``train.recompute_mlp``: every GatedMLP of ``module`` recomputes in backward (``on``) or keeps its
    activations; returns how many MLPs it set."""
    mlps = [m for m in module.modules() if isinstance(m, GatedMLP)]
    for m in mlps:
        m.recompute = bool(on)
    return len(mlps)


class _SiluMulFn(torch.autograd.Function):
    """SwiGLU's ``silu(g) * u`` with a backward of its own that keeps ``g`` and ``u`` only and recomputes
    ``silu(g)`` (autograd through the two ops keeps ``silu(g)`` too: one more I-wide tensor per row, a
    quarter of the MLP's saved activations). The forward is the same two ops, and the backward the same
    kernels autograd runs (``silu_backward``, the two products), so values and gradients are bit for bit
    autograd's (tests/test_gated_mlp.py)."""

    @staticmethod
    def forward(ctx, g, u):
        ctx.save_for_backward(g, u)
        return F.silu(g) * u

    @staticmethod
    def backward(ctx, dp):
        g, u = ctx.saved_tensors
        du = dp * F.silu(g) if ctx.needs_input_grad[1] else None
        dg = torch.ops.aten.silu_backward(dp * u, g) if ctx.needs_input_grad[0] else None
        return dg, du


def frozen_tables(module: nn.Module) -> list[nn.Module]:
    """The draft's frozen tables: ``nn.Embedding`` and ``nn.Linear`` modules whose weight takes no
    gradient (the target's embedding and lm_head a draft copies: EAGLE-3's embedding, DFlash's both)."""
    return [m for m in module.modules() if isinstance(m, (nn.Embedding, nn.Linear)) and not m.weight.requires_grad
            and getattr(m, "bias", None) is None]


def _lookup_in(dtype: torch.dtype) -> Callable:
    def hook(mod, args, out):
        return out.to(dtype)
    return hook


def hold_frozen_tables(module: nn.Module, dtype: Optional[torch.dtype]) -> int:
    """Store each frozen table (``frozen_tables``) in the 16-bit autocast ``dtype`` where that holds its
    values exactly (a table copied from a target loaded in ``dtype``): half the bytes, the same values.
    An embedding's lookups come back in the dtype the table had, so what they feed computes as before;
    a linear layer under autocast casts its weight to ``dtype`` anyway (now a no-op, no cached copy).
    Under ``dtype`` None (fp32 compute), or for a table ``dtype`` would round, nothing changes.
    Returns the bytes saved (tests/test_frozen_tables.py; the memory model: ``memory.DraftParams.of``)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return 0
    saved = 0
    for m in frozen_tables(module):
        W = m.weight
        if W.dtype != torch.float32:
            continue
        with torch.no_grad():
            Wc = W.to(dtype)
            if not torch.equal(Wc.to(W.dtype), W):
                continue
            saved += W.nbytes - Wc.nbytes
            if isinstance(m, nn.Embedding):
                m.register_forward_hook(_lookup_in(W.dtype))
            W.data = Wc
    return saved


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[dict] = None, device=None) -> torch.Tensor:
    """The ``head_dim / 2`` inverse frequencies (fp32) for base ``theta`` and an HF ``rope_scaling``."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    return _scaled(inv, scaling).float()


def _scaled(inv: torch.Tensor, scaling: Optional[dict]) -> torch.Tensor:
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old = float(scaling.get("original_max_position_embeddings", 8192))
        low_wl, high_wl = old / low, old / high
        wl = 2 * math.pi / inv
        out = torch.where(wl > low_wl, inv / factor, inv)
        smooth = (old / wl - low) / (high - low)
        mid = (1 - smooth) * out / factor + smooth * out
        is_mid = (wl >= high_wl) & (wl <= low_wl)
        return torch.where(is_mid, mid, out)
    raise NotImplementedError(f"rope_scaling type {kind!r} is not implemented (linear, llama3 are)")


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of shape ``position_ids.shape + (D,)``, fp32."""
    freqs = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq.to(position_ids.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotary(x_BHTD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor) -> torch.Tensor:
    cos, sin = cos_BTD.unsqueeze(1).to(x_BHTD.dtype), sin_BTD.unsqueeze(1).to(x_BHTD.dtype)
    return x_BHTD * cos + rotate_half(x_BHTD) * sin


# apply_rotary compiled (torch.compile: one fused kernel each way instead of ~9 launches) on a CUDA
# device when True. Off by default, as COMPILE_NORM: not yet measured on a GPU.
COMPILE_ROTARY = False


def apply_rotary(x_BHTD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor,
                 compiled: Optional[bool] = None) -> torch.Tensor:
    """Rotate heads ``[B, heads, T, D]`` by ``cos``/``sin`` ``[B, T, D]`` (cast to ``x``'s dtype);
    ``compiled`` (default: ``COMPILE_ROTARY`` on CUDA) runs it through torch.compile."""
    if compiled if compiled is not None else (COMPILE_ROTARY and x_BHTD.device.type == "cuda"):
        return _compiled(_rotary)(x_BHTD, cos_BTD, sin_BTD)
    return _rotary(x_BHTD, cos_BTD, sin_BTD)


class _UseOfCast(torch.autograd.Function):
    """One use of ``Wc``, a graph-free cast of ``W``: forward returns ``Wc``; backward hands ``W`` the
    use's gradient in ``W``'s dtype, as a per-use ``W.to(dtype)`` would (so the uses' gradients are
    summed in ``W``'s dtype, fp32, never in the 16-bit copy's)."""

    @staticmethod
    def forward(ctx, W, Wc):
        ctx.dtype = W.dtype
        return Wc.view_as(Wc)

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.dtype), None


def cast_once(W: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Under autocast, ``W`` (fp32/fp16/bf16) cast to the autocast dtype ONCE; each call returns a use of
    that copy: the same values and gradients, bit for bit, as casting at every use (what autocast does
    to a weight that is not a leaf, and what an explicit ``W.to(dt)`` per TTT step did), without the
    per-use cast kernels and copies. Elsewhere (no autocast, fp64, already that dtype): ``W`` itself."""
    dev = W.device.type
    dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
    if dt is None or W.dtype == dt or W.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return lambda: W
    Wc = W.detach().to(dt)
    return lambda: _UseOfCast.apply(W, Wc)
