"""The tiny random Llama target (from tests/test_target.py)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_target(num_layers=6, tie=False):
    cfg = LlamaConfig(
        vocab_size=320, hidden_size=48, intermediate_size=96, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()
