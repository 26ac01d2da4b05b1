"""Soak: memory over a long run. Per-process RSS of a tiny disaggregated Ray run over a few hundred
steps, and the high-water mark of feature bytes in flight.

    nice -n 19 python benchmarks/soak.py [--steps 300] [--every 25] [--warmup 50] [--no-readme]

A tiny random Llama target (hidden 64, 4 layers, a 400-token BPE vocab) and 64 short ShareGPT-style
conversations, run through the driver's own pieces (``prepare``, ``spawn_cluster``, ``Planner``,
``train_loop``): 1 rollout worker feeding 2 train DP ranks (FSDP2, gloo) over p2p, with periodic eval
and checkpoints, and an in-flight budget of a few steps so backpressure works the whole run.

Every ``--every`` steps the driver reads the RSS of itself and of every worker (through
``actor.__ray_call__``, queued behind the plans already submitted). Growth is judged after
``--warmup`` steps (allocator pools, the first checkpoint and eval, buffer pools): RSS at the
warm-up sample vs the last one, and the least-squares slope over the samples in between. A slope
that stays well above the noise of the samples is a leak. At the end the workers' in-flight logs
are merged (``dataplane.inflight_peak``): the peak must stay within ``placement.max_inflight_mb``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import append_section, header_markdown, machine_info, markdown_table  # noqa: E402

TITLE = "Soak: memory over a long run"


def rss_mb(_actor=None, settle: bool = False) -> float:
    """This process's resident set size in MB (``actor.__ray_call__.remote(rss_mb)`` asks a worker).
    ``settle``: first a full garbage collection and glibc ``malloc_trim(0)`` (freed memory the
    allocator still holds goes back to the OS), so what remains is memory in use."""
    import psutil

    if settle:
        import ctypes
        import gc

        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass
    return psutil.Process().memory_info().rss / 2**20


def trace_start(actor=None) -> None:
    """``--trace``: start tracemalloc in this process and keep a baseline snapshot (on the actor)."""
    import gc
    import tracemalloc

    gc.collect()
    tracemalloc.start(4)
    holder = actor if actor is not None else sys.modules[__name__]
    holder._soak_base = tracemalloc.take_snapshot()


def trace_growth(actor=None, top: int = 6) -> list[str]:
    """The Python allocations that grew most since ``trace_start`` (file:line, KB, count)."""
    import gc
    import tracemalloc

    gc.collect()
    holder = actor if actor is not None else sys.modules[__name__]
    diff = tracemalloc.take_snapshot().compare_to(holder._soak_base, "lineno")
    return [f"{d.size_diff / 1024:+.1f} KB in {d.count_diff:+d} blocks at "
            f"{d.traceback[0].filename}:{d.traceback[0].lineno}"
            for d in sorted(diff, key=lambda d: -d.size_diff)[:top]]


def build_assets(root: Path) -> None:
    """A tiny random Llama target + ChatML tokenizer folder and a small ShareGPT-style JSONL."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.test_data_prepare import make_tokenizer, rec, write_jsonl

    tok = make_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    words = "hello world user assistant system question answer".split()
    rows = [rec(" ".join(words[(i + j) % 7] for j in range(3 + i % 5)),
                " ".join(words[(3 * i + j) % 7] for j in range(8 + i % 13))) for i in range(72)]
    write_jsonl(root / "data.jsonl", rows)


def soak_config(root: Path, steps: int, budget_mb: float):
    from specforge.config import load_config

    return load_config(None, [
        f"model.target_path={root / 'target'}", "model.dtype=float32", "model.device=cpu",
        f"model.cache_dir={root / 'cache'}", f"data.path={root / 'data.jsonl'}", "data.max_length=128",
        "data.num_eval=8", "draft.vocab_size=128", "draft.ttt_length=3", "train.lr=1e-3", "train.warmup_steps=5",
        "train.batch_size=2", f"train.max_steps={steps}", "train.precision=fp32", "train.num_threads=1",
        "train.num_workers=2", "train.log_every=1", "train.eval_every=50", f"train.output_dir={root / 'run'}",
        "tracking.wandb=false", "checkpoint.every_steps=100", "checkpoint.keep_last=1", "checkpoint.resume=false",
        "placement.mode=disaggregated", "rollout.num_workers=1", f"placement.max_inflight_mb={budget_mb}",
        "parallel.timeout_s=600",
    ])


class SamplingLogger:
    """The run's MetricsLogger, plus an RSS sample of every process every ``every`` steps."""

    def __init__(self, inner, every: int, sample):
        self.inner, self.every, self.sample = inner, every, sample

    def log(self, step: int, metrics: dict, kind: str = "train") -> None:
        self.inner.log(step, metrics, kind=kind)
        if kind == "train" and step % self.every == 0:
            self.sample(step)

    def close(self) -> None:
        self.inner.close()


