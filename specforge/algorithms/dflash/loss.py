"""The DFlash training objective: random anchors, blocks, decayed block cross-entropy, metrics.

Legend: B batch, T tokens, N blocks (anchors) per row, K block size, H hidden, V target vocab.

What the public implementations do, and what we do:

* Anchors (SpecForge PR #463, ``OnlineDFlashModel``): up to ``num_anchors`` positions per row,
  drawn uniformly without replacement among positions ``a`` where token ``a`` AND token ``a+1``
  are loss-masked (assistant) tokens; sorted. Rows with fewer candidates keep fewer blocks
  (``keep`` False for the rest). A block is ``[x_a, mask, ..., mask]``. Ours: per sample (a packed
  row's samples each draw up to ``num_anchors``, a and a+1 in the sample), the draw a hash of the
  sample (:func:`anchor_keys`), so a sample draws the same anchors packed or padded.
* Labels: block row k (k >= 1) of anchor a predicts the token at ``a + k``. The reference trains
  hard cross-entropy against the DATA token ``x_{a+k}`` (its data are target-generated answers);
  speculators trains KL against the target's distribution. :func:`next_token_labels` gives either
  the data tokens or the target's greedy prediction for each position (``target_ids[p-1]``).
  Row 0 (the anchor) is never trained.
* Which rows count: row k counts iff ``a + k < T``, the block is kept and every token
  ``x_{a+1} .. x_{a+k}`` is an assistant token (of the anchor's document). The reference counts
  any assistant token in the window, also past a gap (a user turn in between); a draft never has
  to cross a turn boundary, so we stop at the first gap.
* Weights: ``exp(-(k - 1) / gamma)`` for k >= 1, 0 for the anchor (reference gamma: 7 for K=16,
  5 for K=10, 4 for K=8); loss = weighted sum / sum of weights of the counted rows. Or D-PACE
  (``draft.loss_weighting=dpace``, :func:`dpace_weights`): row k weighs the expected accepted drafts
  it leads to, from the draft's own (smoothed, detached) probability of each row's label; loss =
  weighted sum / counted rows (speculators' normalization; the weights are known only after the forward).
* Metrics travel as raw sums ``counts[K, 4]`` (columns :data:`COUNTERS`), reduced once, turned into
  rates by :func:`metrics_from_counts`: per-position accuracy, and the simulated acceptance
  length of a block (1 + leading run of correct drafts, the run stopping at the first wrong or
  uncounted row: speculators' convention, which keeps the correlation between positions).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["COUNTERS", "anchor_keys", "positions_in_sample", "sample_anchors", "local_anchors", "build_block_ids",
           "next_token_labels", "block_targets", "decay_weights", "dpace_weights", "loss_weights", "counted_weight",
           "block_loss", "dflash_loss", "metrics_from_counts"]

COUNTERS = ("loss_sum", "valid", "correct", "accepted")  # per block position k


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 values in ``[0, 2^32)`` (every product stays below 2^59: exact
    and alike on every device)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def positions_in_sample(doc_ids_BT: Optional[torch.Tensor], like_BT: torch.Tensor) -> torch.Tensor:
    """``[B, T]``: each position's index within its sample (``doc_ids_BT`` None: the row is one)."""
    idx = torch.arange(like_BT.shape[1], device=like_BT.device).expand(like_BT.shape)
    if doc_ids_BT is None:
        return idx
    new = torch.ones_like(doc_ids_BT, dtype=torch.bool)
    new[:, 1:] = doc_ids_BT[:, 1:] != doc_ids_BT[:, :-1]
    return idx - torch.where(new, idx, 0).cummax(dim=1).values


