"""The ``flex`` TTT attention core (``flex_attention`` over the concatenated keys, a block mask from
``ttt_mask_mod``) against the eager reference on the CPU.

torch 2.13 refuses flex_attention's backward on the CPU with a guard (``_validate_device``); the
dense reference math under it runs, so the ``cpu_flex_backward`` fixture lifts the guard to check
our block mask and gradients here (the compiled CUDA kernels are the GPU suite's: test_gpu.py).

* forward and every gradient (q, each key and value) equal the eager reference in fp64 for 0..3
  diagonal steps, GQA and MHA, ``q_offset`` with ``T0 > q_offset + T`` (the all-gather SP
  reference), a sliding window (with the TTT-step shift), and ``T`` not a multiple of 128; bf16
  within a loose tolerance. Control: a mask_mod whose diagonal is off by one row fails the check.
* a whole ``ttt_loss`` with the flex core equals the fast core's loss, counters and gradients.
* without the fixture the CPU backward is refused with one error naming ``draft.attention``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module

from specforge.algorithms.eagle3 import attention
from specforge.algorithms.eagle3.attention import TTTAttentionCore, ttt_attention_eager, ttt_attention_flex
from specforge.algorithms.eagle3.loss import ttt_loss
from specforge.algorithms.eagle3.model import Eagle3Draft, Eagle3DraftConfig


@pytest.fixture
def cpu_flex_backward(monkeypatch):
    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)


def _inputs(B, Hq, Hkv, T, T0, n, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).requires_grad_()  # noqa: E731
    q = rnd(B, Hq, T, D)
    keys = [rnd(B, Hkv, T0, D)] + [rnd(B, Hkv, T, D) for _ in range(n)]
    values = [rnd(B, Hkv, T0, D)] + [rnd(B, Hkv, T, D) for _ in range(n)]
    return q, keys, values


def _check_against_eager(q, keys, values, q_offset=0, window=None, atol=1e-10, rtol=1e-8):
    """Forward and the gradients of q and every key/value: flex vs eager (raises AssertionError)."""
    leaves = [q, *keys, *values]
    out = ttt_attention_flex(q, keys, values, q_offset=q_offset, window=window)
    ref = ttt_attention_eager(q, keys, values, q_offset=q_offset, window=window)
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64).to(ref.dtype)
    got = torch.autograd.grad(out, leaves, dout)
    want = torch.autograd.grad(ref, leaves, dout)
    for name, a, b in zip(["q"] + [f"k{j}" for j in range(len(keys))] + [f"v{j}" for j in range(len(values))],
                          got, want):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m, name=name: f"grad {name}: {m}")


CASES = [  # B, Hq, Hkv, T, T0 - T, n, q_offset, window
    pytest.param(2, 4, 2, 40, 0, 0, 0, None, id="gqa-step0"),
    pytest.param(1, 4, 2, 40, 0, 1, 0, None, id="gqa-n1"),
    pytest.param(1, 4, 4, 33, 0, 2, 0, None, id="mha-n2"),
    pytest.param(2, 4, 2, 150, 0, 3, 0, None, id="gqa-n3-T150"),
    pytest.param(1, 4, 2, 24, 40, 2, 16, None, id="q_offset-T0-longer"),
    pytest.param(1, 4, 2, 150, 0, 3, 0, 20, id="window-n3"),
    pytest.param(1, 2, 1, 24, 30, 2, 10, 8, id="window-q_offset"),
]


@pytest.mark.parametrize("B,Hq,Hkv,T,extra,n,q_offset,window", CASES)
def test_flex_equals_eager_fp64_forward_and_gradients(cpu_flex_backward, B, Hq, Hkv, T, extra, n, q_offset, window):
    q, keys, values = _inputs(B, Hq, Hkv, T, T + extra, n, 8, torch.float64)
    _check_against_eager(q, keys, values, q_offset=q_offset, window=window)


def test_flex_bf16_within_a_loose_tolerance(cpu_flex_backward):
    q, keys, values = _inputs(1, 4, 2, 130, 130, 2, 16, torch.bfloat16)
    _check_against_eager(q, keys, values, atol=3e-2, rtol=3e-2)


def test_a_diagonal_off_by_one_row_is_caught(cpu_flex_backward, monkeypatch):
    """Control: the comparison detects a wrong mask_mod (each diagonal key seen by the next row)."""
    right = attention.ttt_mask_mod

    def wrong(T, T0, q_offset=0, window=None, num_diag=0):
        ok = right(T, T0, q_offset, window, num_diag)
        return lambda b, h, q, kv: torch.where(kv >= T0, (kv - T0) % T == q - 1, ok(b, h, q, kv))

    q, keys, values = _inputs(1, 4, 2, 40, 40, 2, 8, torch.float64)
    _check_against_eager(q, keys, values)  # the real mask passes
    monkeypatch.setattr(attention, "ttt_mask_mod", wrong)
    attention._block_mask.cache_clear()
    try:
        with pytest.raises(AssertionError):
            _check_against_eager(q, keys, values)
    finally:
        attention._block_mask.cache_clear()


def test_flex_backward_on_the_cpu_is_refused_naming_the_key():
    q, keys, values = _inputs(1, 4, 2, 16, 16, 1, 8, torch.float32)
    qd, kd, vd = q.detach(), [k.detach() for k in keys], [v.detach() for v in values]
    # inputs that need no gradient: the forward runs on the CPU (torch's dense reference)
    torch.testing.assert_close(ttt_attention_flex(qd, kd, vd), ttt_attention_eager(qd, kd, vd))
    with pytest.raises(ValueError, match="'draft.attention'='flex'.*draft.attention=auto"):
        ttt_attention_flex(q, keys, values)
    assert TTTAttentionCore("flex").impl == "flex"


# ----------------------------------------------------------------------------- the whole loss

V, N, HT = 300, 100, 48


def _draft(impl: str) -> Eagle3Draft:
    cfg = Eagle3DraftConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, vocab_size=V, draft_vocab_size=N, target_hidden_size=HT, attention=impl)
    torch.manual_seed(5)
    d = Eagle3Draft(cfg).double()
    d.reset_parameters(std=0.1)
    d.set_vocab(torch.sort(torch.randperm(V)[:N]).values - torch.arange(N))
    return d


def _batch(B=2, T=24):
    g = torch.Generator().manual_seed(6)
    mask = torch.zeros(B, T, dtype=torch.long)
    mask[:, 5:12] = 1
    mask[:, 15:21] = 1
    mask[1, 18:] = 0
    return {"input_ids_BT": torch.randint(0, V, (B, T), generator=g), "loss_mask_BT": mask,
            "target_ids_BT": torch.randint(0, V, (B, T), generator=g),
            "aux_hidden_BTKH": torch.randn(B, T, 3 * HT, generator=g, dtype=torch.float64),
            "last_hidden_BTH": torch.randn(B, T, HT, generator=g, dtype=torch.float64)}


def test_ttt_loss_with_flex_equals_the_fast_core(cpu_flex_backward):
    b, W = _batch(), torch.randn(N, HT, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    results = {}
    for impl in ("fast", "flex"):
        d = _draft(impl)
        loss, counts = ttt_loss(d, b, W, ttt_length=4)
        params = [p for p in d.parameters() if p.requires_grad]
        results[impl] = (loss, counts, torch.autograd.grad(loss, params))
    (l1, c1, g1), (l2, c2, g2) = results["fast"], results["flex"]
    torch.testing.assert_close(l2, l1, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(c2, c1, rtol=1e-9, atol=1e-12)
    for a, c in zip(g2, g1):
        torch.testing.assert_close(a, c, rtol=1e-9, atol=1e-12)


def test_the_config_accepts_flex_and_refuses_it_with_ring_attention():
    from specforge.config import load_config

    assert load_config(None, ["draft.attention=flex"]).draft.attention == "flex"
    assert load_config(None, ["draft.attention=flex", "parallel.sp_ulysses=2"]).draft.attention == "flex"
    with pytest.raises(ValueError, match=r"'draft\.attention'='flex' does not apply with parallel\.sp_ring=2"):
        load_config(None, ["draft.attention=flex", "parallel.sp_ring=2"])


# ----------------------------------------------------------------------------- the memory model


def _saved_bytes(draft, batch, W, ttt_length) -> int:
    """Bytes autograd keeps for one ttt_loss (each storage once, parameters left out)."""
    params = {p.untyped_storage().data_ptr() for p in draft.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ttt_loss(draft, batch, W, ttt_length=ttt_length)
    return sum(seen.values())


def test_the_memory_model_counts_what_the_flex_core_keeps(cpu_flex_backward):
    """fp32 on the CPU: the model's saved activations (+ the fused q/k/v weight) within 20% (the memory
    tests' tolerance; measured 0.5%) of what autograd keeps, for both cores; flex keeps less."""
    from specforge import memory
    from specforge.algorithms.eagle3.memory import Eagle3Dims, eagle3_step

    B, T, L, Vt, Nd, Ht = 2, 96, 4, 500, 200, 64
    measured, predicted = {}, {}
    for impl in ("fast", "flex"):
        cfg = Eagle3DraftConfig(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=32, vocab_size=Vt, draft_vocab_size=Nd, target_hidden_size=Ht, attention=impl)
        torch.manual_seed(0)
        d = Eagle3Draft(cfg)
        b = {"input_ids_BT": torch.randint(0, Vt, (B, T)), "loss_mask_BT": torch.ones(B, T, dtype=torch.long),
             "target_ids_BT": d.draft_to_target_ids()[torch.randint(0, Nd, (B, T))],
             "aux_hidden_BTKH": torch.randn(B, T, 3 * Ht), "last_hidden_BTH": torch.randn(B, T, Ht)}
        measured[impl] = _saved_bytes(d, b, torch.randn(Nd, Ht), L)
        step = eagle3_step(Eagle3Dims.of(cfg), memory.SeqShape(B, T, 1, 1, L), memory.StepPrecision(compute=4),
                           attention.CHUNK_CPU, 64, None, impl)
        predicted[impl] = sum(t.nbytes for t in step["forward"]
                              if t.name.startswith("activations") or "fused q/k/v" in t.name)
        assert abs(predicted[impl] / measured[impl] - 1) < 0.20, (impl, predicted[impl], measured[impl])
    assert measured["flex"] < measured["fast"] and predicted["flex"] < predicted["fast"]


