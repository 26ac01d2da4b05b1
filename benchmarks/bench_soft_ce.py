"""The fused loss kernels (``specforge/kernels/losses.py``: soft CE and every other ``train.loss`` kind)
against the torch ops they replace, on a GPU.

    python benchmarks/bench_soft_ce.py [--kinds kl_div,tv,...] [--rows 2048,8192] [--vocab 32000] [--hidden 4096]
                                       [--reps 20] [--no-readme]
    python benchmarks/bench_soft_ce.py --device cpu --rows 8 --vocab 300 --hidden 16 --reps 1 --no-readme

Two cases per loss kind and row count, bf16 (EAGLE-3's Llama-3.1-8B draft: H 4096, draft vocab 32000):

* the row-wise part alone, on one chunk of bf16 logits: ``losses.loss_rows`` (the torch ops; ``kl_div``:
  ``soft_ce_rows_reference``) against ``losses.loss_rows_fused`` (one launch; the first call of a kind
  autotunes its tile);
* ``linear_soft_cross_entropy`` forward + backward over the default chunks, ``kernel=False`` against
  ``kernel=True`` (the matmuls are the same cuBLAS calls in both).

Milliseconds are medians of ``--reps`` after warm-up (CUDA events); launches are the CUDA kernels one
call runs (torch.profiler); peak is what one call allocates above what it started with
(``max_memory_allocated``); the largest differences say how far the kernel's GPU figures are from the
torch ops' (the GPU's exp is approximate: the interpreter tests cannot pin these). ``--device cpu`` runs
the harness in Triton's interpreter (slow, tiny shapes, no README section).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import append_section, header_markdown, markdown_table  # noqa: E402
from specforge.algorithms.eagle3.loss import linear_soft_cross_entropy  # noqa: E402
from specforge.kernels import losses, soft_ce  # noqa: E402


def timed(fn, reps: int, device: torch.device) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` calls after two warm-up calls."""
    fn(), fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def launches(fn, device: torch.device) -> int | str:
    if device.type != "cuda":
        return "-"
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)


def peak_mib(fn, device: torch.device) -> str:
    """MiB one call of ``fn`` allocates above what was allocated when it started (CUDA only)."""
    if device.type != "cuda":
        return "-"
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return f"{(torch.cuda.max_memory_allocated(device) - base) / 2**20:.0f}"


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def teacher_rows(kind: str, M: int, N: int, g: torch.Generator, device: torch.device) -> torch.Tensor:
    """The teacher rows as ``kind`` reads them: probabilities (``kl_div``) or log-probabilities."""
    logits = 2 * torch.randn(M, N, generator=g, device=device)
    return torch.log_softmax(logits, -1) if losses.log_teacher(kind) else torch.softmax(logits, -1)


def row_part(kind: str, M: int, N: int, reps: int, device: torch.device) -> list:
    g = torch.Generator(device=device).manual_seed(0)
    z = (3 * torch.randn(M, N, generator=g, device=device)).bfloat16()
    teacher = teacher_rows(kind, M, N, g, device)
    tidx = torch.randperm(M, generator=g, device=device)
    ref_out, ker_out = soft_ce.empty_outputs(z), soft_ce.empty_outputs(z)

    def ref():
        return losses.loss_rows(kind, z, teacher, tidx, out=ref_out)  # bf16 z: copied, not overwritten

    def ker():
        return losses.loss_rows_fused(kind, z, teacher, tidx, out=ker_out)

    ms_ref, ms_ker = timed(ref, reps, device), timed(ker, reps, device)
    ref(), ker()
    diffs = (f"loss {max_diff(ker_out[0], ref_out[0]):.1e}, pred {int((ker_out[1] != ref_out[1]).sum())} rows, "
             f"acc_p {max_diff(ker_out[2], ref_out[2]):.1e}, G {max_diff(ker_out[3], ref_out[3]):.1e}")
    return [kind, f"row-wise part, {M} x {N} bf16 logits", f"{ms_ref:.3f}", f"{ms_ker:.3f}",
            f"{ms_ref / ms_ker:.2f}x", f"{launches(ref, device)} / {launches(ker, device)}",
            f"{peak_mib(ref, device)} / {peak_mib(ker, device)}", diffs]


def whole_loss(kind: str, M: int, N: int, H: int, reps: int, device: torch.device) -> list:
    g = torch.Generator(device=device).manual_seed(1)
    h = torch.randn(M, H, generator=g, device=device).bfloat16().requires_grad_()
    W = (torch.randn(N, H, generator=g, device=device) / H**0.5).bfloat16().requires_grad_()
    teacher = teacher_rows(kind, M, N, g, device)
    tidx = torch.randperm(M, generator=g, device=device)

    def step(kernel: bool):
        h.grad = W.grad = None
        out = linear_soft_cross_entropy(h, W, teacher, tidx, kernel=kernel, kind=kind)
        out[0].backward()
        return out[0].detach(), h.grad, W.grad

    ms = [timed(lambda k=k: step(k), reps, device) for k in (False, True)]
    (l0, dh0, dW0), (l1, dh1, dW1) = step(False), step(True)
    diffs = (f"loss {max_diff(l1, l0) / l0.abs().item():.1e} rel, dh {max_diff(dh1, dh0):.1e}, "
             f"dW {max_diff(dW1, dW0):.1e}")
    peaks = []
    for k in (False, True):
        h.grad = W.grad = None  # each call's peak counts the gradients it makes
        peaks.append(peak_mib(lambda k=k: step(k), device))
    counts = " / ".join(str(launches(lambda k=k: step(k), device)) for k in (False, True))
    return [kind, f"fused loss fwd + bwd, {M} rows, H {H}, N {N}", f"{ms[0]:.3f}", f"{ms[1]:.3f}",
            f"{ms[0] / ms[1]:.2f}x", counts, " / ".join(peaks), diffs]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--kinds", default=",".join(losses.KINDS), help="the loss kinds (train.loss), comma-separated")
    ap.add_argument("--rows", default="2048,8192")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-readme", action="store_true")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel module is imported, at the first launch
    if not soft_ce.available(device):
        sys.exit(f"error: the loss kernels cannot run on {device}: they need triton and CUDA (or --device cpu)")
    kinds = [k for k in args.kinds.split(",") if k]
    if bad := [k for k in kinds if k not in losses.KINDS]:
        sys.exit(f"error: --kinds {','.join(bad)}: not a loss; use some of {','.join(losses.KINDS)}")
    rows = []
    for kind in kinds:
        for M in (int(r) for r in args.rows.split(",")):
            rows.append(row_part(kind, M, args.vocab, args.reps, device))
            rows.append(whole_loss(kind, M, args.vocab, args.hidden, args.reps, device))
            print(" | ".join(rows[-2]), "\n" + " | ".join(rows[-1]), flush=True)  # a timeout keeps what ran
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU, Triton interpreter"
    table = markdown_table(["kind", "case", "torch ms", "kernel ms", "speed-up", "launches torch / kernel",
                            "peak MiB torch / kernel", "largest difference"], rows)
    print(f"{name}\n{table}")
    if not args.no_readme and device.type == "cuda":
        append_section("Fused loss kernels", f"{header_markdown()} | **GPU** {name}\n\n"
                       "`python benchmarks/bench_soft_ce.py` (the kernels of `specforge/kernels/losses.py` "
                       "against the torch ops; bf16).\n\n" + table)


if __name__ == "__main__":
    main()
