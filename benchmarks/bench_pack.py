"""Packed vs unpacked training (``train.pack_tokens``): useful tokens per second and the draft's acceptance.

    python benchmarks/bench_pack.py --run unpacked=runs/a --log unpacked=a.log \
        --run packed=runs/b --log packed=b.log [--no-readme]

Each ``--run`` is a finished ``scripts/train_eagle3.sh`` output folder (its ``metrics.jsonl``), each
``--log`` that script's printed output (its eval table gives the chain-7 acceptance). Useful tokens
are the samples' own tokens, padding left out (``useful_tokens`` of each logged train step, one row
every ``train.log_every`` steps: a sample of the steps, scaled to all of them for the run's total);
"train step" counts the step's own time (``train_ms``: forward, backward, optimizer), "run" the
loop's wall time to its last step (``time_s``: feature reads, periodic evals and saves included). Both runs are the same recipe,
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", action="append", required=True, help="label=folder")
    ap.add_argument("--log", action="append", default=[], help="label=train_eagle3.sh output")
    ap.add_argument("--note", default="")
    ap.add_argument("--no-readme", action="store_true")
    args = ap.parse_args()
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
