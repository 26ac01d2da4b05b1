"""The EAGLE-3 train step the CPU benchmarks time: a SmolLM2-135M-shaped draft, a batch of random
target features with a realistic loss mask, and one step (zero_grad, TTT forward, backward, AdamW).

Shared by ``bench_ttt.py`` (its step), ``launches.py`` (the launch proxy, at other shapes), and the
SP, save, pack and GPU-step benchmarks; it imports no other benchmark, so none of them imports a
benchmark script to reach it.
"""

from __future__ import annotations

import time

import torch

from specforge.algorithms.eagle3.model import Eagle3Draft, Eagle3DraftConfig
from specforge.device import autocast

TARGET = dict(hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, vocab=49152)
TTT_LENGTH = 7

# The draft's compute dtype under test (None = fp32, no autocast): a benchmark sets it once before its steps.
AMP: "torch.dtype | None" = torch.bfloat16


def realistic_loss_mask(B: int, T: int, gen: torch.Generator) -> torch.Tensor:
    """Alternating user (0) / assistant (1) spans; about 60% ones."""
    mask = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        t = int(torch.randint(10, 40, (1,), generator=gen))  # system + first user turn
        while t < T:
            a = int(torch.randint(40, 160, (1,), generator=gen))
            mask[b, t : t + a] = 1
            t += a + int(torch.randint(30, 110, (1,), generator=gen))
    return mask


def make_draft(N: int, shape: dict = TARGET, attention: str = "auto") -> Eagle3Draft:
    cfg = Eagle3DraftConfig(
        hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"], vocab_size=shape["vocab"], draft_vocab_size=N, target_hidden_size=shape["hidden"],
        rope_theta=100000.0, max_position_embeddings=8192, aux_layer_ids=[1, 14, 26], attention=attention,
    )
    draft = Eagle3Draft(cfg)
    g = torch.Generator().manual_seed(0)
    ids = torch.sort(torch.randperm(shape["vocab"], generator=g)[:N]).values
    draft.set_vocab(ids - torch.arange(N))
    return draft


def feature_dtype() -> torch.dtype:
    """Features as the trainer computes on them: bf16 under autocast, upcast to fp32 without."""
    return AMP or torch.float32


def make_batch(B: int, T: int, draft: Eagle3Draft, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    H, V, N = draft.config.hidden_size, draft.config.vocab_size, draft.config.draft_vocab_size
    in_vocab = draft.draft_to_target_ids()[torch.randint(0, N, (B, T), generator=g)]
    tgt = torch.where(torch.rand(B, T, generator=g) < 0.9, in_vocab, torch.randint(0, V, (B, T), generator=g))
    return {
        "input_ids_BT": torch.randint(0, V, (B, T), generator=g),
        "loss_mask_BT": realistic_loss_mask(B, T, g),
        "target_ids_BT": tgt,
        "aux_hidden_BTKH": torch.randn(B, T, 3 * H, generator=g).to(feature_dtype()),
        "last_hidden_BTH": torch.randn(B, T, H, generator=g).to(feature_dtype()),
    }


def train_step(draft, opt, batch, teacher_W, fn) -> float:
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    with autocast(torch.device("cpu"), AMP):
        loss, _ = fn(draft, batch, teacher_W, ttt_length=TTT_LENGTH)
    loss.backward()
    opt.step()
    return time.perf_counter() - t0
