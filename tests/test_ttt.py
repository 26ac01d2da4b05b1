"""TTT loss: golden loss-mask rows, equality with the straightforward reference, gradients,
frozen embedding, training progress, metrics, bf16 autocast."""

import pytest
import torch

from specforge.algorithms.eagle3.loss import (
    metrics_from_counts,
    teacher_weight_from_target,
    ttt_loss,
    ttt_loss_reference,
    valid_rows,
)
from specforge.algorithms.eagle3.model import Eagle3Draft, Eagle3DraftConfig
from tests.helpers.ttt import HT, N, V
from tests.helpers.ttt import tiny_draft as _draft
from tests.helpers.ttt import ttt_batch as _batch


def test_golden_valid_rows_at_assistant_span_boundary():
    # positions:      0  1  2  3  4  5  6  7  8  9
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 0, 0, 1, 1]])
    tgt = torch.zeros(1, 10, dtype=torch.long)
    t2d = torch.ones(5, dtype=torch.bool)
    v = valid_rows(mask, tgt, t2d, 3)
    # step i, row t predicts x_{t+2+i}: counts iff mask[t+2+i] == 1 (and t+2+i < T)
    assert v[0, 0].nonzero().flatten().tolist() == [1, 2, 3, 6, 7]
    assert v[1, 0].nonzero().flatten().tolist() == [0, 1, 2, 5, 6]
    assert v[2, 0].nonzero().flatten().tolist() == [0, 1, 4, 5]
    # the upstream #885 bug (unshifted mask at later steps) would count row 3 at step 1
    # (mask[3] == 1 but it predicts x_6, a user token): it must not count
    assert not v[1, 0, 3]
    # target argmax outside the draft vocab: the row does not count
    t2d_missing = t2d.clone()
    t2d_missing[4] = False
    tgt2 = tgt.clone()
    tgt2[0, 4] = 4  # target argmax at position 4 predicts x_5 -> row 3 of step 0, row 2 of step 1
    v2 = valid_rows(mask, tgt2, t2d_missing, 3)
    assert not v2[0, 0, 3] and not v2[1, 0, 2] and not v2[2, 0, 1]
    assert v2[0, 0, 2] and v2[1, 0, 1]


