"""Every registered draft algorithm on the same feature store and the same minutes: held-out
acceptance, acceptance by position, draft cost per round, llama.cpp acceptance and speed where served.

    python benchmarks/bench_algorithms.py [--minutes 5] [--prompts 16] [--max-new-tokens 64] [--only A,B]
        [--no-readme] [--stores DIR] [overrides...]

1. The feature stores the configs name (``store.dir``), each filled once if missing (python -m
   specforge.capture with the first config that reads it): the embedded default's
   (configs/smollm2-135m-cpu.yaml: 300 ShareGPT conversations captured by the target, layers
   [1, 14, 26]), which every algorithm but MTP reads, and MTP's (the target's last layer alone).
2. EAGLE-3, EAGLE-3.1, DFlash, DSpark, P-EAGLE, DFlash2, XPress and MTP (their
   ``configs/*smollm2-135m*-cpu.yaml``) each trained for ``--minutes`` of wall clock from scratch
   (python -m specforge.ray_train, placement.mode=offline), one after the other.
3. ``python -m specforge.eval`` of all of them on the same held-out prompts (no training row shares
   them; one eval per store, with the config of its first draft: the layers its drafts read), one
   table: each draft proposes what its algorithm drafts per round, at most 7 tokens (``--chain 7``; a
   block draft from its whole trained block); every output checked against plain greedy decoding.
   Draft ms per round = the draft's cost of one round.
4. The drafts llama.cpp serves (``python -m specforge.eval --engine llama.cpp``: llama.cpp's
   converter, ``llama-server --spec-type`` the algorithm's, n_max 7, p_min 0) on the same prompts:
   tokens per target forward beside ours (the parity target: within 0.05; for a block draft, ours with
   the block llama.cpp runs, n_max + 1 rows: ``--as-served``), tokens/s and speedup
   against the target served alone. A draft llama.cpp does not serve (DFlash2, XPress, MTP) gets '-'
   in those columns and the one-line reason under the table. ``--no-engine`` skips it.
``--reuse`` evaluates the newest checkpoints already under ``--out`` instead of training again.
``--only`` a subset (names comma- or space-separated). Writes the table, naming machine, commit and
load, into benchmarks/README.md and the plot beside it; ``--no-readme`` prints them and writes the
plot under ``--out`` only (a smoke run). The overrides apply to every capture, training and eval; with
ones that change the data (a smoke run: ``data.max_samples=...``) give ``--stores`` a folder of its
own, so the shared stores are not filled with them:

    python benchmarks/bench_algorithms.py --only DFlash2,XPress,MTP --minutes 0.1 --prompts 2 \
        --max-new-tokens 8 --out /tmp/bench-algos --stores /tmp/bench-algos/stores --no-readme \
        data.max_samples=24 data.num_eval=8
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_section, header_markdown, markdown_table, run  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
EAGLE3 = "configs/smollm2-135m-cpu.yaml"
ALGORITHMS = {  # display name -> the config that trains it on the default's store
    "EAGLE-3": EAGLE3,
    "EAGLE-3.1": "configs/eagle31-smollm2-135m-cpu.yaml",
    "DFlash": "configs/smollm2-135m-dflash-cpu.yaml",
    "DSpark": "configs/dspark-smollm2-135m-cpu.yaml",
    "P-EAGLE": "configs/peagle-smollm2-135m-cpu.yaml",
    "DFlash2": "configs/dflash2-smollm2-135m-cpu.yaml",
    "XPress": "configs/xpress-smollm2-135m-cpu.yaml",
    "MTP": "configs/mtp-smollm2-135m-cpu.yaml",  # its own store: the target's last layer
}
BLOCK_DRAFTS = ("DFlash", "DSpark", "DFlash2")  # whose engines run blocks as long as the drafts asked for
DEFAULT_STORE = "runs/smollm2-135m-cpu/features"  # the embedded default's store (scripts/train_eagle3.sh)
TITLE = "Draft algorithms (same store, same minutes)"


def llamacpp_refusal(draft: str) -> str | None:
    """Why llama.cpp would not serve ``draft`` (the converter's own pre-checks, run here so that one
    refused draft does not stop the others' rows), or None."""
    from specforge.config import load_config
    from specforge.engines import llamacpp
    from specforge.models.target import resolve_target_path

    try:
        target_dir = resolve_target_path(load_config(REPO / EAGLE3).model)
        draft_config, target_config = llamacpp.check_draft(draft, target_dir)
        algo = llamacpp._served_algorithm(draft_config)
        algo.llamacpp_config(draft_config, target_config, None)
    except ValueError as e:
        return str(e)
    return None


def names(text: str) -> list[str]:
    """``--only``'s names, comma-separated; each one of ``ALGORITHMS``."""
    out = [n.strip() for n in text.split(",") if n.strip()]
    for n in out:
        if n not in ALGORITHMS:
            raise argparse.ArgumentTypeError(f"{n!r} is none of {', '.join(ALGORITHMS)}")
    return out


def store_of(config: str, stores: str | None) -> Path:
    """The feature store a config trains from: its ``store.dir`` (under the repo; the default's when it
    names none, as configs/smollm2-135m-cpu.yaml, whose script sets it), or the folder of the same name
    under ``--stores``."""
    from specforge.config import load_config

    own = Path(load_config(REPO / config).store.dir or DEFAULT_STORE)
    if stores is None:
        return own if own.is_absolute() else REPO / own
    return Path(stores).resolve() / own.parent.name


def newest(folder: Path) -> str:
    return str(sorted((folder / "checkpoints").glob("step-*"))[-1])


def plot(points: list[dict], path: Path) -> None:
    """Left: accepted fraction by draft position (ours; llama.cpp's tokens per forward in the legend).
    Right: what one round costs each draft (draft ms + verify ms)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    for p in points:
        served = f", llama.cpp {p['served']:.3f}" if p.get("served") is not None else ""
        axes[0].plot(range(1, len(p["by_position"]) + 1), p["by_position"], "o-",
                     label=f"{p['name']} ({p['setting']}): {p['acceptance']:.3f} tok/forward{served}")
    axes[0].set_xlabel("draft position")
    axes[0].set_ylabel("accepted fraction (held-out)")
    axes[0].set_ylim(0, 1)
    axes[0].legend(fontsize=8)
    axes[0].set_title("acceptance by position")
    x = list(range(len(points)))
    axes[1].bar(x, [p["draft_ms"] for p in points], 0.5, label="draft")
    axes[1].bar(x, [p["verify_ms"] for p in points], 0.5, bottom=[p["draft_ms"] for p in points], label="verify")
    axes[1].set_xticks(x, [f"{p['name']}\n{p['setting']}" for p in points], fontsize=7, rotation=30, ha="right")
    axes[1].set_ylabel("ms per round (our eval)")
    axes[1].legend(fontsize=8)
    axes[1].set_title("cost of one round")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default="runs/bench-algorithms")
    ap.add_argument("--only", nargs="*", type=names, default=[],
                    help=f"a subset, comma- or space-separated (default: all of {', '.join(ALGORITHMS)})")
    ap.add_argument("--reuse", action="store_true", help="evaluate the checkpoints under --out, no training")
    ap.add_argument("--no-engine", action="store_true", help="skip the llama.cpp rows")
    ap.add_argument("--no-readme", action="store_true",
                    help="print the table, write the plot under --out; leave benchmarks/README.md alone")
    ap.add_argument("--stores", default=None,
                    help="a folder for the feature stores (default: each config's store.dir, shared)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides for every capture, training and eval")
    args = ap.parse_args()
    only = [n for group in args.only for n in group]
    out = REPO / args.out
    chosen = {n: c for n, c in ALGORITHMS.items() if not only or n in only}
    stores = {n: store_of(c, args.stores) for n, c in chosen.items()}
    for store in dict.fromkeys(stores.values()):  # each store once, captured by the first config reading it
        if not (store / "index.json").is_file():
            config = chosen[next(n for n, s in stores.items() if s == store)]
            run([PY, "-m", "specforge.capture", "--config", config, "--no-progress", f"store.dir={store}",
                 *args.overrides])
    common = [f"train.max_minutes={args.minutes}", "checkpoint.resume=false", "tracking.wandb=false", *args.overrides]
    trained = {}  # name -> (checkpoint, wall seconds)
    for name, config in chosen.items():
        store = stores[name]
        folder = out / name.lower().replace("-", "").replace(".", "")
        if args.reuse:  # the training loop's own clock (its last metrics.jsonl record; start-up not included)
            lines = (folder / "metrics.jsonl").read_text().splitlines()
            secs = json.loads(lines[-1]).get("time_s", math.nan) if lines else math.nan
        else:
            secs = run([PY, "-m", "specforge.ray_train", "--config", config, f"train.output_dir={folder}",
                        f"store.dir={store}", *common])
        trained[name] = (newest(folder), secs)
    load = os.getloadavg()[0]
    # one eval per store: the drafts of one store read the same target layers, which the eval's config
    # names (MTP's checkpoint records no layer ids, so an eval run with EAGLE-3's config would feed it
    # EAGLE-3's three); the held-out prompts are the same in every config (the same data keys)
    groups: dict[Path, list[str]] = {}
    for name in trained:
        groups.setdefault(stores[name], []).append(name)
    evaluated, served, refused, as_served = [], {}, {}, {}
    if not args.no_engine:
        refused = {n: why for n, t in trained.items() if (why := llamacpp_refusal(t[0]))}
    for i, group in enumerate(groups.values()):
        config, suffix = chosen[group[0]], f"-{i}" if i else ""
        report = out / f"eval{suffix}.json"
        drafts = [a for n in group for a in ("--draft", trained[n][0])]
        run([PY, "-m", "specforge.eval", "--config", config, *drafts, "--num-prompts", str(args.prompts),
             "--max-new-tokens", str(args.max_new_tokens), "--chain", "7", "--json", str(report), *args.overrides])
        evaluated += json.loads(report.read_text())["rows"]
        engine_drafts = [a for n in group if not (args.no_engine or n in refused) for a in ("--draft", trained[n][0])]
        if engine_drafts:
            engine_report = out / f"engine{suffix}.json"
            run([PY, "-m", "specforge.eval", "--config", config, "--engine", "llama.cpp", *engine_drafts,
                 "--num-prompts", str(args.prompts), "--max-new-tokens", str(args.max_new_tokens),
                 "--engine-n-max", "7", "--engine-p-min", "0", "--json", str(engine_report), *args.overrides])
            served.update({r["draft"]: r for r in json.loads(engine_report.read_text())["rows"]})
            # llama.cpp runs a block of n_max + 1 rows (n_max anchor-first), the eval the whole trained block:
            # the parity compares llama.cpp with our eval of the block it runs (--as-served)
            blocks = [a for n in group if n in BLOCK_DRAFTS and n not in refused for a in ("--draft", trained[n][0])]
            if blocks:
                as_served_report = out / f"eval-as-served{suffix}.json"
                run([PY, "-m", "specforge.eval", "--config", config, *blocks, "--num-prompts", str(args.prompts),
                     "--max-new-tokens", str(args.max_new_tokens), "--chain", "7", "--as-served",
                     "--json", str(as_served_report), *args.overrides])
                as_served.update({r["draft"]: r for r in json.loads(as_served_report.read_text())["rows"]})
    rows, points, engine_done = [], [], set()
    for r in evaluated:
        name = next(n for n, t in trained.items() if t[0] == r["draft"])
        steps = int(Path(r["draft"]).name.split("-")[-1])  # the evaluated checkpoint's step
        row = [name, r["setting"], f"{trained[name][1] / 60:.1f}", steps, f"{r['acceptance_length']:.3f}",
               " ".join(f"{a:.2f}" for a in r["acceptance_by_position"]), f"{r['drafted_per_round']:.2f}",
               f"{r['draft_ms_per_round']:.1f}", f"{r['verify_ms_per_round']:.1f}", f"{r['speedup']:.2f}x"]
        engine = None  # the engine's row sits beside the draft's fixed-length setting (llama.cpp's n_max 7)
        if name not in engine_done and not r["setting"].startswith("dynamic"):
            engine = served.get(r["draft"])
            engine_done.add(name)
        if engine:
            ours = as_served.get(r["draft"], r)  # a block draft: ours with the block llama.cpp runs
            gap = engine["tokens_per_forward"] - ours["acceptance_length"]
            row += [f"{ours['acceptance_length']:.3f}" if ours is not r else "=",
                    f"{engine['tokens_per_forward']:.3f}", f"{gap:+.3f}", "yes" if abs(gap) <= 0.05 else "no",
                    f"{engine['equal_outputs']}/{engine['prompts']}", f"{engine['tokens_per_s']:.1f}",
                    f"{engine['speedup']:.2f}x"]
        else:
            row += ["-"] * 7
        rows.append(row)
        points.append({"name": name, "setting": r["setting"], "acceptance": r["acceptance_length"],
                       "by_position": r["acceptance_by_position"], "draft_ms": r["draft_ms_per_round"],
                       "verify_ms": r["verify_ms_per_round"],
                       "served": engine["tokens_per_forward"] if engine else None})
    alone = next((e for e in served.values() if e["draft"] == "target alone"), None)
    table = markdown_table(["draft", "setting", "train wall min", "steps", "acceptance length",
                            "accepted by position", "drafted/round", "draft ms/round", "verify ms/round", "speedup",
                            "ours as llama.cpp runs the block", "llama.cpp acceptance (n_max 7)", "llama.cpp - ours",
                            "parity (within 0.05) met",
                            "llama.cpp outputs = target", "llama.cpp tok/s", "llama.cpp speedup"], rows)
    if alone:
        table += f"\n\nllama.cpp target alone: {alone['tokens_per_s']:.1f} tok/s (f32 GGUF, same prompts)."
    for name, why in refused.items():
        table += f"\n\nllama.cpp does not serve {name}: `{why}`"
    flags = " --reuse" if args.reuse else f" --minutes {args.minutes:g}"
    how = (f"for {args.minutes:g} minutes of wall clock each" if not args.reuse else
           "by an earlier run of this script (checkpoints reused; train wall min = the training loop's own clock "
           "from each run's metrics.jsonl, start-up not included)")
    body = (f"`python benchmarks/bench_algorithms.py{flags}`\n\n**Current figures**: {header_markdown()} · 1-minute "
            f"load average before the eval {load:.1f} (2 cores; the trainings ran one after the other, "
            "nothing else heavy).\n\n"
            f"Every draft trained on the same 300 captured conversations (the default's store, target layers "
            f"[1, 14, 26]; MTP's own store of the last layer) {how}; {args.prompts} held-out ShareGPT prompts x "
            f"{args.max_new_tokens} new tokens, greedy, every output equal to plain greedy decoding.\n\n" + table)
    png = out / "bench_algorithms.png" if args.no_readme else Path(__file__).resolve().parent / "bench_algorithms.png"
    plot(points, png)
    body += f"\n\n![draft algorithms]({png.name})\n"
    print(body)
    if not args.no_readme:
        append_section(TITLE, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
