"""Sliding-window draft attention (EAGLE-3, ``draft.sliding_window``).

* the core: the fast path equals the eager reference with windows, offsets and TTT steps, and the
  eager reference equals a per-row softmax over the keys the rule names (a query at position p sees
  keys at positions > p - W; at TTT step n the query sits n positions after its row); without the
  window the same comparison fails (negative control);
* the draft: a change of the target's features W or more rows back changes no logit, every TTT
  step, and does change them under full attention (negative control); the unrolled TTT forward
  equals chain drafting (``forward_cached`` and the fast ``ChainDrafter``) with the window;
* config: a window that does not exceed the diagonal keys is one error naming the key; P-EAGLE
  refuses the key; ``config.json`` carries the window and a reload keeps it;
* engines: the vLLM export writes it where speculators' Eagle3 model (and vLLM's Llama layer) read it,
  and that model gives our step-0 logits, full attention there does not; at TTT steps >= 1 the two
  agree on the rows no window binds (speculators' trainer windows by row, we by position as served,
  see ``attention.py``); SGLang and llama.cpp, whose
  EAGLE-3 layers have no window, are refused with one line and nothing written.
Ring sequence parallelism with a window: ``tests/test_ring_attention.py``.
"""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specforge import export
from specforge.algorithms.eagle3 import export as eagle3_export
from specforge.algorithms.eagle3.attention import ttt_attention_eager, ttt_attention_fast
from specforge.algorithms.eagle3.loss import ttt_logits
from specforge.algorithms.eagle3.model import ChainDrafter, DraftKVCache, Eagle3Draft, Eagle3DraftConfig
from specforge.cli import run_cli
from specforge.config import load_config
from specforge.models.target import TargetModel, forward_aux
from specforge.training.checkpoint import save_checkpoint
from tests.helpers.export import load_speculators, step_logits
from tests.helpers.models import tiny_target

V, N, H, L = 320, 100, 48, 8


def _per_row(q, keys, values, window, q_offset=0):
    """Each row's softmax over the keys the rule names, one row at a time (fp64)."""
    B, Hq, T, D = q.shape
    G = Hq // keys[0].shape[1]
    n = len(keys) - 1
    out = torch.zeros_like(q)
    for t in range(T):
        p = q_offset + t  # the row's step-0 position; its query sits at p + n
        lo = 0 if window is None else max(0, p + n - window + 1)
        ks = [keys[0][:, :, lo : p + 1]] + [k[:, :, t : t + 1] for k in keys[1:]]
        vs = [values[0][:, :, lo : p + 1]] + [v[:, :, t : t + 1] for v in values[1:]]
        K = torch.cat(ks, 2).repeat_interleave(G, 1)
        Vv = torch.cat(vs, 2).repeat_interleave(G, 1)
        w = torch.softmax(q[:, :, t : t + 1] @ K.transpose(-1, -2) / math.sqrt(D), -1)
        out[:, :, t : t + 1] = w @ Vv
    return out


@pytest.mark.parametrize("window", [4, 9, 30])
@pytest.mark.parametrize("n, q_offset", [(0, 0), (2, 0), (3, 7)])
def test_the_core_follows_the_rule_and_fails_without_it(window, n, q_offset):
    g = torch.Generator().manual_seed(window * 10 + n)
    T, D = 21, 8
    r = lambda h, t: torch.randn(2, h, t, D, generator=g, dtype=torch.float64)  # noqa: E731
    q = r(4, T).requires_grad_()
    keys = [r(2, T + q_offset)] + [r(2, T) for _ in range(n)]
    values = [r(2, T + q_offset)] + [r(2, T) for _ in range(n)]
    want = _per_row(q, keys, values, window, q_offset)
    eager = ttt_attention_eager(q, keys, values, q_offset=q_offset, window=window)
    fast = ttt_attention_fast(q, keys, values, q_offset=q_offset, window=window, chunk=5)
    torch.testing.assert_close(eager, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(fast, want, rtol=1e-10, atol=1e-10)
    gq_fast, = torch.autograd.grad(fast.sum(), q)
    gq_eager, = torch.autograd.grad(eager.sum(), q)
    torch.testing.assert_close(gq_fast, gq_eager, rtol=1e-10, atol=1e-10)
    full = ttt_attention_fast(q, keys, values, q_offset=q_offset, chunk=5)
    if window < q_offset + T + n:  # the window cuts some row's keys: full attention must differ
        assert (full - want).abs().max() > 1e-3


def test_a_window_not_above_the_diagonal_keys_is_refused():
    q = torch.randn(1, 2, 5, 4)
    keys = [torch.randn(1, 2, 5, 4) for _ in range(3)]
    with pytest.raises(ValueError, match="sliding window 2 must exceed"):
        ttt_attention_fast(q, keys, keys, window=2)


def _draft(window, dtype=torch.float64):
    cfg = Eagle3DraftConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, vocab_size=V, draft_vocab_size=N, target_hidden_size=64,
                            sliding_window=window)
    torch.manual_seed(0)
    d = Eagle3Draft(cfg).to(dtype)
    d.reset_parameters(std=0.1)
    d.set_vocab(torch.sort(torch.randperm(V)[:N]).values - torch.arange(N))
    return d.eval()


