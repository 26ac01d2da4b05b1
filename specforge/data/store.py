"""The offline feature store: target features of many samples, packed into safetensors shards.

``python -m specforge.capture`` (and ``specforge.regenerate``) write it with
:class:`FeatureStoreWriter`; offline training reads it memory-mapped with :class:`FeatureStore`,
a third feature source beside in-process capture and p2p receive.

A store folder::

    index.json               format, meta (what the features mean), dtype, complete, and per shard:
                             file, bytes, sha256, tokens, samples [{id, offset, length}]
    shard-00000.safetensors  many samples concatenated along T:
                             input_ids int32[N], loss_mask uint8[N], target_ids int32[N],
                             aux_hidden [N, kH], last_hidden [N, H]   (bfloat16 stores), or
                             int8 rows + aux_scale f32[N, k], last_scale f32[N, 1],
                             aux_col f32[kH], last_col f32[H]                  (int8 stores)

A reading process checks each shard's size and sha256 against the index at the shard's first open, before
any sample of it is read: bytes changed after the capture (a truncated copy, a flipped bit, another job's
write) stop the run naming the shard; deleting it and rerunning the capture redoes its samples alone.

Only complete shards are in the index: a shard is written to ``*.tmp`` and renamed, then the
index is rewritten the same way, so an interrupted capture leaves a valid store of the samples
done so far; a rerun skips them (``done()``) and writes new shards only. Files the index does not
name are stale and get overwritten. ``append_samples`` adds new samples to a complete store
(duplicates skipped) and rewrites the index only at its end.

int8 (SmoothQuant-style): x[t, c] = q[t, c] * row[t, layer] * col[c]. ``col`` (one per shard) =
the shard's column absmax ** alpha takes out the few massive-activation channels (SmolLM2: a channel
absmax of ~25,000 beside a median of ~42; one plain absmax scale per row then leaves ~5% error and
flips 2-3% of the teacher's argmax); ``row`` = per-token absmax of x / col, per captured layer (each
layer has its own range). Measured on SmolLM2 features: 0.6% (aux) / 0.7% (last) relative error.

Legend: B batch, T tokens, H target hidden, k captured layers (3).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from collections import OrderedDict
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch
from safetensors import SafetensorError
from safetensors.torch import save

from specforge import failpoints
from specforge.data.prepare import tokenizer_fingerprint
from specforge.files import human_bytes, open_safetensors
from specforge.models.features import TrainBatch, feature_flags, refuse_bad_features
from specforge.models.target import FINGERPRINT_FILES, checkpoint_fingerprint, config_hash

FORMAT = "specforge-feature-store-v1"
INDEX = "index.json"
STORE_DTYPES = ("bfloat16", "int8")
DISK_MARGIN = 1.05  # filesystem overhead + the index; refuse before starting, not 90% in
_ID_BYTES = 4 + 4 + 1  # input_ids int32, target_ids int32, loss_mask uint8
_MAX_OPEN = 64  # memory-mapped shard handles kept open (LRU), well under the usual fd limit
# Smoothing exponents, picked on SmolLM2 features (0.25-1.0 tried): the captured layers have the
# massive channels (0.5 best), the last hidden state is normed (0.75 best for the teacher argmax).
_ALPHA = {"aux_hidden": 0.5, "last_hidden": 0.75}
_QUANT_ROWS = 4096  # tokens quantized at a time at flush (bounds the float32 temporaries)


def _stamp(path: Path) -> Optional[tuple]:
    """(inode, size, mtime) of a file, None where it is missing: a write to it or its replacement changes
    it (one stat, ~3 us: taken at each read of a shard)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns) if stat.S_ISREG(st.st_mode) else None


@dataclass(frozen=True)
class StoreMeta:
    """What the features mean. A store is only used by a run whose meta is equal."""

    target: str  # target_fingerprint(target)
    tokenizer: str  # specforge.data.prepare.tokenizer_fingerprint
    vocab_size: int
    aux_layer_ids: tuple[int, ...]
    hidden_size: int
    max_length: int  # data.max_length the samples were cut to
    source: str  # what the samples are: the tokenized-data cache key, or "regenerated:<hash>"

    def __post_init__(self) -> None:  # a list from a caller or from JSON compares equal to the tuple
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))


