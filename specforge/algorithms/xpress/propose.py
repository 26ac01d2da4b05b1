"""XPress drafting: one block in one forward (DFlash's), then Jacobi decoding of its rows
(:meth:`~.model.XPressDraft.jacobi`): the base argmax, then ``jacobi_passes`` refine passes, each
fed the previous pass's tokens, all rows at once. Row 0's previous token is the token before the
anchor in DFlash's layout (the proposer keeps it), the anchor anchor-first.

The refiner reads the whole block (its block mean, its K x K mix), so a round always runs the full
block and returns its first ``min(k, drafts_per_block)`` tokens.
"""

from __future__ import annotations

from typing import Optional

import torch

from specforge.algorithms.dflash.model import ContextCache
from specforge.algorithms.dflash.propose import DFlashProposer

from .model import XPressDraft

__all__ = ["propose_block_xpress", "XPressProposer"]


@torch.no_grad()
def propose_block_xpress(draft: XPressDraft, cache: ContextCache, anchor_ids_B: torch.Tensor,
                         before_ids_B: torch.Tensor, passes: Optional[int] = None) -> torch.Tensor:
    """Greedy drafts ``[B, drafts_per_block]`` after ``anchor_ids_B`` (at position ``cache.length``);
    ``before_ids_B``: the token before each anchor (the anchor itself where there is none)."""
    c = draft.config
    block = torch.full((anchor_ids_B.shape[0], c.block_size), c.mask_token_id, dtype=torch.long,
                       device=anchor_ids_B.device)
    block[:, 0] = anchor_ids_B
    hidden = draft.forward_block(cache, block)
    first = anchor_ids_B if c.shift else before_ids_B
    return draft.jacobi(hidden, first.long(), anchor_ids_B.long(), passes)[:, 1 - c.shift:]


class XPressProposer(DFlashProposer):
    """``specforge.eval``'s proposer for an XPress draft: ``propose(k)`` drafts ``min(k,
    drafts_per_block)`` tokens from one block; ``start`` / ``accept`` are DFlash's, and keep the token
    before the anchor too."""

    def __init__(self, draft: XPressDraft, dtype: Optional[torch.dtype] = None):
        super().__init__(draft, dtype)
        self.before = 0

    @torch.no_grad()
    def start(self, ids: list[int], aux_TH: torch.Tensor) -> None:
        super().start(ids, aux_TH)
        self.before = ids[-2] if len(ids) > 1 else ids[-1]

    @torch.no_grad()
    def propose(self, k: int, costs=None) -> list[int]:
        dev = self.draft.fc.weight.device
        anchor, before = torch.tensor([self.anchor], device=dev), torch.tensor([self.before], device=dev)
        return propose_block_xpress(self.draft, self.cache, anchor, before)[0, :k].tolist()

    @torch.no_grad()
    def accept(self, new_tokens: list[int], aux_TH: torch.Tensor) -> None:
        self.before = new_tokens[-2] if len(new_tokens) > 1 else self.anchor
        super().accept(new_tokens, aux_TH)
