"""Disaggregated pipeline: end-to-end tokens/s vs each stage alone, and how long training idles.

    python benchmarks/bench_pipeline.py [--steps 8] [--scenario default rollout-faster] [--no-readme]

One Ray cluster per scenario, built with the driver's own pieces (``prepare``, ``spawn_cluster``,
``Planner``, ``train_loop``): 1 rollout worker (SmolLM2-135M target, fp32) feeding 2 train DP
ranks (FSDP2, gloo) over p2p, as in configs/smollm2-135m-cpu.yaml. Then, on the same workers:

* rollout alone = ``RolloutWorker.forward_only``: the one batched target forward per step,
  nothing sent, training idle;
* train alone   = ``TrainWorker.train_repeat``: THE train step on the last step's already
  received features (no waiting), rollout idle.

e2e tokens/s and the train-wait fraction (time a train rank sat waiting for features / step
time) are over the steps after the first two (warm-up). Target: e2e >= 0.9x the slower stage;
train idle < 10% when rollout is the faster stage. All processes share the machine's cores, so
on a small box the stages cannot run side by side at full speed: the "serial bound"
1 / (1/rollout + 1/train) is what one would get if they simply took turns on the same cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import append_section, header_markdown, machine_info, markdown_table  # noqa: E402

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "smollm2-135m-cpu.yaml"
SCENARIOS = {
    "default": [],  # the embedded default config: draft vocab 8192, 2 x 512 tokens per train rank
    # a heavier train step (7 TTT steps over a 32k draft vocab) makes rollout the faster stage
    "rollout-faster": ["draft.vocab_size=32000"],
}
WARMUP = 2


def run_scenario(name: str, extra: list[str], steps: int, reps: int) -> dict:
    import ray

    from specforge.config import load_config
    from specforge.ray_train import Planner, collect, prepare, spawn_cluster, start_ray, train_loop
    from specforge.tracking import MetricsLogger

    out = Path(tempfile.mkdtemp(prefix=f"bench-pipeline-{name}-"))
    cfg = load_config(CONFIG, [f"train.max_steps={steps}", "train.log_every=1", "train.max_minutes=null",
                               "tracking.wandb=false", f"train.output_dir={out}", "checkpoint.every_steps=0",
                               "checkpoint.resume=false", *extra])
    started = start_ray(cfg, cfg.train.num_workers + cfg.rollout.num_workers)
    cluster = None
    try:
        data = prepare(cfg, use_gpu=False)
        cluster = spawn_cluster(cfg, data, use_gpu=False)
        plan = Planner(cfg, data, cluster.layout)
        logger = MetricsLogger(cfg.tracking, out)
        train_loop(cfg, cluster, plan, logger)
        logger.close()
        recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][WARMUP:]
        t = cluster.timeout_s
        fwd = [collect([w.forward_only.remote(plan(steps + i)) for w in cluster.rollout.actors],
                       cluster.rollout.labels, t, "forward_only") for i in range(reps)]
        trn = collect([w.train_repeat.remote(reps) for w in cluster.train.actors], cluster.train.labels, t,
                      "train_repeat")
    finally:
        if cluster is not None:
            cluster.shutdown()
        if started:
            ray.shutdown()
    step_s = sum(r["step_s"] for r in recs)
    e2e = sum(r["tokens"] for r in recs) / step_s
    wait = sum(r["train_wait_ms"] for r in recs) / 1e3 / step_s
    rollout = statistics.median(sum(r.metrics["tokens"] for r in f) / (max(r.timings_ms["forward"] for r in f) / 1e3)
                                for f in fwd)
    step_tokens = sum(r.metrics["tokens_local"] for r in trn)
    train_ms = statistics.median(max(r.timings_ms[f"train_{i}"] for r in trn) for i in range(reps))
    train = step_tokens / (train_ms / 1e3)
    slower = min(rollout, train)
    return {
        "scenario": name, "steps": len(recs), "e2e": e2e, "rollout": rollout, "train": train, "ratio": e2e / slower,
        "serial": 1 / (1 / rollout + 1 / train), "wait": wait, "faster": "rollout" if rollout > train else "train",
        "fwd_ms": statistics.median(r["rollout_forward_ms"] for r in recs),
        "train_ms": statistics.median(r["train_ms"] for r in recs),
        "wait_ms": statistics.median(r["train_wait_ms"] for r in recs),
        "step_ms": statistics.median(1e3 * r["step_s"] for r in recs),
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(results))
    for off, key, label in [(-0.3, "rollout", "rollout alone"), (-0.1, "train", "train alone"),
                            (0.1, "serial", "serial bound"), (0.3, "e2e", "end to end")]:
        axes[0].bar([i + off for i in x], [r[key] for r in results], 0.2, label=label)
    axes[0].set_xticks(list(x), [r["scenario"] for r in results])
    axes[0].set_ylabel("tokens/s")
    axes[0].legend(fontsize=8)
    axes[0].set_title("throughput")
    bottom = [0.0] * len(results)
    for key, label in [("fwd_ms", "rollout forward (concurrent)"), ("train_ms", "train"), ("wait_ms", "train wait")]:
        vals = [r[key] for r in results]
        if key == "fwd_ms":
            axes[1].plot(list(x), vals, "k^", label=label)
            continue
        axes[1].bar(list(x), vals, 0.4, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    axes[1].set_xticks(list(x), [r["scenario"] for r in results])
    axes[1].set_ylabel("ms per step (median)")
    axes[1].legend(fontsize=8)
    axes[1].set_title("train rank time per step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--scenario", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    ap.add_argument("--no-readme", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    results = []
    for name in args.scenario:
        t0 = time.time()
        results.append(run_scenario(name, SCENARIOS[name], args.steps, args.reps))
        print(f"{name}: {results[-1]} ({time.time() - t0:.0f} s)", flush=True)
    rows = [[r["scenario"], " ".join(SCENARIOS[r["scenario"]]) or "(config as shipped)", r["steps"],
             f"{r['rollout']:.0f}", f"{r['train']:.0f}", f"{r['serial']:.0f}", f"**{r['e2e']:.0f}**",
             f"{r['ratio']:.2f}x", "yes" if r["ratio"] >= 0.9 else "no", f"{100 * r['wait']:.0f}%",
             ("yes" if r["wait"] < 0.10 else "no") if r["faster"] == "rollout" else "n/a (train faster)",
             f"{r['fwd_ms']:.0f} / {r['train_ms']:.0f} / {r['wait_ms']:.0f} / {r['step_ms']:.0f}"] for r in results]
    table = markdown_table(["scenario", "overrides", "steps timed", "rollout alone tok/s", "train alone tok/s",
                            "serial bound tok/s", "e2e tok/s", "e2e / slower stage", ">= 0.9x", "train idle",
                            "idle < 10%", "median ms: fwd / train / wait / step"], rows)
    png = Path(__file__).resolve().parent / "bench_pipeline.png"
    plot(results, png)
    body = (f"`python benchmarks/bench_pipeline.py --steps {args.steps}` -- {header_markdown(machine_info())}\n\n"
            f"{__doc__.split(chr(10) + chr(10), 2)[2].strip()}\n\n{table}\n\n![pipeline]({png.name})\n")
    print(body)
    if not args.no_readme:
        append_section("Disaggregated pipeline", body)


if __name__ == "__main__":
    main()
