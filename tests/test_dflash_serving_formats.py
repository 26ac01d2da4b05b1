"""DFlash drafts for SGLang and vLLM: z-lab's ``DFlashDraftModel`` folder, which both serve as it is.

* ``--engine sglang`` / ``--engine vllm`` copy the checkpoint's config.json and model.safetensors
  byte for byte, and print the engine's serve command (vLLM: ``"method": "dflash"``,
  ``num_speculative_tokens`` = block size - 1).
* SGLang: a mirror of ``python/sglang/srt/models/dflash.py`` ``DFlashDraftModel.load_weights``
  (q/k/v -> ``qkv_proj``, gate/up -> ``gate_up_proj``, an optional ``model.`` prefix, every other
  unknown name skipped silently) and of ``parse_dflash_draft_config`` (``dflash_config``
  ``target_layer_ids`` / ``mask_token_id``, top-level ``block_size``): every tensor of the export
  lands on a parameter and every parameter gets one. Negative control: a checkpoint with a layer
  renamed loads "fine" in that loader with random weights, and our export refuses it.
* vLLM's ``speculators``: its own converter (``DFlashConverter``, layer ids +1 = "after k layers")
  turns the export into its format, and its ``DFlashDraftModel`` computes the same block logits
  as our draft for the same anchors and context (the target's HF hidden states). Negative
  control: the same draft exported with its layer ids shifted by one gives other logits.
"""

import json
from pathlib import Path

import pytest
import torch

L, H, V, MASK, IDS, K = 6, 64, 128, 127, [1, 3, 4], 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(target dir, HF target, our DFlash draft folder): a 6-layer Qwen3 target, random weights."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from specforge.algorithms.dflash.export import save_dflash
    from specforge.algorithms.dflash.model import DFlashConfig, DFlashDraft

    root = tmp_path_factory.mktemp("dflash-formats")
    torch.manual_seed(0)
    tc = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=L, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)
    target = Qwen3ForCausalLM(tc).eval()
    target.save_pretrained(root / "target")
    draft = DFlashDraft(DFlashConfig.from_target(tc.to_dict(), mask_token_id=MASK, num_hidden_layers=2,
                                                 target_layer_ids=IDS, block_size=K))
    with torch.no_grad():  # sharp attention over the context, so that the context features matter
        for layer in draft.layers:
            layer.self_attn.q_norm.weight.fill_(3.0)
            layer.self_attn.k_norm.weight.fill_(3.0)
    return root / "target", target, save_dflash(draft, root / "draft", torch.float32)


def export(args, capsys) -> str:
    from specforge.export import main

    assert main([str(a) for a in args]) == 0
    return capsys.readouterr().out


# ---------------------------------------------------------------- SGLang


def sglang_params(config: dict) -> set[str]:
    """The parameters SGLang's DFlashDraftModel builds from this config."""
    per_layer = ["self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
                 "self_attn.k_norm.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
                 "mlp.gate_up_proj.weight", "mlp.down_proj.weight"]
    return ({f"layers.{i}.{p}" for i in range(config["num_hidden_layers"]) for p in per_layer}
            | {"norm.weight", "fc.weight", "hidden_norm.weight"})


def sglang_load(config: dict, names) -> tuple[dict[str, str], list[str]]:
    """(checkpoint name -> parameter it lands on, names skipped), as SGLang's load_weights does."""
    params, landed, skipped = sglang_params(config), {}, []
    stacked = [("qkv_proj", "q_proj"), ("qkv_proj", "k_proj"), ("qkv_proj", "v_proj"),
               ("gate_up_proj", "gate_proj"), ("gate_up_proj", "up_proj")]

    def resolve(name):
        for n in (name, name.removeprefix("model.")):
            if n in params:
                return n
        return None

    for name in names:
        for param, weight in stacked:
            if f".{weight}." in name:
                target = resolve(name.replace(weight, param))
                break
        else:
            target = resolve(name)
        if target is None:
            skipped.append(name)
        else:
            landed[name] = target
    return landed, skipped


def test_sglang_export_is_the_folder_and_sglang_loads_every_tensor(tiny, tmp_path, capsys):
    from safetensors.torch import load_file

    target_dir, _, folder = tiny
    out = export(["--draft", folder, "--engine", "sglang", "--out", tmp_path / "s", "--target", target_dir], capsys)
    assert "--speculative-algorithm DFLASH" in out and f"--speculative-draft-model-path {tmp_path / 's'}" in out
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["config.json", "model.safetensors"]
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "s" / name).read_bytes() == (folder / name).read_bytes()
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    weights = load_file(tmp_path / "s" / "model.safetensors")
    landed, skipped = sglang_load(config, weights)
    assert skipped == [] and set(landed.values()) == sglang_params(config)
    # parse_dflash_draft_config: layer ids, mask token, block size; fc reads len(ids) x hidden
    assert config["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": IDS} and config["block_size"] == K
    assert weights["fc.weight"].shape == (H, len(IDS) * H)
    assert "embed_tokens.weight" not in weights and "lm_head.weight" not in weights  # the target's


