"""Draft vocabulary: the N most frequent target tokens among the assistant (loss-masked) tokens.

Conventions (upstream EAGLE-3 / SGLang):

* draft ids are ordered by target id ascending: ``target_ids = sorted(selected)``;
* ``d2t`` int64[N] holds OFFSETS: ``target_id = draft_id + d2t[draft_id]``;
* ``t2d`` bool[V] is True for target ids in the draft vocab.

Selection: count only tokens with ``loss_mask == 1``; take the N highest counts, ties broken by
the lower token id (deterministic). When fewer than N distinct tokens were seen, the rest is
filled with the lowest target ids not selected yet (an honest, simple choice: those tokens are
never seen in assistant text, so any fill is arbitrary; low ids are usually the byte/special
tokens, which keeps the fill stable and harmless).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import numpy as np
import torch
from safetensors.torch import save_file

from specforge.files import open_safetensors

# The draft-vocab file of a draft that predicts the target's whole vocabulary (DFlash's family, MTP):
# the ids the data use most, no more (DFlash picks its mask token outside them)
MOST_USED_IDS = 32000

__all__ = ["DraftVocab", "count_loss_tokens", "build_draft_vocab", "save_draft_vocab", "load_draft_vocab"]


@dataclass
class DraftVocab:
    d2t: torch.Tensor  # int64[N], target_id = draft_id + d2t[draft_id]
    t2d: torch.Tensor  # bool[V]
    coverage: Optional[float] = None  # fraction of loss tokens whose target id is in the draft vocab

    @property
    def draft_vocab_size(self) -> int:
        return int(self.d2t.numel())

    @property
    def target_vocab_size(self) -> int:
        return int(self.t2d.numel())

    @property
    def target_ids(self) -> torch.Tensor:
        """int64[N]: the target id of every draft id (ascending)."""
        return torch.arange(self.draft_vocab_size, dtype=torch.int64, device=self.d2t.device) + self.d2t

    def content_hash(self) -> str:
        return _content_hash(self.d2t, self.t2d)


def _content_hash(d2t: torch.Tensor, t2d: torch.Tensor) -> str:
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(d2t.to(torch.int64).numpy()).astype("<i8").tobytes())
    h.update(np.ascontiguousarray(t2d.to(torch.bool).numpy()).astype(np.uint8).tobytes())
    return h.hexdigest()


def count_loss_tokens(rows: Iterable, target_vocab_size: int) -> np.ndarray:
    """int64[V] counts of the tokens at loss-masked positions.

    ``rows``: a ``datasets.Dataset`` or a ``TokenRows`` with ``input_ids``/``loss_mask`` columns, or an iterable
    of mappings with those keys.
    """
    counts = np.zeros(target_vocab_size, dtype=np.int64)
    table = getattr(rows, "data", None)  # datasets.Dataset, TokenRows: read the Arrow columns directly
    if table is not None and hasattr(rows, "column_names"):
        if getattr(rows, "_indices", None) is not None:
            rows = rows.flatten_indices()
            table = rows.data
        ids = table.column("input_ids").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        mask = table.column("loss_mask").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        chunks = [(ids, mask)]
    else:
        chunks = ((np.asarray(r["input_ids"]), np.asarray(r["loss_mask"])) for r in rows)
    for ids, mask in chunks:
        if ids.shape != mask.shape:
            raise ValueError(f"input_ids and loss_mask differ in length: {ids.shape} vs {mask.shape}")
        sel = ids[mask.astype(bool)].astype(np.int64)
        if sel.size and (sel.min() < 0 or sel.max() >= target_vocab_size):
            raise ValueError(f"token id {int(sel.max())} outside the target vocab of {target_vocab_size}")
        counts += np.bincount(sel, minlength=target_vocab_size)
    return counts


def build_draft_vocab(rows_or_counts: Any, target_vocab_size: int, draft_vocab_size: int) -> DraftVocab:
    """The draft vocab from tokenized rows (see :func:`count_loss_tokens`) or counts.

    Counts: an int array/tensor of length V, or a mapping ``{token_id: count}``.
    """
    V, N = int(target_vocab_size), int(draft_vocab_size)
    if not 1 <= N <= V:
        raise ValueError(f"draft vocab size {N} must be in 1..target vocab size {V}")
    if isinstance(rows_or_counts, Mapping):
        counts = np.zeros(V, dtype=np.int64)
        for k, v in rows_or_counts.items():
            if not 0 <= int(k) < V:
                raise ValueError(f"token id {k} outside the target vocab of {V}")
            counts[int(k)] = int(v)
    elif isinstance(rows_or_counts, (np.ndarray, torch.Tensor)):
        counts = np.asarray(rows_or_counts.cpu() if isinstance(rows_or_counts, torch.Tensor)
                            else rows_or_counts).astype(np.int64)
        if counts.shape != (V,):
            raise ValueError(f"counts must have shape ({V},), got {tuple(counts.shape)}")
    else:
        counts = count_loss_tokens(rows_or_counts, V)
    # most frequent first, ties -> lower id: a stable sort on -count keeps id order among ties
    order = np.argsort(-counts, kind="stable")
    seen = int((counts > 0).sum())
    chosen = order[: min(N, seen)]
    if len(chosen) < N:  # fill with the lowest ids not chosen yet
        free = np.ones(V, dtype=bool)
        free[chosen] = False
        chosen = np.concatenate([chosen, np.flatnonzero(free)[: N - len(chosen)]])
    target_ids = np.sort(chosen).astype(np.int64)
    d2t = torch.from_numpy(target_ids - np.arange(N, dtype=np.int64))
    t2d = torch.zeros(V, dtype=torch.bool)  # device: the vocab is built and saved on the host
    t2d[torch.from_numpy(target_ids)] = True
    total = counts.sum()
    coverage = float(counts[target_ids].sum() / total) if total > 0 else None
    return DraftVocab(d2t=d2t, t2d=t2d, coverage=coverage)


def save_draft_vocab(vocab: DraftVocab, path: Union[str, Path]) -> Path:
    """Write ``d2t``/``t2d`` to a safetensors file with the content hash in its metadata."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "format": "specforge-draft-vocab-v1",
        "sha256": vocab.content_hash(),
        "draft_vocab_size": str(vocab.draft_vocab_size),
        "target_vocab_size": str(vocab.target_vocab_size),
    }
    if vocab.coverage is not None:
        meta["coverage"] = repr(vocab.coverage)
    tmp = path.with_name(path.name + ".tmp")
    save_file({"d2t": vocab.d2t.contiguous(), "t2d": vocab.t2d.contiguous()}, str(tmp), metadata=meta)
    tmp.replace(path)
    return path


