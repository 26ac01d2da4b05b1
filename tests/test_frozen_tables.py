"""models/layers.hold_frozen_tables: the target's tables a draft copies (frozen embedding; DFlash's
lm_head too) held in the bf16 autocast dtype when that holds them exactly. Half their bytes, the same
training: a bf16-autocast run from a bf16 target trains bit for bit as with the fp32 tables (EAGLE-3,
P-EAGLE, DFlash), and the memory model counts the tables at 2 bytes. Controls: a table bf16 would
round stays fp32; without autocast nothing moves."""

import json
from pathlib import Path

import pytest
import torch

from specforge import memory
from specforge.config import load_config
from specforge.models.layers import frozen_tables, hold_frozen_tables
from tests.helpers.ray_run import cfg_overrides

ALGOS = {
    "eagle3": [],
    "peagle": ["draft.algorithm=peagle", "draft.vocab_size=64", "draft.parallel_tokens=3"],
    "dflash": ["draft.algorithm=dflash", "draft.block_size=4", "draft.num_anchors=6", "draft.num_layers=2"],
}


def _run(assets, out, algorithm, monkeypatch, hold: bool):
    """Three bf16-autocast steps from a bf16 target; ``hold`` False replaces the lever by a no-op.
    Returns (losses, grad norms, the bytes the lever saved in the trainer)."""
    import specforge.training.trainer as trainer_mod
    from specforge.train import run

    saved = []

    def lever(draft, dtype):
        saved.append(hold_frozen_tables(draft, dtype) if hold else 0)
        return saved[-1]

    monkeypatch.setattr(trainer_mod, "hold_frozen_tables", lever)
    base = [a for a in cfg_overrides(assets, out) if not a.startswith(("model.dtype", "train.precision",
                                                                       "train.num_workers", "train.max_steps"))]
    extra = ALGOS[algorithm]
    if extra:
        base = [a for a in base if not a.startswith("draft.")]
    run(load_config(None, [*base, *extra, "model.dtype=bfloat16", "train.precision=bf16", "train.num_workers=1",
                           "train.max_steps=3"]))
    recs = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r["kind"] == "train"]
    return [r["loss"] for r in recs], [r.get("grad_norm") for r in recs], sum(saved)


@pytest.mark.parametrize("algorithm", list(ALGOS))
def test_a_bf16_run_trains_bit_for_bit_with_its_tables_in_bf16(assets, tmp_path, monkeypatch, algorithm):
    held = _run(assets, tmp_path / "held", algorithm, monkeypatch, hold=True)
    plain = _run(assets, tmp_path / "plain", algorithm, monkeypatch, hold=False)
    assert held[2] > 0 and plain[2] == 0  # the lever moved tables in one run only
    assert held[0] == plain[0] and held[1] == plain[1], (held, plain)


def _embedding_draft(exact: bool):
    from specforge.algorithms.dflash.model import DFlashConfig, DFlashDraft

    torch.manual_seed(0)
    draft = DFlashDraft(DFlashConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                     head_dim=8, vocab_size=100, num_hidden_layers=1, num_target_layers=4,
                                     target_layer_ids=[0], block_size=4, mask_token_id=99))
    E, W = torch.randn(100, 32), torch.randn(100, 32)
    draft.set_target_weights(E.bfloat16().float() if exact else E, W.bfloat16().float())
    return draft


def test_the_tables_move_only_when_bf16_holds_them_and_autocast_is_16_bit():
    draft = _embedding_draft(exact=True)
    tables = frozen_tables(draft)
    assert {type(m).__name__ for m in tables} == {"Embedding", "Linear"}
    before = memory.DraftParams.of(draft, tables16=True).frozen_bytes
    ids = torch.randint(0, 100, (2, 5))
    want = draft.embed_tokens(ids)
    assert hold_frozen_tables(draft, None) == 0 and draft.embed_tokens.weight.dtype == torch.float32  # fp32 compute
    assert hold_frozen_tables(draft, torch.bfloat16) == 2 * 100 * 32 * 2
    assert draft.embed_tokens.weight.dtype == draft.lm_head.weight.dtype == torch.bfloat16
    got = draft.embed_tokens(ids)
    assert got.dtype == torch.float32 and torch.equal(got, want)  # lookups come back as the table was
    # the memory model's count of the held tables is what the held draft holds
    assert memory.DraftParams.of(draft).frozen_bytes == before
    # control: an embedding bf16 would round stays fp32 (only the exact lm_head moves)
    inexact = _embedding_draft(exact=False)
    assert hold_frozen_tables(inexact, torch.bfloat16) == 100 * 32 * 2
    assert inexact.embed_tokens.weight.dtype == torch.float32 and inexact.lm_head.weight.dtype == torch.bfloat16
