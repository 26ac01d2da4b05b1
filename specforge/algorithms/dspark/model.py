"""The DSpark draft: DFlash's block-diffusion draft plus a low-rank Markov head and a confidence head.

Legend: B batch, N blocks, K block size, H hidden, V target vocab (the draft's vocab is the
target's whole vocabulary, as DFlash's), r the Markov rank.

The backbone is :class:`~specforge.algorithms.dflash.model.DFlashDraft` unchanged (block
``[anchor, mask, ...]`` after the target's context features, bidirectional in-block attention,
``norm``, the target's frozen ``lm_head``). On top (speculators' ``DSparkDraftModel``, the "vanilla"
head llama.cpp loads):

* Markov head: ``W1 = markov_head.markov_w1`` (an embedding ``[V, r]``, init N(0, 0.01)) and
  ``W2 = markov_head.markov_w2`` (a linear ``r -> V``, no bias). A block row's logits are
  ``lm_head(h_k) + W2 W1[prev_k]``: an additive bias that depends on the previous token only.
  Training feeds the data token before the predicted one (teacher forcing); drafting feeds the
  argmax of the row before (a greedy chain, :mod:`.propose`).
* Confidence head (optional): ``confidence_head.proj`` (a linear ``H + r -> 1`` with a bias) on
  ``[h_k ; W1[prev_k]]`` (the hidden first): a logit of the row's acceptance probability. llama.cpp
  loads only this input layout (``conf_proj.weight`` must be ``{n_embd + r, 1}``).

``sample_from_anchor`` (speculators' and DeepSpec's default, True): block row k predicts the token
after position a + k, so a block of K rows drafts K tokens, row 0 included. False: DFlash's layout,
row k predicts the token AT a + k (row 0, the anchor, predicts nothing; K - 1 drafts).

The state-dict keys are speculators' (``markov_head.markov_w1.weight``, ``markov_head.markov_w2.weight``,
``confidence_head.proj.weight``, ``confidence_head.proj.bias``), what llama.cpp's converter maps to
``markov_w1`` / ``markov_w2`` / ``conf_proj``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn

from specforge.algorithms.dflash.blocks import ShiftedLayout
from specforge.algorithms.dflash.model import DFlashConfig, DFlashDraft

__all__ = ["DSparkConfig", "DSparkDraft", "MarkovHead", "ConfidenceHead"]


@dataclass
class DSparkConfig(ShiftedLayout, DFlashConfig):
    """DFlash's shape plus the heads (speculators' defaults: rank 256, a confidence head, anchor-first)."""

    block_size: int = 8
    markov_rank: int = 256
    confidence_head: bool = True
    sample_from_anchor: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.markov_rank < 1:
            raise ValueError(f"markov_rank={self.markov_rank}: the Markov head needs a rank >= 1")


class MarkovHead(nn.Module):
    """``W2 W1[prev]``: a rank-r logit bias from the previous token."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        nn.init.normal_(self.markov_w1.weight, std=0.01)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)


class ConfidenceHead(nn.Module):
    """``proj([h ; W1[prev]])``: the logit of a row's acceptance probability."""

    def __init__(self, hidden_size: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size + rank, 1)


class DSparkDraft(DFlashDraft):
    """Trainable: DFlash's parts, the Markov head, the confidence head. Frozen (the target's): embed_tokens, lm_head."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__(cfg)
        self.markov_head = MarkovHead(cfg.vocab_size, cfg.markov_rank)
        self.confidence_head = ConfidenceHead(cfg.hidden_size, cfg.markov_rank) if cfg.confidence_head else None

    def forward(self, ctx_BTF, block_ids_BNK, anchors_BN, keep_BN=None, position_ids_BT=None, doc_ids_BT=None,
                heads: Optional[Callable[["DSparkDraft", torch.Tensor], object]] = None):
        """DFlash's training forward -> hidden ``[B, N, K, H]``; with ``heads``, ``heads(self, hidden)``.

        The loss applies the heads through ``heads`` so that every trainable parameter is used inside
        this call: FSDP2 shards the root module and unshards its parameters for its forward only."""
        hidden = super().forward(ctx_BTF, block_ids_BNK, anchors_BN, keep_BN, position_ids_BT, doc_ids_BT)
        return hidden if heads is None else heads(self, hidden)

    def markov_embedding(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """``W1[prev]`` ``[..., r]``."""
        return self.markov_head.markov_w1(prev_ids)

    def head(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(logits [..., V], confidence logit [...] or None)`` of rows ``hidden [..., H]`` whose
        previous tokens are ``prev_ids [...]``: ``lm_head(h) + W2 W1[prev]`` and ``proj([h ; W1[prev]])``."""
        e = self.markov_embedding(prev_ids)
        logits = self.logits(hidden) + self.markov_head.markov_w2(e)
        conf = None
        if self.confidence_head is not None:
            conf = self.confidence_head.proj(torch.cat([hidden, e.to(hidden.dtype)], dim=-1)).squeeze(-1)
        return logits, conf
