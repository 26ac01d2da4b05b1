"""Tokenize conversations once, cache them with ``datasets``, and split train/eval.

``prepare_dataset`` reads the conversations (:mod:`specforge.data.sharegpt`), tokenizes them
with the exact assistant loss mask (:mod:`specforge.data.template`), and stores the result as
an Arrow dataset (``datasets.Dataset.save_to_disk``), memory-mapped when loaded back, so every
worker reads the same tokenized rows without holding a copy. A split comes back as
:class:`TokenRows`: the saved Arrow files read with pyarrow (what ``datasets`` reads them with),
not through ``datasets``, whose import alone costs a process ~0.7 CPU-s (every train and rollout
worker, driver and CLI opens the cache); it reads as ``datasets.Dataset`` does.

Columns: ``input_ids`` (list<int32>), ``loss_mask`` (list<int8>, 1 = assistant token),
``length`` (int32).

Cache key = sha256 over: the pipeline version, the data files' CONTENT (full sha256 of every
file: the embedded ShareGPT file is 125 MB and hashes in ~0.3 s, negligible next to
tokenizing it; a multi-GB dataset would pay a few seconds, still cheaper than any risk of a
stale cache from an edited-in-place file with a preserved mtime), the tokenizer (its full
serialized ``tokenizer.json`` incl. added tokens, plus its class name), the chat template text,
``max_length`` and ``max_samples`` (and ``num_eval``, which decides the split), and ``min_length`` /
``join_parts`` when set (left out at their defaults, so older caches keep their keys). A different
tokenizer or template therefore never reuses a stale cache.

Rows: ``max_samples`` keeps the first N usable conversations (usable = normalized and at least
one loss token after truncation, and at least ``min_length`` tokens; with ``join_parts`` a
conversation is every consecutive part of one chat, see ``data/sharegpt.py``). The eval split is the LAST \
``num_eval`` of the kept rows
(deterministic, never trained on); train is everything before it. Order is the source order;
shuffling is the sampler's job (a pure function of seed, epoch, step).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import numpy as np
from tqdm.auto import tqdm

from specforge.config import DataConfig
from specforge.data.sharegpt import Conversation, iter_conversations, resolve_data_files
from specforge.data.template import TemplateError, resolve_chat_template, tokenize_conversation
from specforge.environment import env_defaults
from specforge.files import publish_folder

PIPELINE_VERSION = "specforge-data-v1"
NO_LOSS_TOKENS = "no loss tokens after truncation"
TEMPLATE_FAILED = "chat template failed"
TOO_SHORT = "shorter than data.min_length"
MAX_EXAMPLES = 8  # first skip examples kept in the stats


@dataclass
class DataStats:
    rows_read: int = 0
    rows_kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count
    first_skips: list[dict] = field(default_factory=list)  # [{"row", "reason", "detail", "source"}]
    tokens: int = 0
    loss_tokens: int = 0
    truncated: int = 0
    train_rows: int = 0
    eval_rows: int = 0
    seconds: float = 0.0
    cache_hit: bool = False
    cache_path: Optional[str] = None

    @property
    def rows_skipped(self) -> int:
        return sum(self.skipped.values())

    def skip(self, conv_index: int, reason: str, detail: str = "", source: str = "") -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if len(self.first_skips) < MAX_EXAMPLES:
            self.first_skips.append({"row": conv_index, "reason": reason, "detail": detail, "source": source})

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["rows_skipped"] = self.rows_skipped
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DataStats":
        d = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**d)

    def table(self) -> str:
        """A human-readable statistics table."""
        lines = [
            f"{'rows read':<40}{self.rows_read:>12,}",
            f"{'rows kept':<40}{self.rows_kept:>12,}",
            f"{'  train / eval':<40}{f'{self.train_rows:,} / {self.eval_rows:,}':>12}",
            f"{'rows skipped':<40}{self.rows_skipped:>12,}",
        ]
        for reason, n in sorted(self.skipped.items(), key=lambda kv: (-kv[1], kv[0])):
            lines.append(f"{'  ' + reason:<40}{n:>12,}")
        lines += [
            f"{'tokens':<40}{self.tokens:>12,}",
            f"{'loss tokens':<40}{self.loss_tokens:>12,}",
            f"{'  loss fraction':<40}{(self.loss_tokens / max(self.tokens, 1)):>12.3f}",
            f"{'truncated rows':<40}{self.truncated:>12,}",
            f"{'seconds':<40}{self.seconds:>12.1f}",
            f"{'cache':<40}{'hit' if self.cache_hit else 'built':>12}",
        ]
        if self.cache_path:
            lines.append(f"cache path: {self.cache_path}")
        if self.first_skips:
            lines.append("first skipped rows:")
            for s in self.first_skips:
                det = f" ({s['detail']})" if s.get("detail") else ""
                lines.append(f"  row {s['row']} [{s.get('source', '')}]: {s['reason']}{det}")
        return "\n".join(lines)


class TokenRows:
    """A tokenized split (an Arrow table: ``input_ids``, ``loss_mask``, ``length``) read as
    ``datasets.Dataset`` reads it: ``rows[i]`` a row as a dict of lists, ``rows[[i, j]]`` and
    ``rows[a:b]`` a dict of columns, ``rows["length"]`` a column as a list; ``.data`` the table
    (memory-mapped from the cache)."""

    def __init__(self, table):
        self.data = table

    @property
    def column_names(self) -> list[str]:
        return list(self.data.column_names)

    def __len__(self) -> int:
        return self.data.num_rows

    def _rows(self, table) -> dict:
        return {name: table.column(name).to_pylist() for name in table.column_names}

    def __getitem__(self, key):
        if isinstance(key, str):
            return self.data.column(key).to_pylist()
        if isinstance(key, slice):
            return self._rows(self.data.slice(*_span(key, len(self))))
        if isinstance(key, (int, np.integer)):
            i = int(key) + (len(self) if key < 0 else 0)
            if not 0 <= i < len(self):
                raise IndexError(f"row {key} of a split of {len(self)} rows")
            return {name: col[0] for name, col in self._rows(self.data.slice(i, 1)).items()}
        return self._rows(self.data.take([int(i) for i in key]))

    def __iter__(self):
        for batch in self.data.to_batches(max_chunksize=256):
            cols = {name: batch.column(name).to_pylist() for name in batch.schema.names}
            for i in range(batch.num_rows):
                yield {name: col[i] for name, col in cols.items()}


def _span(s: slice, n: int) -> tuple[int, int]:
    start, stop, step = s.indices(n)
    if step != 1:
        raise ValueError(f"a split is sliced in steps of 1, not {step}")
    return start, max(0, stop - start)


@dataclass
class PreparedData:
    train: TokenRows
    eval: TokenRows
    stats: DataStats
    cache_key: str


# ---------------------------------------------------------------- hashing


def tokenizer_fingerprint(tokenizer) -> str:
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:  # slow tokenizers cannot be used for the mask anyway, but hash something faithful
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(getattr(tokenizer, "special_tokens_map", {}), sort_keys=True, default=str).encode())
    return h.hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def cache_key(data_cfg: DataConfig, tokenizer, chat_template: str) -> str:
    h = hashlib.sha256(PIPELINE_VERSION.encode())
    for f in resolve_data_files(data_cfg.path):
        h.update(f"\0file:{f.name}:{_file_sha256(f)}".encode())
    h.update(f"\0tok:{tokenizer_fingerprint(tokenizer)}".encode())
    h.update(b"\0template:" + chat_template.encode())
    h.update(f"\0max_length={data_cfg.max_length};max_samples={data_cfg.max_samples};num_eval={data_cfg.num_eval}".encode())
    if data_cfg.min_length or data_cfg.join_parts:
        h.update(f";min_length={data_cfg.min_length};join_parts={data_cfg.join_parts}".encode())
    return h.hexdigest()[:24]


# ---------------------------------------------------------------- building


_WORKER_TOK = None
_WORKER_ARGS: tuple = ()


def _worker_init(tokenizer, max_length, chat_template, min_length=0):
    global _WORKER_TOK, _WORKER_ARGS
    _WORKER_TOK, _WORKER_ARGS = tokenizer, (max_length, chat_template, min_length)


def _tokenize_one(conv: Conversation):
    return _tokenize(_WORKER_TOK, conv, *_WORKER_ARGS)


def _tokenize(tokenizer, conv: Conversation, max_length: int, chat_template: str, min_length: int = 0):
    """-> (conv, ids int32 array | None, mask int8 array | None, truncated, reason, detail)."""
    if not conv.ok:
        return conv, None, None, False, conv.reason, conv.detail
    try:
        ids, mask, truncated = tokenize_conversation(tokenizer, conv.messages, max_length, chat_template)
    except TemplateError as e:
        return conv, None, None, False, TEMPLATE_FAILED, str(e)[:200]
    if not any(mask):
        return conv, None, None, truncated, NO_LOSS_TOKENS, f"{len(ids)} tokens"
    if len(ids) < min_length:
        return conv, None, None, truncated, TOO_SHORT, f"{len(ids)} < {min_length} tokens"
    return conv, np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.int8), truncated, None, ""


def _load_split(path: Path) -> TokenRows:
    """A split ``datasets`` saved (``save_to_disk``: its ``state.json`` names Arrow stream files),
    memory-mapped; an empty one (data.num_eval=0), which ``datasets`` saves with no data file, as
    an empty split."""
    import pyarrow as pa  # lazy: heavy (pyarrow)

    files = [f["filename"] for f in json.loads((path / "state.json").read_text()).get("_data_files") or []]
    if not files:
        return _to_dataset([], [])
    tables = [pa.ipc.open_stream(pa.memory_map(str(path / f))).read_all() for f in files]
    return TokenRows(tables[0] if len(tables) == 1 else pa.concat_tables(tables))


def _save_split(rows: TokenRows, path: Path) -> None:
    """``datasets``' own layout (``load_from_disk`` reads it; so does :func:`_load_split`)."""
    import datasets  # lazy: heavy (datasets)

    datasets.Dataset(rows.data).save_to_disk(str(path))


