"""The P-EAGLE proposer of ``specforge.eval``: K tokens from ONE draft forward, as vLLM drafts them."""

from __future__ import annotations

from typing import Optional

import torch

from specforge.algorithms.eagle3.propose import EagleProposer


class PEagleProposer(EagleProposer):
    """EAGLE-3's proposer state (the draft's KV cache of target-fed rows, ``start`` / ``accept``
    inherited), drafting a block: ``propose(k)`` runs the pending target-fed rows and
    ``min(k, parallel_tokens) - 1`` mask rows (``mask_token_id``'s trained embedding, ``fc(mask_hidden)``)
    at the next positions in one causal forward, and returns the argmax of the last real row and
    of each mask row. The mask rows' keys are dropped from the cache afterwards (vLLM's pard slots
    are not kept either). What the training forward computes at depth d of the last row's anchor.
    """

    def __init__(self, draft, dtype: Optional[torch.dtype] = None):
        super().__init__(draft, dtype)
        d = self.drafter
        d.embed_V = draft.embedding_table().to(d.dtype)  # the served table: row mask_token_id = mask_embed
        self.mask_id = int(draft.config.mask_token_id)
        self.mask_hidden = draft.mask_hidden.detach().to(d.dtype).view(1, -1)  # raw 3H: prefill applies fc
        self.max_tokens = int(draft.config.parallel_tokens)
        self.last_logits: Optional[torch.Tensor] = None  # the block's draft-vocab logits (tests read them)

    @torch.no_grad()
    def propose(self, k: int, costs=None) -> list[int]:
        """``min(k, parallel_tokens)`` tokens (``costs`` is ignored: a block is drafted whole)."""
        d = self.drafter
        n = max(1, min(int(k), self.max_tokens))
        ids, aux = self.pending
        P = ids.shape[0]
        rows = torch.cat([ids.to(torch.long), torch.full((n - 1,), self.mask_id, dtype=torch.long, device=ids.device)])
        hidden = torch.cat([aux.to(d.dtype), self.mask_hidden.to(aux.device).expand(n - 1, -1)])
        start = len(d.cache)
        _, logits = d.prefill(rows, hidden)
        self.committed = start + P  # the target-fed rows stay; the mask rows' keys go
        d.cache.crop(self.committed)
        self.last_logits = logits[P - 1 :]
        return d.to_target(self.last_logits.argmax(-1)).tolist()
