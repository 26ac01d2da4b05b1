"""Served traffic -> training rows: read the log from where the last round stopped, skip and count
what is malformed, drop duplicates, and split by content hash into the rows a round trains on and
the held-out slice its gate measures (a row is in one of them for ever: the gate's prompts are never
trained on).

A traffic row is what the proxy records, ``{"messages": [...], "completion": str}`` (the completion
becomes the last assistant turn), or any row ``specforge.data`` reads (``messages`` or ShareGPT
``conversations`` with the assistant turns in them). Rows are normalized by
``data.sharegpt.normalize_record``, so a row adapt keeps is a row training reads the same way.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from specforge.data.sharegpt import BAD_JSON, EMPTY_CONTENT, NO_TURNS, NOT_OBJECT, MalformedRow, normalize_record

UNPARSED = "upstream answer not understood"


def row_messages(obj) -> list[dict]:
    """The normalized conversation of one traffic row; MalformedRow (with a reason) otherwise."""
    if not isinstance(obj, dict):
        raise MalformedRow(NOT_OBJECT, type(obj).__name__)
    if obj.get("unparsed"):
        raise MalformedRow(UNPARSED)
    if "completion" in obj:
        done, msgs = obj["completion"], obj.get("messages")
        if not isinstance(msgs, list):
            raise MalformedRow(NO_TURNS, "a completion row needs a messages list")
        if not isinstance(done, str) or not done.strip():
            raise MalformedRow(EMPTY_CONTENT, "completion")
        obj = {"messages": [*msgs, {"role": "assistant", "content": done}]}
    return normalize_record(obj)


def row_key(messages: list[dict]) -> str:
    return hashlib.sha256(json.dumps(messages, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def held_out(key: str, share: float) -> bool:
    """Whether a row (by its content hash) belongs to the gate's held-out slice."""
    return int(key[:8], 16) % 10_000 < round(share * 10_000)


@dataclass
class Ingested:
    train: int = 0  # new rows appended for training
    gate: int = 0  # new rows appended to the held-out slice
    duplicates: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> rows
    offset: int = 0  # bytes of the traffic file consumed

    def summary(self) -> str:
        bad = ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items()))
        return (f"{self.train} new training rows, {self.gate} new held-out rows, {self.duplicates} duplicates"
                + (f", skipped {sum(self.skipped.values())} malformed ({bad})" if bad else ""))


class Ledger:
    """The rows adapt keeps: ``rows.jsonl`` (train; sample id = line number) and ``gate.jsonl``."""

    def __init__(self, root: Path, holdout_share: float):
        self.train_path, self.gate_path = root / "rows.jsonl", root / "gate.jsonl"
        self.share = holdout_share
        self.keys: set[str] = set()
        self.counts = {"train": 0, "gate": 0}
        for kind, path in (("train", self.train_path), ("gate", self.gate_path)):
            for messages in self._read(path):
                self.keys.add(row_key(messages))
                self.counts[kind] += 1

    @staticmethod
    def _read(path: Path) -> list[list[dict]]:
        if not path.is_file():
            return []
        out = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line)["messages"])
            except (ValueError, KeyError, TypeError):  # a torn last line of a killed process
                continue
        return out

    def gate_rows(self) -> list[list[dict]]:
        return self._read(self.gate_path)

    def _parse(self, traffic: Path, offset: int, keys: set[str]) -> tuple[Ingested, dict[str, list[str]]]:
        """The new rows of ``traffic`` from byte ``offset`` to its last complete line (``keys``: the
        rows already kept, updated), split into training and held-out lines; nothing written."""
        out = Ingested(offset=offset)
        add: dict[str, list[str]] = {"train": [], "gate": []}
        if not traffic.is_file():
            return out, add
        with open(traffic, "rb") as f:
            f.seek(offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # an unfinished last line is read next time
        for raw in data[:end].splitlines():
            if not raw.strip():
                continue
            try:
                messages = row_messages(json.loads(raw))
            except (ValueError, UnicodeDecodeError) as e:
                out.skipped[e.reason if isinstance(e, MalformedRow) else BAD_JSON] += 1
                continue
            key = row_key(messages)
            if key in keys:
                out.duplicates += 1
                continue
            keys.add(key)
            add["gate" if held_out(key, self.share) else "train"].append(json.dumps({"messages": messages},
                                                                                   ensure_ascii=False))
        out.train, out.gate, out.offset = len(add["train"]), len(add["gate"]), offset + end
        return out, add

    def preview(self, traffic: Path, offset: int) -> Ingested:
        """What ``ingest`` would add, without adding it (adapt's checks before any work)."""
        return self._parse(traffic, offset, set(self.keys))[0]

    def ingest(self, traffic: Path, offset: int) -> Ingested:
        """Rows of ``traffic`` from byte ``offset`` to its last complete line."""
        out, add = self._parse(traffic, offset, self.keys)
        for kind, path in (("train", self.train_path), ("gate", self.gate_path)):
            if add[kind]:
                with open(path, "a", encoding="utf-8") as f:
                    f.write("".join(line + "\n" for line in add[kind]))
                self.counts[kind] += len(add[kind])
        return out
