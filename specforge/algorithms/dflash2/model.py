"""The DFlash2 draft: DFlash's block draft with local convolutions and a candidate selector.

Legend: B batch, Q block rows of a forward, N blocks, K block size, H hidden, G = H / group
channel groups, t taps (``conv_kernel_size``), V target vocab, r the selector's rank, k top-k.

Backbone: :class:`~specforge.algorithms.dflash.model.DFlashDraft` (context features -> keys and
values, blocks ``[anchor, mask, ...]``, the target's frozen embedding and ``lm_head``), each layer
wrapped as speculators' ``Qwen3DFlash2DecoderLayer`` does:

* ``u = input_layernorm(x)``; the layer's ``attention_conv`` projects ``u`` to two dynamic kernels
  (``kernel_projection``: ``H -> 2 t G``, read as ``[2, t, G]``: input side, output side);
  ``x = x + conv_out(attn(conv_in(u)))``; the same around the MLP with ``mlp_conv`` on
  ``post_attention_layernorm(x)``. The block's keys and values come from the convolved rows; the
  context's do not pass through any convolution.
* A convolution is causal inside a block: row ``j`` of a block gets
  ``sum_{s < t, s <= j} x[j - s] * (base_kernel[side, s] + delta[j, s, group])``, the delta of the
  OUTPUT row ``j`` broadcast over its group's channels; rows never see another block. The base
  kernel starts as identity (tap 0 = 1) and the projection at 0, so a fresh DFlash2 computes
  DFlash's function.

Training runs ``N`` blocks of ``K`` rows at once; drafting runs one block of ``n <= K`` rows (the
rows of one forward are blocks of ``min(K, Q)``).

Selector (``candidate_selector``): ``predecessor_codebook [V, r]``, ``successor_codebook [V, r]``
and ``hidden_projection`` (``H -> r``, no bias), all N(0, 0.02). The score of candidate ``c`` for a
row with hidden state ``h`` (after ``norm``) and previous token ``p``: ``unary[c] + sum_r
P[p] * proj(h) * S[c]``; candidates are the unary logits' top-k. Drafting picks the best-scored
candidate and feeds it as the next row's ``p`` (:mod:`.propose`).

State-dict keys are speculators' (``layers.i.attention_conv.base_kernel``,
``layers.i.attention_conv.kernel_projection.weight``, ``layers.i.mlp_conv.*``,
``candidate_selector.*``), beside DFlash's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from specforge.algorithms.dflash.blocks import ShiftedLayout
from specforge.algorithms.dflash.model import DFlashConfig, DFlashDraft, DFlashLayer

__all__ = ["DFlash2Config", "DFlash2Draft", "DFlash2Layer", "BlockConv", "CandidateSelector", "block_conv"]


@dataclass
class DFlash2Config(ShiftedLayout, DFlashConfig):
    """DFlash's shape plus the convolutions and the selector (speculators' defaults)."""

    block_size: int = 8
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    sample_from_anchor: bool = False
    sliding_window_non_causal: bool = True
    initializer_range: float = 0.02

    def __post_init__(self):
        super().__post_init__()
        problems = []
        if not 1 <= self.conv_kernel_size <= self.block_size:
            problems.append(f"conv_kernel_size={self.conv_kernel_size}: expected 1 .. block_size={self.block_size}")
        if self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
            problems.append(f"conv_group_size={self.conv_group_size} does not divide hidden_size={self.hidden_size}")
        if self.selector_rank < 1:
            problems.append(f"selector_rank={self.selector_rank}: expected >= 1")
        if not 1 <= self.selector_top_k <= self.vocab_size:
            problems.append(f"selector_top_k={self.selector_top_k}: expected 1 .. vocab_size={self.vocab_size}")
        if self.sliding_window is not None and not self.sliding_window_non_causal:
            problems.append("sliding_window_non_causal=false with a sliding window: causal in-block attention is "
                            "not implemented")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def num_groups(self) -> int:
        return self.hidden_size // self.conv_group_size


def block_conv(x_BQH: torch.Tensor, delta_BQtG: torch.Tensor, base_tH: torch.Tensor, block: int) -> torch.Tensor:
    """The dynamic grouped causal convolution of rows that come in blocks of ``min(block, Q)`` (see
    the module docstring): ``x [..., Q, H]``, ``delta [..., Q, t, G]``, ``base [t, H]``."""
    *lead, Q, H = x_BQH.shape
    taps, G = delta_BQtG.shape[-2:]
    n = min(block, Q)
    if Q % n:
        raise ValueError(f"{Q} rows are not whole blocks of {n}")
    x = x_BQH.reshape(*lead, Q // n, n, G, H // G)
    d = delta_BQtG.reshape(*lead, Q // n, n, taps, G)
    base = base_tH.to(x.dtype).view(taps, G, H // G)
    out = x * (base[0] + d[..., 0, :, None])
    for s in range(1, min(taps, n)):
        shifted = F.pad(x[..., : n - s, :, :], (0, 0, 0, 0, s, 0))  # row j reads row j - s of its block
        out = out + shifted * (base[s] + d[..., s, :, None])
    return out.reshape(x_BQH.shape)


class BlockConv(nn.Module):
    """One sublayer's pair of convolutions (input side, output side), kernels from one projection."""

    def __init__(self, cfg: DFlash2Config):
        super().__init__()
        self.block, self.taps, self.groups = cfg.block_size, cfg.conv_kernel_size, cfg.num_groups
        self.base_kernel = nn.Parameter(torch.zeros(2, self.taps, cfg.hidden_size))  # device: module init
        self.kernel_projection = nn.Linear(cfg.hidden_size, 2 * self.taps * self.groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Identity: tap 0 of both sides 1, every delta 0."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(conv_in(u), the output side's delta)``; both kernels are functions of ``u``."""
        kernels = self.kernel_projection(u).view(*u.shape[:-1], 2, self.taps, self.groups)
        return block_conv(u, kernels[..., 0, :, :], self.base_kernel[0], self.block), kernels[..., 1, :, :]

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return block_conv(y, delta, self.base_kernel[1], self.block)


class DFlash2Layer(DFlashLayer):
    """DFlash's layer with a :class:`BlockConv` around its attention and around its MLP."""

    def __init__(self, cfg: DFlash2Config):
        super().__init__(cfg)
        self.attention_conv = BlockConv(cfg)
        self.mlp_conv = BlockConv(cfg)

    def forward(self, x_BQH, ctx_kv, cos, sin, mask=None, attend=None):
        u, out_delta = self.attention_conv.prepare(self.input_layernorm(x_BQH))
        x_BQH = x_BQH + self.attention_conv.finish(self.self_attn(u, ctx_kv, cos, sin, mask, attend), out_delta)
        u, out_delta = self.mlp_conv.prepare(self.post_attention_layernorm(x_BQH))
        return x_BQH + self.mlp_conv.finish(self.mlp(u), out_delta)


class CandidateSelector(nn.Module):
    """Bilinear rescoring of the unary top-k by (previous token, hidden state)."""

    def __init__(self, cfg: DFlash2Config):
        super().__init__()
        V, r = cfg.vocab_size, cfg.selector_rank
        self.top_k = cfg.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(V, r))  # device: module init
        self.successor_codebook = nn.Parameter(torch.empty(V, r))  # device: module init
        self.hidden_projection = nn.Linear(cfg.hidden_size, r, bias=False)
        for w in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            nn.init.normal_(w, std=cfg.initializer_range)

    def scores(self, unary: torch.Tensor, hidden: torch.Tensor, prev_ids: torch.Tensor,
               cand_ids: torch.Tensor) -> torch.Tensor:
        """``[..., k]``: ``unary [..., V]`` at the candidates ``cand_ids [..., k]`` plus the transition
        score of (``prev_ids [...]``, ``hidden [..., H]``) to each."""
        ctx = self.predecessor_codebook[prev_ids.long()]
        ctx = ctx * self.hidden_projection(hidden).to(ctx.dtype)
        trans = (ctx.unsqueeze(-2) * self.successor_codebook[cand_ids.long()]).sum(-1)
        picked = unary.gather(-1, cand_ids)
        return picked + trans.to(picked.dtype)

    def pick(self, unary: torch.Tensor, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """The drafted token ``[...]``: the best-scored of the unary top-k."""
        cand = unary.topk(self.top_k, dim=-1).indices
        best = self.scores(unary, hidden, prev_ids, cand).argmax(-1, keepdim=True)
        return cand.gather(-1, best).squeeze(-1)


class DFlash2Draft(DFlashDraft):
    """Trainable: DFlash's parts, the convolutions, the selector. Frozen (the target's): embed_tokens, lm_head."""

    def __init__(self, cfg: DFlash2Config):
        super().__init__(cfg)
        self.layers = nn.ModuleList([DFlash2Layer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.candidate_selector = CandidateSelector(cfg)

    def forward(self, ctx_BTF, block_ids_BNK, anchors_BN, keep_BN=None, position_ids_BT=None, doc_ids_BT=None,
                heads: Optional[Callable[["DFlash2Draft", torch.Tensor], object]] = None):
        """DFlash's training forward -> hidden ``[B, N, K, H]``; with ``heads``, ``heads(self, hidden)``
        (the loss runs the selector inside this call, so FSDP2 has every parameter unsharded)."""
        hidden = super().forward(ctx_BTF, block_ids_BNK, anchors_BN, keep_BN, position_ids_BT, doc_ids_BT)
        return hidden if heads is None else heads(self, hidden)