@torch.no_grad()
def test_far_features_change_no_logit_inside_the_window():
    W, T, steps = 6, 24, 4
    ids = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(1))
    aux = torch.randn(1, T, 192, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    far = aux.clone()
    far[:, :3] += 1.0  # rows 0..2 changed
    for window, changes in ((W, False), (None, True)):
        d = _draft(window)
        a = ttt_logits(d, {"input_ids_BT": ids, "aux_hidden_BTKH": aux}, ttt_length=steps)
        b = ttt_logits(d, {"input_ids_BT": ids, "aux_hidden_BTKH": far}, ttt_length=steps)
        # step i of row t sees rows > t + i - W: rows t >= 3 + W - 1 never see rows 0..2
        diff = max((x[:, 2 + W :] - y[:, 2 + W :]).abs().max().item() for x, y in zip(a, b))
        assert (diff > 1e-3) == changes, (window, diff)
        if window is not None:  # rows inside the window do see the change
            assert (a[0][:, 3 : W + 2] - b[0][:, 3 : W + 2]).abs().max() > 1e-3


@torch.no_grad()
@pytest.mark.parametrize("window", [5, None])
def test_training_rows_equal_chain_drafting_with_a_window(window):
    d = _draft(window, torch.float32)
    B, T, steps = 1, 20, 4
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(3))
    aux = torch.randn(B, T, 192, generator=torch.Generator().manual_seed(4))
    train = ttt_logits(d, {"input_ids_BT": ids, "aux_hidden_BTKH": aux}, ttt_length=steps)
    for t in (3, 9, 14):
        cache = DraftKVCache()
        hid, logits = d.forward_cached(ids[:, 1 : t + 2], d.project_aux(aux[:, : t + 1]),
                                       torch.arange(t + 1)[None], cache)
        torch.testing.assert_close(logits[:, t], train[0][:, t], rtol=1e-5, atol=1e-5)
        for i in range(1, steps):
            tok = ids[:, t + 1 + i : t + 2 + i]
            hid, logits = d.forward_cached(tok, hid[:, -1:], torch.full((B, 1), t + i), cache)
            torch.testing.assert_close(logits[:, 0], train[i][:, t], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_the_fast_chain_drafter_slides_its_window():
    """A 12-row prefill and nine drafted tokens past a 5-token window: ``ChainDrafter`` equals
    ``forward_cached``; the same drafter told no window does not."""
    d = _draft(5, torch.float32)
    ids = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(5))
    aux = torch.randn(12, 192, generator=torch.Generator().manual_seed(6))
    worst = {}
    for window in (5, None):
        cache = DraftKVCache()
        h_ref, l_ref = d.forward_cached(ids[None], aux[None], torch.arange(12)[None], cache)
        fast = ChainDrafter(d)
        fast.window = window
        h, logits = fast.prefill(ids, aux)  # the multi-row path
        worst[window] = (logits - l_ref[0]).abs().max().item()
        hr, lr, hf, lf = h_ref[:, -1:], l_ref[0, -1], h[-1:], logits[-1]
        for i in range(9):
            tok = lf.argmax()
            hr, lr = d.forward_cached(fast.to_target(tok).view(1, 1), hr, torch.tensor([[12 + i]]), cache)
            hf, lf = fast.step(tok, hf)
            lr, lf = lr[0, -1], lf[0]
            worst[window] = max(worst[window], (lf - lr).abs().max().item())
    assert worst[5] < 1e-4 and worst[None] > 1e-3, worst


def test_config_key_checks_and_config_json_round_trip(tmp_path):
    with pytest.raises(ValueError, match=r"'draft\.sliding_window'=4 must exceed 6"):
        load_config(None, ["draft.sliding_window=4"])  # ttt_length 7: six drafted tokens before the last
    with pytest.raises(ValueError, match=r"draft\.sliding_window"):
        load_config(None, ["draft.sliding_window=0"])
    with pytest.raises(ValueError,
                       match=r"'draft\.sliding_window'=2048 applies to draft\.algorithm=eagle3, not peagle"):
        load_config(None, ["draft.algorithm=peagle", "draft.sliding_window=2048"])
    assert load_config(None, ["draft.sliding_window=2048"]).draft.sliding_window == 2048
    assert load_config(None, ["draft.algorithm=eagle31", "draft.sliding_window=2048"]).draft.sliding_window == 2048
    d = _draft(64)
    hf = d.config.to_hf_config()
    assert hf["sliding_window"] == 64 and hf["layer_types"] == ["sliding_attention"]
    assert Eagle3DraftConfig.from_hf_config(hf).sliding_window == 64
    assert Eagle3DraftConfig.from_hf_config(_draft(None).config.to_hf_config()).sliding_window is None
    assert Eagle3DraftConfig.from_hf_config({**hf, "layer_types": ["full_attention"]}).sliding_window is None