def line_fit(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope (MB per 100 steps) and the largest residual (MB): growth vs noise."""
    n = len(xs)
    if n < 2:
        return float("nan"), 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return 100 * slope, max(abs(y - my - slope * (x - mx)) for x, y in zip(xs, ys))


def run(steps: int, every: int, budget_steps: float, trace_at: Optional[int] = None, settle: bool = False) -> dict:
    import ray

    from specforge.contracts import Layout
    from specforge.ray_train import Planner, collect, prepare, spawn_cluster, start_ray, train_loop
    from specforge.runtime.dataplane import inflight_peak, inflight_snapshot
    from specforge.tracking import MetricsLogger

    root = Path(tempfile.mkdtemp(prefix="soak-"))
    build_assets(root)
    probe = soak_config(root, steps, 1.0)
    data = prepare(probe, use_gpu=False)
    planner = Planner(probe, data, Layout("disaggregated", (0,), (1, 2), data.vocab_path))
    per_step = [planner.step_bytes(s) for s in range(steps)]
    budget = budget_steps * planner.largest_step_bytes()  # the loop refuses a budget one step could exceed
    cfg = soak_config(root, steps, budget / 2**20)
    started = start_ray(cfg, 3)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import benchmarks/
    samples: dict[str, list[tuple[int, float]]] = {}
    cluster = None
    try:
        cluster = spawn_cluster(cfg, data, use_gpu=False)
        actors, labels = cluster.rollout.actors + cluster.train.actors, cluster.rollout.labels + cluster.train.labels

        def sample(step: int) -> None:
            rss = collect([a.__ray_call__.remote(rss_mb, settle) for a in actors], labels, 600, "rss")
            for label, mb in zip(["driver", *labels], [rss_mb(None, settle), *rss]):
                samples.setdefault(label, []).append((step, mb))
            if step == trace_at:
                trace_start()
                collect([a.__ray_call__.remote(trace_start) for a in actors], labels, 600, "trace")

        sample(0)
        logger = SamplingLogger(MetricsLogger(cfg.tracking, cfg.train.output_dir), every, sample)
        t0 = time.perf_counter()
        done = train_loop(cfg, cluster, Planner(cfg, data, cluster.layout), logger)
        seconds = time.perf_counter() - t0
        if done % every:
            sample(done)
        logger.close()
        logs = collect([a.__ray_call__.remote(inflight_snapshot) for a in actors], labels, 600, "inflight log")
        if trace_at is not None:
            grown = collect([a.__ray_call__.remote(trace_growth) for a in actors], labels, 600, "trace")
            for label, lines in zip(["driver", *labels], [trace_growth(), *grown]):
                print(f"{label}: Python allocations grown since step {trace_at}:\n  " + "\n  ".join(lines))
    finally:
        if cluster is not None:
            cluster.shutdown()
        if started:
            ray.shutdown()
    return {"samples": samples, "steps": done, "seconds": seconds, "peak": inflight_peak(logs), "budget": budget,
            "max_step": max(per_step), "events": sum(len(t) for t, _ in logs)}


def report(res: dict, warmup: int) -> tuple[list[str], list[list]]:
    headers = ["process", "RSS step 0 MB", f"RSS step {warmup} MB", f"RSS step {res['steps']} MB",
               f"growth after step {warmup} MB", "slope MB / 100 steps", "largest residual MB"]
    rows = []
    for label, pts in res["samples"].items():
        after = [(s, mb) for s, mb in pts if s >= warmup]
        xs, ys = [s for s, _ in after], [mb for _, mb in after]
        slope, noise = line_fit(xs, ys)
        rows.append([label, f"{pts[0][1]:.0f}", f"{ys[0]:.1f}", f"{ys[-1]:.1f}", f"{ys[-1] - ys[0]:+.1f}",
                     f"{slope:+.2f}", f"{noise:.1f}"])
    return headers, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=25, help="RSS sample interval (steps)")
    ap.add_argument("--warmup", type=int, default=50, help="growth is measured from this step (a sample step)")
    ap.add_argument("--budget-steps", type=float, default=3.0,
                    help="placement.max_inflight_mb = this many of the largest step")
    ap.add_argument("--no-readme", action="store_true")
    ap.add_argument("--settle", action="store_true",
                    help="gc.collect() + malloc_trim(0) in every process before each RSS sample (memory in use, "
                         "not what the allocator keeps)")
    ap.add_argument("--trace", action="store_true",
                    help="tracemalloc from the warm-up step on: print each process's Python allocations that grew")
    args = ap.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # On a loaded box a worker process can take minutes to import torch; Ray's default (60 s)
    # kills and retries it until actor creation fails.
    os.environ.setdefault("RAY_worker_register_timeout_seconds", "900")
    info = machine_info()
    info["load"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    res = run(args.steps, args.every, args.budget_steps, args.warmup if args.trace else None, args.settle)
    info["load_after"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    headers, rows = report(res, args.warmup)
    table = markdown_table(headers, rows)
    kib = lambda b: f"{b / 1024:.1f} KiB"  # noqa: E731
    within = "within" if res["peak"] <= res["budget"] else "OVER"
    summary = (f"{res['steps']} steps in {res['seconds']:.0f} s; in-flight high-water mark {kib(res['peak'])} "
               f"({within} placement.max_inflight_mb = {kib(res['budget'])} = {args.budget_steps:g} x "
               "the largest possible step; "
               f"the largest step of the run: {kib(res['max_step'])}); {res['events']} in-flight log events")
    print(header_markdown(info))
    for label, pts in res["samples"].items():  # the raw series, to tell a slope from a warm-up step
        print(f"{label}: " + " ".join(f"{s}:{mb:.1f}" for s, mb in pts))
    print(table)
    print(summary)
    if not args.no_readme:
        cmd = (f"`nice -n 19 python benchmarks/soak.py --steps {args.steps} --every {args.every} --warmup {args.warmup}"
               f"{' --settle' if args.settle else ''}`")
        body = (f"{cmd} -- {header_markdown(info)}\n\n{__doc__.split(chr(10) * 2, 2)[2].strip()}\n\n"
                f"{table}\n\n{summary}\n")
        append_section(TITLE, body)


if __name__ == "__main__":
    main()
