import json

import pytest

from specforge.config import DataConfig
from specforge.data import sharegpt as sg
from specforge.data.prepare import NO_LOSS_TOKENS, cache_key, prepare_dataset
from tests.helpers.data import CHATML, make_tokenizer, rec, write_jsonl


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture
def data_file(tmp_path):
    rows = [rec(f"question {i}", f"answer {i} hello world") for i in range(10)]
    rows.insert(3, "{broken")
    rows.insert(5, {"conversations": [{"from": "human", "value": "no reply"}]})
    rows.insert(7, {"conversations": [{"from": "robot", "value": "x"}, {"from": "gpt", "value": "y"}]})
    return write_jsonl(tmp_path / "d.jsonl", rows)


def test_prepare_stats_split_and_columns(tok, data_file, tmp_path):
    cfg = DataConfig(path=str(data_file), max_length=64, num_eval=3)
    out = prepare_dataset(cfg, tok, cache_dir=tmp_path / "cache", progress=False)
    s = out.stats
    assert (s.rows_read, s.rows_kept, s.rows_skipped) == (13, 10, 3)
    assert s.skipped == {sg.BAD_JSON: 1, sg.NO_ASSISTANT: 1, sg.UNKNOWN_ROLE: 1}
    assert [f["row"] for f in s.first_skips] == [3, 5, 7]
    assert (s.train_rows, s.eval_rows) == (7, 3) and len(out.train) == 7 and len(out.eval) == 3
    assert out.train.column_names == ["input_ids", "loss_mask", "length"]
    # eval = the LAST usable conversations, in order
    assert [tok.decode(r["input_ids"]).split("\n")[1] for r in out.eval] == [
        "question 7<|im_end|>", "question 8<|im_end|>", "question 9<|im_end|>"
    ]
    row = out.train[0]
    assert row["length"] == len(row["input_ids"]) == len(row["loss_mask"])
    masked = tok.decode([i for i, m in zip(row["input_ids"], row["loss_mask"]) if m])
    assert masked == "answer 0 hello world<|im_end|>"
    all_rows = list(out.train) + list(out.eval)
    assert s.tokens == sum(r["length"] for r in all_rows)
    assert s.loss_tokens == sum(sum(r["loss_mask"]) for r in all_rows)
    assert s.truncated == 0 and not s.cache_hit
    table = s.table()
    assert "rows skipped" in table and sg.BAD_JSON in table and "row 3" in table


def test_truncation_and_no_loss_rows(tok, tmp_path):
    long_q = "question " * 60
    rows = [rec("q", "answer hello"), rec(long_q, "answer"), rec("q", "answer " * 60)]
    p = write_jsonl(tmp_path / "t.jsonl", rows)
    out = prepare_dataset(DataConfig(path=str(p), max_length=32, num_eval=0), tok, cache_dir=None, progress=False)
    s = out.stats
    assert s.skipped == {NO_LOSS_TOKENS: 1}  # the long question leaves no assistant token in 32
    assert s.rows_kept == 2 and s.truncated == 2  # both long rows were cut
    assert max(r["length"] for r in out.train) == 32


def test_max_samples_counts_usable_rows(tok, data_file):
    cfg = DataConfig(path=str(data_file), max_length=64, max_samples=4, num_eval=1)
    out = prepare_dataset(cfg, tok, cache_dir=None, progress=False)
    assert out.stats.rows_kept == 4 and len(out.train) == 3 and len(out.eval) == 1
    assert out.stats.rows_read == 5  # stopped reading after the 4th usable row (one bad line before it)


def test_cache_reuse_and_invalidation(tok, data_file, tmp_path):
    cache = tmp_path / "cache"
    cfg = DataConfig(path=str(data_file), max_length=64, num_eval=2)
    first = prepare_dataset(cfg, tok, cache_dir=cache, progress=False)
    again = prepare_dataset(cfg, tok, cache_dir=cache, progress=False)
    assert again.stats.cache_hit and again.cache_key == first.cache_key
    assert again.stats.skipped == first.stats.skipped and list(again.train) == list(first.train)

    # a changed tokenizer (one more added token) must not reuse the cache
    tok2 = make_tokenizer(extra_tokens=["<|extra|>"])
    other = prepare_dataset(cfg, tok2, cache_dir=cache, progress=False)
    assert not other.stats.cache_hit and other.cache_key != first.cache_key

    # a changed chat template must not reuse the cache, and must change the rows
    template = CHATML.replace("'\n' + message['content']", "':\n' + message['content']")
    other = prepare_dataset(cfg, tok, chat_template=template, cache_dir=cache, progress=False)
    assert not other.stats.cache_hit and other.cache_key != first.cache_key
    assert list(other.train) != list(first.train)
    tok_t = make_tokenizer()
    tok_t.chat_template = template  # the tokenizer's own template changed: same
    assert cache_key(cfg, tok_t, tok_t.chat_template) == other.cache_key

    # changed data bytes, max_length, max_samples: new keys
    keys = {first.cache_key}
    for c in (DataConfig(path=str(data_file), max_length=65, num_eval=2),
              DataConfig(path=str(data_file), max_length=64, max_samples=5, num_eval=2)):
        keys.add(cache_key(c, tok, CHATML))
    with open(data_file, "a") as f:
        f.write(json.dumps(rec("new", "new answer")) + "\n")
    keys.add(cache_key(cfg, tok, CHATML))
    assert len(keys) == 4
    changed = prepare_dataset(cfg, tok, cache_dir=cache, progress=False)
    assert not changed.stats.cache_hit and changed.stats.rows_kept == first.stats.rows_kept + 1


