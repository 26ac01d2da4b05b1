"""DFlash's sliding window (``draft.sliding_window`` = W): block row k of a block anchored at a sees
the context positions p < a with (a + k) - p < W, the row's own position minus the key's, which is
what every engine that reads a window means by it (``specforge/algorithms/dflash/export.py``).

* Far context: a change of the features W or more positions before a block's rows leaves its
  logits as they were with the window, and changes them with full attention (the negative control),
  in the training forward and in drafting (``forward_block`` over a ``ContextCache``).
* Per row, not per block: with one layer, a change at p = a - W + 1 moves row 0 only (row 1 is one
  position further on); a window over [a - W, a) for every row would move them all.
* The training forward and drafting agree under the window (fp64, 1e-10).
* z-lab's reference model (the PyPI package ``dflash``, ``dflash.model.DFlashDraftModel``) loads the
  export and computes our drafted block (fp32, 1e-5); without ``is_causal: false`` in the config it
  makes its sliding layers causal and computes another one (the negative control).
* Exports: vLLM gets the folder with the window keys; SGLang is refused in one ``error:`` line
  naming the key and the engine (it would serve the sliding layers as causal attention); a config
  with mixed or causal sliding layers is refused on load.
* Config: a window below 1, not an int, or below the block size is one error naming
  ``draft.sliding_window``; DSpark refuses the key.
(Ring sequence parallelism with a window: tests/test_dflash_sp.py; llama.cpp: tests/test_engine_dflash.py.)
"""

import json

import pytest
import torch

from tests.helpers.dflash import tiny_draft

W, K, T = 6, 4, 24  # window, block size (tiny_draft's), context length


def _drafts(**kw):
    """(windowed, full) tiny drafts with the same weights."""
    win, full = tiny_draft(torch.float64, sliding_window=W, **kw), tiny_draft(torch.float64, **kw)
    assert all(torch.equal(a, b) for a, b in zip(win.state_dict().values(), full.state_dict().values()))
    return win, full


def _inputs(F, anchors=(4, 12, 20)):
    g = torch.Generator().manual_seed(0)
    ctx = torch.randn(1, T, F, generator=g, dtype=torch.float64)
    a = torch.tensor([anchors])
    ids = torch.randint(0, 96, (1, len(anchors), K), generator=g)
    ids[..., 1:] = 96  # [anchor token, mask, ...]
    return ctx, a, ids


def _moved(x, y):
    return (x - y).abs().amax(dim=-1)  # per row


def test_a_far_context_change_moves_the_logits_only_without_a_window():
    from specforge.algorithms.dflash.model import ContextCache

    win, full = _drafts()
    ctx, a, ids = _inputs(win.config.context_width)
    far = ctx.clone()
    far[:, 2] += 1.0  # 10 and 18 positions before the blocks at 12 and 20; 2 before the one at 4
    for d, windowed in ((win, True), (full, False)):
        moved = _moved(d.logits(d(far, ids, a)), d.logits(d(ctx, ids, a)))  # [1, N, K]
        assert moved[0, 0].min() > 1e-3  # the block at 4 sees position 2 either way
        if windowed:
            assert moved[0, 1:].max() == 0, moved
        else:  # the control: full attention sees it
            assert moved[0, 1:].min() > 1e-3, moved
        # drafting the block at 20 after the cached context
        blocks = [d.logits(d.forward_block(ContextCache().extend(d, c[:, :20]), ids[:, 2])) for c in (ctx, far)]
        assert (_moved(*blocks).max() == 0) == windowed


def test_the_window_counts_from_each_rows_own_position():
    win, _ = _drafts(num_hidden_layers=1, target_layer_ids=[2])
    ctx, a, ids = _inputs(win.config.context_width, anchors=(12,))
    edge = ctx.clone()
    edge[:, 12 - W + 1] += 1.0  # the farthest position row 0 sees; row 1 (one position on) does not
    moved = _moved(win(edge, ids, a), win(ctx, ids, a))[0, 0]
    assert moved[0] > 1e-3 and moved[1:].max() == 0, moved


def test_training_forward_equals_drafting_under_the_window():
    from specforge.algorithms.dflash.model import ContextCache

    win, _ = _drafts()
    ctx, a, ids = _inputs(win.config.context_width, anchors=(3, 9, 17, 20))
    hidden = win(ctx, ids, a)
    for n, anchor in enumerate(a[0].tolist()):
        got = win.forward_block(ContextCache().extend(win, ctx[:, :anchor]), ids[:, n])
        torch.testing.assert_close(got, hidden[:, n], rtol=0, atol=1e-10)


def _zlab_hidden(folder, ctx, block_embeds, L):
    from dflash.model import DFlashDraftModel

    ref = DFlashDraftModel.from_pretrained(str(folder), attn_implementation="sdpa").float().eval()
    with torch.no_grad():
        return ref(position_ids=torch.arange(L + K)[None], noise_embedding=block_embeds, target_hidden=ctx[:, :L])


