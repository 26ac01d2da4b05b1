"""Sequence parallelism: peak memory per train rank and step time vs sequence length.

    python benchmarks/bench_sp.py [--seqs 1024,2048,4096,8192] [--sps 1,2,4] [--steps 2] [--no-readme]
                                  [--mode ulysses|ring|allgather]

One train step = the real ``DraftTrainer.step`` (TTT forward with 7 steps under bf16 autocast,
backward, FSDP2 gradient reduce-scatter over the SP ranks, AdamW) on the SmolLM2-135M-shaped draft
of ``bench_ttt.py`` (hidden 576, 9 heads / 3 kv heads, target vocab 49152, draft vocab 8192),
batch 1, random target features, ~60% assistant tokens. SP ranks are spawned processes on gloo
(``specforge.parallel.launch.run_ranks``), ``parallelize_draft`` with ``sp_ulysses = SP``
(``--mode ulysses``), ``sp_ring = SP`` (``--mode ring``: ``parallel/ring.py``, step-0 K/V passed
around the ring), or ``sp_ring = SP`` with the all-gather reference swapped in (``--mode
allgather``: ``sp.AllGatherRingAttention``, every rank holds the whole sequence's step-0 K/V).
9 query heads do not split over 2 or 4 ranks: Ulysses pads to 10 / 12 heads (MHA), so SP 2 and
4 do 11% / 33% more attention work than SP 1 in total.

Memory = peak resident set size of each rank process (``resource.getrusage(RUSAGE_SELF).
ru_maxrss``: the high-water mark of the whole process, so every (SP, T) point is a fresh set of
processes). It includes the Python + torch baseline and the replicated frozen embedding
(49152 x 576 fp32 = 113 MB); the table also shows the peak minus the RSS measured just before the
first step ("step peak"), which is what sequence parallelism divides. The reported value is the
maximum over ranks; "memory model" is ``specforge/memory.py``'s peak for the same rank and step
(``bench_memory.predict``: tensors the step holds at its fullest phase, no interpreter baseline, so
compare it with the step peak plus the draft's weights; ``--predict-only`` lists it for lengths not
run here). ``--window W``: the draft's sliding window. Time = median over the measured steps of the slowest
rank. Every rank runs
``--threads`` torch threads (default 1: two-thread OpenMP regions on this shared, loaded 2-core
machine measured ~3x slower than one thread), so SP 2 uses both cores and SP 4 oversubscribes
them 2x: time is only indicative; memory is the measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import append_section, header_markdown, machine_info, markdown_table  # noqa: E402
from benchmarks.ttt_step import make_batch, make_draft  # noqa: E402

DRAFT_VOCAB = 8192


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def predicted_mb(sp: int, T: int, mode: str, window) -> float:
    """The memory model's peak for this rank (``bench_memory.predict``: held + the largest phase of a
    step; tensors only, no interpreter baseline), for the same draft, batch and precision."""
    from benchmarks.bench_memory import Case, predict, predicted_peak
    from benchmarks.ttt_step import TARGET

    u, r = (sp, 1) if mode == "ulysses" else (1, sp)
    case = Case("bench_sp", B=1, T=T, H=TARGET["hidden"], I=TARGET["intermediate"], Hq=TARGET["heads"],
                Hkv=TARGET["kv_heads"], D=TARGET["head_dim"], V=TARGET["vocab"], N=DRAFT_VOCAB, ttt=7,
                ulysses=u, ring=r, window=window)
    return predicted_peak(predict(case))[0] / 2**20


def _rank(rank: int, world: int, T: int, steps: int, out_dir: str, mode: str = "ulysses", window=None) -> None:
    from specforge.algorithms.eagle3.algorithm import Eagle3Options
    from specforge.config import Config, TrainConfig
    from specforge.models.features import TrainBatch
    from specforge.parallel import sp
    from specforge.parallel.dims import ParallelDims
    from specforge.parallel.parallelize import parallelize_draft, sum_over_train_ranks
    from specforge.registry import bound_algorithm
    from specforge.training.slicing import sp_slice_batch
    from specforge.training.trainer import DraftTrainer

    cfg = Config(draft=Eagle3Options(vocab_size=DRAFT_VOCAB, ttt_length=7, sliding_window=window),
                 train=TrainConfig(precision="bf16", lr=1e-4, warmup_steps=0))
    dims = ParallelDims(dp=1, sp_ulysses=world) if mode == "ulysses" else ParallelDims(dp=1, sp_ring=world)
    if mode == "allgather":  # the reference, swapped in where apply_sp builds the ring wrapper
        sp.RingAttention = sp.AllGatherRingAttention
    groups = dims.build(list(range(world)), rank, timeout_s=1800)
    torch.manual_seed(0)
    draft = make_draft(DRAFT_VOCAB)
    draft.midlayer.self_attn.core.window = window
    teacher = torch.randn(DRAFT_VOCAB, 576) * 0.05
    b = make_batch(1, T, draft)
    full = TrainBatch(b["input_ids_BT"], b["loss_mask_BT"], b["aux_hidden_BTKH"], b["last_hidden_BTH"],
                      b["target_ids_BT"])
    draft = parallelize_draft(draft, dims, groups, cfg.train.precision, bound_algorithm(cfg))
    trainer = DraftTrainer(bound_algorithm(cfg), draft, teacher, cfg, torch.device("cpu"),
                           reduce_sum=sum_over_train_ranks(groups))
    local = [sp_slice_batch(full, groups.sp_rank, groups.sp_size, cfg.draft.ttt_length + 1)]
    base = _rss_mb()
    times = []
    for _ in range(steps + 1):  # the first step warms up (allocator, optimizer state)
        t0 = time.perf_counter()
        trainer.step(local)
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"peak_mb": peak, "base_mb": base, "times": times[1:]}))


def measure(sp: int, T: int, steps: int, threads: int, mode: str = "ulysses", window=None) -> dict:
    from specforge.parallel.launch import run_ranks

    with tempfile.TemporaryDirectory() as d:
        run_ranks(_rank, sp, T, steps, d, mode, window, workdir=d, timeout_s=3600, threads=threads)
        ranks = [json.loads(Path(d, f"rank{r}.json").read_text()) for r in range(sp)]
    step_s = statistics.median(max(r["times"][i] for r in ranks) for i in range(steps))
    return {"sp": sp, "mode": mode if sp > 1 else "-", "T": T, "peak_mb": max(r["peak_mb"] for r in ranks),
            "step_peak_mb": max(r["peak_mb"] - r["base_mb"] for r in ranks), "step_s": step_s, "window": window,
            "model_mb": predicted_mb(sp, T, mode, window)}


def plot(results: list[dict], path: Path, mode: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for sp in sorted({r["sp"] for r in results}):
        rs = sorted((r for r in results if r["sp"] == sp), key=lambda r: r["T"])
        Ts = [r["T"] for r in rs]
        axes[0].plot(Ts, [r["peak_mb"] for r in rs], "o-", label=f"SP {sp}")
        axes[1].plot(Ts, [r["step_peak_mb"] for r in rs], "o-", label=f"SP {sp}")
        axes[2].plot(Ts, [r["step_s"] for r in rs], "o-", label=f"SP {sp}")
    for ax, title in zip(axes, ["peak RSS per rank (MB)", "step peak above baseline (MB)",
                                "step time (s, oversubscribed)"]):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"SP ({mode}), SmolLM2-shaped draft, 7 TTT steps, bf16 autocast, CPU gloo")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="1024,2048,4096,8192")
    ap.add_argument("--sps", default="1,2,4")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--mode", choices=("ulysses", "ring", "allgather"), default="ulysses")
    ap.add_argument("--window", type=int, default=None, help="the draft's sliding window (draft.sliding_window)")
    ap.add_argument("--predict-only", default="", help="tokens (comma list) to list the memory model's peak for, "
                    "unmeasured (lengths whose step would not fit or finish here)")
    ap.add_argument("--no-readme", action="store_true")
    args = ap.parse_args()
    info = machine_info()
    info["load"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    results = []
    for T in [int(s) for s in args.seqs.split(",")]:
        for sp in [int(s) for s in args.sps.split(",")]:
            r = measure(sp, T, args.steps, args.threads, args.mode, args.window)
            results.append(r)
            print(json.dumps(r), flush=True)
    info["load_after"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    base = {r["T"]: r for r in results if r["sp"] == 1}
    rows = []
    for r in results:
        b = base.get(r["T"])
        ratio = f"{r['step_peak_mb'] / b['step_peak_mb']:.2f}" if b else "-"
        rows.append([r["T"], r["sp"], r["mode"], f"{r['peak_mb']:.0f}", f"{r['step_peak_mb']:.0f}", ratio,
                     f"{r['model_mb']:.0f}", f"{r['step_s']:.2f}"])
    for T in [int(x) for x in args.predict_only.split(",") if x]:
        for sp in [int(x) for x in args.sps.split(",")]:
            rows.append([T, sp, args.mode if sp > 1 else "-", "not run", "-", "-",
                         f"{predicted_mb(sp, T, args.mode, args.window):.0f}", "-"])
    table = markdown_table(["tokens", "SP", "mode", "peak RSS/rank MB", "step peak MB", "step peak vs SP 1",
                            "memory model MB", "step s"], rows)
    tag = "" if args.mode == "ulysses" else f"_{args.mode}"
    png = Path(__file__).with_name(f"bench_sp{tag}{'' if args.window is None else f'_w{args.window}'}.png")
    plot(results, png, args.mode)
    print(header_markdown(info))
    print(table)
    if not args.no_readme:
        flags = (f" --window {args.window}" if args.window else "") + (f" --predict-only {args.predict_only}"
                                                                          if args.predict_only else "")
        body = (f"{header_markdown(info)}\n\n`python benchmarks/bench_sp.py --seqs {args.seqs} --sps {args.sps} "
                f"--steps {args.steps} --threads {args.threads} --mode {args.mode}{flags}`: see the script "
                f"docstring for what is measured.\n\n{table}\n\n![]({png.name})\n")
        title = {"ulysses": "Ulysses", "ring": "ring", "allgather": "all-gather ring reference"}[args.mode]
        if args.window:
            title += f", sliding window {args.window}"
        append_section(f"Sequence parallel ({title}) memory and step time", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