def load_draft_vocab(path: Union[str, Path]) -> DraftVocab:
    """Read a file written by :func:`save_draft_vocab`; ValueError if it is inconsistent."""
    with open_safetensors(path, "draft vocab file", "delete it: the run builds it again from the data (or take "
                          "the draft.init_from folder's mapping again)") as f:
        meta = f.metadata() or {}
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool or d2t.ndim != 1 or t2d.ndim != 1:
        raise ValueError(f"draft vocab {path}: d2t must be int64[N] and t2d bool[V]")
    expected = meta.get("sha256")
    if expected is None or _content_hash(d2t, t2d) != expected:
        raise ValueError(f"draft vocab {path}: content hash mismatch (file corrupted or edited)")
    target_ids = torch.arange(d2t.numel(), device=d2t.device) + d2t
    in_range = d2t.numel() == 0 or (int(target_ids.min()) >= 0 and int(target_ids.max()) < t2d.numel())
    if (not in_range or int(t2d.sum()) != d2t.numel() or not bool(t2d[target_ids].all())
            or not bool((target_ids[1:] > target_ids[:-1]).all())):
        raise ValueError(f"draft vocab {path}: d2t and t2d disagree")
    cov = meta.get("coverage")
    return DraftVocab(d2t=d2t, t2d=t2d, coverage=float(cov) if cov else None)
