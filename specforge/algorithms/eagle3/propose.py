"""The EAGLE-3 proposer of ``specforge.eval``: chain drafting with the draft's own KV cache."""

from __future__ import annotations

from typing import Optional

import torch

from specforge.algorithms.eagle3.model import ChainDrafter


class EagleProposer:
    """Chain drafting with the EAGLE-3 draft's KV cache, the way an inference engine drafts.

    Draft row t takes the target feature at position t and the token at t+1. Rows whose
    features came from the target are committed to the cache; rows drafted from the draft's own
    hidden states are cropped away after verification. The draft runs in ``dtype`` (default: its
    own) through a :class:`ChainDrafter`, which snapshots its weights: build a new proposer after
    the draft changes.
    """

    def __init__(self, draft, dtype: Optional[torch.dtype] = None):
        self.drafter = ChainDrafter(draft, dtype)
        self.committed = 0
        self.pending: tuple[torch.Tensor, torch.Tensor] = (torch.empty(0), torch.empty(0))  # device: empty placeholders

    def start(self, ids: list[int], aux_TH: torch.Tensor) -> None:
        self.drafter.cache.crop(0)
        self._queue(ids[1:], aux_TH)

    def _queue(self, next_ids: list[int], aux_TH: torch.Tensor) -> None:
        assert len(next_ids) == aux_TH.shape[0]
        self.pending = (torch.as_tensor(next_ids, device=aux_TH.device), aux_TH)

    def propose(self, k: int, costs=None) -> list[int]:
        """Up to ``k`` tokens. With ``costs`` (dynamic drafting) the draft's own probability that
        everything drafted so far is accepted decides, token by token, whether drafting and
        verifying one more pays off; the result may be empty (the round is a plain decode step)."""
        d = self.drafter
        hidden, logits = d.prefill(*self.pending)  # the target-fed rows: always needed, committed
        self.committed = len(d.cache)
        hidden, logits = hidden[-1:], logits[-1]
        ids = torch.empty(k, dtype=torch.long, device=logits.device)
        p_all, n = 1.0, 0
        while True:
            ids[n] = logits.argmax()  # stays a tensor: no host sync per step without costs
            if costs is not None:
                p_all *= float(torch.softmax(logits.float(), dim=-1)[ids[n]])
                if not costs.verify_pays(n + 1, p_all):
                    break
            n += 1
            if n == k or (costs is not None and not costs.step_pays(n, p_all)):
                break
            hidden, logits = d.step(ids[n - 1], hidden)
            logits = logits[0]
        return d.to_target(ids[:n]).tolist()

    def accept(self, new_tokens: list[int], aux_TH: torch.Tensor) -> None:
        self.drafter.cache.crop(self.committed)
        self._queue(new_tokens, aux_TH)
