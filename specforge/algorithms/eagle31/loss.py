"""The EAGLE-3.1 TTT loss: EAGLE-3's (``algorithms/eagle3/loss.py``, its conventions and metrics), run
on the EAGLE-3.1 draft, whose ``forward`` is the unroll with the switches inside.

One difference reaches the loss: EAGLE-3's head computes ``lm_head(draft.norm(h))`` of the hidden the
forward hands it. With ``norm_output`` that hidden is already ``norm(y)`` (the value fed back to the
next step), so its logits are ``lm_head(h)``: the loss runs on :class:`OutputNormed`, a view of the
draft whose ``norm`` is the identity (everything else, the forward call included, is the draft's).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["OutputNormed", "for_loss"]


class OutputNormed:
    """A ``norm_output`` draft as ``ttt_loss`` reads it: ``norm`` is the identity, the rest is the
    draft (calling the view calls the draft, so FSDP2's hooks fire around its forward as usual)."""

    def __init__(self, draft: torch.nn.Module):
        self.draft = draft

    @staticmethod
    def norm(hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.draft(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.draft, name)


def for_loss(draft):
    """What EAGLE-3's loss functions are given for this draft."""
    return OutputNormed(draft) if draft.config.norm_output else draft
