"""``python -m specforge.capture --config cfg.yaml [section.key=value ...]``

Runs the frozen target once over the train split and writes its features (captured layers, last
hidden state, argmax) to the offline feature store (``store.dir``, default
``<train.output_dir>/features``; ``store.dtype`` bfloat16 or int8), for offline training.
Sample id = row index of the train split. It prints the expected size and refuses to start if the
disk cannot hold it; rerunning the same command after an interruption keeps the complete shards
and captures only the rest.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
from tqdm.auto import tqdm

from specforge.config import load_config
from specforge.data.packing import target_packs
from specforge.data.prepare import prepare_dataset
from specforge.data.store import (
    FeatureStoreWriter,
    StoreMeta,
    bytes_per_token,
    check_disk,
    head_only_capture,
    human_bytes,
    recorded_fingerprint,
    store_meta,
    store_root,
)
from specforge.device import pick_device, pick_dtype, set_threads
from specforge.files import check_writable
from specforge.models.target import (
    capture,
    engine_rows,
    load_target,
    load_target_config,
    load_tokenizer,
    resolve_target_path,
)
from specforge.models.vllm_engine import SERVER_STORAGE, check_storage, engine_factory, server_command, spec_for
from specforge.registry import feature_layers
from specforge.targets import text_config
from specforge.training.batch import collate, pad_id

CAPTURE_TOKENS = 4096  # padded tokens per target forward (at least train.batch_size rows)


def plan_batches(lengths: Sequence[int], batch_size: int, max_tokens: int = CAPTURE_TOKENS) -> list[list[int]]:
    """Row indices in target-forward batches: longest first (padding stays small, and an
    out-of-memory shows up at once), at least ``batch_size`` rows, else up to ``max_tokens``.
    Depends on the lengths only, so an interrupted capture recomputes the same batches."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        cur = batches[-1] if batches else None
        if cur is None or (len(cur) >= batch_size and (len(cur) + 1) * lengths[cur[0]] > max_tokens):
            batches.append([i])
        else:
            cur.append(i)
    return batches


@torch.no_grad()
def iter_features(target, rows, batches: Sequence[Sequence[int]], chunk_tokens: int,
                  pack_tokens: Optional[int] = None) -> Iterator[tuple[int, dict]]:
    """(row index, per-sample features) for every row of ``batches``, one target forward per batch
    (``pack_tokens``: per packed row of the batch, ``capture``'s). Through an engine that computes on
    its own devices (a GPU), the next batch's requests go out before this batch is read, normed and
    stored, so the engine does not wait on us; on the CPU, where the engine and this process share the
    cores, one batch at a time (the overlap measured 7% slower: benchmarks/README.md, "vLLM capture")."""
    pad = pad_id(target.tokenizer)
    engine = getattr(target, "engine", None)
    if engine is not None and not engine.computes_apart:
        engine = None  # one batch at a time: an engine on our cores gains nothing from the overlap
    collated = (collate([rows[i] for i in ids], pad) for ids in batches)
    nxt = next(collated, None)
    ahead = engine.submit(engine_rows(nxt[0], nxt[2])) if engine is not None and nxt is not None else None
    for ids in batches:
        sub = [rows[i] for i in ids]
        input_ids_BT, loss_mask_BT, attn_BT = nxt
        nxt, pending = next(collated, None), ahead
        if engine is not None and nxt is not None:  # the engine computes the next batch while this one is read
            ahead = engine.submit(engine_rows(nxt[0], nxt[2]))
        f = capture(target, input_ids_BT, attn_BT, chunk_tokens, target_packs(attn_BT, pack_tokens), pending)
        for b, sid in enumerate(ids):
            n = len(sub[b]["input_ids"])
            yield sid, {"input_ids_T": input_ids_BT[b, :n], "loss_mask_T": loss_mask_BT[b, :n],
                        "aux_hidden_TKH": f.aux_hidden_BTKH[b, :n], "last_hidden_TH": f.last_hidden_BTH[b, :n],
                        "target_ids_T": f.target_ids_BT[b, :n]}


def _lengths(rows) -> list[int]:
    if hasattr(rows, "column_names") and "length" in rows.column_names:  # a tokenized split (TokenRows)
        return [int(n) for n in rows["length"]]
    return [len(r["input_ids"]) for r in rows]


def write_store(target, rows, root, meta: StoreMeta, dtype: str = "bfloat16", shard_mb: float = 256.0,
                batch_size: int = 1, chunk_tokens: int = 1024, progress: bool = True,
                max_tokens: int = CAPTURE_TOKENS, pack_tokens: Optional[int] = None) -> Path:
    """Capture the features of ``rows`` (sample id = row index) into the store at ``root``,
    skipping the samples already in complete shards. ``pack_tokens`` (``rollout.pack_tokens``): each
    batch's samples run in packed rows; the stored features are the padded capture's."""
    lengths = _lengths(rows)
    bpt = bytes_per_token(meta.hidden_size, dtype, len(meta.aux_layer_ids))
    t0 = time.perf_counter()
    with FeatureStoreWriter(root, meta, dtype, shard_mb) as writer:
        done = writer.done()
        todo = [i for i in range(len(lengths)) if i not in done]
        total, left = sum(lengths), sum(lengths[i] for i in todo)
        print(f"feature store {root}: {len(lengths):,} samples, {total:,} tokens x {bpt:,.0f} B/token ({dtype}) "
              f"= {human_bytes(total * bpt)}; {len(done):,} samples already stored, {human_bytes(left * bpt)} to write")
        check_disk(root, int(left * bpt))
        batches = [b for b in plan_batches(lengths, batch_size, max_tokens) if not done.issuperset(b)]
        bar = tqdm(total=left, unit="tok", unit_scale=True, desc="capture", disable=not progress, mininterval=1.0)
        with bar:
            for sid, feats in iter_features(target, rows, batches, chunk_tokens, pack_tokens):
                if sid not in done:  # a batch straddling a complete shard is recomputed whole (same numbers)
                    writer.add(sid, **feats)
                    bar.update(lengths[sid])
    seconds = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in Path(root).expanduser().glob("shard-*.safetensors"))
    rate = left / max(seconds, 1e-9)
    print(f"captured {len(todo):,} samples ({left:,} tokens) in {seconds:.1f} s = {rate:,.0f} tokens/s; "
          f"store {human_bytes(size)} on disk")
    return Path(root).expanduser()