def test_flex_is_predicted_below_sdpa_at_8b_shapes_and_4096_tokens():
    from types import SimpleNamespace

    from specforge import memory
    from specforge.algorithms.eagle3.algorithm import ALGORITHM
    from specforge.config import load_config

    draft = SimpleNamespace(config=Eagle3DraftConfig(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        vocab_size=128256, draft_vocab_size=32000, target_hidden_size=4096))
    shape, p = memory.SeqShape(1, 4096, 1, 1, 7), memory.StepPrecision(compute=2)
    peak, attn = {}, {}
    for impl in ("sdpa", "flex", "auto"):
        step = ALGORITHM.bind(load_config(None, [f"draft.attention={impl}"])).memory_step(draft, shape, p, gpu=True)
        peak[impl] = max(sum(t.nbytes for t in terms) for terms in step.values())
        attn[impl] = sum(t.nbytes for t in step["forward"] if "probabilities" in t.name or "attention core" in t.name)
        probs = [t.nbytes for t in step["forward"] if "probabilities" in t.name]
        assert (impl == "sdpa") == bool(probs), (impl, probs)  # flex (auto on a GPU) keeps no probabilities
    # sdpa: SDPA for step 0, the fast core's T^2/2 probabilities for steps 1..6 (3.4 GiB);
    # flex: O(T) per head (cat(keys), out, lse): the whole step's peak drops by about a fifth
    assert attn["flex"] < attn["sdpa"] / 4 and peak["flex"] < 0.85 * peak["sdpa"], (attn, peak)
    assert peak["auto"] == peak["flex"]  # auto is flex on a GPU (unpacked rows)


