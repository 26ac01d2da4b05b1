"""The fused soft-CE kernel (``specforge/kernels/soft_ce.py``) against the torch ops it replaces, on a GPU.

    python benchmarks/bench_soft_ce.py [--rows 2048,8192] [--vocab 32000] [--hidden 4096] [--reps 20] [--no-readme]
    python benchmarks/bench_soft_ce.py --device cpu --rows 8 --vocab 300 --hidden 16 --reps 1 --no-readme

Two cases per row count, bf16 (EAGLE-3's Llama-3.1-8B draft: H 4096, draft vocab 32000):

* the row-wise part alone, on one chunk of bf16 logits: ``soft_ce_rows_reference`` (the torch ops) against
  ``soft_ce_rows`` (one launch; the first call autotunes the tile);
* ``linear_soft_cross_entropy`` forward + backward over the default chunks, ``kernel=False`` against
  ``kernel=True`` (the matmuls are the same cuBLAS calls in both).

Milliseconds are medians of ``--reps`` after warm-up (CUDA events); launches are the CUDA kernels one
call runs (torch.profiler); the largest differences say how far the kernel's GPU figures are from the
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
from specforge.kernels import soft_ce  # noqa: E402


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


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def row_part(M: int, N: int, reps: int, device: torch.device) -> list:
    g = torch.Generator(device=device).manual_seed(0)
    z = (3 * torch.randn(M, N, generator=g, device=device)).bfloat16()
    teacher = torch.softmax(2 * torch.randn(M, N, generator=g, device=device), -1)
    tidx = torch.randperm(M, generator=g, device=device)
    ref_out, ker_out = soft_ce.empty_outputs(z), soft_ce.empty_outputs(z)

    def ref():
        return soft_ce.soft_ce_rows_reference(z, teacher, tidx, out=ref_out)  # bf16 z: copied, not overwritten

    def ker():
        return soft_ce.soft_ce_rows(z, teacher, tidx, out=ker_out)

    ms_ref, ms_ker = timed(ref, reps, device), timed(ker, reps, device)
    ref(), ker()
    diffs = (f"ce {max_diff(ker_out[0], ref_out[0]):.1e}, pred {int((ker_out[1] != ref_out[1]).sum())} rows, "
             f"acc_p {max_diff(ker_out[2], ref_out[2]):.1e}, G {max_diff(ker_out[3], ref_out[3]):.1e}")
    return [f"row-wise part, {M} x {N} bf16 logits", f"{ms_ref:.3f}", f"{ms_ker:.3f}", f"{ms_ref / ms_ker:.2f}x",
            f"{launches(ref, device)} / {launches(ker, device)}", diffs]


def whole_loss(M: int, N: int, H: int, reps: int, device: torch.device) -> list:
    g = torch.Generator(device=device).manual_seed(1)
    h = torch.randn(M, H, generator=g, device=device).bfloat16().requires_grad_()
    W = (torch.randn(N, H, generator=g, device=device) / H**0.5).bfloat16().requires_grad_()
    teacher = torch.softmax(2 * torch.randn(M, N, generator=g, device=device), -1)
    tidx = torch.randperm(M, generator=g, device=device)

    def step(kernel: bool):
        h.grad = W.grad = None
        out = linear_soft_cross_entropy(h, W, teacher, tidx, kernel=kernel)
        out[0].backward()
        return out[0].detach(), h.grad, W.grad

    ms = [timed(lambda k=k: step(k), reps, device) for k in (False, True)]
    (l0, dh0, dW0), (l1, dh1, dW1) = step(False), step(True)
    diffs = (f"loss {max_diff(l1, l0) / l0.abs().item():.1e} rel, dh {max_diff(dh1, dh0):.1e}, "
             f"dW {max_diff(dW1, dW0):.1e}")
    return [f"fused loss fwd + bwd, {M} rows, H {H}, N {N}", f"{ms[0]:.3f}", f"{ms[1]:.3f}", f"{ms[0] / ms[1]:.2f}x",
            f"{launches(lambda: step(False), device)} / {launches(lambda: step(True), device)}", diffs]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
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
        sys.exit(f"the soft-CE kernel cannot run on {device}: it needs triton and CUDA (or --device cpu)")
    rows = []
    for M in (int(r) for r in args.rows.split(",")):
        rows.append(row_part(M, args.vocab, args.reps, device))
        rows.append(whole_loss(M, args.vocab, args.hidden, args.reps, device))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU, Triton interpreter"
    table = markdown_table(["case", "torch ms", "kernel ms", "speed-up", "launches torch / kernel",
                            "largest difference"], rows)
    print(f"{name}\n{table}")
    if not args.no_readme and device.type == "cuda":
        append_section("Fused soft-CE kernel", f"{header_markdown()} | **GPU** {name}\n\n"
                       "`python benchmarks/bench_soft_ce.py` (the kernel of `specforge/kernels/soft_ce.py` "
                       "against the torch ops; bf16).\n\n" + table)


if __name__ == "__main__":
    main()
