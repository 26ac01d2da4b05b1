"""Batched target forward: one forward over 4 DP groups' samples vs one forward per DP group.

    python benchmarks/bench_batched_forward.py [--reps 5] [--threads 2] [--no-readme]

What a rollout worker does per step (``RolloutWorker._forward``): collate the union of the
samples of the DP groups it serves (right-padded) and run ``capture`` once (aux layers + last
hidden + chunked argmax). The alternative is one ``capture`` per DP group. Target: SmolLM2-135M
(the embedded default, fp32 as in configs/smollm2-135m-cpu.yaml), real ShareGPT samples drawn by
the same sampler as training (``global_batch_ids`` + ``split_for_ranks``), ``--threads`` torch
threads. Methods alternate rep by rep (the machine is shared); medians reported. tokens/s counts
real tokens (padding excluded), so padding waste shows up as lower throughput.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    default_cpu_run,
    machine_info,
    markdown_table,
    publish,
)
from specforge.models.target import capture  # noqa: E402
from specforge.training.batch import collate, global_batch_ids, split_for_ranks  # noqa: E402

DP_GROUPS = 4
# (samples per DP group, token cap per sample): the default config's shape, then shorter ones
CASES = [(2, 512), (1, 512), (2, 128), (1, 64)]
TARGET_SPEEDUP = 1.3


def groups_of(data, per_group: int, cap: int, step: int) -> list[list[dict]]:
    ids = global_batch_ids(len(data.train), per_group * DP_GROUPS, seed=0, step=step)
    rows = [{"input_ids": r["input_ids"][:cap], "loss_mask": r["loss_mask"][:cap]}
            for r in (data.train[i] for i in ids)]
    return [[rows[i] for i in micro[0]] for micro in split_for_ranks(list(range(len(rows))), DP_GROUPS, 1)]


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_case(target, data, per_group: int, cap: int, reps: int, pad: int) -> dict:
    batched, separate, tokens, padded = [], [], 0, 0
    for rep in range(reps + 1):  # rep 0 warms up
        groups = groups_of(data, per_group, cap, step=rep)
        union = [r for g in groups for r in g]

        def one():
            ids, _, attn = collate(union, pad)
            capture(target, ids, attn)

        def per_group_fwd():
            for g in groups:
                ids, _, attn = collate(g, pad)
                capture(target, ids, attn)

        order = [(batched, one), (separate, per_group_fwd)]
        for out, fn in order if rep % 2 == 0 else order[::-1]:
            t = timed(fn)
            if rep:
                out.append(t)
        if rep:
            tokens += sum(len(r["input_ids"]) for r in union)
            padded += len(union) * max(len(r["input_ids"]) for r in union)
    tb, ts = statistics.median(batched), statistics.median(separate)
    tok = tokens / reps
    return {"per_group": per_group, "cap": cap, "tokens": tok, "pad_frac": 1 - tokens / padded,
            "batched_s": tb, "separate_s": ts, "batched_tps": tok / tb, "separate_tps": tok / ts, "speedup": ts / tb}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['per_group']}x{DP_GROUPS} samples\n<= {r['cap']} tok" for r in results]
    x = range(len(results))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([i - 0.2 for i in x], [r["separate_tps"] for r in results], 0.4, label="one forward per DP group")
    ax.bar([i + 0.2 for i in x], [r["batched_tps"] for r in results], 0.4, label="one batched forward (ours)")
    for i, r in enumerate(results):
        ax.text(i + 0.2, r["batched_tps"], f"{r['speedup']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("target tokens/s")
    ax.set_title("SmolLM2-135M target forward (capture), 4 DP groups")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-readme", action="store_true")
    args = ap.parse_args()
    cfg, target, data = default_cpu_run(args.threads)
    pad = target.tokenizer.pad_token_id or 0
    results = [run_case(target, data, g, cap, args.reps, pad) for g, cap in CASES]
    rows = [[f"{r['per_group']} x {DP_GROUPS}", r["cap"], f"{r['tokens']:.0f}", f"{100 * r['pad_frac']:.0f}%",
             f"{r['separate_s']:.3f}", f"{r['separate_tps']:.0f}", f"{r['batched_s']:.3f}",
             f"**{r['batched_tps']:.0f}**", f"{r['speedup']:.2f}x",
             "yes" if r["speedup"] >= TARGET_SPEEDUP else "no"] for r in results]
    table = markdown_table(["samples (per group x groups)", "token cap", "real tokens/step", "padding (batched)",
                            "per-group fwd s", "per-group tokens/s", "batched fwd s", "batched tokens/s",
                            "speedup", f">= {TARGET_SPEEDUP}x"], rows)
    png = Path(__file__).resolve().parent / "bench_batched_forward.png"
    plot(results, png)
    publish("Batched target forward", "python benchmarks/bench_batched_forward.py", __doc__, table, machine_info(),
            tail=f"\n![batched forward]({png.name})\n", write=not args.no_readme)


if __name__ == "__main__":
    main()
