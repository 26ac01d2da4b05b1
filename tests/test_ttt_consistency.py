"""Train/inference consistency: the unrolled TTT forward == chain drafting with a KV cache."""

import pytest
import torch

from specforge.algorithms.eagle3.attention import (
    build_ttt_mask,
    ttt_attention_eager,
    ttt_attention_fast,
    ttt_attention_sdpa,
)
from specforge.algorithms.eagle3.loss import ttt_logits
from specforge.algorithms.eagle3.model import DraftKVCache, Eagle3Draft, Eagle3DraftConfig

V, N = 300, 100


def _draft(target_hidden=64, dtype=torch.float32):
    cfg = Eagle3DraftConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=V, draft_vocab_size=N, target_hidden_size=target_hidden,
        rope_theta=10000.0,
    )
    d = Eagle3Draft(cfg).to(dtype)
    d.reset_parameters(std=0.1)  # larger weights: the residual path must not hide attention bugs
    d.set_vocab(torch.sort(torch.randperm(V)[:N]).values - torch.arange(N))
    return d


@pytest.mark.parametrize("target_hidden", [64, 40])
def test_ttt_rows_equal_chain_drafting(target_hidden):
    torch.manual_seed(1)
    d = _draft(target_hidden).eval()
    B, T, L = 2, 24, 4
    ids = torch.randint(0, V, (B, T))
    aux = torch.randn(B, T, 3 * target_hidden)
    with torch.no_grad():
        train = ttt_logits(d, {"input_ids_BT": ids, "aux_hidden_BTKH": aux}, ttt_length=L)
        for t in range(T - 1):
            cache = DraftKVCache()
            pos = torch.arange(t + 1).expand(B, t + 1)
            hid, logits = d.forward_cached(ids[:, 1 : t + 2], d.project_aux(aux[:, : t + 1]), pos, cache)
            torch.testing.assert_close(logits[:, t], train[0][:, t], rtol=1e-5, atol=1e-5)
            for i in range(1, L):
                if t + 1 + i >= T:
                    break
                tok = ids[:, t + 1 + i : t + 2 + i]
                hid, logits = d.forward_cached(tok, hid[:, -1:], torch.full((B, 1), t + i), cache)
                torch.testing.assert_close(logits[:, 0], train[i][:, t], rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"step {i} row {t}: {m}")
            # rollback: crop to the prefill and redo step 1 -> same as before
            cache.crop(t + 1)
            assert len(cache) == t + 1


def test_forward_cached_accepts_raw_features_and_multi_token_decode():
    torch.manual_seed(2)
    d = _draft(40).eval()
    ids = torch.randint(0, V, (1, 10))
    aux = torch.randn(1, 10, 120)
    with torch.no_grad():
        h1, l1 = d.forward_cached(ids, aux, torch.arange(10)[None], DraftKVCache())
        c = DraftKVCache()
        h2a, l2a = d.forward_cached(ids[:, :6], aux[:, :6], torch.arange(6)[None], c)
        h2b, l2b = d.forward_cached(ids[:, 6:], aux[:, 6:], torch.arange(6, 10)[None], c)
    torch.testing.assert_close(torch.cat([l2a, l2b], 1), l1, rtol=1e-5, atol=1e-5)


def _qkv(B, Hq, Hk, T, D, n, T0=None, dtype=torch.float64):
    T0 = T0 or T
    q = torch.randn(B, Hq, T, D, dtype=dtype, requires_grad=True)
    ks = [torch.randn(B, Hk, T0, D, dtype=dtype, requires_grad=True)]
    vs = [torch.randn(B, Hk, T0, D, dtype=dtype, requires_grad=True)]
    for _ in range(n):
        ks.append(torch.randn(B, Hk, T, D, dtype=dtype, requires_grad=True))
        vs.append(torch.randn(B, Hk, T, D, dtype=dtype, requires_grad=True))
    return q, ks, vs


@pytest.mark.parametrize("n,q_offset,T0,chunk",
                         [(0, 0, None, 4), (3, 0, None, 4), (2, 5, 20, 3), (1, 0, 14, 128), (2, 0, None, 7)])
def test_fast_core_equals_eager_forward_and_backward(n, q_offset, T0, chunk):
    q, ks, vs = _qkv(2, 4, 2, 10, 8, n, T0)
    g = torch.randn(2, 4, 10, 8, dtype=torch.float64)
    ref = ttt_attention_eager(q, ks, vs, q_offset=q_offset)
    gref = torch.autograd.grad(ref, [q] + ks + vs, g)
    for fn in (lambda *a, **k: ttt_attention_fast(*a, chunk=chunk, **k), ttt_attention_sdpa):
        out = fn(q, ks, vs, q_offset=q_offset)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
        for a, b in zip(torch.autograd.grad(out, [q] + ks + vs, g), gref):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_fast_core_gradcheck():
    q, ks, vs = _qkv(1, 4, 2, 5, 4, 2)
    fn = lambda q, *kv: ttt_attention_fast(q, list(kv[:3]), list(kv[3:]), chunk=2)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, *ks, *vs))


def test_fast_core_under_bf16_autocast_close_to_fp32():
    q, ks, vs = _qkv(1, 4, 2, 32, 16, 3, dtype=torch.float32)
    ref = ttt_attention_eager(q, ks, vs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ttt_attention_fast(q, ks, vs, chunk=8)
        out.float().sum().backward()
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max() < 0.05
    assert all(torch.isfinite(t.grad).all() for t in [q] + ks + vs)


def test_mask_layout():
    m = build_ttt_mask(3, 5, 2, q_offset=2)
    assert m.shape == (3, 11)
    assert m[0, :5].tolist() == [True, True, True, False, False]
    assert m[2, :5].all()
    assert m[1, 5:].tolist() == [False, True, False, False, True, False]
