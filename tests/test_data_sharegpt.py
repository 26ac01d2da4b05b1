import json

import pytest

from specforge.config import EMBEDDED_DATA
from specforge.data import sharegpt as sg
from specforge.data.sharegpt import MalformedRow, iter_conversations, load_conversations, normalize_record


def conv(*turns, style="sharegpt"):
    if style == "sharegpt":
        return {"conversations": [{"from": r, "value": c} for r, c in turns]}
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


GOOD = conv(("human", "hi"), ("gpt", "hello"))
GOOD_MSG = conv(("user", "q"), ("assistant", "a"), style="messages")


def test_normalize_roles_and_styles():
    assert normalize_record(GOOD) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert normalize_record(GOOD_MSG) == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    mixed = {"messages": [{"from": "system", "value": "s"}, {"role": "human", "content": "u"},
                          {"from": "chatgpt", "value": "a"}]}
    assert [m["role"] for m in normalize_record(mixed)] == ["system", "user", "assistant"]
    for alias in ("bing", "bard", "GPT", "Assistant"):
        assert normalize_record(conv(("human", "u"), (alias, "a")))[1]["role"] == "assistant"


def test_leading_assistant_and_trailing_user_dropped():
    rec = conv(("gpt", "orphan answer"), ("human", "q"), ("gpt", "a"), ("human", "unanswered"))
    assert normalize_record(rec) == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    rec = conv(("system", "sys"), ("gpt", "orphan"), ("human", "q"), ("gpt", "a"))
    assert [m["content"] for m in normalize_record(rec)] == ["sys", "q", "a"]
    # consecutive same-role turns are kept as they are
    rec = conv(("human", "q1"), ("human", "q2"), ("gpt", "a"))
    assert [m["content"] for m in normalize_record(rec)] == ["q1", "q2", "a"]


@pytest.mark.parametrize(
    "record, reason",
    [
        ([1, 2], sg.NOT_OBJECT),
        ({"id": "x"}, sg.NO_TURNS),
        ({"conversations": "text"}, sg.NO_TURNS),
        ({"conversations": []}, sg.EMPTY_CONVERSATION),
        ({"conversations": ["hi"]}, sg.BAD_TURN),
        (conv(("human", "hi"), ("robot", "beep")), sg.UNKNOWN_ROLE),
        ({"conversations": [{"value": "no role"}]}, sg.UNKNOWN_ROLE),
        ({"conversations": [{"from": "human", "value": ["a"]}, {"from": "gpt", "value": "b"}]}, sg.NON_STRING_CONTENT),
        ({"conversations": [{"from": "human", "value": None}, {"from": "gpt", "value": "b"}]}, sg.NON_STRING_CONTENT),
        (conv(("human", "hi"), ("gpt", "")), sg.EMPTY_CONTENT),
        (conv(("human", "  \n"), ("gpt", "x")), sg.EMPTY_CONTENT),
        (conv(("human", "hi")), sg.NO_ASSISTANT),
        (conv(("gpt", "only an answer"), ("human", "q")), sg.NO_ASSISTANT),
    ],
)
def test_malformed_records(record, reason):
    with pytest.raises(MalformedRow) as e:
        normalize_record(record)
    assert e.value.reason == reason


def test_jsonl_with_bad_lines(tmp_path):
    p = tmp_path / "d.jsonl"
    lines = [json.dumps(GOOD), "{not json", "", json.dumps(conv(("human", "x"))), json.dumps(GOOD_MSG), "[1,"]
    p.write_text("\n".join(lines) + "\n")
    rows = list(iter_conversations(p))
    assert [(r.index, r.reason) for r in rows] == [
        (0, None), (1, sg.BAD_JSON), (2, sg.NO_ASSISTANT), (3, None), (4, sg.BAD_JSON)
    ]
    assert rows[1].source == "d.jsonl:2" and "d.jsonl:2" in rows[1].detail
    assert rows[3].messages[1]["content"] == "a"


def test_truncated_json_recovery(tmp_path):
    items = [GOOD, GOOD_MSG, conv(("human", "z"), ("gpt", "w, [with] {brackets} \"quotes\""))]
    text = json.dumps(items, indent=2)
    cut = text.rindex("brackets")  # truncated inside the last record
    p = tmp_path / "trunc.json"
    p.write_text(text[:cut])
    rows = list(iter_conversations(p))
    assert [r.ok for r in rows] == [True, True, False]
    assert rows[2].reason == sg.TRUNCATED_JSON
    assert load_conversations(p) == [normalize_record(GOOD), normalize_record(GOOD_MSG)]
    # complete file: all three, no skip
    p.write_text(text)
    assert len(load_conversations(p)) == 3 and all(r.ok for r in iter_conversations(p))


def test_folder_and_missing_path(tmp_path):
    (tmp_path / "b.jsonl").write_text(json.dumps(GOOD_MSG) + "\n")
    (tmp_path / "a.json").write_text(json.dumps([GOOD]))
    (tmp_path / "notes.txt").write_text("ignored")
    rows = list(iter_conversations(tmp_path))
    assert [r.messages[0]["content"] for r in rows] == ["hi", "q"]  # sorted: a.json then b.jsonl
    with pytest.raises(ValueError, match="does not exist"):
        list(iter_conversations(tmp_path / "nope.json"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="without .json"):
        list(iter_conversations(tmp_path / "empty"))


@pytest.mark.slow
def test_embedded_recovers_every_complete_conversation():
    rows = list(iter_conversations(EMBEDDED_DATA))
    # 17,671 complete records + the truncated tail reported as one skipped row
    assert len(rows) == 17_672
    assert rows[-1].reason == sg.TRUNCATED_JSON
    usable = [r for r in rows if r.ok]
    assert 17_000 < len(usable) < 17_671
    for r in usable[:200]:
        assert r.messages[-1]["role"] == "assistant"
        assert r.messages[0]["role"] in ("system", "user")