def _to_dataset(ids_list: list, mask_list: list) -> TokenRows:
    import pyarrow as pa  # lazy: heavy (pyarrow)

    lengths = np.array([len(x) for x in ids_list], dtype=np.int32)
    offsets = np.zeros(len(ids_list) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat_ids = np.concatenate(ids_list) if ids_list else np.zeros(0, np.int32)
    flat_mask = np.concatenate(mask_list) if mask_list else np.zeros(0, np.int8)
    table = pa.table({
        "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat_ids, type=pa.int32())),
        "loss_mask": pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat_mask, type=pa.int8())),
        "length": pa.array(lengths, type=pa.int32()),
    })
    return TokenRows(table)


def _iter_tokenized(convs: Iterable[Conversation], tokenizer, max_length: int, chat_template: str, num_proc: int,
                    min_length: int = 0):
    if num_proc <= 1:
        for conv in convs:
            yield _tokenize(tokenizer, conv, max_length, chat_template, min_length)
        return

    ctx = mp.get_context("fork")
    init = (tokenizer, max_length, chat_template, min_length)
    with env_defaults({"TOKENIZERS_PARALLELISM": "false"}), ctx.Pool(num_proc, _worker_init, init) as pool:
        # imap keeps source order; the pool is terminated on exit if we stop early (max_samples)
        yield from pool.imap(_tokenize_one, convs, chunksize=32)


