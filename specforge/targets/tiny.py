"""Tiny random configs, one per family of ``specforge.targets.FAMILIES``: few layers, small hidden,
but every quirk the family's real checkpoints have (MoE routing, sliding windows and sinks, MLA
head dims, embedding scaling, logit soft-capping, linear-attention layers, tied or untied heads,
RoPE variants). Built from the family's own transformers config class, so a test over them runs
the real HF modeling code. Legend: V vocab (256), H hidden (64), L layers (6).
"""

from __future__ import annotations

V, H, L = 256, 64, 6
_COMMON = dict(vocab_size=V, hidden_size=H, num_hidden_layers=L, max_position_embeddings=256,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _text(**kw):
    return {**_COMMON, **kw}


def llama():
    from transformers import LlamaConfig  # lazy: heavy (transformers)
    return LlamaConfig(**_text(intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                               rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 64}))


def mistral():
    from transformers import MistralConfig  # lazy: heavy (transformers)
    return MistralConfig(**_text(intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=32, sliding_window=8))


def qwen2():
    from transformers import Qwen2Config  # lazy: heavy (transformers)
    return Qwen2Config(**_text(intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                               tie_word_embeddings=True))


def qwen3():
    from transformers import Qwen3Config  # lazy: heavy (transformers)
    return Qwen3Config(**_text(intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                               tie_word_embeddings=True))


def qwen3_moe():
    from transformers import Qwen3MoeConfig  # lazy: heavy (transformers)
    return Qwen3MoeConfig(**_text(intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                                  num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  decoder_sparse_step=1, mlp_only_layers=[0], norm_topk_prob=True,
                                  rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                                                   "original_max_position_embeddings": 64}))


def qwen3_next():
    from transformers import Qwen3NextConfig  # lazy: heavy (transformers)
    return Qwen3NextConfig(**_text(intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                                   linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                   layer_types=["linear_attention", "linear_attention", "linear_attention",
                                                "full_attention", "linear_attention", "full_attention"]))


def gemma3_text():
    from transformers import Gemma3TextConfig  # lazy: heavy (transformers)
    return Gemma3TextConfig(**_text(intermediate_size=128, num_attention_heads=4, num_key_value_heads=1,
                                    head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                                    layer_types=["sliding_attention"] * 5 + ["full_attention"],
                                    # a cap the tiny logits reach
                                    final_logit_softcapping=0.5, attn_logit_softcapping=50.0,
                                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                        "rope_theta": 1000000.0},
                                                     "sliding_attention": {"rope_type": "default",
                                                                           "rope_theta": 10000.0}}))


def phi3():
    from transformers import Phi3Config  # lazy: heavy (transformers)
    return Phi3Config(**_text(intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                              partial_rotary_factor=0.75, tie_word_embeddings=True))


def gpt_oss():
    from transformers import GptOssConfig  # lazy: heavy (transformers)
    return GptOssConfig(**_text(intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
                                layer_types=["sliding_attention", "full_attention"] * 3,
                                rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                                 "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                 "original_max_position_embeddings": 64}))


def deepseek_v3():
    from transformers import DeepseekV3Config  # lazy: heavy (transformers)
    return DeepseekV3Config(**_text(intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
                                    num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
                                    num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                                    kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                    v_head_dim=16,
                                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                                     "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                                                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 64}))


def glm4_moe():
    from transformers import Glm4MoeConfig  # lazy: heavy (transformers)
    return Glm4MoeConfig(**_text(intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                                 n_shared_experts=1, first_k_dense_replace=1, use_qk_norm=True, attention_bias=True,
                                 partial_rotary_factor=0.5))


def mixtral():
    from transformers import MixtralConfig  # lazy: heavy (transformers)
    return MixtralConfig(**_text(intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                 num_local_experts=4, num_experts_per_tok=2))


# --------------------------------------------------------------- image-text models: text tower + a 1-layer vision tower


def qwen3_5():
    from transformers import Qwen3_5Config  # lazy: heavy (transformers)
    text = _text(intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                 linear_num_key_heads=2, linear_num_value_heads=4,
                 layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention", "full_attention"],
                 rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                  "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=H, patch_size=4)
    return Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)


def gemma3():
    from transformers import Gemma3Config  # lazy: heavy (transformers)
    text = gemma3_text().to_dict()
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                  patch_size=4)
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=255,
                        boi_token_index=253, eoi_token_index=254)


def gemma4():
    from transformers import Gemma4Config  # lazy: heavy (transformers)
    text = _text(intermediate_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                 sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                 final_logit_softcapping=0.5, vocab_size_per_layer_input=V, hidden_size_per_layer_input=8,
                 num_kv_shared_layers=2, tie_word_embeddings=True, global_head_dim=32)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16)
    return Gemma4Config(text_config=text, vision_config=vision, audio_config=None)


def qwen2_5_vl():
    from transformers import Qwen2_5_VLConfig  # lazy: heavy (transformers)
    text = _text(intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=H, patch_size=4,
                  window_size=16, fullatt_block_indexes=[0])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=255, video_token_id=254,
                            vision_start_token_id=253)


def qwen3_vl():
    from transformers import Qwen3VLConfig  # lazy: heavy (transformers)
    text = _text(intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [4, 2, 2],
                                  "mrope_interleaved": True})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=H, patch_size=4,
                  num_position_embeddings=16, deepstack_visual_indexes=[0])
    return Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=255, video_token_id=254,
                         vision_start_token_id=253)
