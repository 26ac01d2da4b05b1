"""Offline feature store: bytes/token on disk, capture and read tokens/s, and what int8 does to
the acceptance length.

    python benchmarks/bench_store.py [--samples 100] [--train-steps 150] [--threads 2]

Target: SmolLM2-135M (the embedded default, fp32 as in configs/smollm2-135m-cpu.yaml), the first
``--samples`` ShareGPT train rows (+16 held out). ONE capture pass (``specforge.capture``'s
batches and ``iter_features``) feeds three sinks, each write timed on its own: the bf16 store,
the int8 store, and the upstream SpecForge baseline (one ``torch.save`` file per sample: the dict
input_ids, loss_mask, hidden_state, aux_hidden_state, bf16 hidden). Read = random batches of 2
samples right-padded into a TrainBatch (``FeatureStore.batch``, ``torch.load`` + the same padding
for the baseline), page cache warm (the files were just written). Acceptance: two drafts trained
``--train-steps`` steps with the same seed and data order, one on the bf16 store and one on the
int8 store (``DraftTrainer.step`` on ``FeatureStore.batch``), evaluated on fp32 features of the
held-out rows: simulated acceptance length tau and step-0 accuracy. Results go to stdout and
``benchmarks/results/store.md`` (not the README: the lead merges it).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import header_markdown, machine_info, markdown_table  # noqa: E402
from specforge.capture import CAPTURE_TOKENS, iter_features, plan_batches  # noqa: E402
from specforge.config import load_config  # noqa: E402
from specforge.data.prepare import prepare_dataset  # noqa: E402
from specforge.data.store import FeatureStore, FeatureStoreWriter, bytes_per_token, store_meta  # noqa: E402
from specforge.device import set_threads  # noqa: E402
from specforge.models.target import capture, load_target  # noqa: E402
from specforge.training.batch import TrainBatch, collate, global_batch_ids, pad_id  # noqa: E402

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "smollm2-135m-cpu.yaml"
RESULTS = Path(__file__).resolve().parent / "results" / "store.md"
NUM_EVAL = 16


def load_avg() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def note(msg: str) -> None:
    print(f"[bench_store {time.strftime('%H:%M:%S')} load {load_avg()}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the torch.save baseline


def save_baseline(folder: Path, sid: int, f: dict) -> None:
    """What upstream SpecForge writes per sample (scripts/prepare_hidden_states.py)."""
    torch.save({"input_ids": f["input_ids_T"].clone(), "loss_mask": f["loss_mask_T"].clone(),
                "hidden_state": f["last_hidden_TH"].to(torch.bfloat16).unsqueeze(0),
                "aux_hidden_state": f["aux_hidden_TKH"].to(torch.bfloat16).unsqueeze(0)}, folder / f"data_{sid}.ckpt")


def read_baseline(folder: Path, ids: list[int], pad: int) -> torch.Tensor:
    rows = [torch.load(folder / f"data_{i}.ckpt") for i in ids]
    T = max(r["input_ids"].shape[0] for r in rows)
    aux = torch.zeros(len(rows), T, rows[0]["aux_hidden_state"].shape[-1], dtype=torch.bfloat16)
    last = torch.zeros(len(rows), T, rows[0]["hidden_state"].shape[-1], dtype=torch.bfloat16)
    ids_BT = torch.full((len(rows), T), pad, dtype=torch.long)
    for b, r in enumerate(rows):
        n = r["input_ids"].shape[0]
        aux[b, :n], last[b, :n], ids_BT[b, :n] = r["aux_hidden_state"][0], r["hidden_state"][0], r["input_ids"]
    return ids_BT


# ---------------------------------------------------------------- capture, size, read


def capture_all(target, rows, root: Path, meta, batch_size: int, chunk: int) -> dict:
    """One capture pass into three sinks; seconds per stage."""
    lengths = [int(n) for n in rows["length"]]
    secs = {"forward": 0.0, "bfloat16": 0.0, "int8": 0.0, "torch.save": 0.0}
    (root / "torch.save").mkdir(parents=True)
    writers = {d: FeatureStoreWriter(root / d, meta, d, shard_mb=64) for d in ("bfloat16", "int8")}
    feats = iter_features(target, rows, plan_batches(lengths, batch_size, CAPTURE_TOKENS), chunk)
    while True:
        t0 = time.perf_counter()
        item = next(feats, None)  # the forward runs when a batch's first sample is asked for
        secs["forward"] += time.perf_counter() - t0
        if item is None:
            break
        sid, f = item
        for d, w in writers.items():
            t0 = time.perf_counter()
            w.add(sid, **f)
            secs[d] += time.perf_counter() - t0
        t0 = time.perf_counter()
        save_baseline(root / "torch.save", sid, f)
        secs["torch.save"] += time.perf_counter() - t0
    for d, w in writers.items():
        t0 = time.perf_counter()
        w.close()
        secs[d] += time.perf_counter() - t0
    return secs


def disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def read_rate(read_batch, ids: list[int], lengths: dict, reps: int, seed: int = 0) -> float:
    rng = random.Random(seed)
    batches = [rng.sample(ids, 2) for _ in range(reps)]
    t0 = time.perf_counter()
    for b in batches:
        read_batch(b)
    return sum(lengths[i] for b in batches for i in b) / (time.perf_counter() - t0)


# ---------------------------------------------------------------- acceptance length


def train_and_eval(cfg, target, vocab, store: FeatureStore, eval_batches, steps: int) -> dict:
    from specforge.algorithms.eagle3 import ALGORITHM as EAGLE3
    from specforge.registry import bound_algorithm
    from specforge.training.trainer import DraftTrainer

    torch.manual_seed(cfg.train.seed)
    draft = EAGLE3.bind(cfg).build_draft(target, vocab)
    trainer = DraftTrainer(bound_algorithm(cfg), draft, EAGLE3.bind(cfg).train_state(target, vocab), cfg, target.device)
    pad = pad_id(target.tokenizer)
    t0 = time.perf_counter()
    for step in range(steps):
        ids = global_batch_ids(len(store), cfg.train.batch_size, cfg.train.seed, step)
        m = trainer.step([store.batch([store.ids[i] for i in ids], pad).to(target.device)])
        if step % 25 == 0:
            note(f"{store.dtype} step {step}: loss {m['loss']:.3f} ({time.perf_counter() - t0:.0f} s)")
    seconds = time.perf_counter() - t0
    trainer.amp_dtype = None  # evaluate in fp32: the drafts are compared, not the eval's speed
    m = trainer.evaluate(eval_batches)
    note(f"{store.dtype} eval: tau {m['tau']:.3f}")
    return {"tau": m["tau"], "acc_0": m["acc_0"], "seconds": seconds}


def fp32_batches(target, rows, chunk: int) -> list[TrainBatch]:
    """Held-out rows with features straight from the target (what the draft sees when serving)."""
    out = []
    for s in range(0, len(rows), 2):
        ids, mask, attn = collate([rows[i] for i in range(s, min(s + 2, len(rows)))], pad_id(target.tokenizer))
        out.append(TrainBatch.from_features(ids, mask, capture(target, ids, attn, chunk)))
    return out


def fp32_reference(target, rows, ids: list[int], chunk: int) -> dict:
    """Unquantized features of a few samples, and the lm_head the argmax is taken with."""
    return dict(iter_features(target, rows, [[i] for i in ids], chunk))


def feature_error(store: FeatureStore, ref: dict, target, chunk: int) -> dict:
    """Relative L2 error of the stored hidden states vs fp32, and how often the target argmax
    re-derived from the stored last hidden state (what the teacher sees) equals the fp32 argmax."""
    from specforge.models.target import argmax_chunked

    num = den = agree = n = 0.0
    for i, want in ref.items():
        got = store.read(i)
        for name, key in (("aux_hidden", "aux_hidden_TKH"), ("last_hidden", "last_hidden_TH")):
            num += float((got[name].float() - want[key]).norm() ** 2)
            den += float(want[key].norm() ** 2)
        am = argmax_chunked(got["last_hidden"].float(), target.lm_head_weight_VH.float(), chunk)
        agree += float((am == want["target_ids_T"]).sum())
        n += am.numel()
    return {"rel_err": (num / den) ** 0.5, "argmax_agree": agree / n}


# ---------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=100, help="train rows captured")
    ap.add_argument("--train-steps", type=int, default=150,
                    help="draft steps per store for the acceptance check (0 = skip)")
    ap.add_argument("--reads", type=int, default=200, help="random 2-sample batches read per format")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="scratch folder (default: a temp dir, removed after)")
    args = ap.parse_args()

    set_threads(args.threads)
    info = machine_info()
    load_before = load_avg()
    cfg = load_config(CONFIG, [f"data.max_samples={args.samples + NUM_EVAL}", f"data.num_eval={NUM_EVAL}",
                               f"train.max_steps={max(args.train_steps, 1)}", "tracking.wandb=false"])
    target = load_target(cfg.model)
    data = prepare_dataset(cfg.data, target.tokenizer, chat_template=cfg.model.chat_template,
                           cache_dir=cfg.model.cache_dir, progress=False)
    meta = store_meta(cfg, target, data.cache_key)
    tokens = int(sum(data.train["length"]))
    scratch = Path(args.out or tempfile.mkdtemp(prefix="bench-store-"))
    try:
        note(f"capture {len(data.train)} rows, {tokens:,} tokens")
        secs = capture_all(target, data.train, scratch, meta, cfg.train.batch_size, cfg.model.argmax_chunk_tokens)
        H, pad = target.config.hidden_size, pad_id(target.tokenizer)
        stores = {d: FeatureStore(scratch / d, expect=meta) for d in ("bfloat16", "int8")}
        lengths = stores["bfloat16"].lengths
        readers = {**{d: (lambda b, s=s: s.batch(b, pad)) for d, s in stores.items()},
                   "torch.save": lambda b: read_baseline(scratch / "torch.save", b, pad)}
        note(f"captured: {secs}")
        ref = fp32_reference(target, data.train, stores["bfloat16"].ids[:4], cfg.model.argmax_chunk_tokens)
        ref_tokens = sum(lengths[i] for i in ref)
        rows = []
        for d, reader in readers.items():
            note(f"read + error: {d}")
            size = disk_bytes(scratch / d)
            read = read_rate(reader, stores["bfloat16"].ids, lengths, args.reads)
            err = feature_error(stores[d], ref, target, cfg.model.argmax_chunk_tokens) if d in stores else None
            rows.append([
                d if d != "torch.save" else "torch.save, 1 file/sample (upstream)",
                f"{size / tokens:,.0f}", f"{bytes_per_token(H, d):,.0f}" if d in stores else "-",
                len(list((scratch / d).iterdir())), f"{tokens / (secs['forward'] + secs[d]):,.0f}",
                f"{tokens / secs[d]:,.0f}", f"{read:,.0f}",
                f"{err['rel_err']:.4f}" if err else "(bf16)", f"{err['argmax_agree']:.4f}" if err else "(bf16)",
            ])
        acc = {}
        if args.train_steps:
            from specforge.registry import bound_algorithm
            from specforge.training.trainer import build_vocab

            vocab = build_vocab(bound_algorithm(cfg), cfg, data.train, target.config.vocab_size, data.cache_key)
            eval_batches = fp32_batches(target, data.eval, cfg.model.argmax_chunk_tokens)
            for d, s in stores.items():
                acc[d] = train_and_eval(cfg, target, vocab, s, eval_batches, args.train_steps)
    finally:
        if args.out is None:
            shutil.rmtree(scratch, ignore_errors=True)

    head = ["format", "bytes/token on disk", "bytes/token (formula)", "files", "capture tok/s (fwd+write)",
            "write-only tok/s", "read tok/s (batches of 2)", "hidden rel. L2 err vs fp32*",
            "argmax from stored last hidden = fp32*"]
    body = [
        f"`python benchmarks/bench_store.py --samples {args.samples} --train-steps {args.train_steps}` -- "
        f"{header_markdown(info)} | **load avg (1/5/15 min)** before {load_before}, after {load_avg()}",
        "",
        f"SmolLM2-135M target (fp32, H {H}, 3 captured layers), {len(data.train)} ShareGPT train rows, "
        f"{tokens:,} tokens (max_length {cfg.data.max_length}), {args.threads} threads. One capture pass feeds all "
        f"three sinks (target forward {secs['forward']:.1f} s = {tokens / secs['forward']:,.0f} tok/s, shared); "
        f"each write is timed alone. Stores: 64 MB shards. Read = {args.reads} random 2-sample batches padded into "
        "a TrainBatch, page cache warm. The machine is shared with other jobs (2 cores): rates are indicative.",
        "",
        markdown_table(head, rows),
        "",
        f"\\* on {len(ref)} samples ({ref_tokens:,} tokens) recaptured one by one in fp32; the argmax is over the "
        "full target vocab, i.e. how often the teacher's top token survives the storage format.",
    ]
    if acc:
        b, q = acc["bfloat16"], acc["int8"]
        body += [
            "",
            f"What int8 does to acceptance: two drafts (draft vocab {cfg.draft.vocab_size}), same seed and data order, "
            f"{args.train_steps} steps of batch {cfg.train.batch_size} each, trained from the bf16 and from the int8 "
            f"store, evaluated on fp32 features of {NUM_EVAL} held-out conversations (simulated acceptance length tau, "
            f"TTT length {cfg.draft.ttt_length}). A short run: the draft is far from converged.",
            "",
            markdown_table(["trained from", "tau (sim. acceptance length)", "acc step 0", "train s"], [
                ["bfloat16 store", f"{b['tau']:.3f}", f"{b['acc_0']:.3f}", f"{b['seconds']:.0f}"],
                ["int8 store", f"{q['tau']:.3f}", f"{q['acc_0']:.3f}", f"{q['seconds']:.0f}"],
                ["int8 - bf16", f"{q['tau'] - b['tau']:+.3f}", f"{q['acc_0'] - b['acc_0']:+.3f}", ""],
            ]),
        ]
    text = "## Feature store\n\n" + "\n".join(body) + "\n"
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