def _build(data_cfg: DataConfig, tokenizer, chat_template: str,
           progress: bool) -> tuple[TokenRows, TokenRows, DataStats]:
    stats = DataStats()
    t0 = time.perf_counter()
    ids_list, mask_list = [], []
    limit = data_cfg.max_samples
    bar = tqdm(total=limit, desc="tokenizing conversations", unit="conv", disable=not progress, mininterval=1.0)
    try:
        for conv, ids, mask, truncated, reason, detail in _iter_tokenized(
            iter_conversations(data_cfg.path, data_cfg.join_parts), tokenizer, data_cfg.max_length, chat_template,
            data_cfg.num_proc, data_cfg.min_length,
        ):
            stats.rows_read += 1
            if reason is not None:
                stats.skip(conv.index, reason, detail, conv.source)
                if reason == NO_LOSS_TOKENS and truncated:
                    stats.truncated += 1
                continue
            stats.rows_kept += 1
            stats.truncated += int(truncated)
            stats.tokens += len(ids)
            stats.loss_tokens += int(mask.sum())
            ids_list.append(ids)
            mask_list.append(mask)
            bar.update(1)
            if limit is not None and stats.rows_kept >= limit:
                break
    finally:
        bar.close()
    if stats.rows_kept == 0:
        reasons = ", ".join(f"{r}: {n}" for r, n in stats.skipped.items()) or "no rows at all"
        raise ValueError(f"data.path {data_cfg.path!r}: no usable conversation among {stats.rows_read} rows "
                         f"({reasons})")
    n_train = split_point(stats.rows_kept, data_cfg.num_eval)
    n_eval = stats.rows_kept - n_train
    if n_train == 0:
        raise ValueError(
            f"data.path {data_cfg.path!r}: only {stats.rows_kept} usable conversations and data.num_eval="
            f"{data_cfg.num_eval} leaves none to train on; lower data.num_eval"
        )
    train = _to_dataset(ids_list[:n_train], mask_list[:n_train])
    eval_ = _to_dataset(ids_list[n_train:], mask_list[n_train:])
    stats.train_rows, stats.eval_rows = n_train, n_eval
    stats.seconds = time.perf_counter() - t0
    return train, eval_, stats


