"""Draft model: config round trip, checkpoint keys, target-derived config, init helpers."""

import json

import pytest
import torch

from specforge.algorithms.eagle3.algorithm import Eagle3Options
from specforge.algorithms.eagle3.model import Eagle3Draft, Eagle3DraftConfig, draft_config_from_target


def _cfg(**kw):
    base = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, vocab_size=300, draft_vocab_size=100, aux_layer_ids=[1, 14, 26])
    base.update(kw)
    return Eagle3DraftConfig(**base)


def test_hf_config_round_trip_and_sglang_fields():
    cfg = _cfg(target_hidden_size=96, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    d = cfg.to_hf_config()
    json.dumps(d)
    assert d["architectures"] == ["LlamaForCausalLMEagle3"]
    assert d["model_type"] == "llama" and d["num_hidden_layers"] == 1
    assert d["draft_vocab_size"] == 100 and d["vocab_size"] == 300
    assert d["target_hidden_size"] == 96
    assert d["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert d["tie_word_embeddings"] is False and d["torch_dtype"] == "bfloat16"
    back = Eagle3DraftConfig.from_hf_config(d)
    assert back == cfg
    same = _cfg()
    assert "target_hidden_size" not in same.to_hf_config()
    assert Eagle3DraftConfig.from_hf_config(same.to_hf_config()) == same


def test_export_state_dict_keys_exact():
    m = Eagle3Draft(_cfg())
    keys = set(m.export_state_dict())
    expected = {
        "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
        "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
        "midlayer.post_attention_layernorm.weight",
        "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
        "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
        "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
    }
    assert keys == expected
    sd = m.export_state_dict()
    assert sd["fc.weight"].shape == (64, 192)
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (64, 128)
    assert sd["midlayer.self_attn.k_proj.weight"].shape == (32, 128)
    assert sd["lm_head.weight"].shape == (100, 64)
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool and sd["t2d"].shape == (300,)
    assert set(m.trainable_state_dict()) == expected - {"d2t", "t2d"}
    assert not m.embed_tokens.weight.requires_grad
    # a different target hidden size gives the draft its own (saved, trainable) embedding
    m2 = Eagle3Draft(_cfg(target_hidden_size=48))
    assert set(m2.export_state_dict()) == expected | {"embed_tokens.weight"}
    assert m2.embed_tokens.weight.requires_grad and m2.fc.weight.shape == (64, 144)


def test_load_export_state_dict_round_trip():
    a, b = Eagle3Draft(_cfg()), Eagle3Draft(_cfg())
    a.set_vocab(torch.sort(torch.randperm(300)[:100]).values - torch.arange(100))
    b.load_export_state_dict(a.export_state_dict())
    for k, v in a.export_state_dict().items():
        assert torch.equal(b.export_state_dict()[k], v), k
    with pytest.raises(KeyError):
        b.load_export_state_dict({"fc.weight": a.fc.weight})


def test_vocab_and_inits_from_target():
    m = Eagle3Draft(_cfg())
    ids = torch.sort(torch.randperm(300)[:100]).values
    d2t = ids - torch.arange(100)
    W = torch.randn(300, 64)
    m.init_lm_head_from_target(W, d2t)
    assert torch.equal(m.lm_head.weight, W[ids])
    assert m.t2d.sum() == 100 and m.t2d[ids].all()
    assert torch.equal(m.draft_to_target_ids(), ids)
    E = torch.randn(300, 64)
    m.init_embeddings_from_target(E)
    assert torch.equal(m.embed_tokens.weight, E) and not m.embed_tokens.weight.requires_grad
    m2 = Eagle3Draft(_cfg(target_hidden_size=48))
    m2.init_embeddings_from_target(torch.randn(300, 48))
    assert m2.embed_tokens.weight.shape == (300, 64) and m2.embed_tokens.weight.requires_grad


def test_draft_config_from_target():
    from transformers import LlamaConfig

    t = LlamaConfig(hidden_size=96, intermediate_size=256, num_attention_heads=6, num_key_value_heads=2,
                    vocab_size=500, num_hidden_layers=8, rope_theta=50000.0, rms_norm_eps=1e-5,
                    max_position_embeddings=4096)
    cfg = draft_config_from_target(t, Eagle3Options(vocab_size=128), [1, 3, 4])
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (96, 256, 6, 2)
    assert cfg.head_dim == 16 and cfg.vocab_size == 500 and cfg.draft_vocab_size == 128
    assert cfg.rope_theta == 50000.0 and cfg.rms_norm_eps == 1e-5 and cfg.max_position_embeddings == 4096
    assert cfg.target_hidden_size == 96 and cfg.aux_layer_ids == [1, 3, 4]
    same = draft_config_from_target(t.to_dict(), Eagle3Options(vocab_size=128), [1, 3, 4])
    assert same == cfg
    small = draft_config_from_target(t, Eagle3Options(vocab_size=128, hidden_size=64, intermediate_size=128), [1, 3, 4])
    assert small.hidden_size == 64 and small.target_hidden_size == 96 and small.num_attention_heads == 4
    assert small.to_hf_config()["target_hidden_size"] == 96
    Eagle3Draft(small)  # builds


def test_rope_llama3_scaling_changes_low_frequencies_only():
    plain = Eagle3Draft(_cfg(rope_theta=500000.0))
    scaled = Eagle3Draft(_cfg(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}))
    assert torch.allclose(plain.inv_freq[:2], scaled.inv_freq[:2])
    assert torch.allclose(plain.inv_freq[-1] / 8, scaled.inv_freq[-1])


def test_init_midlayer_from_target_is_the_target_layer_on_the_deepest_aux_hidden():
    """With the embedding half of q/k/v zeroed, TTT step 0 of a draft started from target layer
    j computes exactly layer j of the target on the deepest aux hidden (fc selects it)."""
    from specforge.models.generate import _layer
    from tests.helpers.models import tiny_target

    model = tiny_target()
    H, layer = model.config.hidden_size, model.model.layers[3]
    dcfg = draft_config_from_target(model.config, Eagle3Options(vocab_size=64), [0, 1, 2])
    draft = Eagle3Draft(dcfg)
    draft.init_midlayer_from_target(layer, top_aux=2)
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(draft.midlayer.self_attn, name).weight[:, :H].zero_()
    T = 9
    x = torch.randn(1, T, H)
    aux = torch.cat([torch.randn(1, T, H), torch.randn(1, T, H), x], dim=-1)
    pos = torch.arange(T)[None]
    with torch.no_grad():
        got = draft(torch.randint(0, 300, (1, T)), aux, pos, [T])[0]
        cos, sin = model.model.rotary_emb(x, pos)
        K, D = model.config.num_key_value_heads, H // model.config.num_attention_heads
        kv = (torch.zeros(1, K, T, D), torch.zeros(1, K, T, D))
        causal = torch.ones(T, T, dtype=torch.bool).tril()[None]
        want = _layer(layer, x, cos, sin, kv, 0, causal)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="hidden size"):
        Eagle3Draft(draft_config_from_target(model.config, Eagle3Options(vocab_size=64, hidden_size=32), [0, 1, 2])) \
            .init_midlayer_from_target(layer, top_aux=2)
