"""Draft quality on the embedded default: real chain speculative decoding, before and after training.

    python benchmarks/bench_quality.py [--minutes 30] [--trainer ray|single] [--prompts 16] [overrides...]

Trains the embedded default (configs/smollm2-135m-cpu.yaml) for at most ``--minutes`` of wall
time, then runs `specforge.eval` (chain of 7, greedy, output checked token for token against
plain greedy decoding) on held-out ShareGPT prompts for: prompt-lookup decoding (no model), the
untrained draft (step 0: lm_head/norm warm-started from the target, the rest random) and the
trained draft. Appends a table naming machine and commit to benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_section, header_markdown, markdown_table, run  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
CONFIG = "configs/smollm2-135m-cpu.yaml"



def evaluate(draft: str, out_json: Path, args) -> dict:
    run([PY, "-m", "specforge.eval", "--config", CONFIG, "--draft", draft, "--num-prompts", str(args.prompts),
         "--max-new-tokens", str(args.max_new_tokens), "--chain", "7", "--json", str(out_json), *args.overrides])
    return json.loads(out_json.read_text())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--trainer", choices=["ray", "single"], default="ray")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--out", default="runs/bench-quality")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides for training and eval")
    args = ap.parse_args()
    out = REPO / args.out
    untrained = out / "untrained"
    common = ["--config", CONFIG, *args.overrides, "tracking.wandb=false"]
    module = "specforge.ray_train" if args.trainer == "ray" else "specforge.train"

    # the untrained baseline: one step at a learning rate too small to move a weight (train.max_steps=0 is refused)
    run([PY, "-m", "specforge.train", *common, "train.max_steps=1", "train.lr=1e-12", f"train.output_dir={untrained}",
         "checkpoint.resume=false"])
    results = [("prompt-lookup", evaluate("prompt-lookup", out / "eval-pld.json", args), None)]
    results.append(("untrained draft",
                    evaluate(str(untrained / "checkpoints" / "step-000001"), out / "eval-untrained.json", args), None))
    train_s = run([PY, "-m", module, *common, f"train.max_minutes={args.minutes}", "train.max_steps=100000",
                   f"train.output_dir={out / 'trained'}", "checkpoint.resume=false"])
    ckpt = sorted((out / "trained" / "checkpoints").glob("step-*"))[-1]
    results.append((f"trained {ckpt.name} ({args.trainer})", evaluate(str(ckpt), out / "eval-trained.json", args),
                    train_s))

    rows = [
        [name, f"{r['acceptance_length']:.2f}", " ".join(f"{a:.2f}" for a in r["acceptance_by_position"]),
         f"{r['target_tokens_per_s']:.1f}", f"{r['speculative_tokens_per_s']:.1f}", f"{r['speedup']:.2f}x",
         "" if s is None else f"{s / 60:.1f}"]
        for name, r, s in results
    ]
    table = markdown_table(
        ["draft", "acceptance length (chain 7)", "accepted by position", "target tok/s", "spec tok/s", "speedup",
         "train wall min"],
        rows,
    )
    body = (
        f"`python benchmarks/bench_quality.py --minutes {args.minutes:g} --trainer {args.trainer}` -- "
        f"{header_markdown()}\n\n"
        f"{args.prompts} held-out ShareGPT prompts (cut before the first assistant turn), "
        f"{args.max_new_tokens} new tokens "
        "each, greedy; the speculative output equals plain greedy decoding token for token (checked). Acceptance "
        "length = tokens per target verify forward, bonus token included. Target: trained >= 2.5, "
        "prompt-lookup ~1.3.\n\n"
        + table
    )
    print(body)
    append_section("Draft quality (speculative decoding)", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
