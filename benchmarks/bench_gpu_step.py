"""The project's EAGLE-3 train step on a GPU at Llama-3.1-8B draft shapes: tokens/s, peak memory
against the memory model, kernel launches, per attention core (and packed rows).

    python benchmarks/bench_gpu_step.py [--T 2048,4096,8192] [--attention sdpa,flex] [--reps 5] [--no-readme]
    python benchmarks/bench_gpu_step.py --device cpu --shapes small --no-readme   # the harness itself, on a CPU

One step = zero_grad + ``ttt_loss`` (7 TTT steps, bf16 autocast, fp32 weights) + backward + fused AdamW,
B=1, the loss mask of ``ttt_step.realistic_loss_mask``; tokens/s from the median of ``--reps`` steps
after two warm-up steps (a compiled core compiles there). Peak: ``torch.cuda.max_memory_allocated``
over one step, beside ``specforge.memory``'s prediction for the same step (the algorithm's
``memory_step`` terms plus weights, gradients and AdamW state). Launches: CUDA kernels one step runs
(torch.profiler). ``--pack N`` adds a case of short samples (``--pack-lengths``) packed into rows of N
tokens against the same samples padded (``train.pack_tokens``): useful tokens per second.
The external gpu-bench harness (not part of this repository) holds the same step against other
trainers' (SpecForge v0.2.0 on the same problem). On a machine without CUDA the default device refuses with one line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import append_section, header_markdown, markdown_table  # noqa: E402
from benchmarks.ttt_step import make_draft, realistic_loss_mask  # noqa: E402
from specforge.algorithms.eagle3.algorithm import Eagle3Options  # noqa: E402
from specforge.algorithms.eagle3.loss import ttt_loss  # noqa: E402
from specforge.config import Config  # noqa: E402
from specforge.device import autocast, synchronize  # noqa: E402
from specforge.memory import DraftParams, SeqShape, StepPrecision  # noqa: E402
from specforge.models.features import TrainBatch  # noqa: E402
from specforge.models.layers import hold_frozen_tables  # noqa: E402
from specforge.registry import get_algorithm  # noqa: E402
from specforge.training.slicing import pack_micro_batches  # noqa: E402

SHAPES = {  # Llama-3.1-8B's draft (the gpu-bench yardstick's) and a CPU-sized stand-in
    "gpu": dict(hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256, draft_vocab=32000),
    "small": dict(hidden=256, intermediate=512, heads=8, kv_heads=2, head_dim=32, vocab=4096, draft_vocab=1024),
}
TTT = 7
GiB = 2**30


def batch_of(draft, lengths, device, seed=0) -> TrainBatch:
    """Right-padded samples of ``lengths`` tokens (bf16 features), lengths recorded."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    H, V, N = draft.config.hidden_size, draft.config.vocab_size, draft.config.draft_vocab_size
    in_vocab = draft.draft_to_target_ids().cpu()[torch.randint(0, N, (B, T), generator=g)]
    mask = realistic_loss_mask(B, T, g)
    for b, n in enumerate(lengths):
        mask[b, n:] = 0
    batch = TrainBatch(torch.randint(0, V, (B, T), generator=g), mask, torch.randn(B, T, 3 * H, generator=g).bfloat16(),
                       torch.randn(B, T, H, generator=g).bfloat16(), in_vocab, length_B=torch.tensor(lengths))
    return batch.to(device)


def one_step(draft, opt, batches, W, device) -> None:
    opt.zero_grad(set_to_none=True)
    total = float(sum(int(b.loss_mask_BT.sum()) for b in batches))
    for b in batches:
        with autocast(device, torch.bfloat16):
            loss, _ = ttt_loss(draft, b, W, ttt_length=TTT, num_valid_global=total)
        loss.backward()
    opt.step()


