"""The tiny DFlash draft (from tests/test_dflash_model.py)."""

import torch

from specforge.algorithms.dflash.model import DFlashConfig, DFlashDraft


def tiny_cfg(**kw):
    base = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                intermediate_size=64, vocab_size=97, num_target_layers=6, target_layer_ids=[1, 3, 4],
                block_size=4, mask_token_id=96, rope_theta=10000.0)
    base.update(kw)
    return DFlashConfig(**base)


def tiny_draft(dtype=torch.float64, **kw):
    torch.manual_seed(0)
    d = DFlashDraft(tiny_cfg(**kw)).to(dtype)
    with torch.no_grad():  # non-trivial norm weights, so a missing norm shows
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return d
