"""DFlash draft: the block attention mask, training forward == inference forward, the reference model."""

import pytest
import torch

from specforge.algorithms.dflash.loss import build_block_ids, sample_anchors
from specforge.algorithms.dflash.model import ContextCache, build_block_mask
from tests.helpers.dflash import tiny_draft

# ---------------------------------------------------------------- the mask, element by element

def test_block_mask_literal():
    # T=5 context positions, K=2, anchors 1 and 3. Columns: p0..p4 | block0 r0 r1 | block1 r0 r1.
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 1, 1, 0, 0],  # block 0 (anchor 1): context p < 1, its own block
        [1, 0, 0, 0, 0, 1, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 1, 1],  # block 1 (anchor 3): context p < 3, its own block
        [1, 1, 1, 0, 0, 0, 0, 1, 1],
    ], dtype=torch.bool)
    mask = build_block_mask(torch.tensor([[1, 3]]), None, T=5, K=2)
    assert mask.shape == (1, 1, 4, 9)
    assert torch.equal(mask[0, 0], expected)


def check_mask(mask, anchors, keep, T, K, docs=None):
    """The three rules, asserted for every (query, key) pair from a separate loop formulation."""
    B, N = anchors.shape
    for b in range(B):
        for n in range(N):
            a = int(anchors[b, n])
            for k in range(K):
                q = n * K + k
                for p in range(T):  # context: causal up to (excluding) the anchor, same document
                    want = p < a and bool(keep[b, n]) and (docs is None or docs[b, p] == docs[b, a])
                    assert bool(mask[b, 0, q, p]) == want, f"context b={b} block={n} row={k} key={p}"
                for m in range(N):  # blocks: bidirectional inside, isolated from each other
                    for j in range(K):
                        assert bool(mask[b, 0, q, T + m * K + j]) == (m == n), f"block {n} row {k} -> block {m} row {j}"


def test_block_mask_rules_and_negative_controls():
    T, K = 12, 3
    anchors = torch.tensor([[0, 4, 9], [2, 3, 0]])
    keep = torch.tensor([[True, True, True], [True, True, False]])
    docs = torch.tensor([[0] * 12, [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1]])
    for d in (None, docs):
        mask = build_block_mask(anchors, keep, T, K, d)
        check_mask(mask, anchors, keep, T, K, d)
    mask = build_block_mask(anchors, keep, T, K)
    # negative controls: each classic bug must be caught by the checker
    leak_anchor = mask.clone()
    leak_anchor[0, 0, K * 1, 4] = True  # block 1 sees the anchor's own target feature
    causal_block = mask.clone()
    causal_block[0, 0, K * 1, T + K * 1 + 2] = False  # row 0 cannot see row 2 of its block
    cross_block = mask.clone()
    cross_block[0, 0, K * 2, T + 0] = True  # block 2 sees block 0
    wrong_doc = build_block_mask(anchors, keep, T, K)  # no document ids where there are two docs
    for bad, d in ((leak_anchor, None), (causal_block, None), (cross_block, None), (wrong_doc, docs)):
        with pytest.raises(AssertionError):
            check_mask(bad, anchors, keep, T, K, d)


# ---------------------------------------------------------------- training forward == inference forward

def _features(B, T, draft, seed=1):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randn(B, T, draft.config.context_width, generator=g, dtype=torch.float64)
    ids = torch.randint(0, draft.config.vocab_size - 1, (B, T), generator=g)
    return ctx, ids


