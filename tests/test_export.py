"""``python -m specforge.export``: each engine's row of docs/ENGINES.md checked against that engine's code.

* vLLM: the export is loaded by vLLM's own draft library, ``speculators`` (``Eagle3DraftModel``), fed
  the target features IT asks for (its layer ids, its "after k layers" convention) and must give our
  logits on our features, every TTT step, in the target vocab (its d2t); negative controls show the
  comparison fails with unshifted layer ids or a wrong d2t.
* SGLang: sglang cannot be installed here (CUDA), so its loader's facts are encoded below, read from
  sgl-project/sglang ``python/sglang/srt/models/llama_eagle3.py`` (``LlamaForCausalLMEagle3``).
* llama.cpp: the CLI's wiring to ``specforge.engines.llamacpp.convert_draft`` (that module's own tests
  run llama.cpp's converter).
Tiny random target (Llama, 8 layers, hidden 48, vocab 320) and draft (draft vocab 100), fp32.
"""

import json
import re
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specforge import engines, export
from specforge.algorithms.eagle3 import export as eagle3_export
from specforge.algorithms.eagle3.model import Eagle3Draft, Eagle3DraftConfig
from specforge.cli import run_cli
from specforge.models.target import TargetModel, forward_aux
from specforge.training.checkpoint import save_checkpoint
from tests.helpers.export import SGLANG_PARAMS, load_speculators, sglang_load, step_logits
from tests.helpers.models import tiny_target

L, V, N, H = 8, 320, 100, 48


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    tiny_target(num_layers=L).save_pretrained(path)
    return path


def make_checkpoint(root: Path, target_dir: Path, aux_ids, step=5, identity=None, hidden=H) -> Path:
    """A saved draft checkpoint (with resume state) trained 'for' the tiny target."""
    from transformers import LlamaForCausalLM

    target = LlamaForCausalLM.from_pretrained(target_dir)
    cfg = Eagle3DraftConfig(hidden_size=hidden, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=hidden // 4, vocab_size=V, draft_vocab_size=N, aux_layer_ids=list(aux_ids),
                            torch_dtype="float32", rope_theta=5000.0, target_hidden_size=H)
    torch.manual_seed(1)
    draft = Eagle3Draft(cfg)
    draft.reset_parameters(std=0.1)
    draft.set_vocab(torch.sort(torch.randperm(V)[:N]).values - torch.arange(N))
    draft.init_embeddings_from_target(target.model.embed_tokens.weight)
    return save_checkpoint(root, step, cfg.to_hf_config(), draft.export_state_dict(),
                           train_state={"step": step, "identity": identity or {}})


def run(argv, capsys):
    """The CLI as a user runs it: (exit code, stdout, stderr)."""
    code = run_cli(lambda: export.main([str(a) for a in argv]))
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------- SGLang