# ---------------------------------------------------------------- identity


def target_fingerprint(target, like: Optional[str] = None) -> str:
    """What a store records of the target it holds features of (``meta.target``), in the kind ``like`` (a
    fingerprint a store recorded) is of; None: the kind a new store gets.

    The kind a new store gets is ``checkpoint_fingerprint``'s (``files:...``): read from the checkpoint's
    safetensors, so a process that holds only the target's head (an engine's capture,
    ``load_target(head_only=True)``) and one that holds the whole model compute the same. A target
    without such files (a model built in memory) and stores written before it have the model's kind:
    a hash of its config, weight names and shapes, and a strided sample of every weight in memory.
    Either way the sampled values are rounded to bf16 first, so a float32 and a bfloat16 copy of the same
    checkpoint agree (features differ by rounding only), while a different checkpoint of the same
    architecture does not.
    """
    if like is None or fingerprint_kind(like) == "files":
        found = checkpoint_fingerprint(getattr(target, "path", None))
        if found is not None or like is not None:
            return found or FINGERPRINT_FILES + "none (no safetensors files to read)"  # of the kind: compared
    model = getattr(target, "model", target)
    if any(p.is_meta for p in model.parameters()):
        raise ValueError(f"the store's target fingerprint ({like!r}) is of the kind read from the whole model, and "
                         "this process holds only the target's head; load the whole target (rollout.backend=hf) "
                         "or capture into a new store.dir")
    h = config_hash(model.config.to_dict())
    for name, w in sorted(model.state_dict().items()):
        flat = w.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 4096)][:4096].to(torch.bfloat16).cpu()
        h.update(f"{name}:{tuple(w.shape)}:".encode())
        h.update(sample.view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:24]


def fingerprint_kind(fingerprint: str) -> str:
    """``files`` or ``model``: which of ``target_fingerprint``'s kinds a recorded fingerprint is."""
    return "files" if fingerprint.startswith(FINGERPRINT_FILES) else "model"


def store_meta(cfg, target, source: str, like: Optional[str] = None) -> StoreMeta:
    """The meta of features of ``target`` on the samples ``source`` names, cut to data.max_length; its
    target fingerprint of ``like``'s kind (a store's recorded one: what to compare with), else a new store's."""
    tok = target.tokenizer
    return StoreMeta(
        target=target_fingerprint(target, like),
        tokenizer=tokenizer_fingerprint(tok) if tok is not None else "none",
        vocab_size=int(target.config.vocab_size),
        aux_layer_ids=target.aux_layer_ids,
        hidden_size=int(target.config.hidden_size),
        max_length=int(cfg.data.max_length),
        source=source,
    )


def recorded_fingerprint(root) -> Optional[str]:
    """The target fingerprint a store at ``root`` records (complete or not), None where there is none yet."""
    root = Path(root).expanduser()
    return _load_index(root)["meta"].target if (root / INDEX).is_file() else None


def head_only_capture(root) -> bool:
    """May a capture into the store at ``root`` hold only the target's head beside its engine? Yes, but for a
    store (being resumed) whose target fingerprint is of the kind read from the whole model."""
    found = recorded_fingerprint(root)
    return found is None or fingerprint_kind(found) == "files"


def store_root(cfg) -> Path:
    """``store.dir``, or ``<train.output_dir>/features``."""
    return Path(cfg.store.dir or Path(cfg.train.output_dir) / "features").expanduser()


def meta_differences(a: StoreMeta, b: StoreMeta, a_name: str, b_name: str, ignore: tuple[str, ...] = ()) -> list[str]:
    """``field (a_name: value, b_name: value)`` for every meta field (but ``ignore``) where ``a`` and ``b`` differ."""
    return [f"{f.name} ({a_name}: {getattr(a, f.name)!r}, {b_name}: {getattr(b, f.name)!r})"
            for f in fields(StoreMeta) if f.name not in ignore and getattr(a, f.name) != getattr(b, f.name)]


def check_meta(found: StoreMeta, expected: StoreMeta, root) -> None:
    """ValueError naming every field where the store differs from what this run expects."""
    diffs = meta_differences(found, expected, "store", "this run")
    if diffs:
        raise ValueError(
            f"feature store {root} was captured for a different setup: {'; '.join(diffs)}; "
            f"point store.dir elsewhere or recapture with python -m specforge.capture"
        )


