"""The XPress draft: DFlash's block draft plus a small causal refiner over each block's rows.

Legend: B batch, N blocks, K block size, H hidden, V target vocab, r the refiner's rank.

Backbone: :class:`~specforge.algorithms.dflash.model.DFlashDraft` unchanged (context features ->
keys and values, blocks ``[anchor, mask, ...]``, the target's frozen embedding and ``lm_head``):
its logits ``lm_head(h)`` are the block's "base" logits.

Refiner (``refiner_head``; speculators 0.9.0's ``XPressRefinerHead``): a logit bias for every row of
a block from three r-wide parts, mixed causally along the block:

* ``down_h(h_k)`` of the row's own hidden state and ``down_g(mean_k h_k)`` of the block's (the
  same for every row): computed once per block (:meth:`CausalRefiner.context`), reused by every pass;
* ``token_embed(prev_k)``: the token before the one row k stands for (teacher forcing: the data;
  a Jacobi pass: the previous pass's argmax);
* ``x = in_proj([own; block; token])``; per channel c a lower-triangular K x K mix
  ``x_k += sum_{j <= k} mix_l[c, k, j] x_j`` (a row reads its own and earlier rows only); a SwiGLU
  MLP (``mlp_gate``, ``mlp_up``: r -> r * mlp_ratio, ``mlp_down`` back) with a residual; ``readout``
  (r -> V) is the bias. The refined logits are ``base + bias``.

Init: every projection and the embedding N(0, 0.02), ``mix_l`` 0.

State-dict keys are speculators' (``refiner_head.token_embed.weight``, ``refiner_head.mix_l``, ...),
beside DFlash's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from specforge.algorithms.dflash.blocks import ShiftedLayout
from specforge.algorithms.dflash.model import DFlashConfig, DFlashDraft

__all__ = ["XPressConfig", "XPressDraft", "CausalRefiner", "jacobi_prev"]


@dataclass
class XPressConfig(ShiftedLayout, DFlashConfig):
    """DFlash's shape plus the refiner (speculators' XPress defaults) and the block layout."""

    block_size: int = 16
    refiner_rank: int = 256
    refiner_mlp_ratio: int = 2
    jacobi_passes: int = 6  # drafting: refine passes after the base argmax (0: the base argmax alone)
    sample_from_anchor: bool = False
    initializer_range: float = 0.02

    def __post_init__(self):
        super().__post_init__()
        problems = []
        if self.refiner_rank < 1:
            problems.append(f"refiner_rank={self.refiner_rank}: expected >= 1")
        if self.refiner_mlp_ratio < 1:
            problems.append(f"refiner_mlp_ratio={self.refiner_mlp_ratio}: expected >= 1")
        if self.jacobi_passes < 0:
            problems.append(f"jacobi_passes={self.jacobi_passes}: expected >= 0")
        if self.sliding_window is not None:
            problems.append("sliding_window: XPress has no sliding window")
        if problems:
            raise ValueError("; ".join(problems))


class CausalRefiner(nn.Module):
    """The per-row logit bias of a block (module docstring)."""

    def __init__(self, cfg: XPressConfig):
        super().__init__()
        V, H, K, r = cfg.vocab_size, cfg.hidden_size, cfg.block_size, cfg.refiner_rank
        wide = r * cfg.refiner_mlp_ratio
        self.token_embed = nn.Embedding(V, r)
        self.down_h = nn.Linear(H, r, bias=False)
        self.down_g = nn.Linear(H, r, bias=False)
        self.in_proj = nn.Linear(3 * r, r, bias=False)
        self.mix_l = nn.Parameter(torch.zeros(r, K, K))  # device: module init
        self.mlp_gate = nn.Linear(r, wide, bias=False)
        self.mlp_up = nn.Linear(r, wide, bias=False)
        self.mlp_down = nn.Linear(wide, r, bias=False)
        self.readout = nn.Linear(r, V, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=cfg.initializer_range)

    def context(self, hidden_NKH: torch.Tensor) -> torch.Tensor:
        """``[..., K, 2r]``: each row's own projection and its block mean's, the passes' shared input."""
        dtype = self.down_h.weight.dtype
        h = hidden_NKH.to(dtype)
        block = self.down_g(h.mean(dim=-2, keepdim=True)).expand(*h.shape[:-1], -1)
        return torch.cat([self.down_h(h), block], dim=-1)

    def bias(self, context_NK2r: torch.Tensor, prev_ids_NK: torch.Tensor) -> torch.Tensor:
        """``[..., K, V]``: the logit bias of every row given the token before each (``prev_ids``)."""
        tok = self.token_embed(prev_ids_NK.long()).to(context_NK2r.dtype)
        x = self.in_proj(torch.cat([context_NK2r, tok], dim=-1))
        x = x + torch.einsum("ckj,...jc->...kc", torch.tril(self.mix_l).to(x.dtype), x)
        x = x + self.mlp_down(F.silu(self.mlp_gate(x)) * self.mlp_up(x))
        return self.readout(x)


def jacobi_prev(first_N: torch.Tensor, anchor_N: torch.Tensor, pred_NK: torch.Tensor, shift: int) -> torch.Tensor:
    """The previous tokens ``[N, K]`` of a free-running pass: row 0 keeps its teacher token
    ``first`` (the token before the anchor, or the anchor anchor-first), row k reads the token drafted
    at row k - 1, where row 0 (DFlash's layout: the anchor's own row) drafts the anchor itself."""
    pred = pred_NK[..., :-1]
    if not shift:
        pred = torch.cat([anchor_N.unsqueeze(-1), pred[..., 1:]], dim=-1)
    return torch.cat([first_N.unsqueeze(-1), pred], dim=-1)


class XPressDraft(DFlashDraft):
    """Trainable: DFlash's parts and the refiner. Frozen (the target's): embed_tokens, lm_head."""

    def __init__(self, cfg: XPressConfig):
        super().__init__(cfg)
        self.refiner_head = CausalRefiner(cfg)

    def forward(self, ctx_BTF, block_ids_BNK, anchors_BN, keep_BN=None, position_ids_BT=None, doc_ids_BT=None,
                heads: Optional[Callable[["XPressDraft", torch.Tensor], object]] = None):
        """DFlash's training forward -> hidden ``[B, N, K, H]``; with ``heads``, ``heads(self, hidden)``
        (the loss runs the refiner inside this call, so FSDP2 has every parameter unsharded)."""
        hidden = super().forward(ctx_BTF, block_ids_BNK, anchors_BN, keep_BN, position_ids_BT, doc_ids_BT)
        return hidden if heads is None else heads(self, hidden)

    @torch.no_grad()
    def jacobi(self, hidden_NKH: torch.Tensor, first_N: torch.Tensor, anchor_N: torch.Tensor,
               passes: Optional[int] = None) -> torch.Tensor:
        """Drafting's block decode ``[N, K]``: the base argmax, then ``passes`` (default the config's)
        refine passes, each fed the previous pass's tokens (:func:`jacobi_prev`)."""
        base = self.logits(hidden_NKH)
        ctx = self.refiner_head.context(hidden_NKH)
        pred = base.argmax(-1)
        for _ in range(self.config.jacobi_passes if passes is None else passes):
            prev = jacobi_prev(first_N, anchor_N, pred, self.config.shift)
            pred = (base + self.refiner_head.bias(ctx, prev).to(base.dtype)).argmax(-1)
        return pred