def test_sglang_export_is_the_checkpoint_and_sglang_loads_every_tensor(tmp_path, target_dir, capsys):
    ckpt = make_checkpoint(tmp_path / "ckpts", target_dir, [1, L // 2 - 1, L - 4])
    code, out, err = run(["--draft", tmp_path / "ckpts", "--engine", "sglang", "--out", tmp_path / "sg"], capsys)
    assert code == 0, err
    assert "--speculative-algorithm EAGLE3" in out
    served = tmp_path / "sg"
    assert sorted(p.name for p in served.iterdir()) == ["config.json", "model.safetensors"]  # no resume state
    for name in ("config.json", "model.safetensors"):
        assert (served / name).read_bytes() == (ckpt / name).read_bytes()

    config, weights = json.loads((served / "config.json").read_text()), load_file(served / "model.safetensors")
    # The SGLang loader: architectures picks LlamaForCausalLMEagle3; num_hidden_layers 1 = only midlayer;
    # tie_word_embeddings true would make lm_head the embedding; draft_vocab_size None would load
    # lm_head from the target; target_hidden_size sizes fc (3 x it); eagle_config's ids are read by
    # model_runner and passed to set_eagle3_layers_to_capture, which captures the INPUT of layer k + 1
    # (= the output of layer k, HF hidden_states[k + 1]: what our capture keeps).
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["tie_word_embeddings"] is False and config["draft_vocab_size"] == N
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, L // 2 - 1, L - 4]
    landed, dropped = sglang_load(weights)
    assert dropped == []
    assert set(landed.values()) == SGLANG_PARAMS - {"model.embed_tokens.weight"}  # embedding: the target's
    assert weights["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * H  # qkv_proj reads 2 x hidden
    assert weights["fc.weight"].shape == (H, 3 * H)
    # hot_token_id = d2t + arange: the target id of each draft id
    hot = weights["d2t"] + torch.arange(N)
    assert torch.equal(torch.nonzero(weights["t2d"]).flatten(), hot)
    # negative control: a checkpoint in speculators' naming loads into SGLang as random weights
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in weights.items()}
    landed, dropped = sglang_load(renamed)
    assert dropped and all(k.startswith("layers.0.") for k in dropped)
    assert not any(".midlayer." in p for p in landed.values())
    with pytest.raises(ValueError, match="missing midlayer.self_attn.q_proj.weight"):
        eagle3_export.check_checkpoint(_with_weights(ckpt, renamed, tmp_path / "bad"))


def _with_weights(ckpt: Path, weights, dest: Path) -> Path:
    dest.mkdir()
    (dest / "config.json").write_text((ckpt / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in weights.items()}, dest / "model.safetensors")
    return dest


def test_check_checkpoint_names_what_is_wrong(tmp_path, target_dir):
    ckpt = make_checkpoint(tmp_path / "ckpts", target_dir, [1, 3, 4])
    weights = load_file(ckpt / "model.safetensors")
    bad = dict(weights, **{"fc.weight": weights["fc.weight"][:, :H]})
    with pytest.raises(ValueError, match=r"fc.weight is \[48, 48\] torch.float32, expected \[48, 144\]"):
        eagle3_export.check_checkpoint(_with_weights(ckpt, bad, tmp_path / "a"))
    bad = dict(weights, d2t=torch.roll(weights["d2t"], 1))
    with pytest.raises(ValueError, match="d2t"):
        eagle3_export.check_checkpoint(_with_weights(ckpt, bad, tmp_path / "b"))
    bad = dict(weights, **{"norm.weight": weights["norm.weight"].bfloat16()})
    with pytest.raises(ValueError, match="norm.weight .* torch.bfloat16, expected .* torch.float32"):
        eagle3_export.check_checkpoint(_with_weights(ckpt, bad, tmp_path / "c"))


# ---------------------------------------------------------------- vLLM (speculators)


@torch.no_grad()
def logits_ours_and_speculators(ckpt: Path, exported: Path, target_dir: Path, T=24, steps=3):
    """Per TTT step: (ours, speculators') logits in the target vocab over the rows both define.
    Each side gets the target features its own convention names; the same token ids."""
    from transformers import LlamaForCausalLM

    from specforge.registry import load_draft

    hf_target = LlamaForCausalLM.from_pretrained(target_dir).eval()
    ours_ids = json.loads((ckpt / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    target = TargetModel(model=hf_target, tokenizer=None, aux_layer_ids=ours_ids, device=torch.device("cpu"))
    draft = load_draft(ckpt, target)
    theirs = load_speculators(exported)

    ids = torch.randint(0, V, (1, T + 1), generator=torch.Generator().manual_seed(3))
    aux_ours = forward_aux(target, ids[:, :T])[0]  # our capture: hooks on the layer outputs
    hidden = hf_target(ids[:, :T], output_hidden_states=True).hidden_states
    aux_theirs = torch.cat([hidden[k] for k in theirs.target_layer_ids], dim=-1)  # "after k layers"
    return step_logits(draft, theirs, ids, aux_ours, aux_theirs, V, steps)


@pytest.mark.parametrize("aux_ids, theirs", [
    ([1, L // 2 - 1, L - 4], [2, L // 2, L - 3]),  # our default = vLLM's default, the same layers
    ([0, 2, 6], [1, 3, 7]),
])
def test_vllm_export_gives_our_logits_in_speculators(tmp_path, target_dir, capsys, aux_ids, theirs):
    ckpt = make_checkpoint(tmp_path / "ckpts", target_dir, aux_ids)
    code, out, err = run(["--draft", ckpt, "--engine", "vllm", "--out", tmp_path / "vllm", "--target", target_dir,
                          "--num-speculative-tokens", 5], capsys)
    assert code == 0, err
    assert "vllm serve" in out
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == theirs
    # vLLM's update_eagle3 (transformers_utils/configs/speculators/algos.py) reads
    # config_dict.get("norm_before_residual", True): absent would flip our residual convention
    assert config["norm_before_residual"] is False
    # vLLM's validate_speculators_config needs these paths
    spec = config["speculators_config"]
    assert spec["proposal_methods"][0]["speculative_tokens"] == 5
    assert spec["verifier"]["name_or_path"] == str(target_dir)
    assert config["speculators_model_type"] == "eagle3" and isinstance(config["transformer_layer_config"], dict)

    pairs = logits_ours_and_speculators(ckpt, tmp_path / "vllm", target_dir)
    for i, (ours, theirs_logits) in enumerate(pairs):
        torch.testing.assert_close(theirs_logits, ours, rtol=1e-5, atol=1e-5, msg=f"TTT step {i}")


def test_vllm_comparison_fails_on_unshifted_ids_or_wrong_d2t(tmp_path, target_dir, capsys, monkeypatch):
    ckpt = make_checkpoint(tmp_path / "ckpts", target_dir, [0, 2, 6])
    # 1. the layer ids copied as they are (SGLang's numbers in vLLM's convention): other features
    with monkeypatch.context() as m:
        m.setattr(eagle3_export, "speculators_layer_ids", lambda ids: list(ids))
        assert run(["--draft", ckpt, "--engine", "vllm", "--out", tmp_path / "ids", "--target", target_dir],
                   capsys)[0] == 0
    ours, theirs = logits_ours_and_speculators(ckpt, tmp_path / "ids", target_dir)[0]
    assert not torch.allclose(ours, theirs, rtol=1e-3, atol=1e-3)
    # 2. d2t lost (zeros: draft id = target id, as for a full-vocab draft): logits land on other tokens
    assert run(["--draft", ckpt, "--engine", "vllm", "--out", tmp_path / "d2t", "--target", target_dir], capsys)[0] == 0
    f = tmp_path / "d2t" / "model.safetensors"
    w = load_file(f)
    save_file(dict(w, d2t=torch.zeros_like(w["d2t"])), f)
    ours, theirs = logits_ours_and_speculators(ckpt, tmp_path / "d2t", target_dir)[0]
    assert not torch.allclose(ours, theirs, rtol=1e-3, atol=1e-3)


def test_vllm_export_of_a_draft_with_its_own_hidden_size(tmp_path, target_dir, capsys):
    ckpt = make_checkpoint(tmp_path / "ckpts", target_dir, [1, 3, 4], hidden=32)
    assert run(["--draft", ckpt, "--engine", "vllm", "--out", tmp_path / "vllm", "--target", target_dir],
               capsys)[0] == 0
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    weights = load_file(tmp_path / "vllm" / "model.safetensors")
    # vLLM's llama_eagle3: fc input = 3 x target_hidden_size; embed_tokens loaded when present
    assert config["target_hidden_size"] == H and config["transformer_layer_config"]["hidden_size"] == 32
    assert weights["fc.weight"].shape == (32, 3 * H) and weights["embed_tokens.weight"].shape == (V, 32)


# ---------------------------------------------------------------- llama.cpp (the CLI's side)


def test_llamacpp_export_calls_the_converter(tmp_path, target_dir, capsys, monkeypatch):
    ckpt = make_checkpoint(tmp_path / "ckpts", target_dir, [1, 3, 4])
    calls = []

    def convert_draft(draft_dir, target_hf_dir, out_path, outtype="f32"):
        calls.append((Path(draft_dir), Path(target_hf_dir), Path(out_path).name, outtype))
        Path(out_path).write_bytes(b"GGUF")
        return Path(out_path)

    from specforge.engines.llamacpp import draft_spec_type  # the real one (the stub replaces the module)

    stub = types.SimpleNamespace(convert_draft=convert_draft, OUTTYPES=("f32", "q8_0"), draft_spec_type=draft_spec_type)
    monkeypatch.setitem(sys.modules, "specforge.engines.llamacpp", stub)
    monkeypatch.setattr(engines, "llamacpp", stub, raising=False)  # if the real one was imported before
    monkeypatch.setattr(export, "llamacpp", stub)  # the module export.py imported
    code, out, err = run(["--draft", tmp_path / "ckpts", "--engine", "llama.cpp", "--out", tmp_path / "gguf",
                          "--target", target_dir, "--outtype", "q8_0"], capsys)
    assert code == 0, err
    assert calls == [(ckpt, target_dir, "draft-q8_0.gguf", "q8_0")]
    assert (tmp_path / "gguf" / "draft-q8_0.gguf").read_bytes() == b"GGUF"
    assert "--spec-type draft-eagle3" in out
    # no --target: the embedded default (what training uses without a config)
    seen = []
    monkeypatch.setattr(export, "resolve_target", lambda t: seen.append(t) or (str(target_dir), _config(target_dir)))
    assert run(["--draft", ckpt, "--engine", "llama.cpp", "--out", tmp_path / "gguf2"], capsys)[0] == 0
    assert seen == [None] and calls[-1][3] == "f32"


def test_default_target_is_checked_against_the_recorded_fingerprint(tmp_path, target_dir, capsys, monkeypatch):
    from transformers import LlamaForCausalLM

    from specforge.compat import target_fingerprints

    mine = sorted(target_fingerprints(LlamaForCausalLM.from_pretrained(target_dir)))[0]
    monkeypatch.setattr(export, "resolve_target", lambda t: (str(target_dir), _config(target_dir)))
    ok = make_checkpoint(tmp_path / "a", target_dir, [1, 3, 4], identity={"target": mine})
    assert run(["--draft", ok, "--engine", "vllm", "--out", tmp_path / "o1"], capsys)[0] == 0
    other = make_checkpoint(tmp_path / "b", target_dir, [1, 3, 4], identity={"target": "0123456789abcdef"})
    code, _, err = run(["--draft", other, "--engine", "vllm", "--out", tmp_path / "o2"], capsys)
    assert code == 1 and "no --target: the default target" in err and "trained with another target" in err
    assert "pass it as --target" in err and not (tmp_path / "o2").exists()


def _config(path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


# ---------------------------------------------------------------- bad input: one error line, exit 1


def test_vllm_export_without_speculators_is_one_error_line(tmp_path, target_dir, capsys, monkeypatch):
    """The vLLM format is speculators' converter's: without it, one line says what to install, before the
    target loads (the lent H200 had no speculators, and the export died in a ModuleNotFoundError).
    Control: with speculators importable the same command exports."""
    ckpt = make_checkpoint(tmp_path / "ckpts", target_dir, [1, 3, 4])
    argv = ["--draft", ckpt, "--engine", "vllm", "--target", target_dir]
    monkeypatch.setitem(sys.modules, "speculators", None)  # as if not installed: find_spec gives None
    monkeypatch.setattr(export, "resolve_target", lambda *a: pytest.fail("the target was resolved"))
    capsys.readouterr()  # the setup's progress bars
    code, out, err = run([*argv, "--out", tmp_path / "o1"], capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: --engine vllm: ") and "pip install speculators==0.9.0" in err, err
    monkeypatch.undo()
    assert run([*argv, "--out", tmp_path / "o2"], capsys)[0] == 0


def test_bad_input_is_one_error_line(tmp_path, target_dir, capsys):
    ckpt = make_checkpoint(tmp_path / "ckpts", target_dir, [1, 3, 4])
    (tmp_path / "empty").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    (tmp_path / "medusa").mkdir()
    (tmp_path / "medusa" / "config.json").write_text('{"architectures": ["MedusaModel"]}')
    other = tiny_target(num_layers=3)
    other.save_pretrained(tmp_path / "small")
    cases = [
        (["--draft", tmp_path / "empty", "--engine", "sglang", "--out", tmp_path / "o1"], "is not a draft checkpoint"),
        (["--draft", tmp_path / "nope", "--engine", "sglang", "--out", tmp_path / "o2"], "does not exist"),
        (["--draft", ckpt, "--engine", "tensorrt", "--out", tmp_path / "o3"], "--engine 'tensorrt' is not supported"),
        (["--draft", ckpt, "--engine", "sglang", "--out", tmp_path / "full"], "not empty; .* --force"),
        (["--draft", ckpt, "--engine", "sglang", "--out", tmp_path / "ckpts", "--force"], "holds the checkpoint"),
        (["--draft", ckpt, "--engine", "sglang", "--out", tmp_path / "o4", "--outtype", "q8_0"], "llama.cpp only"),
        (["--draft", ckpt, "--engine", "llama.cpp", "--out", tmp_path / "o5", "--outtype", "q4"], "--outtype 'q4'"),
        (["--draft", ckpt, "--engine", "vllm", "--out", tmp_path / "o6", "--target", tmp_path / "small"],
         "--target .*small': draft .* fuses target layers \\[1, 3, 4\\], but this target has only 3 layers: "
         "export it for"),
        (["--engine", "sglang", "--out", tmp_path / "o7"], "--draft"),
        *[(["--draft", tmp_path / "medusa", "--engine", e, "--out", tmp_path / "o8"],
           "\\['MedusaModel'\\] is none of .*DFlashDraftModel.*LlamaForCausalLMEagle3.*; "
           "not a draft checkpoint this project wrote")
          for e in ("sglang", "vllm", "llama.cpp")],
    ]
    capsys.readouterr()  # the setup's progress bars
    for argv, message in cases:
        code, out, err = run(argv, capsys)
        assert code == 1, (argv, err)
        assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
        assert re.search(message, err), (message, err)
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"  # nothing overwritten
    assert not any(p.name.startswith(".o") for p in tmp_path.iterdir())  # no temp folder left behind
    # --force replaces a non-empty --out, and only after the export succeeded
    assert run(["--draft", ckpt, "--engine", "sglang", "--out", tmp_path / "full", "--force"], capsys)[0] == 0
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["config.json", "model.safetensors"]
