"""Block proposal for speculative decoding, and a small greedy reference loop (tests, examples).

Legend: B batch, T tokens, K block size, F = len(target_layer_ids) * H.

One round (z-lab's ``dflash_generate``, greedy): the target has run tokens ``0 .. s-1`` and
predicted ``x_s`` (the anchor, not yet run by the target). The draft, given the target's features
of ``0 .. s-1`` (:class:`~.model.ContextCache`), drafts ``x_{s+1} .. x_{s+K-1}`` in ONE forward of
``[x_s, mask, ...]``. The target verifies ``[x_s, drafts]`` in one forward; the accepted drafts plus
the target's next token (the bonus) are appended, the bonus is the next anchor, and the features of
the anchor and the accepted drafts extend the context.

Rows of a round's block (:func:`block_rows`). The rows of a block attend each other both ways, so a
block's length changes what every row drafts. Training always runs whole blocks of ``block_size``
rows, and so does the eval by default: a round runs the whole block and keeps its first k drafts.
vLLM (``1 + num_speculative_tokens`` query rows) and llama.cpp (``n_max + 1`` rows, ``n_max`` for
anchor-first DSpark) run a block as long as the drafts asked for: served with k below the drafts of
one block, they run a shorter block than the draft was trained on. ``as_served=True`` proposes that
way (the engine-parity probes); at k = drafts per block both are the same block.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .model import ContextCache, DFlashDraft

__all__ = ["DFlashProposer", "block_rows", "propose_block", "context_features", "spec_decode_greedy",
           "greedy_decode"]


@torch.no_grad()
def propose_block(draft: DFlashDraft, cache: ContextCache, anchor_ids_B: torch.Tensor,
                  block_size: Optional[int] = None) -> torch.Tensor:
    """Greedy drafts ``[B, K-1]`` for the tokens after ``anchor_ids_B`` (which sit at position ``cache.length``)."""
    K = block_size or draft.config.block_size
    block = torch.full((anchor_ids_B.shape[0], K), draft.config.mask_token_id,
                       dtype=torch.long, device=anchor_ids_B.device)
    block[:, 0] = anchor_ids_B
    hidden = draft.forward_block(cache, block)
    return draft.logits(hidden[:, 1:]).argmax(-1)


def block_rows(config, k: int, as_served: bool = False) -> int:
    """Rows of the block a round that wants ``k`` drafts runs: the whole trained block (``block_size``),
    or, ``as_served``, what vLLM and llama.cpp run for ``k`` drafts: one row per draft, plus the anchor's
    row where the anchor drafts nothing (``shift`` 0; DFlash has no ``shift``), clamped to one block."""
    if not as_served:
        return config.block_size
    shift = getattr(config, "shift", 0)
    return min(k, config.block_size - 1 + shift) + 1 - shift


def context_features(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """``[B, T, F]`` from HF ``output_hidden_states`` (index 0 = embeddings, so layer i is ``i + 1``)."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


@torch.no_grad()
def greedy_decode(target, input_ids_1T: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Plain greedy decoding, one full target forward per token (the losslessness reference)."""
    ids = input_ids_1T
    for _ in range(max_new_tokens):
        nxt = target(ids).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


@torch.no_grad()
def spec_decode_greedy(target, draft: DFlashDraft, input_ids_1T: torch.Tensor, max_new_tokens: int,
                       block_size: Optional[int] = None,
                       proposer: Optional[Callable[[ContextCache, torch.Tensor], torch.Tensor]] = None):
    """Greedy block speculative decoding with a HF causal LM target (batch 1, no target KV cache).

    Returns ``(ids [1, T + max_new_tokens], accepted)``, ``accepted[r]`` = tokens the round added
    (accepted drafts + the bonus). Lossless: ``ids`` equals :func:`greedy_decode`.
    ``proposer(cache, anchor_ids_B) -> drafts [B, K-1]`` replaces the draft (tests).
    """
    layer_ids = draft.config.target_layer_ids
    propose = proposer or (lambda cache, anchor: propose_block(draft, cache, anchor, block_size))
    out = target(input_ids_1T, output_hidden_states=True)
    cache = ContextCache().extend(draft, context_features(out.hidden_states, layer_ids))
    ids = torch.cat([input_ids_1T, out.logits[:, -1:].argmax(-1)], dim=1)
    T0, accepted = input_ids_1T.shape[1], []
    while ids.shape[1] - T0 < max_new_tokens:
        s = ids.shape[1] - 1  # the anchor's position
        drafts = propose(cache, ids[:, -1])
        out = target(torch.cat([ids, drafts], dim=1), output_hidden_states=True)
        verdict = out.logits[:, s:].argmax(-1)  # the target's token for positions s+1 ..
        n = int((drafts == verdict[:, :-1]).long().cumprod(-1).sum())
        ids = torch.cat([ids, drafts[:, :n], verdict[:, n:n + 1]], dim=1)
        cache.extend(draft, context_features(out.hidden_states, layer_ids)[:, s:s + n + 1])
        accepted.append(n + 1)
    return ids[:, :T0 + max_new_tokens], accepted


class DFlashProposer:
    """``specforge.eval``'s proposer for a DFlash draft: one block per round, in ONE draft forward.

    The eval hands it the target's aux features of every token the target has run (the prompt at
    ``start``, then the verified anchor + accepted drafts at ``accept``): exactly the context the
    draft reads. The last token produced (the target's own, not yet run by it) is the anchor.
    ``propose(k)`` drafts ``min(k, block_size - 1)`` tokens (k = the eval's chain: a block of K drafts
    K - 1): the first k of the whole block's, as trained; ``as_served``: from a block of k + 1 rows, as
    vLLM and llama.cpp run it (:func:`block_rows`).
    """

    def __init__(self, draft: DFlashDraft, dtype: Optional[torch.dtype] = None, as_served: bool = False):
        self.draft = draft if dtype is None else draft.to(dtype)
        self.dtype = next(draft.parameters()).dtype
        self.cache, self.anchor = ContextCache(), 0
        self.as_served = as_served

    def rows(self, k: int) -> int:
        return block_rows(self.draft.config, k, self.as_served)

    @torch.no_grad()
    def start(self, ids: list[int], aux_TH: torch.Tensor) -> None:
        self.cache = ContextCache().extend(self.draft, aux_TH.to(self.dtype).unsqueeze(0))
        self.anchor = ids[-1]

    @torch.no_grad()
    def propose(self, k: int, costs=None) -> list[int]:
        anchor = torch.tensor([self.anchor], device=self.draft.fc.weight.device)
        return propose_block(self.draft, self.cache, anchor, self.rows(k))[0, :k].tolist()

    @torch.no_grad()
    def accept(self, new_tokens: list[int], aux_TH: torch.Tensor) -> None:
        self.cache.extend(self.draft, aux_TH.to(self.dtype).unsqueeze(0))
        self.anchor = new_tokens[-1]