def anchor_keys(input_ids_BT: torch.Tensor, loss_mask_BT: torch.Tensor, seed: int,
                doc_ids_BT: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Random keys ``[B, T]`` (int64 in ``[0, 2^32)``) for :func:`sample_anchors`: a hash of ``seed``,
    the sample's loss-masked tokens at their positions within the sample, and the position within
    the sample. So a sample draws the same keys wherever it lies (alone in a padded row, packed
    after others, its row gathered by a ring's ranks) and whatever pads it (padding has mask 0)."""
    local = positions_in_sample(doc_ids_BT, input_ids_BT)
    doc_ids_BT = torch.zeros_like(input_ids_BT) if doc_ids_BT is None else doc_ids_BT.long()
    terms = input_ids_BT.long() * loss_mask_BT.long() * (local + 1)
    content = torch.zeros_like(terms).scatter_add_(1, doc_ids_BT, terms).gather(1, doc_ids_BT) & _M32
    sample = _mix32(_mix32(content) ^ (seed & _M32))
    return _mix32(_mix32(sample ^ local))


def sample_anchors(loss_mask_BT: torch.Tensor, num_anchors: int, generator: Optional[torch.Generator] = None,
                   doc_ids_BT: Optional[torch.Tensor] = None,
                   keys_BT: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random anchors ``[B, N]`` (sorted, 0 where dropped) and ``keep [B, N]``: up to ``num_anchors``
    per sample (a row, or each of a packed row's ``doc_ids_BT``), uniformly among its
    candidates; N = the most any row has (at least 1: a batch without two consecutive assistant
    tokens gets one dropped anchor per row). ``keys_BT`` (:func:`anchor_keys`): the lowest keys
    win; else keys drawn from ``generator``. Right padding (loss mask 0) changes nothing."""
    m = loss_mask_BT.bool()
    valid = m[:, :-1] & m[:, 1:]
    doc_ids_BT = torch.zeros_like(m, dtype=torch.long) if doc_ids_BT is None else doc_ids_BT.long()
    valid &= doc_ids_BT[:, :-1] == doc_ids_BT[:, 1:]
    B, S = valid.shape
    if keys_BT is None:
        # drawn position-major: position t of row b takes draw t*B + b of the stream, whatever T is, so
        # right padding moves no anchor; 24-bit floats times 2^32 are exact integers
        keys = (torch.rand((S, B), generator=generator, device=valid.device).T * 2**32).long()
    else:
        keys = keys_BT[:, :S]
    # one sort: by sample, then key (invalid last), ties by position; the first num_anchors of each sample win
    order, perm = (torch.where(valid, keys, 1 << 32) + doc_ids_BT[:, :S] * (1 << 33)).sort(dim=1, stable=True)
    sorted_doc = order >> 33
    rank = torch.arange(S, device=valid.device) - torch.searchsorted(sorted_doc, sorted_doc)
    chosen = torch.zeros_like(valid).scatter(1, perm, (rank < num_anchors) & valid.gather(1, perm))
    # at least one (dropped) anchor: a micro-batch with nothing to train still runs the forward,
    # so every FSDP rank runs the same collectives
    width = max(1, int(chosen.sum(1).max()) if chosen.numel() else 0)
    anchors = torch.where(chosen, torch.arange(S, device=valid.device), S).sort(dim=1).values[:, :width]
    keep = anchors < S
    return torch.where(keep, anchors, 0), keep


def local_anchors(anchors_BN: torch.Tensor, keep_BN: torch.Tensor, start: int,
                  end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The anchors of ``sample_anchors`` that lie in ``[start, end)`` (a sequence-parallel rank's
    context rows), as indices into that range: ``[B, N']`` sorted, 0 where dropped, and ``keep``;
    N' = the most any row keeps (at least 1, as ``sample_anchors``)."""
    mine = keep_BN & (anchors_BN >= start) & (anchors_BN < end)
    width = max(1, int(mine.sum(1).max()) if mine.numel() else 0)
    sentinel = end - start
    local = torch.where(mine, anchors_BN - start, sentinel).sort(dim=1).values[:, :width]
    keep = local < sentinel
    return torch.where(keep, local, 0), keep


def build_block_ids(input_ids_BT: torch.Tensor, anchors_BN: torch.Tensor, block_size: int,
                    mask_token_id: int) -> torch.Tensor:
    """``[B, N, K]``: the anchor's token, then ``K - 1`` mask tokens."""
    B, N = anchors_BN.shape
    ids = torch.full((B, N, block_size), mask_token_id, dtype=input_ids_BT.dtype, device=input_ids_BT.device)
    ids[..., 0] = input_ids_BT.gather(1, anchors_BN)
    return ids


def next_token_labels(input_ids_BT: torch.Tensor, target_ids_BT: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The token the draft should produce at each position p.

    Without ``target_ids_BT``: the data token ``x_p`` (the reference). With the target's argmax at
    every position (``target_ids[t]`` = its greedy prediction of ``x_{t+1}``): ``target_ids[p-1]``,
    what greedy verification will accept when the data are not the target's own answers.
    """
    if target_ids_BT is None:
        return input_ids_BT
    labels = input_ids_BT.clone()
    labels[:, 1:] = target_ids_BT[:, :-1]
    return labels


def block_targets(labels_BT: torch.Tensor, loss_mask_BT: torch.Tensor, anchors_BN: torch.Tensor,
                  keep_BN: torch.Tensor, block_size: int,
                  doc_ids_BT: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels ``[B, N, K]`` and which rows count (see the module docstring)."""
    B, T = labels_BT.shape
    k = torch.arange(block_size, device=labels_BT.device)
    idx = anchors_BN.unsqueeze(-1) + k
    inside = idx < T
    flat = idx.clamp(max=T - 1).reshape(B, -1)
    labels = labels_BT.gather(1, flat).view_as(idx)
    ok = inside & loss_mask_BT.bool().gather(1, flat).view_as(idx)
    if doc_ids_BT is not None:
        same_doc = doc_ids_BT.gather(1, flat).view_as(idx) == doc_ids_BT.gather(1, anchors_BN).unsqueeze(-1)
        ok &= same_doc
    ok[..., 0] = True  # the anchor itself is not a prediction; it must not cut the run
    valid = ok.long().cumprod(-1).bool() & keep_BN.unsqueeze(-1) & (k > 0)
    return labels, valid


def decay_weights(block_size: int, gamma: Optional[float], device: torch.device) -> torch.Tensor:
    """``[K]`` on ``device`` (that of the data it will meet: no default, as a CPU-made weight times a
    CUDA mask stops a GPU run): 0 for the anchor, ``exp(-(k-1)/gamma)`` after it (1
    everywhere if gamma is None or <= 0)."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    w = torch.exp(-(k - 1).clamp(min=0) / gamma) if gamma and gamma > 0 else torch.ones_like(k)
    return w * (k > 0)


def dpace_weights(conf_BNK: torch.Tensor, valid_BNK: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE's position weights ``[B, N, K]`` (no gradient), as speculators' ``dpace_loss_decay``: the
    smoothed confidence ``s_k = (1 - alpha) conf_k + alpha`` of each counted row (1 elsewhere), its prefix
    product ``P_j = prod_{i <= j} s_i`` (the chance the drafts up to j are all accepted), and row k's
    weight ``sum_{j >= k} P_j`` over counted rows j: the accepted drafts that row k's being right leads to.
    ``conf_BNK``: the draft's probability of each row's label (``exp(-CE)``); ``alpha`` in (0, 1]
    (1: every weight the count of counted rows from k on)."""
    with torch.no_grad():
        v = valid_BNK.bool()
        conf = conf_BNK.to(torch.promote_types(conf_BNK.dtype, torch.float32))
        smooth = torch.where(v, (1.0 - alpha) * conf + alpha, 1.0)
        reach = smooth.cumprod(-1) * v
        return reach.flip(-1).cumsum(-1).flip(-1) * v


def loss_weights(valid_BNK: torch.Tensor, gamma: Optional[float], normalizer: Optional[torch.Tensor],
                 dpace_alpha: Optional[float] = None, label_p_BNK: Optional[torch.Tensor] = None,
                 first_row: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, normalizer)`` of a block loss's rows (``[..., K]``, block rows ``first_row ..``): the decay
    (``decay_weights``) and the sum of the counted rows' weights, or with ``dpace_alpha`` D-PACE's
    weights from ``label_p_BNK`` (the draft's probability of each row's label) and the counted rows'
    number. A given ``normalizer`` (the global one) is kept."""
    if normalizer is None:
        normalizer = counted_weight(valid_BNK, gamma, dpace_alpha is not None, first_row)
    if dpace_alpha is None:
        return decay_weights(valid_BNK.shape[-1] + first_row, gamma, valid_BNK.device)[first_row:], normalizer
    return dpace_weights(label_p_BNK, valid_BNK, dpace_alpha), normalizer


def counted_weight(valid_BNK: torch.Tensor, gamma: Optional[float], dpace: bool, first_row: int = 0) -> torch.Tensor:
    """A block loss's denominator over its counted rows ``valid_BNK`` (block rows ``first_row ..``): the sum
    of their decay weights, or under D-PACE (whose weights only the forward gives) their number. The
    algorithms' ``normalizer`` hook sums it over a step's micro-batches before any forward."""
    if dpace:
        return valid_BNK.float().sum()
    return (valid_BNK * decay_weights(valid_BNK.shape[-1] + first_row, gamma, valid_BNK.device)[first_row:]).sum()


def _chunk_terms(logits_fn, hidden, labels, valid):
    logits = logits_fn(hidden).float()
    ce = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="none").view_as(labels)
    ce = ce * valid
    correct = (logits.argmax(-1) == labels) & valid
    return ce, correct


def chunked(terms: Callable, head, args: tuple, *extra, chunk_blocks: int = 0) -> tuple:
    """``terms(head, *args, *extra)``, a tuple of per-row tensors ``[B, N, ...]``; with ``0 < chunk_blocks
    < N`` over that many blocks at a time (``args`` split on their block dim; a None stays None), each
    chunk recomputed in backward, and the pieces concatenated."""
    N = args[0].shape[1]
    if not chunk_blocks or chunk_blocks >= N:
        return terms(head, *args, *extra)
    n = math.ceil(N / chunk_blocks)
    pieces = zip(*[a.split(chunk_blocks, 1) if a is not None else [None] * n for a in args])
    parts = [checkpoint(terms, head, *p, *extra, use_reentrant=False) for p in pieces]
    return tuple(torch.cat(t, 1) for t in zip(*parts))



def block_loss(logits_fn: Callable[[torch.Tensor], torch.Tensor], hidden_BNKH: torch.Tensor,
               labels_BNK: torch.Tensor, valid_BNK: torch.Tensor, gamma: Optional[float],
               normalizer: Optional[torch.Tensor] = None, chunk_blocks: int = 0, dpace_alpha: Optional[float] = None):
    """Decayed (or, with ``dpace_alpha``, D-PACE-weighted) block cross-entropy -> ``(loss, counts[K, 4])``.

    ``normalizer``: the global sum of weights (D-PACE: of counted rows) over every micro-batch and rank
    (so gradients add up); default this call's own. ``chunk_blocks > 0`` computes the logits that many
    blocks at a time and recomputes them in backward (never holds ``N*K x V`` logits at once).
    """
    K = labels_BNK.shape[-1]
    ce, correct = chunked(_chunk_terms, logits_fn, (hidden_BNKH, labels_BNK, valid_BNK), chunk_blocks=chunk_blocks)
    w, normalizer = loss_weights(valid_BNK, gamma, normalizer, dpace_alpha, torch.exp(-ce.detach()))
    loss = (ce * w).sum() / normalizer.clamp_min(1e-12)
    with torch.no_grad():
        run = correct.clone()
        run[..., 0] = True
        accepted = run.long().cumprod(-1).bool() & (torch.arange(K, device=run.device) > 0)
        counts = torch.stack([ce.detach().flatten(0, 1).sum(0), valid_BNK.flatten(0, 1).sum(0).float(),
                              correct.flatten(0, 1).sum(0).float(), accepted.flatten(0, 1).sum(0).float()], dim=1)
    return loss, counts


def dflash_loss(draft, ctx_BTF: torch.Tensor, input_ids_BT: torch.Tensor, loss_mask_BT: torch.Tensor, *,
                labels_BT: Optional[torch.Tensor] = None, num_anchors: int = 512, gamma: Optional[float] = 7.0,
                generator: Optional[torch.Generator] = None, position_ids_BT: Optional[torch.Tensor] = None,
                doc_ids_BT: Optional[torch.Tensor] = None, normalizer: Optional[torch.Tensor] = None,
                chunk_blocks: int = 0):
    """One micro-batch: anchors -> blocks -> the draft's forward -> ``(loss, counts[K, 4])``."""
    cfg = draft.config
    anchors, keep = sample_anchors(loss_mask_BT, num_anchors, generator, doc_ids_BT)
    block_ids = build_block_ids(input_ids_BT, anchors, cfg.block_size, cfg.mask_token_id)
    hidden = draft(ctx_BTF, block_ids, anchors, keep, position_ids_BT, doc_ids_BT)
    labels = input_ids_BT if labels_BT is None else labels_BT
    labels_BNK, valid = block_targets(labels, loss_mask_BT, anchors, keep, cfg.block_size, doc_ids_BT)
    return block_loss(draft.logits, hidden, labels_BNK, valid, gamma, normalizer, chunk_blocks)


def metrics_from_counts(counts_K4: torch.Tensor, gamma: Optional[float]) -> dict[str, float]:
    """Rates from summed counts: ``loss`` (as trained), ``loss_k``, ``acc_k``, ``tau``, ``valid_tokens``."""
    c = counts_K4.double().cpu()
    K = c.shape[0]
    w = decay_weights(K, gamma, c.device).double()
    out: dict[str, float] = {}
    for k in range(1, K):
        n = c[k, 1].item()
        out[f"loss_{k}"] = c[k, 0].item() / n if n else math.nan
        out[f"acc_{k}"] = c[k, 2].item() / n if n else math.nan
    denom = (w * c[:, 1]).sum().item()
    out["loss"] = (w * c[:, 0]).sum().item() / denom if denom else math.nan
    blocks = c[1, 1].item()
    out["tau"] = 1.0 + c[1:, 3].sum().item() / blocks if blocks else math.nan
    out["valid_tokens"] = c[:, 1].sum().item()
    return out
