"""The EAGLE-3.1 proposer of ``specforge.eval``: EAGLE-3's chain drafting with the EAGLE-3.1 drafter."""

from __future__ import annotations

from typing import Optional

import torch

from specforge.algorithms.eagle3.propose import EagleProposer
from specforge.algorithms.eagle31.model import Eagle31ChainDrafter


class Eagle31Proposer(EagleProposer):
    """``EagleProposer`` drafting with :class:`Eagle31ChainDrafter` (the fc-side norms before ``fc``,
    the normed residual and output). EAGLE-3's constructor snapshots its own drafter first; it is
    replaced at once (a one-off copy of the weights per proposer)."""

    def __init__(self, draft, dtype: Optional[torch.dtype] = None):
        super().__init__(draft, dtype)
        self.drafter = Eagle31ChainDrafter(draft, dtype)
