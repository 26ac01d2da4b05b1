"""DFlash objective: anchors, block labels and weights, decay, loss value, metrics."""

import math

import pytest
import torch
import torch.nn.functional as F

from specforge.algorithms.dflash.loss import (
    block_loss,
    block_targets,
    build_block_ids,
    decay_weights,
    dflash_loss,
    metrics_from_counts,
    next_token_labels,
    sample_anchors,
)
from tests.helpers.dflash import tiny_draft


def test_decay_weights():
    # reference (SpecForge PR #463, speculators dflash_loss_decay): 0 for the anchor, exp(-(k-1)/gamma) after
    w = decay_weights(5, 2.0, torch.device("cpu"))
    torch.testing.assert_close(w, torch.tensor([0.0, 1.0, math.exp(-0.5), math.exp(-1.0), math.exp(-1.5)]))
    assert decay_weights(4, None, torch.device("cpu")).tolist() == [0.0, 1.0, 1.0, 1.0]
    assert decay_weights(4, 0.0, torch.device("cpu")).tolist() == [0.0, 1.0, 1.0, 1.0]


def test_anchors_only_in_the_loss_masked_region():
    T = 40
    lm = torch.zeros(3, T)
    lm[0, 5:12] = 1
    lm[0, 20:30] = 1
    lm[1, 33:40] = 1
    lm[2, 17] = 1  # a lone assistant token: no anchor (its next token is not assistant)
    candidates = [set(range(5, 11)) | set(range(20, 29)), set(range(33, 39)), set()]
    seen = [set(), set(), set()]
    for seed in range(60):
        anchors, keep = sample_anchors(lm, 8, torch.Generator().manual_seed(seed))
        assert anchors.shape == (3, 8)
        for b in range(3):
            kept = anchors[b][keep[b]].tolist()
            assert kept == sorted(set(kept)), "sorted, no duplicates"
            assert len(kept) == min(8, len(candidates[b]))
            assert set(kept) <= candidates[b]
            seen[b] |= set(kept)
    assert seen == candidates  # every candidate is drawn sometime: nothing is systematically left out
    anchors, keep = sample_anchors(lm[2:], 4)  # no two consecutive assistant tokens: one dropped anchor
    assert anchors.shape == (1, 1) and not keep.any()


def test_anchors_respect_documents():
    lm = torch.ones(1, 10)
    docs = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1, 1]])
    anchors, keep = sample_anchors(lm, 20, doc_ids_BT=docs)
    assert anchors[keep].tolist() == [0, 1, 2, 4, 5, 6, 7, 8]  # 3 -> 4 crosses documents


def test_block_targets_golden():
    ids = torch.arange(100, 110).view(1, 10)
    lm = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 1, 1, 1]])
    anchors, keep = torch.tensor([[2, 7, 3]]), torch.tensor([[True, True, False]])
    blocks = build_block_ids(ids, anchors, 4, mask_token_id=7)
    assert blocks.tolist() == [[[102, 7, 7, 7], [107, 7, 7, 7], [103, 7, 7, 7]]]
    labels, valid = block_targets(ids, lm, anchors, keep, 4)
    assert labels[0, 0].tolist() == [102, 103, 104, 105]
    assert valid.tolist() == [[[False, True, True, False],    # 5 leaves the assistant span: stop there
                               [False, True, True, False],    # 10 is past the end
                               [False, False, False, False]]]  # dropped block
    # a gap: the run stops at the first non-assistant token even if assistant tokens follow
    lm2 = torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1, 1, 1]])
    _, valid2 = block_targets(ids, lm2, torch.tensor([[0]]), torch.tensor([[True]]), 5)
    assert valid2.tolist() == [[[False, True, False, False, False]]]


def test_next_token_labels():
    ids = torch.tensor([[5, 6, 7, 8]])
    target_ids = torch.tensor([[16, 17, 18, 19]])  # target_ids[t]: the target's guess for x_{t+1}
    assert next_token_labels(ids).tolist() == [[5, 6, 7, 8]]
    assert next_token_labels(ids, target_ids).tolist() == [[5, 16, 17, 18]]


def test_block_loss_value_and_metrics():
    torch.manual_seed(0)
    B, N, K, V = 2, 3, 4, 11
    logits = torch.randn(B, N, K, V)
    labels = torch.randint(0, V, (B, N, K))
    labels[0, 0, 1:] = logits[0, 0, 1:].argmax(-1)  # block (0,0): all 3 drafts right
    labels[0, 1, 1] = logits[0, 1, 1].argmax(-1)  # block (0,1): first right, second wrong
    labels[0, 1, 2] = (logits[0, 1, 2].argmax(-1) + 1) % V
    valid = torch.ones(B, N, K, dtype=torch.bool)
    valid[..., 0] = False
    valid[1, 2, 2:] = False
    gamma = 3.0
    loss, counts = block_loss(lambda h: h, logits, labels, valid, gamma)
    # brute force
    num = den = 0.0
    for b in range(B):
        for n in range(N):
            for k in range(1, K):
                if valid[b, n, k]:
                    w = math.exp(-(k - 1) / gamma)
                    num += w * F.cross_entropy(logits[b, n, k:k + 1], labels[b, n, k:k + 1]).item()
                    den += w
    assert loss.item() == pytest.approx(num / den, rel=1e-6)
    m = metrics_from_counts(counts, gamma)
    assert m["loss"] == pytest.approx(loss.item(), rel=1e-6)
    assert m["valid_tokens"] == valid.sum().item()
    correct = (logits.argmax(-1) == labels) & valid
    for k in range(1, K):
        assert m[f"acc_{k}"] == pytest.approx(correct[..., k].sum().item() / valid[..., k].sum().item())
    runs = [int(correct[b, n, 1:].long().cumprod(0).sum()) for b in range(B) for n in range(N)]
    assert runs[0] == 3 and runs[1] == 1
    assert m["tau"] == pytest.approx(1 + sum(runs) / (B * N))


def test_chunked_loss_equals_unchunked():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 13, bias=False)
    hidden = torch.randn(2, 5, 4, 8, requires_grad=True)
    labels = torch.randint(0, 13, (2, 5, 4))
    valid = torch.rand(2, 5, 4) > 0.3
    valid[..., 0] = False
    l1, c1 = block_loss(head, hidden, labels, valid, 7.0)
    g1 = torch.autograd.grad(l1, [hidden, head.weight])
    l2, c2 = block_loss(head, hidden, labels, valid, 7.0, chunk_blocks=2)
    g2 = torch.autograd.grad(l2, [hidden, head.weight])
    torch.testing.assert_close(l1, l2)
    torch.testing.assert_close(c1, c2)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


def test_dflash_loss_end_to_end_trains():
    draft = tiny_draft(dtype=torch.float32)
    T = 32
    g = torch.Generator().manual_seed(3)
    ctx = torch.randn(2, T, draft.config.context_width, generator=g)
    ids = torch.randint(0, 96, (2, T), generator=g)
    lm = torch.zeros(2, T)
    lm[:, 8:] = 1
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(15):
        loss, counts = dflash_loss(draft, ctx, ids, lm, num_anchors=8, gamma=4.0,
                                   generator=torch.Generator().manual_seed(0))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]  # memorizes a fixed batch: gradients reach the right places
    assert counts[0].sum() == 0  # the anchor row never counts