def timed(draft, opt, batches, W, device, reps) -> float:
    for _ in range(2):
        one_step(draft, opt, batches, W, device)
    times = []
    for _ in range(reps):
        synchronize(device)
        t0 = time.perf_counter()
        one_step(draft, opt, batches, W, device)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def peak_and_launches(draft, opt, batches, W, device) -> tuple[float | None, int | None]:
    if device.type != "cuda":
        return None, None
    torch.cuda.reset_peak_memory_stats(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        one_step(draft, opt, batches, W, device)
        synchronize(device)
    kernels = sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
    return torch.cuda.max_memory_allocated(device) / GiB, kernels


def predicted_gib(draft, T: int, attention: str, gpu: bool) -> float:
    """The memory model's peak of this step: the algorithm's ``memory_step`` terms (its largest phase)
    plus the draft's fp32 weights, gradients and two AdamW moments and its frozen weights."""
    cfg = Config(draft=Eagle3Options(attention=attention, ttt_length=TTT))
    step = get_algorithm("eagle3").bind(cfg).memory_step(draft, SeqShape(1, T, ttt=TTT), StepPrecision(compute=2), gpu)
    phase = max(sum(t.nbytes for t in terms) for terms in step.values())
    params = DraftParams.of(draft)
    return (params.trainable * 4 * 4 + params.frozen_bytes + params.buffer_bytes + phase) / GiB


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="gpu")
    ap.add_argument("--T", default="2048,4096,8192")
    ap.add_argument("--attention", default="sdpa,flex")  # auto: flex on CUDA, sdpa packed
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--pack", type=int, default=0, help="also time packed rows of this many tokens (0: skip)")
    ap.add_argument("--pack-lengths", default="700,350,900,420,610,300,800,500")
    ap.add_argument("--no-readme", action="store_true")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"error: --device cuda: torch {torch.__version__} sees no CUDA device; run it on a GPU machine "
              "(or --device cpu --shapes small to check the harness)", file=sys.stderr)
        return 2
    shape = SHAPES[args.shapes]
    rows = []
    for attention in args.attention.split(","):
        draft = make_draft(shape["draft_vocab"], dict(shape), attention).to(device)
        with torch.no_grad():  # the embedding as copied from a bf16 target, held in bf16 as DraftTrainer holds it
            draft.embed_tokens.weight.copy_(draft.embed_tokens.weight.bfloat16())
        hold_frozen_tables(draft, torch.bfloat16)
        opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4,
                                fused=device.type == "cuda")
        W = (torch.randn(shape["draft_vocab"], shape["hidden"]) * 0.02).bfloat16().to(device)
        for T in (int(t) for t in args.T.split(",")):
            batches = [batch_of(draft, [T], device)]
            sec = timed(draft, opt, batches, W, device, args.reps)
            peak, launches = peak_and_launches(draft, opt, batches, W, device)
            pred = predicted_gib(draft, T, attention, device.type == "cuda")
            rows.append([attention, f"1 x {T}", f"{T / sec:,.0f}", "-" if peak is None else f"{peak:.2f}",
                         f"{pred:.2f}", "-" if peak is None else f"{pred / peak:.2f}",
                         "-" if launches is None else f"{launches:,}"])
            print(rows[-1], flush=True)
        if args.pack:
            lengths = [int(n) for n in args.pack_lengths.split(",")]
            padded = [batch_of(draft, lengths[i:i + 2], device, seed=i) for i in range(0, len(lengths), 2)]
            packed = pack_micro_batches(padded, args.pack)
            useful = sum(lengths)
            for label, bs in (("padded, batch 2", padded), (f"packed rows of {args.pack}", packed)):
                sec = timed(draft, opt, bs, W, device, args.reps)
                rows.append([attention, label, f"{useful / sec:,.0f} (useful)", "-", "-", "-", "-"])
                print(rows[-1], flush=True)
    md = markdown_table(["attention", "B x T", "tok/s", "peak GiB", "memory model GiB", "model / peak",
                         "kernels per step"], rows)
    print(md)
    if not args.no_readme:
        append_section("EAGLE-3 train step on a GPU (8B draft shapes)", header_markdown() + "\n\n" + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