def test_no_usable_row_is_a_clear_error(tok, tmp_path):
    p = write_jsonl(tmp_path / "bad.jsonl", ["{nope", {"conversations": []}, rec("q", "")])
    with pytest.raises(ValueError, match="no usable conversation among 3 rows"):
        prepare_dataset(DataConfig(path=str(p), num_eval=0), tok, cache_dir=None, progress=False)
    p = write_jsonl(tmp_path / "few.jsonl", [rec("q", "a")])
    with pytest.raises(ValueError, match="num_eval"):
        prepare_dataset(DataConfig(path=str(p), num_eval=1), tok, cache_dir=None, progress=False)


def test_missing_template(data_file):
    t = make_tokenizer()
    t.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        prepare_dataset(DataConfig(path=str(data_file)), t, cache_dir=None, progress=False)


def test_embedded_small(tmp_path):
    from specforge.config import EMBEDDED_DATA

    tok = make_tokenizer()
    cfg = DataConfig(path=EMBEDDED_DATA, max_samples=20, num_eval=4, max_length=256)
    out = prepare_dataset(cfg, tok, cache_dir=tmp_path, progress=False)
    assert out.stats.rows_kept == 20 and len(out.eval) == 4
    assert out.stats.loss_tokens > 0


def test_num_proc_matches_serial(tok, data_file):
    serial = prepare_dataset(DataConfig(path=str(data_file), max_length=64, num_eval=2), tok, cache_dir=None,
                             progress=False)
    par = prepare_dataset(DataConfig(path=str(data_file), max_length=64, num_eval=2, num_proc=2), tok, cache_dir=None,
                          progress=False)
    assert list(par.train) == list(serial.train) and list(par.eval) == list(serial.eval)
    assert par.stats.skipped == serial.stats.skipped and par.stats.first_skips == serial.stats.first_skips


def test_cli_prepare_with_vocab(tmp_path, data_file, monkeypatch, capsys):
    import specforge.data.__main__ as data_main
    from specforge.data.__main__ import main
    from specforge.data.vocab import load_draft_vocab

    monkeypatch.setattr(data_main, "load_tokenizer", lambda model_cfg: make_tokenizer())
    vocab_out = tmp_path / "vocab.safetensors"
    rc = main(["prepare", f"data.path={data_file}", "data.num_eval=2", "data.max_length=64",
               f"model.cache_dir={tmp_path}", "--vocab-out", str(vocab_out), "draft.vocab_size=50", "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "rows read" in out and "13" in out and sg.UNKNOWN_ROLE in out and "draft vocab: 50 of" in out
    v = load_draft_vocab(vocab_out)
    assert v.draft_vocab_size == 50 and v.target_vocab_size == len(make_tokenizer())
    assert main(["prepare", "data.bogus=1"]) == 2


def test_a_cached_split_reads_as_datasets_reads_it(tok, data_file, tmp_path):
    """The cache is ``datasets``' own layout; we read it with pyarrow (``TokenRows``): every way a
    split is read gives what ``datasets.load_from_disk`` gives for the same files, and an empty
    split (saved with no data file) reads as empty."""
    import datasets

    out = prepare_dataset(DataConfig(path=str(data_file), max_length=64, num_eval=3), tok,
                          cache_dir=tmp_path / "cache", progress=False)
    theirs = datasets.load_from_disk(out.stats.cache_path + "/train")
    ours = out.train
    assert len(ours) == len(theirs) == 7 and ours.column_names == theirs.column_names
    assert list(ours) == list(theirs)
    for key in (0, 6, -1, -7, [4, 0, 4], slice(2, 5), slice(None, 3), slice(5, None), slice(9, 12), "length",
                "input_ids"):
        got, want = ours[key], theirs[key]
        assert got == (list(want) if isinstance(key, str) else want), key
    for bad in (7, -8):
        with pytest.raises(IndexError):
            ours[bad]
    empty = prepare_dataset(DataConfig(path=str(data_file), max_length=64, num_eval=0), tok,
                            cache_dir=tmp_path / "cache", progress=False).eval
    assert len(empty) == 0 and list(empty) == [] and empty["length"] == [] and empty[0:2] == {
        "input_ids": [], "loss_mask": [], "length": []}


def test_a_cache_hit_does_not_import_datasets(tok, data_file, tmp_path):
    """A worker opening the cache pays no ``datasets`` import (~0.7 CPU-s a process); building the
    cache (a miss, the control) does use it."""
    import subprocess
    import sys

    tok.save_pretrained(tmp_path / "tok")
    code = f"""
import sys
from transformers import AutoTokenizer
from specforge.config import DataConfig
from specforge.data.prepare import prepare_dataset
tok = AutoTokenizer.from_pretrained({str(tmp_path / 'tok')!r})
cfg = DataConfig(path={str(data_file)!r}, max_length=64, num_eval=3)
hit = prepare_dataset(cfg, tok, cache_dir={str(tmp_path / 'cache')!r}, progress=False)
print(hit.stats.cache_hit, 'datasets' in sys.modules, len(hit.train))
miss = prepare_dataset(cfg, tok, cache_dir={str(tmp_path / 'other')!r}, progress=False)
print(miss.stats.cache_hit, 'datasets' in sys.modules, len(miss.train))
"""
    prepare_dataset(DataConfig(path=str(data_file), max_length=64, num_eval=3), tok, cache_dir=tmp_path / "cache",
                    progress=False)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["True False 7", "False True 7"], out.stdout
