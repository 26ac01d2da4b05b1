import numpy as np
import pytest
import torch

from specforge.data.vocab import build_draft_vocab, count_loss_tokens, load_draft_vocab, save_draft_vocab

# Hand-made corpus over a target vocab of 10. Loss-masked counts:
#   token 7: 4, token 2: 3, token 5: 2, token 9: 2, token 1: 1
# unmasked tokens (0, 3, 8 and extra 2s) must not count.
ROWS = [
    {"input_ids": [0, 3, 7, 7, 2, 8], "loss_mask": [0, 0, 1, 1, 1, 0]},
    {"input_ids": [3, 3, 3, 9, 5, 7], "loss_mask": [0, 0, 0, 1, 1, 1]},
    {"input_ids": [2, 2, 2, 9, 5, 1, 7, 8], "loss_mask": [0, 1, 1, 1, 1, 1, 1, 0]},
]
V = 10


def test_counts_only_loss_tokens():
    counts = count_loss_tokens(ROWS, V)
    assert counts.tolist() == [0, 1, 3, 0, 0, 2, 0, 4, 0, 2]


def test_top_n_with_tie_break_and_sglang_layout():
    vocab = build_draft_vocab(ROWS, V, 3)  # 7 (4), 2 (3), then tie 5 vs 9 (2 each) -> 5 (lower id)
    assert vocab.target_ids.tolist() == [2, 5, 7]  # draft ids sorted by target id
    assert vocab.d2t.dtype == torch.int64 and vocab.d2t.tolist() == [2, 4, 5]  # target = draft + d2t
    assert vocab.t2d.dtype == torch.bool and vocab.t2d.shape == (V,)
    assert vocab.t2d.nonzero().flatten().tolist() == [2, 5, 7]
    assert vocab.coverage == pytest.approx(9 / 12)
    assert build_draft_vocab(ROWS, V, 4).target_ids.tolist() == [2, 5, 7, 9]


def test_fill_when_n_exceeds_distinct_tokens():
    vocab = build_draft_vocab(ROWS, V, 7)  # 5 distinct seen (1, 2, 5, 7, 9) + lowest unused ids 0, 3
    assert vocab.target_ids.tolist() == [0, 1, 2, 3, 5, 7, 9]
    assert vocab.coverage == 1.0
    full = build_draft_vocab(ROWS, V, V)
    assert full.target_ids.tolist() == list(range(V)) and full.d2t.tolist() == [0] * V


def test_counts_inputs_and_errors():
    counts = count_loss_tokens(ROWS, V)
    a = build_draft_vocab(counts, V, 3)
    b = build_draft_vocab(torch.from_numpy(counts), V, 3)
    c = build_draft_vocab({7: 4, 2: 3, 5: 2, 9: 2, 1: 1}, V, 3)
    assert a.target_ids.tolist() == b.target_ids.tolist() == c.target_ids.tolist() == [2, 5, 7]
    with pytest.raises(ValueError, match="draft vocab size"):
        build_draft_vocab(counts, V, V + 1)
    with pytest.raises(ValueError, match="outside"):
        build_draft_vocab([{"input_ids": [12], "loss_mask": [1]}], V, 2)
    with pytest.raises(ValueError, match="shape"):
        build_draft_vocab(np.zeros(V + 1), V, 2)


def test_from_datasets_dataset():
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    assert count_loss_tokens(ds, V).tolist() == count_loss_tokens(ROWS, V).tolist()
    sub = ds.select([2, 0])  # an indices mapping must be honoured
    assert count_loss_tokens(sub, V).tolist() == count_loss_tokens([ROWS[2], ROWS[0]], V).tolist()


def test_save_load_roundtrip_and_hash_check(tmp_path):
    vocab = build_draft_vocab(ROWS, V, 4)
    p = save_draft_vocab(vocab, tmp_path / "vocab.safetensors")
    back = load_draft_vocab(p)
    assert torch.equal(back.d2t, vocab.d2t) and torch.equal(back.t2d, vocab.t2d)
    assert back.content_hash() == vocab.content_hash() and back.coverage == pytest.approx(vocab.coverage)
    # tamper with the tensors but keep the stored hash
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(p), framework="pt") as f:
        meta = f.metadata()
    d2t = vocab.d2t.clone()
    d2t[0] += 1
    save_file({"d2t": d2t, "t2d": vocab.t2d}, str(p), metadata=meta)
    with pytest.raises(ValueError, match="hash"):
        load_draft_vocab(p)
