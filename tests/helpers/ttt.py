"""A tiny EAGLE-3 draft and a TTT batch for it (test_ttt, test_losses)."""

import torch

from specforge.algorithms.eagle3.model import Eagle3Draft, Eagle3DraftConfig

V, N, HT = 300, 100, 48


def tiny_draft(dtype=torch.float32, target_hidden=HT):
    cfg = Eagle3DraftConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, vocab_size=V, draft_vocab_size=N, target_hidden_size=target_hidden)
    d = Eagle3Draft(cfg).to(dtype)
    d.reset_parameters(std=0.1)
    d.set_vocab(torch.sort(torch.randperm(V)[:N]).values - torch.arange(N))
    return d


def ttt_batch(B=2, T=24, dtype=torch.float32, draft=None):
    ids = torch.randint(0, V, (B, T))
    mask = torch.zeros(B, T, dtype=torch.long)
    mask[:, 5:12] = 1
    mask[:, 15:21] = 1
    mask[1, 18:] = 0  # right padding of row 1
    tgt = torch.randint(0, V, (B, T))
    if draft is not None:  # mostly in the draft vocab, some not
        inv = draft.draft_to_target_ids()
        tgt = torch.where(torch.rand(B, T) < 0.8, inv[torch.randint(0, N, (B, T))], tgt)
    return {
        "input_ids_BT": ids, "loss_mask_BT": mask, "target_ids_BT": tgt,
        "aux_hidden_BTKH": torch.randn(B, T, 3 * HT, dtype=dtype),
        "last_hidden_BTH": torch.randn(B, T, HT, dtype=dtype),
    }
