"""Long samples: ``data.join_parts`` (consecutive ShareGPT V3 parts of one chat joined),
``data.min_length`` (only rows of at least that many tokens), the held-out rule under both, and
``--long`` eval prompts (``heldout.long_prompts``) cut from held-out conversations only."""

import pytest

from specforge.cli import run_cli
from specforge.config import DataConfig, load_config
from specforge.data import sharegpt as sg
from specforge.data.heldout import heldout_rows, heldout_sources, last_reply_start, long_prompts
from specforge.data.prepare import TOO_SHORT, cache_key, prepare_dataset
from specforge.data.template import tokenize_conversation
from tests.helpers.data import make_tokenizer, write_jsonl


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def part(chat, n, *turns):
    """A ShareGPT V3 part: ``turns`` alternate human/gpt unless a turn is given as (role, text)."""
    conv = [{"from": t[0], "value": t[1]} if isinstance(t, tuple) else
            {"from": "human" if i % 2 == 0 else "gpt", "value": t} for i, t in enumerate(turns)]
    return {"id": f"{chat}_{n}" if n is not None else chat, "conversations": conv}


def test_consecutive_parts_of_a_chat_are_joined(tmp_path):
    rows = [part("a", 0, "q1", "a1"), part("a", 1, ("gpt", "a1 continued"), ("human", "q2"), ("gpt", "a2")),
            part("b", 0, "qb", "ab"), "{broken", part("a", 2, "late q", "late a"), part("c", None, "qc", "ac"),
            part("c", 3, "qc3", "ac3")]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    plain = list(sg.iter_conversations(path))
    assert [c.rows for c in plain] == [(i,) for i in range(7)]
    assert plain[1].messages[0]["role"] == "user"  # alone, part a_1's leading reply is dropped
    joined = list(sg.iter_conversations(path, join_parts=True))
    assert [c.rows for c in joined] == [(0, 1), (2,), (3,), (4,), (5, 6)]  # a_2 is not next to a_0/a_1
    assert [m["content"] for m in joined[0].messages] == ["q1", "a1", "a1 continued", "q2", "a2"]
    assert joined[2].reason == sg.BAD_JSON and joined[3].messages[0]["content"] == "late q"
    assert [c.index for c in joined] == [0, 2, 3, 4, 5]  # a joined chat keeps its first part's row


def test_min_length_keeps_long_rows_and_the_split_holds(tok, tmp_path):
    words = "hello world user assistant system question answer".split()
    rows = []
    for i in range(12):  # chats of 1..3 parts, each part 2 turns; lengths vary with i
        for n in range(1 + i % 3):
            rows.append(part(f"c{i}", n, " ".join(words[: 2 + (i + n) % 5]), " ".join(words[(i + n) % 4:])))
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    base = [f"data.path={path}", "data.max_length=256", "data.num_eval=2", "data.join_parts=true"]
    every = prepare_dataset(load_config(None, base).data, tok, cache_dir=None, progress=False)
    lengths = sorted(list(every.train["length"]) + list(every.eval["length"]))
    cut = lengths[len(lengths) // 2]
    cfg = load_config(None, [*base, f"data.min_length={cut}"])
    long = prepare_dataset(cfg.data, tok, cache_dir=tmp_path / "cache", progress=False)
    kept = list(long.train["length"]) + list(long.eval["length"])
    assert min(kept) >= cut and len(kept) == sum(n >= cut for n in lengths) < len(lengths)
    assert long.stats.skipped == {TOO_SHORT: len(lengths) - len(kept)}
    parts = [len(tokenize_conversation(tok, c.messages, 256)[0]) for c in sg.iter_conversations(path) if c.ok]
    assert max(kept) > max(parts)  # joined chats: longer than any part alone
    # the held-out rule agrees with prepare's split, and a held-out chat shares no row with training
    held = heldout_sources(cfg.data, tok, tok.chat_template)
    convs = list(sg.iter_conversations(path, join_parts=True))
    got = sorted(tokenize_conversation(tok, c.messages, 256)[0] for c in convs if c.index in held)
    assert got == sorted(list(r) for r in long.eval["input_ids"])
    train_rows = {i for c in convs if c.ok and c.index not in held for i in c.rows}
    assert held and not held & train_rows and all(set(c.rows) <= held for c in convs if c.index in held)
    assert [list(r["input_ids"]) for r in heldout_rows(cfg, tok)] == [list(r) for r in long.eval["input_ids"]]
    # the cache key moves with the new keys, and stays what it was without them
    assert (cache_key(cfg.data, tok, tok.chat_template)
            != cache_key(load_config(None, base).data, tok, tok.chat_template))
    plain = DataConfig(path=str(path), max_length=256, num_eval=2)
    assert cache_key(plain, tok, tok.chat_template) == cache_key(DataConfig(path=str(path), max_length=256, num_eval=2,
                                                                            min_length=0), tok, tok.chat_template)


@pytest.mark.parametrize("override, needle", [
    ("data.min_length=-1", "'data.min_length'=-1 must be >= 0"),
    ("data.min_length=600", "'data.min_length'=600 exceeds data.max_length=512"),
    ("data.join_parts=maybe", "data.join_parts"),
])
def test_bad_long_data_keys_are_one_error_line(override, needle, capsys):
    assert run_cli(lambda: load_config(None, ["data.max_length=512", override])) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


def test_long_prompts_take_the_longest_heldout_contexts(tok, tmp_path):
    rows = [part(f"t{i}", None, "question hello", "answer world") for i in range(6)]
    rows += [part("h0", None, "hello", "world", "question", "answer", "user", "system"),  # held out: 3 replies
             part("h1", None, "question", "answer"),  # held out: 1 reply
             part("h2", None, "hello", "world", "user " * 30, "assistant")]  # held out: a long 2nd turn
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = load_config(None, [f"data.path={path}", "data.max_length=16", "data.num_eval=3"])
    held = heldout_sources(cfg.data, tok, tok.chat_template)
    assert held == {6, 7, 8}
    full = {i: tokenize_conversation(tok, sg.load_conversations(path)[i], 10_000)
            for i in held}
    prompts = long_prompts(cfg, tok, num=2, max_prompt_tokens=1000)
    # the two longest: h0 cut before its 3rd reply and h2 before its 2nd (rows read past data.max_length=16)
    ids0, mask0, _ = full[6]
    ids2, mask2, _ = full[8]
    assert prompts == [ids0[: last_reply_start(mask0, 1000)], ids2[: last_reply_start(mask2, 1000)]]
    assert len(prompts[1]) > cfg.data.max_length
    assert tok.decode(prompts[0]).endswith("<|im_start|>assistant\n") and "user" in tok.decode(prompts[0])
    # a limit below h0's last reply moves its cut to an earlier reply; min_prompt_tokens drops short ones
    short = long_prompts(cfg, tok, num=3, max_prompt_tokens=last_reply_start(mask0, 1000) - 1)
    assert ids0[: last_reply_start(mask0, last_reply_start(mask0, 1000) - 1)] in short
    assert all(len(p) >= 20 for p in long_prompts(cfg, tok, num=3, max_prompt_tokens=1000, min_prompt_tokens=20))
    assert last_reply_start([0, 0, 1, 1, 0, 1], 10) == 5 and last_reply_start([0, 0, 1, 1, 0, 1], 4) == 2
    assert last_reply_start([0, 0], 5) is None