def test_flex_rounds_a_steps_rows_to_whole_blocks_so_shapes_recur(cpu_flex_backward, monkeypatch):
    """The flex core asks for whole 128-row blocks (at most T): two batches whose last counted rows
    differ inside one block build one block mask per step shape, not one per batch, and the loss
    equals the fast core's. Control: without the rounding (row_multiple 1) the second batch builds
    its own masks."""
    from specforge.algorithms.eagle3 import loss as loss_module

    T = 300
    W = torch.randn(N, HT, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    base = _batch(B=2, T=T)
    base["target_ids_BT"] = _draft("fast").draft_to_target_ids()[base["target_ids_BT"] % N]
    b200, b180 = (dict(base, loss_mask_BT=torch.ones(2, T, dtype=torch.long)) for _ in range(2))
    b200["loss_mask_BT"][:, 200:] = 0  # last counted row of step i: 197 - i
    b180["loss_mask_BT"][:, 180:] = 0  # 177 - i: both inside the block of rows 128..255
    spans = []
    real = loss_module._step_rows
    monkeypatch.setattr(loss_module, "_step_rows", lambda *a: spans.append((out := real(*a))[0]) or out)

    def builds(multiple):
        d = _draft("flex")
        if multiple is not None:
            monkeypatch.setattr(d, "row_multiple", lambda device_type: multiple)
        attention._block_mask.cache_clear()
        for b in (b200, b180):
            ttt_loss(d, b, W, ttt_length=3)
        return attention._block_mask.cache_info().misses

    assert builds(None) == 3  # one mask per step (0, 1 or 2 diagonal key sets), shared by both batches
    assert spans[-2:] == [[256, 256, 256]] * 2
    assert builds(1) == 6  # control: unrounded spans (198, 197, 196 and 178, 177, 176) build anew
    assert spans[-2:] == [[198, 197, 196], [178, 177, 176]]
    for b in (b200, b180):
        fast, flex = (ttt_loss(_draft(impl), b, W, ttt_length=3) for impl in ("fast", "flex"))
        torch.testing.assert_close(flex[0], fast[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(flex[1], fast[1], rtol=1e-9, atol=1e-12)