def split_point(rows_kept: int, num_eval: int) -> int:
    """THE held-out rule (``data/heldout.py`` reads it for eval and regenerate): rows before the eval split \
among ``rows_kept`` usable rows (the train split's size)."""
    return rows_kept - min(max(num_eval, 0), rows_kept)


def prepare_dataset(
    data_cfg: DataConfig,
    tokenizer,
    chat_template: Optional[str] = None,
    cache_dir: Optional[Union[str, Path]] = "~/.cache/specforge",
    progress: bool = True,
) -> PreparedData:
    """Tokenized train/eval datasets + statistics, cached under ``<cache_dir>/data/<key>``.

    ``chat_template`` overrides the tokenizer's template (e.g. ``cfg.model.chat_template``).
    ``cache_dir=None`` builds in memory without touching the disk.
    """

    template = resolve_chat_template(tokenizer, chat_template)
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("prepare_dataset needs a fast tokenizer (offset mapping for the loss mask)")
    t0 = time.perf_counter()
    key = cache_key(data_cfg, tokenizer, template)
    if cache_dir is None:
        train, eval_, stats = _build(data_cfg, tokenizer, template, progress)
        return PreparedData(train, eval_, stats, key)

    root = Path(cache_dir).expanduser() / "data"
    out = root / key
    if (out / "stats.json").is_file():
        stats = DataStats.from_dict(json.loads((out / "stats.json").read_text()))
        stats.cache_hit, stats.cache_path = True, str(out)
        stats.seconds = time.perf_counter() - t0
        return PreparedData(_load_split(out / "train"), _load_split(out / "eval"), stats, key)

    train, eval_, stats = _build(data_cfg, tokenizer, template, progress)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{key}-"))
    try:
        _save_split(train, tmp / "train")
        _save_split(eval_, tmp / "eval")
        (tmp / "meta.json").write_text(json.dumps({
            "pipeline_version": PIPELINE_VERSION, "data_path": str(data_cfg.path), "max_length": data_cfg.max_length,
            "max_samples": data_cfg.max_samples, "num_eval": data_cfg.num_eval, "chat_template": template,
            "min_length": data_cfg.min_length, "join_parts": data_cfg.join_parts,
        }, indent=1))
        (tmp / "stats.json").write_text(json.dumps(stats.to_dict(), indent=1))  # written last: marks complete
        publish_folder(tmp, out, "stats.json")  # atomic; a concurrent builder that won the race is fine too
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    stats.cache_path = str(out)
    stats.seconds = time.perf_counter() - t0
    # Hand back the memory-mapped copies (what every later run sees).
    return PreparedData(_load_split(out / "train"), _load_split(out / "eval"), stats, key)
