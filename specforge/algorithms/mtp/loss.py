"""The MTP loss: a weighted sum of each step's mean cross-entropy against the data's tokens.

Legend: B batch, T tokens, S steps, V the target's vocabulary.

Step ``k``, row ``t`` predicts ``x[t+k+2]`` (``model.py``) and counts iff ``loss_mask[t+k+2]`` (the
predicted token is an assistant token) and, in a packed row, ``x[t+k+2]`` lies in row ``t``'s sample.
``loss = sum_k w_k * CE_k / N_k``: ``CE_k`` the summed cross-entropy of step ``k``'s counted rows,
``N_k`` their number over the whole step (every micro-batch and rank: ``denominators``; this
micro-batch's own when None, speculators' per-batch mean). ``w_k`` = ``step_weights``: FastMTP's
``beta**k / sum_j beta**j`` (``step_weights``).

Counters (float64 ``[S, 4]``, summed as is over micro-batches and ranks): the summed CE, the rows whose
argmax is the token, the counted rows, and the rows where every step up to ``k`` is right (a
greedy round started at that row accepts ``k + 1`` drafts): ``tau = 1 + sum_k chain_k / N_0``.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

__all__ = ["step_weights", "step_valid", "mtp_loss", "metrics_from_counts", "COUNTERS"]

COUNTERS = ("ce_sum", "correct", "valid", "chain")


def step_weights(beta: float, steps: int) -> list[float]:
    """FastMTP's (arXiv 2509.18362, eq. 2) normalized decay: ``beta**k / sum_j beta**j``."""
    raw = [beta ** k for k in range(steps)]
    return [w / sum(raw) for w in raw]


def step_valid(loss_mask_BT: torch.Tensor, k: int, doc_ids_BT: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[B, T - k - 1]``: whether step ``k``'s row ``t`` counts (see the module docstring)."""
    T = loss_mask_BT.shape[1]
    valid = loss_mask_BT[:, k + 2:].bool()
    if doc_ids_BT is not None:
        valid = valid & (doc_ids_BT[:, k + 2:] == doc_ids_BT[:, :T - k - 2])
    return torch.cat([valid, valid.new_zeros(valid.shape[0], 1)], dim=1)  # the last row has no target


def mtp_loss(draft, hidden_BTH: torch.Tensor, input_ids_BT: torch.Tensor, loss_mask_BT: torch.Tensor,
             weights: Sequence[float], denominators: Optional[torch.Tensor] = None,
             position_ids_BT: Optional[torch.Tensor] = None,
             doc_ids_BT: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, counts [S, 4])`` of one micro-batch (``hidden_BTH``: the target's last hidden state)."""
    S = len(weights)
    outs = draft(hidden_BTH, input_ids_BT, position_ids_BT, doc_ids_BT, steps=S)
    counts = torch.zeros(S, len(COUNTERS), dtype=torch.float64, device=hidden_BTH.device)
    loss = hidden_BTH.new_zeros((), dtype=torch.float32)
    chain = None
    for k, out in enumerate(outs):
        n = out.shape[1]
        valid = step_valid(loss_mask_BT, k, doc_ids_BT)
        labels = input_ids_BT[:, k + 2:k + 2 + n].long()
        labels = torch.cat([labels, labels.new_zeros(labels.shape[0], n - labels.shape[1])], 1)
        rows = valid.nonzero(as_tuple=True)
        logits = draft.logits(out[rows]).float()
        ce = F.cross_entropy(logits, labels[rows], reduction="none")
        count = valid.sum()
        # the global count: a device tensor, divided in fp32 as a Python float would be
        denom = (count.clamp(min=1).double() if denominators is None
                 else torch.as_tensor(denominators[k], device=ce.device).clamp(min=1.0).to(torch.float32))
        loss = loss + weights[k] * ce.sum() / denom
        right = torch.zeros_like(valid)
        right[rows] = logits.argmax(-1) == labels[rows]
        chain = right if chain is None else chain[:, :n] & right
        counts[k] = torch.stack([ce.detach().sum().double(), right.sum().double(), count.double(),
                                 chain.sum().double()])
    return loss, counts


def metrics_from_counts(counts_S4: torch.Tensor, weights: Sequence[float]) -> dict[str, float]:
    """Rates of summed counters: ``loss`` (as trained, the global per-step means), ``loss_k``,
    ``acc_k``, ``tau``, ``valid_tokens``."""
    c = counts_S4.double().cpu()
    out: dict[str, float] = {}
    loss = 0.0
    for k in range(c.shape[0]):
        n = c[k, 2].item()
        out[f"loss_{k}"] = c[k, 0].item() / n if n else math.nan
        out[f"acc_{k}"] = c[k, 1].item() / n if n else math.nan
        loss += weights[k] * c[k, 0].item() / max(n, 1.0)
    out["loss"] = loss
    n0 = c[0, 2].item()
    out["tau"] = 1.0 + c[:, 3].sum().item() / n0 if n0 else math.nan
    out["valid_tokens"] = c[:, 2].sum().item()
    return out
