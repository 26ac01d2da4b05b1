"""Packed vs unpacked training (``train.pack_tokens``): useful tokens per second and the draft's acceptance.

    python benchmarks/bench_pack.py --run unpacked=runs/a --log unpacked=a.log \
        --run packed=runs/b --log packed=b.log [--no-readme]
    python benchmarks/bench_pack.py --step runs/b/features [--pack 2048] [--batches 16] [--no-readme]

``--step STORE``: the train step alone on the same micro-batches, padded vs packed, interleaved: the
default draft's shapes (SmolLM2-135M, draft vocab 8192, 3 TTT steps, bf16 autocast), random features,
the lengths of a seeded draw of the store's samples in global batches of 4 (the default's ``train.batch_size``).

Each ``--run`` is a finished ``scripts/train_eagle3.sh`` output folder (its ``metrics.jsonl``), each
``--log`` that script's printed output (its eval table gives the chain-7 acceptance). Useful tokens
are the samples' own tokens, padding left out (``useful_tokens`` of each logged train step, one row
every ``train.log_every`` steps: a sample of the steps, scaled to all of them for the run's total);
"train step" counts the step's own time (``train_ms``: forward, backward, optimizer), "run" the
loop's wall time to its last step (``time_s``: feature reads, periodic evals and saves included). Both runs \
are the same recipe,
data and seed; only ``train.pack_tokens`` differs.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import append_section, header_markdown, markdown_table  # noqa: E402


def summarize(run: Path, log: Path | None) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    # the logged rows (every train.log_every steps) sample the steps: rates from them, totals scaled to all steps
    useful = sum(r.get("useful_tokens", 0.0) for r in train)
    tokens = sum(r["tokens"] for r in train)
    steps = int(train[-1]["step"])
    wall_s = train[-1]["time_s"]  # the loop's time at the last step (evals and saves included)
    total_useful = useful / len(train) * steps
    out = {"steps": steps, "minutes": wall_s / 60, "useful": total_useful, "padding": 1 - useful / tokens,
           "step_tps": useful / (sum(r["train_ms"] for r in train) / 1e3), "run_tps": total_useful / wall_s,
           "eval_loss": evals[-1]["loss"] if evals else None,
           "eval_acc0": evals[-1].get("acc_0") if evals else None, "acceptance": None}
    if log is not None and log.is_file():
        rows = re.findall(r"\| [^|]*checkpoints[^|]* \| chain 7 fixed \| \d+ \| ([0-9.]+) \|", log.read_text())
        out["acceptance"] = float(rows[-1]) if rows else None
    return out


def step_table(store: Path, budget: int, num_batches: int, reps: int) -> str:
    import statistics
    import time

    import torch

    from benchmarks.bench_gpu_step import batch_of
    from benchmarks.ttt_step import TARGET, make_draft
    from specforge.algorithms.eagle3.loss import ttt_loss
    from specforge.device import autocast
    from specforge.training.slicing import pack_micro_batches

    index = json.loads((store / "index.json").read_text())
    every = [s["length"] for sh in index["shards"] for s in sh["samples"]]  # capture order: longest first
    pick = torch.randperm(len(every), generator=torch.Generator().manual_seed(0))[: 4 * num_batches].tolist()
    lengths = [every[i] for i in pick]  # a seeded draw, as the run's data order draws them
    draft = make_draft(8192, dict(TARGET, draft_vocab=8192))
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4)
    W = (torch.randn(8192, TARGET["hidden"]) * 0.02).bfloat16()
    cpu = torch.device("cpu")
    padded = [batch_of(draft, lengths[i : i + 4], cpu, seed=i) for i in range(0, len(lengths), 4)]
    packed = [pack_micro_batches([b], budget) for b in padded]

    def step(mbs):
        opt.zero_grad(set_to_none=True)
        total = float(sum(int(b.loss_mask_BT.sum()) for b in mbs))
        t0 = time.perf_counter()
        for b in mbs:
            with autocast(cpu, torch.bfloat16):
                loss, _ = ttt_loss(draft, b, W, ttt_length=3, num_valid_global=total)
            loss.backward()
        opt.step()
        return time.perf_counter() - t0

    step([padded[0]]), step(packed[0])  # warm-up
    times = {"padded": [], "packed": []}
    for _ in range(reps):
        for i in range(len(padded)):  # interleaved: load changes hit both
            times["padded"].append(step([padded[i]]))
            times["packed"].append(step(packed[i]))
    useful = sum(lengths) * reps
    run_tokens = {"padded": sum(b.input_ids_BT.numel() for b in padded) * reps,
                  "packed": sum(r.input_ids_BT.numel() for rows in packed for r in rows) * reps}
    rows = [[k, f"{run_tokens[k]:,}", f"{useful / sum(v):,.0f}", f"{1000 * statistics.median(v):.0f}"]
            for k, v in times.items()]
    ratio = sum(times["padded"]) / sum(times["packed"])
    return (f"{len(padded)} global batches of 4 samples ({sum(lengths):,} tokens, {min(lengths)}-{max(lengths)} each), "
            f"{reps} passes; packed rows of up to {budget} tokens. Packed / padded useful tokens per second: "
            f"**{ratio:.2f}x**.\n\n" + markdown_table(["micro-batches", "tokens run per pass x passes",
                                                      "useful tok/s", "median step ms"], rows))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--step", default=None, help="a feature store folder: the train step alone (see the docstring)")
    ap.add_argument("--pack", type=int, default=2048)
    ap.add_argument("--batches", type=int, default=16)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--run", action="append", default=[], help="label=folder")
    ap.add_argument("--log", action="append", default=[], help="label=train_eagle3.sh output")
    ap.add_argument("--note", default="")
    ap.add_argument("--no-readme", action="store_true")
    args = ap.parse_args()
    if args.step:
        md = step_table(Path(args.step), args.pack, args.batches, args.reps)
        print(md)
        if not args.no_readme:
            append_section("Packing (train.pack_tokens): the train step", header_markdown() + "\n\n" + md)
        return 0
    logs = dict(x.split("=", 1) for x in args.log)
    table = []
    for label, folder in (x.split("=", 1) for x in args.run):
        s = summarize(Path(folder), Path(logs[label]) if label in logs else None)
        table.append([label, s["steps"], f"{s['minutes']:.1f}", f"{s['useful']:,.0f}", f"{100 * s['padding']:.0f}%",
                      f"{s['step_tps']:,.0f}", f"{s['run_tps']:,.0f}",
                      "-" if s["eval_loss"] is None else f"{s['eval_loss']:.3f}",
                      "-" if s["acceptance"] is None else f"{s['acceptance']:.3f}"])
    md = markdown_table(["run", "steps", "loop minutes", "useful tokens", "padding of the tokens run",
                         "train step useful tok/s", "run useful tok/s", "held-out loss (last eval)",
                         "chain-7 acceptance"], table)
    print(md)
    if not args.no_readme:
        append_section("Packing (train.pack_tokens) on the default run",
                       header_markdown() + ("\n\n" + args.note if args.note else "") + "\n\n" + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