def test_zlab_reference_computes_our_windowed_block(tmp_path):
    from specforge.algorithms.dflash.export import save_dflash
    from specforge.algorithms.dflash.model import ContextCache

    win = tiny_draft(torch.float32, sliding_window=W)
    folder = save_dflash(win, tmp_path / "win", torch.float32)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["sliding_window"] == W and cfg["layer_types"] == ["sliding_attention"] * 2
    assert cfg["use_sliding_window"] is True and cfg["is_causal"] is False
    ctx, a, ids = _inputs(win.config.context_width)
    ctx, L = ctx.float(), 20
    with torch.no_grad():
        ours = win.forward_block(ContextCache().extend(win, ctx[:, :L]), ids[:, 2])
        theirs = _zlab_hidden(folder, ctx, win.embed_tokens(ids[:, 2]), L)
        plain = tiny_draft(torch.float32)
        full = plain.forward_block(ContextCache().extend(plain, ctx[:, :L]), ids[:, 2])
    err = (theirs - ours).abs().max().item()
    print(f"z-lab reference vs ours, window {W}: max abs err {err:.2e}")
    assert err < 1e-5
    assert (full - ours).abs().max() > 1e-3  # the window matters here
    causal = tmp_path / "causal"
    causal.mkdir()
    del cfg["is_causal"]  # z-lab's default for a sliding layer: causal
    (causal / "config.json").write_text(json.dumps(cfg))
    (causal / "model.safetensors").symlink_to(folder / "model.safetensors")
    assert (_zlab_hidden(causal, ctx, win.embed_tokens(ids[:, 2]), L) - ours).abs().max() > 1e-3


def test_exports_write_the_window_where_the_engine_reads_it(tmp_path, capsys):
    from specforge.algorithms.dflash.export import export, from_hf_config, llamacpp_config, save_dflash, to_hf_config
    from specforge.cli import run_cli
    from specforge.seam import ExportRequest

    win = tiny_draft(torch.float32, sliding_window=W)
    folder = save_dflash(win, tmp_path / "win", torch.float32)

    def run(engine, draft, out):  # the export hook as python -m specforge.export runs it (into a new folder)
        out.mkdir()
        return run_cli(lambda: print(export(engine, draft, out, ExportRequest(out=out, target="t"))))

    assert run("vllm", folder, tmp_path / "v") == 0
    assert json.loads((tmp_path / "v" / "config.json").read_text())["sliding_window"] == W
    assert run("sglang", folder, tmp_path / "s") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: draft.sliding_window=6: SGLang serves"), err
    assert not any((tmp_path / "s").iterdir())
    full = save_dflash(tiny_draft(torch.float32), tmp_path / "full", torch.float32)  # the control: no window
    assert run("sglang", full, tmp_path / "s2") == 0
    cfg = to_hf_config(win.config)
    assert (from_hf_config(cfg).sliding_window == W
            and from_hf_config(to_hf_config(tiny_draft().config)).sliding_window is None)
    staged = llamacpp_config(cfg, {})  # what llama.cpp's converter reads (use_sliding_window + sliding_window)
    assert staged["use_sliding_window"] and staged["sliding_window"] == W and staged["is_causal"] is False
    for bad in ({**cfg, "layer_types": ["sliding_attention", "full_attention"]}, {k: v for k, v in cfg.items()
                                                                                 if k != "is_causal"}):
        with pytest.raises(ValueError, match="does not implement"):
            from_hf_config(bad)


@pytest.mark.parametrize("value, pattern", [
    ("0", r"'draft\.sliding_window'=0 must be >= 1"),
    ("-3", r"'draft\.sliding_window'=-3 must be >= 1"),
    ("2.5", r"'draft\.sliding_window': got 2\.5 \(float\), expected int"),
    ("abc", r"'draft\.sliding_window': got 'abc' \(str\), expected int"),
    ("3", r"'draft\.sliding_window'=3 is below 'draft\.block_size'=4"),
])
def test_a_bad_window_is_one_error_naming_the_key(value, pattern):
    from specforge.config import load_config

    with pytest.raises(ValueError, match=pattern) as e:
        load_config(None, ["draft.algorithm=dflash", "draft.block_size=4", f"draft.sliding_window={value}"])
    assert "\n" not in str(e.value)
    assert load_config(None, ["draft.algorithm=dflash", "draft.block_size=4", "draft.sliding_window=4"])  # control


def test_dspark_refuses_the_window():
    from specforge.config import load_config

    with pytest.raises(ValueError, match=r"'draft\.sliding_window'=16 applies to draft\.algorithm=dflash, not dspark"):
        load_config(None, ["draft.algorithm=dspark", "draft.sliding_window=16"])