def check_store_target(store, target, key: str) -> None:
    """ValueError naming config ``key`` where ``store`` records another target than ``target`` (in the
    fingerprint kind the store recorded)."""
    want = target_fingerprint(target, like=store.meta.target)
    if store.meta.target != want:
        raise ValueError(f"config key {key!r}={str(store.root)!r} holds features of another target (fingerprint "
                         f"{store.meta.target}, this run's target: {want}); name a store captured with this "
                         "model.target_path")


def check_replay_meta(own, ref) -> None:
    """A reference store replayed beside a run's own store must hold features of the same kind:
    every meta field but ``source`` (what the samples are) equal, else a ValueError naming each. Two target
    fingerprints of different kinds (``fingerprint_kind``: a store written before the files kind beside one
    written after) are not compared here: where a run has a target, it holds each store against it in the
    store's own kind (``check_store_target``)."""
    apart = fingerprint_kind(own.meta.target) != fingerprint_kind(ref.meta.target)
    diffs = meta_differences(own.meta, ref.meta, str(own.root), str(ref.root),
                             ignore=("source", "target") if apart else ("source",))
    if diffs:
        raise ValueError(f"config key 'store.replay_dir'={str(ref.root)!r} holds features of another setup than the "
                         f"run's store: {'; '.join(diffs)}; replay a store captured with the same target, tokenizer, "
                         "aux layers and data.max_length")


# ---------------------------------------------------------------- sizes and disk


def bytes_per_token(hidden_size: int, dtype: str, num_aux: int = 3) -> float:
    """On-disk bytes per token: hidden rows + int8 scales (if any) + input/target ids + loss mask."""
    rows = (num_aux + 1) * hidden_size
    if dtype == "bfloat16":
        return rows * 2 + _ID_BYTES
    if dtype == "int8":
        return rows + (num_aux + 1) * 4 + _ID_BYTES
    raise ValueError(f"store.dtype {dtype!r}: expected one of {', '.join(STORE_DTYPES)}")


def check_disk(root, nbytes: int) -> None:
    """ValueError if the filesystem of ``root`` cannot hold ``nbytes`` plus a 5% margin."""
    where = Path(root).expanduser().absolute()
    while not where.exists():  # the store folder may not exist yet
        where = where.parent
    free = shutil.disk_usage(where).free
    need = int(nbytes * DISK_MARGIN)
    if need > free:
        raise ValueError(
            f"not enough disk space for the feature store {root}: needs {human_bytes(need)} "
            f"(expected size + 5%), {human_bytes(free)} free on {where}; free space, set store.dir "
            f"to a larger disk, or use store.dtype=int8"
        )


# ---------------------------------------------------------------- int8 rows


