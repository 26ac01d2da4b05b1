"""TTT train step throughput: fast path vs the straightforward baseline.

    python benchmarks/bench_ttt.py [--quick] [--no-readme] [--profile] [--flex] [--launches]

One train step = zero_grad + TTT forward (7 steps) + backward + AdamW step, on a
SmolLM2-135M-shaped draft (hidden 576, intermediate 1536, 9 heads / 3 kv heads, head_dim 64,
target vocab 49152) with random target features and a realistic loss mask (alternating user /
assistant spans, ~60% assistant tokens). Two threads (torch.set_num_threads(2)).

* fast     = ``specforge.algorithms.eagle3.loss.ttt_loss`` (attention core "auto" = the mask-free chunked core
             on CPU; fused chunked lm_head + soft-CE on counted rows only; teacher once;
             embedding half of q/k/v once; rows no later step needs trimmed)
* baseline = ``specforge.algorithms.eagle3.loss.ttt_loss_reference`` (eager attention over concatenated keys
             with the materialized T x T*(i+1) mask, lm_head + log_softmax on all B*T rows)

Precision: what training runs on this machine (``--precision auto``, the trainer's
``train.precision: auto``: bf16 autocast where the CPU has bf16 instructions, else fp32), or forced
with ``--precision bf16|fp32``; the table names it.

Fast and baseline runs are interleaved so background load on the machine hits both alike;
tokens/s uses the median step time (B*T tokens per step, padding included).

``--flex``: the same steps with the ``fast`` core (what ``auto`` runs on a CPU) vs the ``flex`` core,
interleaved (torch 2.13 refuses flex_attention's backward on the CPU with a guard; the benchmark lifts
it to run torch's dense reference math: the CPU cost of flex, not the GPU's fused kernel).

``--launches``: a CPU proxy for a GPU step's kernel launches (``launches.py``), per core and with the
weights cast per TTT step (as before ``cast_once``) or once. Never a GPU measurement.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import launches, ttt_step  # noqa: E402
from benchmarks.common import append_section, header_markdown, machine_info, markdown_table  # noqa: E402
from benchmarks.ttt_step import TARGET, feature_dtype, make_batch, make_draft, train_step  # noqa: E402
from specforge.algorithms.eagle3.loss import ttt_loss, ttt_loss_reference  # noqa: E402
from specforge.device import autocast_dtype, cpu_fast_bf16  # noqa: E402

CASES = [(1, 512, 8192, 830.0), (2, 1024, 32000, 200.0)]  # B, T, draft vocab, target tokens/s


def pick_amp(precision: str) -> "torch.dtype | None":
    """The autocast dtype the trainer picks for ``train.precision=precision`` on this CPU."""
    return autocast_dtype(precision, torch.device("cpu"))


def run_case(B, T, N, reps_fast, reps_base, skip_base=False):
    draft = make_draft(N)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4, fused=True)
    batch = make_batch(B, T, draft)
    teacher_W = (torch.randn(N, TARGET["hidden"]) * 0.02).to(feature_dtype())
    fns = {"fast": ttt_loss, "baseline": ttt_loss_reference}
    times = {"fast": [], "baseline": []}
    train_step(draft, opt, batch, teacher_W, ttt_loss)  # warm-up
    if not skip_base:
        train_step(draft, opt, batch, teacher_W, ttt_loss_reference)
    for r in range(max(reps_fast, reps_base)):
        for name in ("fast", "baseline"):
            if name == "baseline" and (skip_base or r >= reps_base):
                continue
            if name == "fast" and r >= reps_fast:
                continue
            times[name].append(train_step(draft, opt, batch, teacher_W, fns[name]))
    frac = batch["loss_mask_BT"].float().mean().item()
    return times, frac


def profile_case(B, T, N):
    draft = make_draft(N)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4, fused=True)
    batch = make_batch(B, T, draft)
    teacher_W = (torch.randn(N, TARGET["hidden"]) * 0.02).to(feature_dtype())
    train_step(draft, opt, batch, teacher_W, ttt_loss)
    from torch.profiler import profile

    with profile() as prof:
        train_step(draft, opt, batch, teacher_W, ttt_loss)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def run_flex_case(B, T, N, reps):
    """Step times with the fast core and the flex core on one draft, interleaved."""
    draft = make_draft(N)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4, fused=True)
    batch = make_batch(B, T, draft)
    teacher_W = (torch.randn(N, TARGET["hidden"]) * 0.02).to(feature_dtype())
    core = draft.midlayer.self_attn.core
    times = {"fast": [], "flex": []}
    with launches.cpu_flex_backward():
        for r in range(reps + 1):  # the first round warms up
            for impl in times:
                core.impl = impl
                dt = train_step(draft, opt, batch, teacher_W, ttt_loss)
                if r:
                    times[impl].append(dt)
    return times


def flex_section(args, info, precision) -> str:
    rows, load = [], [open("/proc/loadavg").read().strip()]
    for B, T, N, _ in CASES:
        times = run_flex_case(B, T, N, 2 if args.quick else (3 if B * T >= 2048 else 6))
        tok = B * T
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append([f"{B}x{T}", N, f"{med['fast']:.3f}", f"{tok / med['fast']:.0f}", f"{med['flex']:.3f}",
                     f"{tok / med['flex']:.0f}", f"{med['flex'] / med['fast']:.2f}x"])
        print(" | ".join(str(c) for c in rows[-1]), flush=True)
    load.append(open("/proc/loadavg").read().strip())
    table = markdown_table(["batch", "draft vocab", "fast s/step", "fast tokens/s", "flex s/step", "flex tokens/s",
                            "flex / fast time"], rows)
    return (f"`python benchmarks/bench_ttt.py --flex` -- {header_markdown(info)}\n\n"
            f"The train step of the section \"TTT train step\" ({precision}, {args.threads} threads, "
            "SmolLM2-135M-shaped "
            "draft) with the `fast` core (what `draft.attention: auto` runs on a CPU) and the `flex` core "
            "(`flex_attention` over the concatenated keys). On a CPU torch 2.13 runs flex_attention eagerly as a "
            "dense reference (full scores materialized) and refuses its backward behind a guard, which this "
            "benchmark lifts: this is flex's CPU cost, not the fused GPU kernel's, and why `auto` stays `fast` "
            f"on a CPU. Interleaved, medians. `cat /proc/loadavg` before: `{load[0]}`; after: `{load[1]}` "
            "(2 cores).\n\n" + table)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer reps, no baseline at 2x1024")
    ap.add_argument("--no-readme", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--flex", action="store_true", help="fast vs flex core step times on this CPU")
    ap.add_argument("--launches", action="store_true", help="CPU proxy of a GPU step's kernel launches")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                    help="auto = what train.precision=auto trains in on this CPU")
    args = ap.parse_args()
    ttt_step.AMP = pick_amp(args.precision)
    precision = "bf16 autocast" if ttt_step.AMP is not None else "fp32"
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.profile:
        for B, T, N, _ in CASES:
            profile_case(B, T, N)
        return
    info = machine_info()
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        cwd=Path(__file__).resolve().parent.parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    import platform

    info["platform"] = platform.platform()
    if args.flex or args.launches:
        title, body = (("TTT train step: fast vs flex core (CPU)", flex_section(args, info, precision)) if args.flex
                       else (launches.TITLE, launches.section(info, args.threads)))
        print(body)
        if not args.no_readme:
            append_section(title, body)
        return
    rows = []
    load_before = os.getloadavg()[0]
    for B, T, N, target in CASES:
        big = B * T >= 2048
        reps_fast = 3 if args.quick else (5 if big else 12)
        reps_base = 0 if (args.quick and big) else (2 if big else 4)
        times, frac = run_case(B, T, N, reps_fast, reps_base, skip_base=reps_base == 0)
        tok = B * T
        f_med, f_best = statistics.median(times["fast"]), min(times["fast"])
        row = [f"{B}x{T}", N, f"{frac:.0%}", f"{f_med:.3f}", f"**{tok / f_med:.0f}** (best {tok / f_best:.0f})"]
        if times["baseline"]:
            b_med = statistics.median(times["baseline"])
            row += [f"{b_med:.3f}", f"{tok / b_med:.0f}", f"{b_med / f_med:.1f}x"]
        else:
            row += ["-", "-", "-"]
        row += [f"{target:.0f}", "yes" if tok / f_med >= target else "no"]
        rows.append(row)
        print(" | ".join(str(c) for c in row), flush=True)
    headers = ["batch", "draft vocab", "loss-mask ones", "fast s/step (median)", "fast tokens/s",
               "baseline s/step", "baseline tokens/s", "speedup", "target tokens/s", "met"]
    table = markdown_table(headers, rows)
    body = (
        f"`python benchmarks/bench_ttt.py` -- {header_markdown(info)}\n\n"
        f"One train step = TTT forward (7 steps) + backward + AdamW (fused=True), **{precision}** "
        f"(--precision {args.precision}; bf16 instructions on this CPU: {'yes' if cpu_fast_bf16() else 'no'}), "
        f"{args.threads} threads, SmolLM2-135M-shaped draft (H 576, I 1536, 9/3 heads, head_dim 64, "
        "target vocab 49152), random features. fast = `ttt_loss` (mask-free chunked attention core, fused "
        "chunked lm_head + soft-CE on counted rows only, teacher once, embedding half of q/k/v once, rows no "
        "later step needs trimmed); "
        "baseline = `ttt_loss_reference` (eager attention with materialized full TTT masks, lm_head + "
        "log_softmax on all rows). Runs interleaved; tokens/s from the median step (B*T tokens/step). "
        f"The machine is shared: 1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after "
        "(2 cores); under foreign load the median drops while the best step stays put.\n\n"
        + table
    )
    print()
    print(body)
    if not args.no_readme:
        append_section("TTT train step", body)


if __name__ == "__main__":
    main()
