"""MTP drafting for ``specforge.eval``: a greedy chain of MTP steps at the last target position.

The target has run tokens ``0 .. s-1`` (its last layer's outputs are the eval's features: the draft's
``target_norm``, the target's final norm, makes them the last hidden state the draft trained on) and
produced ``x_s``. Step 0 reads ``h[s-1]`` and ``x_s`` and drafts ``x_{s+1}``; step ``k`` reads step
``k-1``'s output and its draft. Every step runs one row at position ``s-1`` that attends the cached
step-0 rows ``0 .. s-2`` (``model.MTPCache``) and itself: step 0 is the training forward's step 0
exactly; later steps see step-0 keys where training saw their own step's (what one cache affords).
"""

from __future__ import annotations

from typing import Optional

import torch

from .model import MTPCache, MTPDraft

__all__ = ["MTPProposer"]


class MTPProposer:
    """``start(ids, aux_TH)``, ``propose(k)``, ``accept(new, aux_TH)``: ``aux_TH`` the target's last layer
    output of each token it has run (the prompt, then the verified token and the accepted drafts)."""

    def __init__(self, draft: MTPDraft, dtype: Optional[torch.dtype] = None):
        self.draft = draft if dtype is None else draft.to(dtype)
        self.dtype = next(draft.parameters()).dtype
        self.device = draft.lm_head.weight.device
        self.cache, self.hidden, self.token = MTPCache(), None, 0

    def _hidden(self, aux_TH: torch.Tensor) -> torch.Tensor:
        return self.draft.target_norm(aux_TH.to(self.device, self.dtype)).unsqueeze(0)

    def _ids(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor([ids], device=self.device)

    @torch.no_grad()
    def start(self, ids: list[int], aux_TH: torch.Tensor) -> None:
        h = self._hidden(aux_TH)  # rows 0 .. s-1; ids: x_0 .. x_s
        self.cache = MTPCache()
        if h.shape[1] > 1:
            self.draft.cache_rows(self.cache, h[:, :-1], self._ids(ids[1:h.shape[1]]))
        self.hidden, self.token = h[:, -1:], ids[-1]

    @torch.no_grad()
    def propose(self, k: int, costs=None) -> list[int]:
        h, tok, out = self.hidden, self._ids([self.token]), []
        for _ in range(k):
            h = self.draft.draft_step(self.cache, h, tok)
            tok = self.draft.logits(h).argmax(-1)
            out.append(int(tok))
        return out

    @torch.no_grad()
    def accept(self, new_tokens: list[int], aux_TH: torch.Tensor) -> None:
        h = self._hidden(aux_TH)  # rows s .. s+n; new_tokens: x_{s+1} .. x_{s+n+1}
        rows = torch.cat([self.hidden, h[:, :-1]], 1)
        self.draft.cache_rows(self.cache, rows, self._ids([self.token] + new_tokens[:-1]))
        self.hidden, self.token = h[:, -1:], new_tokens[-1]