def quantize_rows(x_TW: torch.Tensor, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one absmax scale per token per group of W/groups columns."""
    T, W = x_TW.shape
    x = x_TW.float().view(T, groups, W // groups)
    scale_TG = x.abs().amax(-1).clamp_min(1e-12) / 127.0
    q = (x / scale_TG[..., None]).round_().clamp_(-127, 127).to(torch.int8)
    return q.view(T, W), scale_TG


def dequantize_rows(q_TW: torch.Tensor, scale_TG: torch.Tensor, col_W: Optional[torch.Tensor] = None) -> torch.Tensor:
    T, W = q_TW.shape
    G = scale_TG.shape[1]
    x = (q_TW.view(T, G, W // G).float() * scale_TG[..., None]).view(T, W)
    return x if col_W is None else x.mul_(col_W)


def quantize_smooth(x_TW: torch.Tensor, groups: int, alpha: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int8 [T, W], row scales f32 [T, groups], column scales f32 [W]): x ~ q * row * col."""
    col_W = x_TW.abs().amax(0).float().clamp_min(1e-6).pow(alpha)
    parts = [quantize_rows(x_TW[s : s + _QUANT_ROWS].float() / col_W, groups)
             for s in range(0, x_TW.shape[0], _QUANT_ROWS)]
    return torch.cat([q for q, _ in parts]), torch.cat([r for _, r in parts]), col_W


# ---------------------------------------------------------------- files


def _atomic_write(path: Path, data: bytes) -> None:
    """Write to ``*.tmp``, fsync, rename: readers see the old file or the whole new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if path.name == INDEX:
        failpoints.hit("store.index")
    os.replace(tmp, path)


def _load_index(root: Path) -> dict:
    path = root / INDEX
    if not path.is_file():
        raise ValueError(f"no feature store at {root} ({INDEX} missing); write one with python -m specforge.capture")
    try:
        idx = json.loads(path.read_text())
        meta = StoreMeta(**idx["meta"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"feature store index {path} is corrupt ({type(e).__name__}: {e})") from e
    if idx.get("format") != FORMAT:
        raise ValueError(f"feature store index {path} has format {idx.get('format')!r}, expected {FORMAT!r}")
    idx["meta"] = meta
    return idx


def _shard_name(number: int) -> str:
    return f"shard-{number:05d}.safetensors"


def restore_index(root: Path, index: Optional[bytes]) -> None:
    """Put a store back to an index it had (its bytes, as read before appending): the index written
    atomically, the shards it does not name removed. ``None``: there was no store; remove it."""
    root = Path(root)
    if index is None:
        shutil.rmtree(root, ignore_errors=True)
        return
    keep = {sh["file"] for sh in json.loads(index).get("shards", [])}
    _atomic_write(root / INDEX, index)
    for f in root.glob("shard-*"):
        if f.name not in keep:
            f.unlink()


# ---------------------------------------------------------------- writing


class FeatureStoreWriter:
    """Pack samples into shards of about ``shard_mb``; resumes a store with the same meta.

    Use as a context manager: a clean exit flushes the last shard and marks the store complete;
    an exception leaves the store as of its last complete shard (what a killed process leaves),
    so a rerun produces the same shards as an uninterrupted run.
    """

    def __init__(self, root, meta: StoreMeta, dtype: str = "bfloat16", shard_mb: float = 256.0,
                 index_at_close: bool = False):
        bytes_per_token(meta.hidden_size, dtype)  # validates dtype
        if shard_mb <= 0:
            raise ValueError(f"store.shard_mb must be > 0, got {shard_mb}")
        self.root, self.meta, self.dtype = Path(root).expanduser(), meta, dtype
        self.root.mkdir(parents=True, exist_ok=True)
        self._shard_bytes = shard_mb * 2**20
        self._shards = self._resume()
        self._done = {s["id"] for sh in self._shards for s in sh["samples"]}
        self._next = 1 + max((int(sh["file"].split("-")[1].split(".")[0]) for sh in self._shards), default=-1)
        self._buf: list[tuple[int, dict[str, torch.Tensor]]] = []
        self._buf_bytes = 0
        self._closed = False
        self._index_at_close = index_at_close  # True: the old index stands until close (append_samples)

    def _resume(self) -> list[dict]:
        """The intact shards of an existing store at root (none for a new store)."""
        if not (self.root / INDEX).is_file():
            return []
        idx = _load_index(self.root)
        check_meta(idx["meta"], self.meta, self.root)
        if idx["dtype"] != self.dtype:
            raise ValueError(f"feature store {self.root} holds {idx['dtype']} features but store.dtype is "
                             f"{self.dtype!r}; set store.dtype={idx['dtype']} or point store.dir elsewhere")
        keep = []
        for sh in idx["shards"]:
            path = self.root / sh["file"]
            if path.is_file() and path.stat().st_size == sh["bytes"]:
                keep.append(sh)
            else:  # its samples are captured again into a new shard
                print(f"feature store: {path} is missing or truncated; its {len(sh['samples'])} samples will be redone")
        return keep

    def __enter__(self) -> "FeatureStoreWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        self._closed = True

    def done(self) -> set[int]:
        """Sample ids already in complete shards (callers skip them)."""
        return set(self._done)

    def add(self, sample_id: int, input_ids_T, loss_mask_T, aux_hidden_TKH, last_hidden_TH, target_ids_T) -> None:
        """Buffer one sample's features; writes a shard when the buffer reaches shard_mb."""
        if self._closed:
            raise ValueError("FeatureStoreWriter.add after close")
        sample_id = int(sample_id)
        if sample_id in self._done or any(sid == sample_id for sid, _ in self._buf):
            raise ValueError(f"sample id {sample_id} is already in the feature store {self.root}")
        enc = self._encode(input_ids_T, loss_mask_T, aux_hidden_TKH, last_hidden_TH, target_ids_T)
        self._buf.append((sample_id, enc))
        m = self.meta  # shard_mb counts bytes on disk (the buffer holds bf16 for int8 stores)
        self._buf_bytes += enc["input_ids"].shape[0] * bytes_per_token(m.hidden_size, self.dtype, len(m.aux_layer_ids))
        if self._buf_bytes >= self._shard_bytes:
            self._flush()

    def _encode(self, input_ids, loss_mask, aux, last, target_ids) -> dict[str, torch.Tensor]:
        m, T = self.meta, int(input_ids.shape[0])
        k, H = len(m.aux_layer_ids), m.hidden_size
        want = {"loss_mask": (T,), "target_ids": (T,), "aux_hidden": (T, k * H), "last_hidden": (T, H)}
        got = {"loss_mask": loss_mask, "target_ids": target_ids, "aux_hidden": aux, "last_hidden": last}
        bad = [f"{n} {tuple(got[n].shape)} (expected {s})" for n, s in want.items() if tuple(got[n].shape) != s]
        if bad or T > m.max_length or T < 1:
            raise ValueError(f"feature store sample of {T} tokens (max_length {m.max_length}) has wrong shapes: "
                             f"{', '.join(bad) or 'length out of range'}")
        # never stored silently: NaN or inf, or a captured layer all zeros (counted on the features'
        # device and read after the host copy below, which waits for them anyway)
        flags = feature_flags(aux[None], None, k)
        # bf16 in the buffer for both dtypes (cast on the device: half the bytes to copy); int8
        # is quantized at flush, when the shard's column scales are known
        enc = {"input_ids": input_ids.to(torch.int32), "loss_mask": loss_mask.to(torch.uint8),
               "target_ids": target_ids.to(torch.int32), "aux_hidden": aux.to(torch.bfloat16),
               "last_hidden": last.to(torch.bfloat16)}
        enc = {n: t.cpu().contiguous() for n, t in enc.items()}
        refuse_bad_features(flags.tolist(), m.aux_layer_ids, f"feature store {self.root}: ")
        return enc

    def _flush(self) -> None:
        if not self._buf:
            return
        samples, offset = [], 0
        for sid, enc in self._buf:
            n = int(enc["input_ids"].shape[0])
            samples.append({"id": sid, "offset": offset, "length": n})
            offset += n
        tensors = {name: torch.cat([enc[name] for _, enc in self._buf]) for name in self._buf[0][1]}
        if self.dtype == "int8":
            for name, groups in (("aux_hidden", len(self.meta.aux_layer_ids)), ("last_hidden", 1)):
                short = name.split("_")[0]
                tensors[name], tensors[f"{short}_scale"], tensors[f"{short}_col"] = quantize_smooth(
                    tensors[name], groups, _ALPHA[name])
        data = save(tensors, metadata={"format": FORMAT})
        name = _shard_name(self._next)
        _atomic_write(self.root / name, data)
        self._shards.append({"file": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                             "tokens": offset, "samples": samples})
        self._done.update(s["id"] for s in samples)
        self._next += 1
        self._buf, self._buf_bytes = [], 0
        if not self._index_at_close:
            self._write_index(complete=False)

    def _write_index(self, complete: bool) -> None:
        idx = {"format": FORMAT, "meta": asdict(self.meta), "dtype": self.dtype, "complete": complete,
               "shards": self._shards}
        _atomic_write(self.root / INDEX, json.dumps(idx, sort_keys=True, separators=(",", ":")).encode())

    def close(self) -> None:
        """Flush the last partial shard and write the index marked complete."""
        if self._closed:
            return
        self._flush()
        self._write_index(complete=True)
        self._closed = True


def append_samples(root, samples: Iterable[tuple[int, dict[str, torch.Tensor]]],
                   shard_mb: float = 256.0) -> tuple[int, int]:
    """Add samples to the complete store at ``root``; returns (added, skipped). ``samples`` yields
    ``(sample_id, features)``, features named as ``FeatureStore.read`` returns them (input_ids,
    loss_mask, aux_hidden, last_hidden, target_ids): a sample id already in the store (or earlier
    in ``samples``) is skipped and counted. New samples go into new shards; the index is rewritten
    once, at the end, so an append that fails or is killed leaves the old store as it was."""
    idx = _load_index(Path(root).expanduser())
    if not idx["complete"]:
        raise ValueError(f"feature store {root} is incomplete; finish it (rerun its python -m specforge.capture) "
                         "before appending")
    added = skipped = 0
    with FeatureStoreWriter(root, idx["meta"], idx["dtype"], shard_mb, index_at_close=True) as w:
        seen = w.done()
        for sample_id, f in samples:
            if int(sample_id) in seen:
                skipped += 1
                continue
            w.add(sample_id, f["input_ids"], f["loss_mask"], f["aux_hidden"], f["last_hidden"], f["target_ids"])
            seen.add(int(sample_id))
            added += 1
    return added, skipped


# ---------------------------------------------------------------- reading


class FeatureStore:
    """A store opened for reading; shards are memory-mapped and only the rows asked for are copied.

    ``ids`` is sorted, so index ``i`` names the same sample on every rank and in every run (the
    sampler's ``global_batch_ids`` draws indices; the offline source maps them to ``ids[i]``).
    Hidden tensors come back as bfloat16 from bfloat16 stores and as float32 from int8 stores.
    """

    def __init__(self, root, expect: Optional[StoreMeta] = None, allow_partial: bool = False):
        self.root = Path(root).expanduser()
        idx = _load_index(self.root)
        self.meta: StoreMeta = idx["meta"]
        self.dtype: str = idx["dtype"]
        self.complete: bool = bool(idx["complete"])
        if expect is not None:
            check_meta(self.meta, expect, self.root)
        if not self.complete and not allow_partial:
            raise ValueError(f"feature store {self.root} is incomplete (its capture was interrupted); "
                             f"rerun the same python -m specforge.capture command to finish it")
        self._shards = idx["shards"]
        self._where = {s["id"]: (i, s["offset"], s["length"])
                       for i, sh in enumerate(self._shards) for s in sh["samples"]}
        self.ids: list[int] = sorted(self._where)
        self.lengths: dict[int, int] = {i: self._where[i][2] for i in self.ids}
        self._open: OrderedDict[int, object] = OrderedDict()
        self._verified: set[int] = set()  # shards whose sha256 this process checked (at their first open)
        self._seen: dict[int, tuple] = {}  # shard -> (inode, size, mtime) when it was checked

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def num_tokens(self) -> int:
        return sum(sh["tokens"] for sh in self._shards)

    def __getstate__(self) -> dict:  # picklable (e.g. to worker processes): handles are reopened (and checked) there
        return {**self.__dict__, "_open": OrderedDict(), "_verified": set(), "_seen": {}}

    def _handle(self, shard: int):
        """The open (memory-mapped) shard, after a cheap check that it is the file the index names."""
        sh = self._shards[shard]
        path = self.root / sh["file"]
        seen = _stamp(path)
        if shard in self._open:
            if seen == self._seen.get(shard):
                self._open.move_to_end(shard)
                return self._open[shard]
            # written to (or replaced) since it was checked, by another job while this run reads it: the
            # open handle would read the new bytes unchecked; drop it and check the file again
            del self._open[shard]
            self._verified.discard(shard)
        size = seen[1] if seen is not None else None
        if size != sh["bytes"]:
            state = ("is missing" if size is None
                     else f"is truncated or was modified ({size} bytes, index says {sh['bytes']})")
            raise ValueError(f"feature store shard {path} {state}; recapture with python -m specforge.capture")
        if shard not in self._verified or seen != self._seen.get(shard):  # before any sample is read
            self._check_sha256(sh)
            self._verified.add(shard)
            self._seen[shard] = seen
        handle = open_safetensors(path, "feature store shard", "recapture with python -m specforge.capture")
        try:
            if handle.get_slice("input_ids").get_shape() != [sh["tokens"]]:
                raise ValueError("input_ids length differs from the index")
        except (SafetensorError, OSError, ValueError, KeyError) as e:
            raise ValueError(f"feature store shard {path} is corrupt ({e}); "
                             f"recapture with python -m specforge.capture") from e
        self._open[shard] = handle
        if len(self._open) > _MAX_OPEN:
            self._open.popitem(last=False)
        return handle

    def read(self, sample_id: int, start: int = 0, stop: Optional[int] = None) -> dict[str, torch.Tensor]:
        """Tokens ``[start, stop)`` of one sample (default all): input_ids, loss_mask, target_ids
        int64 [T]; aux_hidden [T, kH]; last_hidden [T, H]. An SP rank can read just its slice."""
        if sample_id not in self._where:
            raise ValueError(f"sample id {sample_id} is not in the feature store {self.root}")
        shard, offset, n = self._where[sample_id]
        lo, hi = offset + min(start, n), offset + (n if stop is None else min(stop, n))
        h = self._handle(shard)
        try:
            t = {name: h.get_slice(name)[lo:hi] for name in h.keys() if not name.endswith("_col")}
            cols = {name: h.get_tensor(name) for name in h.keys() if name.endswith("_col")}
        except SafetensorError as e:
            raise ValueError(f"feature store shard {self.root / self._shards[shard]['file']} is corrupt ({e})") from e
        out = {name: t[name].long() for name in ("input_ids", "loss_mask", "target_ids")}
        if self.dtype == "int8":
            out["aux_hidden"] = dequantize_rows(t["aux_hidden"], t["aux_scale"], cols["aux_col"])
            out["last_hidden"] = dequantize_rows(t["last_hidden"], t["last_scale"], cols["last_col"])
        else:
            out["aux_hidden"], out["last_hidden"] = t["aux_hidden"], t["last_hidden"]
        return out

    def read_tokens(self, sample_id: int) -> dict[str, torch.Tensor]:
        """One sample's input_ids and loss_mask (int64 [T]) alone: the bytes of its ids, never its
        hidden states (what a process that only counts tokens, the driver, may read)."""
        if sample_id not in self._where:
            raise ValueError(f"sample id {sample_id} is not in the feature store {self.root}")
        shard, offset, n = self._where[sample_id]
        h = self._handle(shard)
        try:
            return {name: h.get_slice(name)[offset : offset + n].long() for name in ("input_ids", "loss_mask")}
        except SafetensorError as e:
            raise ValueError(f"feature store shard {self.root / self._shards[shard]['file']} is corrupt ({e})") from e

    def batch(self, sample_ids: Sequence[int], pad_id: int) -> TrainBatch:
        """The samples right-padded to the longest: pad id / loss mask 0 / zero features / target 0,
        as ``specforge.training.batch.collate`` pads ids and masks."""
        rows = [self.read(i) for i in sample_ids]
        T = max(r["input_ids"].shape[0] for r in rows)

        def stack(name: str, fill: int) -> torch.Tensor:
            first = rows[0][name]
            out = torch.full((len(rows), T, *first.shape[1:]), fill, dtype=first.dtype, device=first.device)
            for b, r in enumerate(rows):
                out[b, : r[name].shape[0]] = r[name]
            return out

        return TrainBatch(input_ids_BT=stack("input_ids", pad_id), loss_mask_BT=stack("loss_mask", 0),
                          aux_hidden_BTKH=stack("aux_hidden", 0), last_hidden_BTH=stack("last_hidden", 0),
                          target_ids_BT=stack("target_ids", 0),
                          length_B=torch.tensor([r["input_ids"].shape[0] for r in rows]))  # device: host (metadata)

    def verify(self) -> None:
        """Check every shard's sha256 against the index (reads the whole store once)."""
        for i, sh in enumerate(self._shards):
            seen = _stamp(self.root / sh["file"])
            self._check_sha256(sh)
            self._verified.add(i)
            self._seen[i] = seen

    def _check_sha256(self, sh: dict) -> None:
        """The shard's bytes hash to the sha256 the index recorded when it was written (~1.5 GB/s on one
        core; a ValueError naming the shard and how to capture its samples again otherwise)."""
        path = self.root / sh["file"]
        h = hashlib.sha256()
        try:
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    h.update(chunk)
        except OSError as e:
            raise ValueError(f"feature store shard {path} cannot be read ({e})") from e
        if h.hexdigest() != sh["sha256"]:
            raise ValueError(f"feature store shard {path} is corrupt (sha256 differs from the index: its bytes "
                             f"changed after it was written); delete it and rerun the python -m specforge.capture "
                             f"command that wrote {self.root}: it captures that shard's {len(sh['samples'])} "
                             "samples again")
