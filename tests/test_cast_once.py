"""Weights every TTT step reads are cast to the autocast dtype once per ``ttt_loss`` (``cast_once``),
not once per step, and nothing else changes:

* under bf16 autocast the loss, counters and every gradient are bit-identical to the per-step casts
  (the old behaviour, rebuilt here by making ``cast_once`` cast at every use);
* counted with a dispatch mode: ``aten._to_copy`` of ``lm_head.weight`` runs once per ``ttt_loss``
  (7 TTT steps), and of the fused q/k/v weight's hidden half once; control: the per-use casts show 7.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specforge.algorithms.eagle3 import loss as loss_module
from specforge.algorithms.eagle3 import model as model_module
from specforge.algorithms.eagle3.loss import ttt_loss
from specforge.algorithms.eagle3.model import Eagle3Draft, Eagle3DraftConfig

V, N, HT, L = 300, 100, 48, 7


def _per_use(W):
    """The behaviour before cast_once: every use casts (autocast for F.linear, .to(dt) in the loss)."""
    return lambda: W


@pytest.fixture
def per_step_casts(monkeypatch):
    monkeypatch.setattr(loss_module, "cast_once", _per_use)
    monkeypatch.setattr(model_module, "cast_once", _per_use)


def _setup():
    cfg = Eagle3DraftConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, vocab_size=V, draft_vocab_size=N, target_hidden_size=HT)
    torch.manual_seed(11)
    d = Eagle3Draft(cfg)
    d.reset_parameters(std=0.1)
    B, T = 2, 40
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 30:] = 0
    batch = {"input_ids_BT": torch.randint(0, V, (B, T)), "loss_mask_BT": mask,
             "target_ids_BT": d.draft_to_target_ids()[torch.randint(0, N, (B, T))],
             "aux_hidden_BTKH": torch.randn(B, T, 3 * HT), "last_hidden_BTH": torch.randn(B, T, HT)}
    return d, batch, torch.randn(N, HT)


def _run(d, batch, W):
    d.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, counts = ttt_loss(d, batch, W, ttt_length=L)
    loss.backward()
    return loss.detach(), counts, {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}


class _CastCounter(TorchDispatchMode):
    """Counts ``aten._to_copy`` whose input is one of ``watched`` (by data pointer and shape: the fused
    q/k/v weight's two halves share a storage and a shape)."""

    def __init__(self, watched: dict):
        super().__init__()
        self.watched = {name: (t.data_ptr(), t.shape) for name, t in watched.items()}
        self.counts = dict.fromkeys(watched, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor):
            key = (args[0].data_ptr(), args[0].shape)
            for name, w in self.watched.items():
                self.counts[name] += key == w
        return func(*args, **(kwargs or {}))


def _count_casts(d, batch, W) -> dict:
    counter = _CastCounter({"lm_head": d.lm_head.weight})
    seen_hid = []
    real = d.qkv_weights

    def qkv_weights():  # watch the hidden half the forward actually uses
        w_emb, w_hid = real()
        counter.watched["w_hid"] = (w_hid.data_ptr(), w_hid.shape)
        counter.counts.setdefault("w_hid", 0)
        seen_hid.append(w_hid)
        return w_emb, w_hid

    d.qkv_weights = qkv_weights
    try:
        with counter, torch.autocast("cpu", dtype=torch.bfloat16):
            ttt_loss(d, batch, W, ttt_length=L)
    finally:
        del d.qkv_weights
    assert len(seen_hid) == 1 and seen_hid[0].shape == (d.midlayer.self_attn.q_proj.weight.shape[0]
                                                         + 2 * d.midlayer.self_attn.k_proj.weight.shape[0],
                                                         d.config.hidden_size)
    return counter.counts


def test_the_hoisted_casts_are_bit_identical_to_per_step_casts(monkeypatch):
    d, batch, W = _setup()
    new = _run(d, batch, W)
    monkeypatch.setattr(loss_module, "cast_once", _per_use)
    monkeypatch.setattr(model_module, "cast_once", _per_use)
    old = _run(d, batch, W)
    assert torch.equal(new[0], old[0]) and torch.equal(new[1], old[1])
    assert new[2].keys() == old[2].keys() and "lm_head.weight" in new[2]
    for name in new[2]:
        assert torch.equal(new[2][name], old[2][name]), name
        assert new[2][name].dtype == torch.float32


def test_lm_head_is_cast_once_per_ttt_loss():
    d, batch, W = _setup()
    assert _count_casts(d, batch, W) == {"lm_head": 1, "w_hid": 1}


def test_control_per_step_casts_are_counted(per_step_casts):
    d, batch, W = _setup()
    assert _count_casts(d, batch, W) == {"lm_head": L, "w_hid": L}