def test_training_forward_equals_inference_per_block():
    draft = tiny_draft()
    B, T, K = 2, 24, draft.config.block_size
    ctx, ids = _features(B, T, draft)
    anchors = torch.tensor([[0, 5, 11, 22], [3, 7, 8, 0]])  # first/last possible, overlapping windows
    keep = torch.tensor([[True] * 4, [True, True, True, False]])
    block_ids = build_block_ids(ids, anchors, K, draft.config.mask_token_id)
    hidden = draft(ctx, block_ids, anchors, keep)
    assert hidden.shape == (B, 4, K, draft.config.hidden_size)
    for b in range(B):
        for n in range(4):
            if not keep[b, n]:
                continue
            a = int(anchors[b, n])
            cache = ContextCache()
            if a:  # built in two pieces: the cache must not care
                cache.extend(draft, ctx[b:b + 1, :a // 2]).extend(draft, ctx[b:b + 1, a // 2:a])
            alone = draft.forward_block(cache, block_ids[b:b + 1, n])
            torch.testing.assert_close(hidden[b, n], alone[0], rtol=0, atol=1e-10)
    # control: the same block with one more context position differs
    a = int(anchors[0, 1])
    more = draft.forward_block(ContextCache().extend(draft, ctx[:1, :a + 1]), block_ids[:1, 1])
    assert (more[0] - hidden[0, 1]).abs().max() > 1e-3


def test_training_forward_packed_documents():
    draft = tiny_draft()
    T, K = 20, draft.config.block_size
    ctx, ids = _features(1, T, draft, seed=2)
    docs = torch.tensor([[0] * 8 + [1] * 12])
    pos = torch.tensor([list(range(8)) + list(range(12))])
    anchors = torch.tensor([[5, 9, 15]])
    block_ids = build_block_ids(ids, anchors, K, draft.config.mask_token_id)
    hidden = draft(ctx, block_ids, anchors, None, pos, docs)
    for n, (start, a) in enumerate([(0, 5), (8, 9), (8, 15)]):
        cache = ContextCache().extend(draft, ctx[:, start:a])  # the document alone, positions from 0
        alone = draft.forward_block(cache, block_ids[:, n])
        torch.testing.assert_close(hidden[0, n], alone[0], rtol=0, atol=1e-10)


def test_dropped_blocks_are_finite_and_trainable_params_only():
    draft = tiny_draft(dtype=torch.float32)
    ctx, ids = _features(2, 16, draft)
    lm = torch.ones(2, 16)
    lm[1, :14] = 0  # row 1 has a single candidate anchor: its other blocks are dropped
    anchors, keep = sample_anchors(lm, 4, torch.Generator().manual_seed(0))
    assert keep[1].sum() == 1 and keep[0].all()
    block_ids = build_block_ids(ids, anchors, draft.config.block_size, draft.config.mask_token_id)
    hidden = draft(ctx.float(), block_ids, anchors, keep)
    assert torch.isfinite(hidden).all()
    draft.logits(hidden).logsumexp(-1).sum().backward()
    assert draft.embed_tokens.weight.grad is None and draft.lm_head.weight.grad is None
    assert all(torch.isfinite(p.grad).all() for p in draft.parameters() if p.requires_grad)


# ---------------------------------------------------------------- the reference model (z-lab's dflash 0.1.0)

def _reference(draft):
    dflash_model = pytest.importorskip(
        "dflash.model", reason="z-lab's reference is not installed: pip install --no-deps dflash==0.1.0")
    from transformers import Qwen3Config

    from specforge.algorithms.dflash.export import to_hf_config

    ref = dflash_model.DFlashDraftModel(Qwen3Config(**to_hf_config(draft.config, torch.float32))).float().eval()
    ours = draft.export_state_dict()
    assert set(ref.state_dict()) == set(ours)  # same tensor names: our export IS the reference format
    ref.load_state_dict(ours, strict=True)
    assert ref.target_layer_ids == draft.config.target_layer_ids
    assert ref.block_size == draft.config.block_size and ref.mask_token_id == draft.config.mask_token_id
    return ref


def test_matches_reference_model_inference():
    draft = tiny_draft(dtype=torch.float32).eval()
    ref = _reference(draft)
    ctx, ids = _features(2, 13, draft)
    ctx = ctx.float()
    block = build_block_ids(ids, torch.tensor([[12], [12]]), draft.config.block_size, draft.config.mask_token_id)[:, 0]
    C, K = 12, draft.config.block_size
    with torch.no_grad():
        want = ref(position_ids=torch.arange(C + K).expand(2, -1), noise_embedding=draft.embed_tokens(block),
                   target_hidden=ctx[:, :C])
        got = draft.forward_block(ContextCache().extend(draft, ctx[:, :C]), block)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(draft.logits(got), ref.compute_logits(want, draft.lm_head), rtol=1e-5, atol=1e-5)


def test_matches_reference_model_training_mask():
    draft = tiny_draft(dtype=torch.float32).eval()
    ref = _reference(draft)
    T, K = 20, draft.config.block_size
    ctx, ids = _features(1, T, draft)
    ctx = ctx.float()
    anchors = torch.tensor([[2, 9, 14]])
    block_ids = build_block_ids(ids, anchors, K, draft.config.mask_token_id)
    block_pos = (anchors.unsqueeze(-1) + torch.arange(K)).view(1, -1)
    with torch.no_grad():
        want = ref(position_ids=torch.cat([torch.arange(T).view(1, -1), block_pos], 1),
                   noise_embedding=draft.embed_tokens(block_ids.view(1, -1)), target_hidden=ctx,
                   attention_mask=build_block_mask(anchors, None, T, K))
        got = draft(ctx, block_ids, anchors)
    torch.testing.assert_close(got.view(1, -1, got.shape[-1]), want, rtol=1e-5, atol=1e-5)