def test_fast_loss_equals_reference_fp64_and_metrics():
    torch.manual_seed(3)
    d = _draft(torch.float64)
    b = _batch(dtype=torch.float64, draft=d)
    W = torch.randn(N, HT, dtype=torch.float64)
    params = [p for p in d.parameters() if p.requires_grad]
    l1, c1 = ttt_loss(d, b, W, ttt_length=4)
    g1 = torch.autograd.grad(l1, params)
    l2, c2 = ttt_loss_reference(d, b, W, ttt_length=4)
    g2 = torch.autograd.grad(l2, params)
    torch.testing.assert_close(l1, l2, rtol=1e-12, atol=1e-12)
    for a, c in zip(g1, g2):
        torch.testing.assert_close(a, c, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(c1, c2, rtol=1e-9, atol=1e-12)  # every counter of every step
    m1, m2 = metrics_from_counts(c1, 0.8), metrics_from_counts(c2, 0.8)
    for k in m1:
        assert m1[k] == pytest.approx(m2[k], rel=1e-9, abs=1e-12), k
    v = valid_rows(b["loss_mask_BT"], b["target_ids_BT"], d.t2d, 4)
    for i in range(4):
        assert c1[i, 0] == int(v[i].sum())
        assert isinstance(m1[f"acc_{i}"], float)
    assert m1["loss"] == pytest.approx(l1.item(), rel=1e-12)  # normalized by the step-0 valid count
    assert m1["valid_tokens"] == c1[0, 0] > 0
    # explicit global normalizer
    l3, _ = ttt_loss(d, b, W, ttt_length=4, num_valid_global=2 * c1[0, 0].item())
    torch.testing.assert_close(l3 * 2, l1)


def test_gradcheck_tiny_fp64():
    torch.manual_seed(4)
    cfg = Eagle3DraftConfig(hidden_size=8, intermediate_size=12, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=4, vocab_size=20, draft_vocab_size=10, target_hidden_size=6)
    d = Eagle3Draft(cfg).double()
    d.reset_parameters(std=0.3)
    B, T = 1, 7
    b = {"input_ids_BT": torch.randint(0, 20, (B, T)), "loss_mask_BT": torch.ones(B, T, dtype=torch.long),
         "target_ids_BT": torch.randint(0, 10, (B, T)),
         "last_hidden_BTH": torch.randn(B, T, 6, dtype=torch.float64)}
    W = torch.randn(10, 6, dtype=torch.float64)
    aux = torch.randn(B, T, 18, dtype=torch.float64, requires_grad=True)
    wq = d.midlayer.self_attn.q_proj.weight
    wk = d.midlayer.self_attn.k_proj.weight

    assert torch.autograd.gradcheck(lambda a: ttt_loss(d, dict(b, aux_hidden_BTKH=a), W, ttt_length=3)[0], (aux,))
    # parameter gradients: compare with finite differences on a few q/k entries
    loss = ttt_loss(d, dict(b, aux_hidden_BTKH=aux.detach()), W, ttt_length=3)[0]
    gq, gk = torch.autograd.grad(loss, [wq, wk])
    eps = 1e-6
    for w, g in ((wq, gq), (wk, gk)):
        for idx in [(0, 0), (1, 9), (3, 15)]:
            with torch.no_grad():
                w[idx] += eps
                lp = ttt_loss(d, dict(b, aux_hidden_BTKH=aux.detach()), W, ttt_length=3)[0]
                w[idx] -= 2 * eps
                lm = ttt_loss(d, dict(b, aux_hidden_BTKH=aux.detach()), W, ttt_length=3)[0]
                w[idx] += eps
            assert (lp - lm).item() / (2 * eps) == pytest.approx(g[idx].item(), rel=1e-5, abs=1e-8)


def test_frozen_embedding_no_grad_and_loss_decreases():
    torch.manual_seed(5)
    d = _draft(target_hidden=64)
    b = _batch(draft=d)
    b["aux_hidden_BTKH"] = torch.randn(2, 24, 192)
    b["last_hidden_BTH"] = torch.randn(2, 24, 64)
    W = torch.randn(N, 64)
    assert not d.embed_tokens.weight.requires_grad
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(8):
        loss, m = ttt_loss(d, b, W, ttt_length=3)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert d.embed_tokens.weight.grad is None
    assert losses[-1] < 0.8 * losses[0], losses
    assert d.fc.weight.grad is not None


def test_bf16_autocast_runs_and_matches_fp32_roughly():
    torch.manual_seed(6)
    d = _draft()
    b = _batch(draft=d)
    W = torch.randn(N, HT)
    ref, _ = ttt_loss_reference(d, b, W, ttt_length=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, m = ttt_loss(d, b, W, ttt_length=3)
    loss.backward()
    assert loss.dtype == torch.float32
    assert abs(loss.item() - ref.item()) < 0.05 * abs(ref.item())
    assert all(torch.isfinite(p.grad).all() for p in d.parameters() if p.requires_grad)


def test_nothing_counted_gives_zero_loss_with_graph():
    d = _draft()
    b = _batch(draft=d)
    b["loss_mask_BT"].zero_()
    loss, counts = ttt_loss(d, b, torch.randn(N, HT), ttt_length=3)
    loss.backward()
    m = metrics_from_counts(counts, 0.8)
    assert loss.item() == 0.0 and m["valid_tokens"] == 0 and m["tau"] == 1.0
    # every trainable parameter still gets a (zero) gradient: all ranks reduce the same set
    assert all(p.grad is not None and not p.grad.any() for p in d.parameters() if p.requires_grad)


def test_teacher_weight_from_target():
    d = _draft()
    Wt = torch.randn(V, HT)
    tw = teacher_weight_from_target(Wt, d.d2t)
    assert torch.equal(tw, Wt[d.draft_to_target_ids()])


def test_hot_loops_chunk_by_device_and_the_chunk_never_changes_the_result():
    """The fused loss and the fast TTT core loop over row chunks: cache-sized on the CPU, large on a
    GPU (fewer launches); a chunk only regroups rows, so every chunk gives the same numbers."""
    import torch

    from specforge.algorithms.eagle3.attention import CHUNK_CPU, CHUNK_GPU, ttt_attention_eager, ttt_attention_fast
    from specforge.algorithms.eagle3.loss import LOSS_CHUNK_BYTES, LOSS_CHUNK_CPU, linear_soft_cross_entropy, loss_chunk

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)  # a device object needs no GPU
    assert loss_chunk(cpu, 32000) == LOSS_CHUNK_CPU
    rows = loss_chunk(gpu, 32000)
    assert rows * 32000 * 4 <= LOSS_CHUNK_BYTES < (rows + 1) * 32000 * 4  # one chunk's fp32 logits
    assert loss_chunk(gpu, 10**8) == LOSS_CHUNK_CPU  # never below the CPU chunk
    assert CHUNK_GPU > CHUNK_CPU

    torch.manual_seed(0)
    h, W = torch.randn(150, 16, dtype=torch.float64), torch.randn(40, 16, dtype=torch.float64)
    teacher, tidx = torch.softmax(torch.randn(150, 40, dtype=torch.float64), -1), torch.arange(150)
    default = linear_soft_cross_entropy(h, W, teacher, tidx)
    for chunk in (7, 150, 1000):
        for a, b in zip(linear_soft_cross_entropy(h, W, teacher, tidx, chunk=chunk), default):
            torch.testing.assert_close(a, b)
    q = torch.randn(1, 4, 300, 8, dtype=torch.float64)
    k, v = ([torch.randn(1, 2, 300, 8, dtype=torch.float64) for _ in range(2)],
            [torch.randn(1, 2, 300, 8, dtype=torch.float64) for _ in range(2)])
    ref = ttt_attention_eager(q, k, v)
    for chunk in (None, 37, CHUNK_GPU):
        torch.testing.assert_close(ttt_attention_fast(q, k, v, chunk=chunk), ref)