def test_sglang_would_load_a_renamed_layer_as_random_weights_and_the_export_refuses_it(tiny, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    from specforge.export import main

    target_dir, _, folder = tiny
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((folder / "config.json").read_text())
    weights = load_file(folder / "model.safetensors")
    renamed = {k.replace("layers.1.", "layers.1.inner."): v for k, v in weights.items()}
    save_file(renamed, bad / "model.safetensors")
    landed, skipped = sglang_load(json.loads((bad / "config.json").read_text()), renamed)
    assert skipped and set(landed.values()) != sglang_params(json.loads((bad / "config.json").read_text()))
    with pytest.raises(ValueError, match="not a valid DFlashDraftModel checkpoint.*layers.1"):
        main(["--draft", str(bad), "--engine", "sglang", "--out", str(tmp_path / "s"), "--target", str(target_dir)])
    assert not (tmp_path / "s").exists()


# ---------------------------------------------------------------- vLLM / speculators


def speculators_model(exported: Path, target_dir: Path, out: Path):
    from loguru import logger
    from speculators.convert.dflash.converter import DFlashConverter
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    logger.disable("speculators")
    DFlashConverter().convert(exported, out, base_model=str(target_dir), validate=False)
    cfg = DFlashSpeculatorConfig.from_pretrained(str(out))
    cfg.transformer_layer_config._attn_implementation = "eager"  # dense masks on CPU: the same math
    model = DFlashDraftModel.from_pretrained(str(out), config=cfg)
    model.load_verifier_weights()
    return model.float().eval()


@torch.no_grad()
def block_logits(tiny, exported: Path, tmp_path: Path, T: int = 20, anchors: int = 4):
    """(ours, speculators') logits of every block position for the anchors speculators picks."""
    from specforge.algorithms.dflash.export import load_dflash
    from specforge.algorithms.dflash.loss import build_block_ids
    from specforge.algorithms.dflash.model import ContextCache
    from specforge.algorithms.dflash.propose import context_features

    target_dir, target, folder = tiny
    theirs = speculators_model(exported, target_dir, tmp_path / "speculators")
    ours = load_dflash(folder, target.get_input_embeddings().weight, target.get_output_embeddings().weight).eval()
    ids = torch.randint(0, MASK, (1, T), generator=torch.Generator().manual_seed(5))
    hidden = target(ids, output_hidden_states=True).hidden_states
    features = torch.cat([hidden[k] for k in theirs.target_layer_ids], dim=-1)  # "after k layers"
    torch.manual_seed(0)
    _, got, _, _, index = theirs._backbone_forward(features, ids, torch.ones(1, T), hidden[-1],
                                                   torch.zeros(1, T, dtype=torch.long), max_anchors=anchors)
    picked = index[::K]
    ctx = context_features(hidden, ours.config.target_layer_ids)
    want = []
    for a in picked.tolist():
        block = build_block_ids(ids, torch.tensor([[a]]), K, MASK)[:, 0]
        want.append(ours.logits(ours.forward_block(ContextCache().extend(ours, ctx[:, :a]), block))[0])
    return torch.stack(want), got[0].view(len(picked), K, -1), picked


def test_vllm_export_is_the_folder_and_speculators_computes_our_blocks(tiny, tmp_path, capsys):
    target_dir, _, folder = tiny
    out = export(["--draft", folder, "--engine", "vllm", "--out", tmp_path / "v", "--target", target_dir], capsys)
    assert f'"method": "dflash", "model": "{tmp_path / "v"}", "num_speculative_tokens": {K - 1}' in out
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "v" / name).read_bytes() == (folder / name).read_bytes()
    ours, theirs, anchors = block_logits(tiny, tmp_path / "v", tmp_path)
    assert json.loads((tmp_path / "speculators" / "config.json").read_text())["aux_hidden_state_layer_ids"] == [
        i + 1 for i in IDS]
    assert len(set(anchors.tolist())) > 1
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)


def test_speculators_comparison_fails_on_shifted_layer_ids(tiny, tmp_path, capsys):
    target_dir, _, folder = tiny
    shifted = tmp_path / "shifted"
    shifted.mkdir()
    config = json.loads((folder / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [i - 1 for i in IDS]  # (+1 would reach the last layer,
    # which speculators' converter drops from the aux ids: it feeds that one to the loss only)
    (shifted / "config.json").write_text(json.dumps(config))
    (shifted / "model.safetensors").symlink_to(folder / "model.safetensors")
    ours, theirs, _ = block_logits(tiny, shifted, tmp_path)
    assert not torch.allclose(theirs, ours, rtol=1e-3, atol=1e-3)