def capture_store(cfg, progress: bool = True, target=None, source: Optional[str] = None) -> Path:
    """Load the target (unless given) and the tokenized data of ``cfg`` and write the train split's
    features. ``source`` (the store meta's source; default the data's cache key) stays the same for a
    caller that appends rows to the same data file over time (``specforge.adapt``)."""
    set_threads(cfg.train.num_threads)
    if not progress:
        from transformers.utils import logging as hf_logging  # lazy: heavy (transformers)

        hf_logging.disable_progress_bar()  # its weight-loading bar too
    root = store_root(cfg)
    check_writable("store.dir", root)  # before the data, the target or its engine
    check_storage(cfg)
    # the data first (the tokenizer alone): a data error is said before the target (or its engine) starts
    data = prepare_dataset(cfg.data, target.tokenizer if target else load_tokenizer(cfg.model),
                           chat_template=cfg.model.chat_template, cache_dir=cfg.model.cache_dir, progress=progress)
    check_room(cfg, root, _lengths(data.train))  # from the target's config.json: before it (or its engine) loads
    own = target is None
    # with an engine, only the head is read from the checkpoint, unless the store being resumed records its
    # target in the kind only the whole model gives (``target_fingerprint``)
    target = target or load_target(cfg.model, layers=lambda n: feature_layers(cfg, n),
                                   packed=cfg.rollout.pack_tokens is not None, engine_for=engine_factory(cfg),
                                   head_only=head_only_capture(root))
    try:
        return _capture(cfg, target, data, progress, source)
    finally:
        if own and target.engine is not None:
            target.engine.close()


def check_room(cfg, root: Path, lengths: Sequence[int]) -> None:
    """The store's filesystem holds what is left to capture (``check_disk``): every sample's bytes at
    the target's width and the captured layers (config.json only), less the shards already written."""
    n = text_config(load_target_config(cfg.model))
    bpt = bytes_per_token(n.hidden_size, cfg.store.dtype, len(feature_layers(cfg, n.num_hidden_layers)))
    written = sum(p.stat().st_size for p in Path(root).expanduser().glob("shard-*.safetensors"))
    check_disk(root, max(0, int(sum(lengths) * bpt) - written))


def _capture(cfg, target, data, progress: bool, source: Optional[str]) -> Path:
    meta = store_meta(cfg, target, source=source or data.cache_key, like=recorded_fingerprint(store_root(cfg)))
    return write_store(target, data.train, store_root(cfg), meta, cfg.store.dtype, cfg.store.shard_mb,
                       cfg.train.batch_size, cfg.model.argmax_chunk_tokens, progress,
                       max_tokens=max(CAPTURE_TOKENS, cfg.rollout.pack_tokens or 0),
                       pack_tokens=cfg.rollout.pack_tokens)


def vllm_command(cfg, listen: str, storage: str = SERVER_STORAGE) -> str:
    """``--vllm-command [HOST:]PORT``: the engine ``rollout.backend=vllm`` would start for ``cfg``, as a
    shell command listening on HOST (default 127.0.0.1) and writing hidden states under ``storage``."""
    host, _, port = listen.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"--vllm-command {listen!r}: give PORT or HOST:PORT (the address the engine listens on)")
    n = text_config(load_target_config(cfg.model)).num_hidden_layers
    device = pick_device(cfg.model.device)
    spec = spec_for(cfg, resolve_target_path(cfg.model), n, feature_layers(cfg, n), pick_dtype(cfg.model.dtype, device),
                    device)
    return server_command(spec, int(port), storage, host or "127.0.0.1")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specforge.capture", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, help="run config YAML (default: built-in defaults)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--vllm-command", metavar="[HOST:]PORT", default=None,
                    help="print the command that starts a vLLM engine this config can use as rollout.vllm_endpoint "
                         "(http://HOST:PORT; HOST defaults to 127.0.0.1), and exit")
    ap.add_argument("--vllm-storage", default=SERVER_STORAGE, metavar="DIR",
                    help="with --vllm-command: where the engine writes hidden states for us to read (default: "
                         "shared memory, the same host; for an engine on another host, a folder both mount at DIR)")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. data.max_samples=100")
    args, extra = ap.parse_known_args(argv)
    bad = [e for e in extra if e.startswith("-") or "=" not in e]
    if bad:
        ap.error(f"unrecognized arguments: {' '.join(bad)}")
    try:
        cfg = load_config(args.config, list(args.overrides) + extra)
        if args.vllm_command is not None:
            print(vllm_command(cfg, args.vllm_command, args.vllm_storage))
            return 0
        root = capture_store(cfg, progress=not args.no_progress)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: complete shards are kept; rerun the same command to resume", file=sys.stderr)
        return 130
    print(f"feature store: {root}")
    return 0


if __name__ == "__main__":
    from specforge.cli import run_cli

    sys.exit(run_cli(main))  # main reports ValueErrors itself; this catches the rest (files)
