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
* vLLM's own config parser (``SpeculatorsConfig``, run in vLLM's venv) reads the export as a
  ``DFlash2DraftModel`` with our layer ids, mask token and convolution / selector sizes, non-causal,
  ``method: dflash`` and ``num_speculative_tokens`` = block size - 1; every exported tensor maps, by
  vLLM's loader names (``model.`` prefix, its ``hf_to_vllm_mapper``), onto a parameter of
  ``DFlash2Qwen3ForCausalLM`` (a mirror of its parameters, written from ``qwen3_dflash2.py``), and
  each of those parameters gets one.
* Refused in one ``error:`` line, writing nothing: SGLang, llama.cpp (its build 11434 converter reads
  ``DFlash2DraftModel``, but no export for it is written or checked here yet), an anchor-first draft
  (vLLM's DFlash runtime raises on ``sample_from_anchor``) and more speculative tokens than a block drafts.
"""

import json
import subprocess
from pathlib import Path

import pytest
import torch

from tests.test_dflash2 import IDS, MASK, TOPK, K, _close, _target, _tiny_draft

pytestmark = [pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(target folder, HF target, our folder, our draft loaded from it) for both block layouts."""
    from specforge.algorithms.dflash2.export import load_dflash2, save_dflash2

    root = tmp_path_factory.mktemp("dflash2-export")
    target = _target()
    target.save_pretrained(root / "target")
    drafts = {}
    for anchor_first in (False, True):
        draft = _tiny_draft(target.config.to_dict(), anchor_first, seed=int(anchor_first))
        folder = save_dflash2(draft, root / f"draft-{int(anchor_first)}", torch.float32)
        drafts[anchor_first] = folder, load_dflash2(folder, target.get_input_embeddings().weight,
                                                    target.lm_head.weight).eval()
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
        assert err.startswith(f"error: --engine {engine}: DFlash2DraftModel drafts cannot be served by {engine}; "
                              "export this draft for vllm"), err
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_the_hook_names_why_each_other_engine_cannot_serve_it():
    from specforge.registry import get_algorithm

    algo = get_algorithm("dflash2")
    assert algo.engines == ("vllm",) and algo.llamacpp_spec_type is None
    for engine, why in (("sglang", "SGLang has no DFlash2 drafting"),
                        ("llama.cpp", "specforge does not export DFlash2 drafts for llama.cpp yet")):
        with pytest.raises(ValueError, match=f"^--engine {engine}: {why}"):
            algo.export(engine, Path("unused"), Path("unused"), None)


# ---------------------------------------------------------------- vLLM's own config parser and loader names

VLLM_SCRIPT = r"""
import json, sys
from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
from vllm.model_executor.models.qwen3_dflash2 import DFlash2Qwen3Model
out = sys.argv[1]
raw = json.load(open(out + "/config.json"))
hf = SpeculatorsConfig.from_pretrained(out)
spec = SpeculatorsConfig.extract_vllm_speculative_config(raw)
from safetensors import safe_open
with safe_open(out + "/model.safetensors", "pt") as f:
    names = list(f.keys())
# DFlash2Qwen3ForCausalLM.load_weights (inherited from DFlashQwen3ForCausalLM): "model." + every name but
# lm_head / d2t / t2d, then the model's hf_to_vllm_mapper (q/k/v -> qkv_proj, gate/up -> gate_up_proj)
mapped = {n: DFlash2Qwen3Model.hf_to_vllm_mapper.map_name(n if "lm_head" in n else "model." + n)
          for n in names + json.loads(sys.argv[2])}
print(json.dumps({"architectures": hf.architectures, "dflash_config": hf.dflash_config,
                  "eagle_aux": hf.eagle_aux_hidden_state_layer_ids, "is_causal": getattr(hf, "is_causal", None),
                  "num_hidden_layers": hf.num_hidden_layers, "spec": spec, "mapped": mapped}))
"""


def vllm_params(num_layers: int) -> set[str]:
    """The parameters of vLLM's DFlash2Qwen3ForCausalLM the checkpoint fills (qwen3_dflash2.py +
    qwen3_dflash.py: DFlashQwen3Model's layers, fc, hidden_norm, norm; each layer's attention_conv /
    mlp_conv; the candidate_selector). embed_tokens and lm_head are the target's (none in the file)."""
    per_layer = ["self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
                 "self_attn.k_norm.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
                 "mlp.gate_up_proj.weight", "mlp.down_proj.weight"]
    conv = [f"{c}.{p}" for c in ("attention_conv", "mlp_conv") for p in ("base_kernel", "kernel_projection.weight")]
    return ({f"model.layers.{i}.{p}" for i in range(num_layers) for p in per_layer + conv}
            | {"model.fc.weight", "model.hidden_norm.weight", "model.norm.weight"}
            | {f"model.candidate_selector.{p}" for p in ("predecessor_codebook", "successor_codebook",
                                                          "hidden_projection.weight")})


def test_vllm_parses_the_config_and_maps_every_tensor(tiny, tmp_path, capsys):
    from specforge.models.vllm_engine import default_python

    target_dir, _, drafts = tiny
    folder, ours = drafts[False]
    out = tmp_path / "v"
    assert run_export(["--draft", folder, "--engine", "vllm", "--out", out, "--target", target_dir], capsys)[0] == 0
    python = default_python()
    assert python.exists(), "run bash scripts/install_vllm.sh (scripts/test.sh does)"
    control = ["layers.0.attn_conv.base_kernel", "selector.successor_codebook"]  # renamed: no parameter of vLLM's
    proc = subprocess.run([str(python), "-c", VLLM_SCRIPT, str(out), json.dumps(control)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    c = ours.config
    assert got["architectures"] == ["DFlash2DraftModel"] and got["num_hidden_layers"] == c.num_hidden_layers
    assert got["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": IDS, "sample_from_anchor": False,
                                    "causal": False, "conv_kernel_size": c.conv_kernel_size,
                                    "conv_group_size": c.conv_group_size, "selector_rank": c.selector_rank,
                                    "selector_top_k": c.selector_top_k}
    assert got["eagle_aux"] == [i + 1 for i in IDS]
    assert got["spec"] == {"method": "dflash", "num_speculative_tokens": K - 1}
    mapped = got["mapped"]
    assert not set(vllm_params(c.num_hidden_layers)) & {mapped.pop(n) for n in control}  # the mirror can fail
    assert None not in mapped.values(), mapped
    assert set(mapped.values()) == vllm_params(c.num_hidden_layers)
    # q/k/v and gate/up land on their stacked parameters, one shard each
    assert sum(v.endswith("qkv_proj.weight") for v in mapped.values()) == 3 * c.num_hidden_layers
