"""DFlash2 drafting: one block in one forward (DFlash's), then the selector's greedy chain over its
rows: ``prev = anchor``; for each drafting row i (from 0 anchor-first, else from 1) the drafted
token is the best-scored of the unary top-k given ``prev`` (``CandidateSelector.pick``), and it
becomes ``prev`` for row i + 1. The block's hidden states do not depend on the chain (the rows are
computed at once); only the selector's input does.
"""

from __future__ import annotations

from typing import Optional

import torch

from specforge.algorithms.dflash.model import ContextCache
from specforge.algorithms.dflash.propose import DFlashProposer

from .model import DFlash2Draft

__all__ = ["propose_block_dflash2", "DFlash2Proposer"]


@torch.no_grad()
def propose_block_dflash2(draft: DFlash2Draft, cache: ContextCache, anchor_ids_B: torch.Tensor,
                          n_rows: Optional[int] = None) -> torch.Tensor:
    """Greedy drafts ``[B, n_rows - 1 + shift]`` after ``anchor_ids_B`` (at position ``cache.length``)
    from one block of ``n_rows`` rows (default: block_size)."""
    c = draft.config
    n = n_rows or c.block_size
    block = torch.full((anchor_ids_B.shape[0], n), c.mask_token_id, dtype=torch.long, device=anchor_ids_B.device)
    block[:, 0] = anchor_ids_B
    hidden = draft.forward_block(cache, block)
    prev, tokens = anchor_ids_B.long(), []
    for i in range(1 - c.shift, n):
        prev = draft.candidate_selector.pick(draft.logits(hidden[:, i]), hidden[:, i], prev)
        tokens.append(prev)
    return torch.stack(tokens, 1) if tokens else block.new_zeros(block.shape[0], 0)


class DFlash2Proposer(DFlashProposer):
    """``specforge.eval``'s proposer for a DFlash2 draft: ``propose(k)`` drafts ``min(k,
    drafts_per_block)`` tokens from one block, the whole block as trained unless ``as_served``
    (DFlash's ``block_rows``; ``start`` / ``accept`` are DFlash's)."""

    def __init__(self, draft: DFlash2Draft, dtype: Optional[torch.dtype] = None, as_served: bool = False):
        super().__init__(draft, dtype, as_served)

    @torch.no_grad()
    def propose(self, k: int, costs=None) -> list[int]:
        anchor = torch.tensor([self.anchor], device=self.draft.fc.weight.device)
        return propose_block_dflash2(self.draft, self.cache, anchor, self.rows(k))[0, :k].tolist()