# ---------------------------------------------------------------- engines


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    tiny_target(num_layers=L).save_pretrained(path)
    return path


def _checkpoint(root: Path, target_dir: Path, window) -> Path:
    from transformers import LlamaForCausalLM

    target = LlamaForCausalLM.from_pretrained(target_dir)
    cfg = Eagle3DraftConfig(hidden_size=H, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=H // 4, vocab_size=V, draft_vocab_size=N, aux_layer_ids=[1, 3, 4],
                            torch_dtype="float32", rope_theta=5000.0, target_hidden_size=H, sliding_window=window)
    torch.manual_seed(1)
    draft = Eagle3Draft(cfg)
    draft.reset_parameters(std=0.1)
    draft.set_vocab(torch.sort(torch.randperm(V)[:N]).values - torch.arange(N))
    draft.init_embeddings_from_target(target.model.embed_tokens.weight)
    return save_checkpoint(root, 5, cfg.to_hf_config(), draft.export_state_dict(),
                           train_state={"step": 5, "identity": {}})


def _run(argv, capsys):
    code = run_cli(lambda: export.main([str(a) for a in argv]))
    out, err = capsys.readouterr()
    return code, out, err


@torch.no_grad()
def test_vllm_export_carries_the_window_and_speculators_gives_our_logits(tmp_path, target_dir, capsys):
    from transformers import LlamaForCausalLM

    from specforge.registry import load_draft

    W, T, steps = 7, 24, 3
    ckpt = _checkpoint(tmp_path / "ckpts", target_dir, W)
    code, out, err = _run(["--draft", ckpt, "--engine", "vllm", "--out", tmp_path / "vllm", "--target", target_dir],
                          capsys)
    assert code == 0, err
    tl = json.loads((tmp_path / "vllm" / "config.json").read_text())["transformer_layer_config"]
    assert tl["sliding_window"] == W and tl["layer_types"] == ["sliding_attention"]

    hf_target = LlamaForCausalLM.from_pretrained(target_dir).eval()
    target = TargetModel(model=hf_target, tokenizer=None, aux_layer_ids=[1, 3, 4], device=torch.device("cpu"))
    draft = load_draft(ckpt, target)
    assert draft.midlayer.self_attn.core.window == W
    ids = torch.randint(0, V, (1, T + 1), generator=torch.Generator().manual_seed(3))
    aux_ours = forward_aux(target, ids[:, :T])[0]
    hidden = hf_target(ids[:, :T], output_hidden_states=True).hidden_states

    def theirs_with(window=None):
        model = load_speculators(tmp_path / "vllm", window=window)
        aux = torch.cat([hidden[k] for k in model.target_layer_ids], dim=-1)
        return step_logits(draft, model, ids, aux_ours, aux, V, steps)

    pairs = theirs_with()  # the window as exported
    torch.testing.assert_close(pairs[0][1], pairs[0][0], rtol=1e-5, atol=1e-5, msg="TTT step 0")
    for i in range(1, steps):  # rows whose window binds at no step <= i: both conventions agree
        ours, theirs = pairs[i]
        torch.testing.assert_close(theirs[: W - i], ours[: W - i], rtol=1e-5, atol=1e-5, msg=f"TTT step {i}")
    ours, theirs = theirs_with("full")[0]  # negative control: served with full attention
    assert (ours - theirs).abs().max() > 1e-3


@pytest.mark.parametrize("engine", ["sglang", "llama.cpp"])
def test_engines_without_a_window_are_refused_with_one_line(tmp_path, target_dir, capsys, engine):
    _checkpoint(tmp_path / "ckpts", target_dir, 64)
    capsys.readouterr()  # the target's load messages
    out = tmp_path / "out"
    code, stdout, err = _run(["--draft", tmp_path / "ckpts", "--engine", engine, "--out", out,
                              "--target", target_dir], capsys)
    assert code == 1 and stdout == "", err
    assert len(err.splitlines()) == 1 and err.startswith(f"error: --engine {engine}: ") and "sliding_window=64" in err
    assert "vllm" in err and not out.exists()
    assert load_file(tmp_path / "ckpts" / "step-000005" / "model.safetensors")  # the checkpoint untouched
    with pytest.raises(ValueError, match="sliding_window=64"):
        eagle3_export.llamacpp_config(json.loads((tmp_path / "ckpts" / "step-000005" / "config.json").read_text()),
                                      {"num_hidden_layers": L})
