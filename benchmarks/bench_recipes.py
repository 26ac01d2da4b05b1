"""Acceptance length vs wall-clock minutes for three training recipes on the embedded default.

    python benchmarks/bench_recipes.py [--segments 3,8] [--capture-rows 300] [--prompts 10] [--recipes a,b,c]

Recipes (same target, same draft shape and optimizer, same held-out prompts):

* ``sharegpt-online``   ShareGPT rows, the target forward every step (placement.mode=colocated,
                        one train worker: what the default did before the offline recipe)
* ``sharegpt-offline``  ShareGPT rows captured once into the feature store (python -m specforge.capture),
                        then several epochs over the store (placement.mode=offline)
* ``self-distilled``    the target answers ShareGPT prompts itself (python -m specforge.regenerate), the
                        features kept while it generates fill the store, then epochs over the store

Each recipe trains in segments (``--segments`` = cumulative training minutes; a segment resumes the
previous one from its checkpoint) and every segment's checkpoint is evaluated with
``python -m specforge.eval`` (chain of 7, greedy, lossless). The x axis is wall-clock minutes of the
whole recipe: data preparation (generation / capture) + training. One job at a time; the load
average is recorded with every point. Every point is kept in benchmarks/bench_recipes.json (a rerun
of some recipes replaces theirs); writes a table + plot of all of them (benchmarks/bench_recipes.png)
and a section of benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_section, git_commit, header_markdown, markdown_table, run  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
CONFIG = "configs/smollm2-135m-cpu.yaml"



def data_step(recipe: str, common: list[str], out: Path, args) -> tuple[list[str], float]:
    """Fill the store (offline recipes); returns the training overrides and the minutes it took.
    The minutes are kept beside the store, so a rerun (which finds the store complete) keeps them."""
    if recipe == "sharegpt-online":
        return ["placement.mode=colocated", "train.num_workers=1"], 0.0
    if recipe == "sharegpt-offline":
        extra = ["placement.mode=offline", "store.fill=capture", f"data.max_samples={args.capture_rows}"]
        cmd = [PY, "-m", "specforge.capture", *common, *extra]
    else:
        extra = ["placement.mode=offline", "store.fill=regenerate"]
        cmd = [PY, "-m", "specforge.regenerate", *common, *extra]
    kept = out / "data_minutes.json"
    if kept.is_file():
        run(cmd)  # completes an interrupted store; a complete one returns at once
        return extra, json.loads(kept.read_text())["minutes"]
    minutes = run(cmd) / 60
    out.mkdir(parents=True, exist_ok=True)
    kept.write_text(json.dumps({"minutes": minutes}))
    return extra, minutes


def eval_point(ckpt: Path, common: list[str], out_json: Path, args) -> dict:
    run([PY, "-m", "specforge.eval", *common, "--draft", str(ckpt), "--num-prompts", str(args.prompts),
         "--json", str(out_json)])
    rows = json.loads(out_json.read_text())
    rows = rows if isinstance(rows, list) else rows.get("rows", [rows])
    fixed = next(r for r in rows if "fixed" in str(r.get("setting", "fixed")))
    best = max(rows, key=lambda r: r.get("speedup", 0.0))
    return {"acceptance": fixed["acceptance_length"], "speedup": best["speedup"], "setting": best.get("setting", "")}


def run_recipe(recipe: str, args) -> list[dict]:
    out = REPO / args.out / recipe
    common = ["--config", CONFIG, f"train.output_dir={out}", "tracking.wandb=false", *args.overrides]
    extra, data_min = data_step(recipe, common, out, args)
    points, trained = [], 0.0
    for seg in args.segments:
        trained += run([PY, "-m", "specforge.ray_train", *common, *extra, f"train.max_minutes={seg - trained}"]) / 60
        ckpt = sorted((out / "checkpoints").glob("step-*"))[-1]
        p = eval_point(ckpt, common, out / f"eval-{ckpt.name}.json", args)
        p.update(recipe=recipe, minutes=data_min + trained, data_minutes=data_min, step=ckpt.name,
                 load=os.getloadavg()[0], commit=git_commit()[:7])
        print(json.dumps(p), flush=True)
        points.append(p)
    return points


POINTS = REPO / "benchmarks" / "bench_recipes.json"


def merge_points(path: Path, new: list[dict]) -> list[dict]:
    """Every recipe's points, kept in ``path``: a rerun of some recipes replaces theirs only, so the
    plot always shows the latest measurement of each recipe."""
    old = json.loads(path.read_text()) if path.is_file() else []
    rerun = {p["recipe"] for p in new}
    points = [p for p in old if p["recipe"] not in rerun] + new
    if new:
        path.write_text(json.dumps(points, indent=1) + "\n")
    return points


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for recipe in dict.fromkeys(p["recipe"] for p in points):
        ps = [p for p in points if p["recipe"] == recipe]
        ax.plot([p["minutes"] for p in ps], [p["acceptance"] for p in ps], "o-", label=recipe)
    ax.axhline(2.5, color="gray", ls="--", lw=0.8, label="target 2.5")
    ax.set_xlabel("wall-clock minutes (data + training)")
    ax.set_ylabel("acceptance length (chain 7, greedy)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipes", default="sharegpt-online,sharegpt-offline,self-distilled")
    ap.add_argument("--segments", default="3,8", help="cumulative training minutes at which to evaluate")
    ap.add_argument("--capture-rows", type=int, default=300, help="ShareGPT rows captured by sharegpt-offline")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--out", default="runs/bench-recipes")
    ap.add_argument("--plot-only", action="store_true", help="redraw the plot from benchmarks/bench_recipes.json")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides for every step")
    args = ap.parse_args()
    args.segments = [float(s) for s in args.segments.split(",")]
    recipes = args.recipes.split(",")
    new = [] if args.plot_only else [p for r in recipes for p in run_recipe(r, args)]
    points = merge_points(POINTS, new)
    plot(points, REPO / "benchmarks" / "bench_recipes.png")
    if args.plot_only:
        return 0
    rows = [[p["recipe"], f"{p['data_minutes']:.1f}", f"{p['minutes']:.1f}", p["step"], f"{p['acceptance']:.3f}",
             f"{p['speedup']:.2f}x ({p['setting']})", f"{p['load']:.1f}"] for p in points]
    table = markdown_table(["recipe", "data min", "total min", "checkpoint", "acceptance (chain 7)",
                            "best speedup", "load avg"], rows)
    body = (f"`python benchmarks/bench_recipes.py --segments {','.join(f'{s:g}' for s in args.segments)}` -- "
            f"{header_markdown()}\n\n{args.prompts} held-out ShareGPT prompts, chain 7, greedy, lossless (checked). "
            "![acceptance vs minutes](bench_recipes.png)\n\n" + table)
    print(body)
    append_section("Acceptance vs training minutes: three recipes", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
