"""DSpark drafting, as ``llama-server --spec-type draft-dspark`` does it (llama.cpp 11434).

One round: the target has run tokens ``0 .. s-1`` and produced ``x_s`` (the anchor, not yet run by
it); the draft's context is the target's features of ``0 .. s-1`` (DFlash's
:class:`~specforge.algorithms.dflash.model.ContextCache`). The draft runs ONE block of ``n`` rows
``[x_s, mask, ...]`` at positions ``s .. s+n-1`` (``common/speculative.cpp``: ``n = n_max``
anchor-first, ``n_max + 1`` otherwise, ``n_max`` clamped to what one trained block drafts; the block
is n rows long, not block_size: in-block attention is bidirectional, so the length matters; the
eval's proposer runs the whole block as trained unless ``as_served``). Then
the Markov chain, always greedy (``src/models/dflash.cpp`` ``build_dspark_markov_head``):
``prev = x_s``; for each drafting row i (from 0 anchor-first, else from 1)
``col_i = lm_head(h_i) + W2 W1[prev]``, ``conf_i = sigmoid(proj([h_i ; W1[prev]]))``,
``prev = argmax(col_i)``; the drafted token of row i is that argmax. With ``p_min > 0`` drafting
stops at the first row whose own confidence is below it (not a cumulative product); fewer than
``n_min`` drafts drop the round's draft.
"""

from __future__ import annotations

from typing import Optional

import torch

from specforge.algorithms.dflash.model import ContextCache
from specforge.algorithms.dflash.propose import DFlashProposer

from .model import DSparkDraft

__all__ = ["propose_block_dspark", "cut_draft", "DSparkProposer"]


@torch.no_grad()
def propose_block_dspark(draft: DSparkDraft, cache: ContextCache, anchor_ids_B: torch.Tensor,
                         n_rows: Optional[int] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Greedy drafts ``[B, n_rows - 1 + shift]`` after ``anchor_ids_B`` (at position ``cache.length``)
    from one block of ``n_rows`` rows (default: block_size), and each draft's confidence
    (``sigmoid``, ``[B, ...]``; None without a confidence head)."""
    c = draft.config
    n = n_rows or c.block_size
    block = torch.full((anchor_ids_B.shape[0], n), c.mask_token_id, dtype=torch.long, device=anchor_ids_B.device)
    block[:, 0] = anchor_ids_B
    hidden = draft.forward_block(cache, block)
    prev = anchor_ids_B.long()
    tokens, confs = [], []
    for i in range(1 - c.shift, n):
        logits, conf = draft.head(hidden[:, i], prev)
        prev = logits.argmax(-1)
        tokens.append(prev)
        if conf is not None:
            confs.append(torch.sigmoid(conf.float()))
    toks = torch.stack(tokens, 1) if tokens else block.new_zeros(block.shape[0], 0)
    return toks, (torch.stack(confs, 1) if confs else None)


def cut_draft(tokens: list[int], confidence: Optional[list[float]], p_min: float = 0.0, n_min: int = 0) -> list[int]:
    """llama-server's cut of one drafted block: stop at the first confidence below ``p_min`` (> 0:
    needs a confidence head, as llama-server refuses it otherwise), none if fewer than ``n_min`` remain."""
    if p_min > 0:
        if confidence is None:
            raise ValueError(f"p_min={p_min}: this DSpark draft has no confidence head; use p_min 0")
        for i, p in enumerate(confidence):
            if p < p_min:
                tokens = tokens[:i]
                break
    return tokens if len(tokens) >= n_min else []


class DSparkProposer(DFlashProposer):
    """``specforge.eval``'s proposer for a DSpark draft: ``propose(k)`` drafts the first k (clamped to
    ``drafts_per_block``) of the whole block, as trained; ``as_served``: what llama-server with
    ``--spec-draft-n-max k`` drafts, from a block of k rows (DFlash's ``block_rows``). The same context
    either way (the target's features of every token it has run; ``start`` / ``accept`` are DFlash's)."""

    def __init__(self, draft: DSparkDraft, dtype: Optional[torch.dtype] = None, p_min: float = 0.0, n_min: int = 0,
                 as_served: bool = False):
        super().__init__(draft, dtype, as_served)
        self.p_min, self.n_min = p_min, n_min

    @torch.no_grad()
    def propose(self, k: int, costs=None) -> list[int]:
        anchor = torch.tensor([self.anchor], device=self.draft.fc.weight.device)
        tokens, conf = propose_block_dspark(self.draft, self.cache, anchor, self.rows(k))
        tokens, conf = tokens[0, :k].tolist(), None if conf is None else conf[0, :k].tolist()
        return cut_draft(tokens, conf, self.p_min, self.n_min)
