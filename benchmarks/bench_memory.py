"""The memory model (specforge/memory.py) against the measured peak of the same train step on CPU.

Each case builds a real draft (EAGLE-3 or DFlash) at a small size, its DraftTrainer, and runs two
optimizer steps on random features (every row counts: the model's worst case); the second step is
measured (steady state: AdamW's moments exist, the first step's grads are freed by zero_grad).
The prediction is memory.train_device's peak for the same shapes, dtypes and parallel layout,
without the GPU-only allowances (CUDA context, NCCL, fragmentation), which a CPU cannot measure.

Measuring the peak: torch's profiler with ``profile_memory=True`` records every allocation and free
of the c10 CPU allocator (size and time); profiling starts before the first tensor of the case is
made, so the running sum of those events is the bytes of live tensors, and its maximum inside the
second step is the peak (what ``torch.cuda.max_memory_allocated`` reports on a GPU). Independent of
glibc's heap (RSS keeps freed pages); it does not see memory outside tensors (oneDNN scratch, gloo
buffers). Multi-rank cases (FSDP2 over 2 ranks with the GPU's bf16 mixed precision, Ulysses or ring
SP of 2) run on gloo; each rank measures itself and the fullest rank is reported.

    python benchmarks/bench_memory.py            # the table (a few minutes on 2 cores)
    python benchmarks/bench_memory.py --quick    # two small cases
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specforge import memory  # noqa: E402

MARK = "bench_memory:step"


@dataclass
class Case:
    """One measured train step. ``algo``: eagle3 | dflash; ``dp``/``ulysses``/``ring``: ranks."""

    name: str
    algo: str = "eagle3"
    B: int = 2
    T: int = 256
    H: int = 256
    I: int = 704
    Hq: int = 8
    Hkv: int = 2
    D: int = 32
    V: int = 4000
    N: int = 1000  # EAGLE-3 draft vocab
    ttt: int = 7
    precision: str = "bf16"
    attention: str = "auto"  # sdpa: step 0 on SDPA's fused kernel, as on a GPU
    dp: int = 1
    ulysses: int = 1
    ring: int = 1
    mp: bool = False  # FSDP2's bf16 mixed precision (the GPU policy)
    layers: int = 2  # DFlash
    block: int = 8
    anchors: int = 40
    window: Optional[int] = None  # EAGLE-3's draft.sliding_window
    recompute: bool = False  # train.recompute_mlp
    extra: dict = field(default_factory=dict)

    @property
    def world(self) -> int:
        return self.dp * self.ulysses * self.ring


CASES = [
    Case("EAGLE-3, 1 process, B=2 T=512", B=2, T=512),
    Case("EAGLE-3, 1 process, B=2 T=512, MLP recomputed", B=2, T=512, recompute=True),
    Case("EAGLE-3, 1 process, B=1 T=1024, N=4000", B=1, T=1024, N=4000, V=8000),
    Case("EAGLE-3, 1 process, fp32, B=2 T=256", T=256, precision="fp32"),
    Case("EAGLE-3, FSDP2 x2 bf16 mp, SDPA step 0, B=2 T=512", T=512, dp=2, mp=True, attention="sdpa"),
    Case("EAGLE-3, Ulysses SP 2 (FSDP2 x2 bf16 mp), B=2 T=1024", T=1024, ulysses=2, mp=True, attention="sdpa"),
    Case("EAGLE-3, ring SP 2 (FSDP2 x2), B=1 T=1024", B=1, T=1024, ring=2),
    Case("EAGLE-3, 1 process, sliding window 256, B=1 T=2048", B=1, T=2048, window=256),
    Case("EAGLE-3, ring SP 2 (FSDP2 x2), sliding window 256, B=1 T=2048", B=1, T=2048, ring=2, window=256),
    Case("DFlash, 1 process, B=2 T=512, 40 anchors x 8", algo="dflash", T=512),
    Case("DFlash, 1 process, B=2 T=512, 40 anchors x 8, MLP recomputed", algo="dflash", T=512, recompute=True),
    Case("DFlash, 1 process, B=1 T=1024, 16 anchors x 16", algo="dflash", B=1, T=1024, anchors=16, block=16),
]
QUICK = [Case("EAGLE-3, 1 process, B=2 T=128", T=128), Case("DFlash, 1 process, B=2 T=128", algo="dflash", T=128)]


# ------------------------------------------------------------------------------ measuring


def _name(node) -> str:
    try:
        return node.name
    except UnicodeDecodeError:  # a frame name the profiler cut mid-character
        return ""


def peak_in_mark(prof, mark: str = MARK) -> int:
    """The largest running sum of allocation events inside the last ``mark`` range (bytes of live
    tensors; the sum starts at the profile's start)."""
    allocs, window = [], None

    def walk(nodes):
        nonlocal window
        for n in nodes:
            if n.tag == _EventType.Allocation:
                allocs.append((n.start_time_ns, n.extra_fields.alloc_size))
            elif _name(n) == mark:
                window = (n.start_time_ns, n.end_time_ns)
            walk(n.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    allocs.sort()
    live, peak = 0, 0
    for t, size in allocs:
        if t > window[1]:
            break
        live += size
        if t >= window[0]:
            peak = max(peak, live)
    return peak


# ------------------------------------------------------------------------------ one case


def _config(case: Case):
    from specforge.algorithms.dflash.algorithm import DFlashOptions
    from specforge.algorithms.eagle3.algorithm import Eagle3Options
    from specforge.config import Config, TrainConfig

    if case.algo == "eagle3":
        draft = Eagle3Options(ttt_length=case.ttt, attention=case.attention, sliding_window=case.window)
    else:
        draft = DFlashOptions(algorithm="dflash", num_layers=case.layers, block_size=case.block,
                              num_anchors=case.anchors)
    return Config(draft=draft, train=TrainConfig(precision=case.precision, warmup_steps=0, num_workers=case.world,
                                                 recompute_mlp=case.recompute))


def _draft(case: Case):
    if case.algo == "eagle3":
        from specforge.algorithms.eagle3.model import Eagle3Draft, Eagle3DraftConfig

        return Eagle3Draft(Eagle3DraftConfig(hidden_size=case.H, intermediate_size=case.I,
                                             num_attention_heads=case.Hq, num_key_value_heads=case.Hkv,
                                             head_dim=case.D, vocab_size=case.V, draft_vocab_size=case.N,
                                             attention=case.attention, sliding_window=case.window))
    from specforge.algorithms.dflash.model import DFlashConfig, DFlashDraft

    return DFlashDraft(DFlashConfig(hidden_size=case.H, num_hidden_layers=case.layers, num_attention_heads=case.Hq,
                                    num_key_value_heads=case.Hkv, head_dim=case.D, intermediate_size=case.I,
                                    vocab_size=case.V, num_target_layers=8, target_layer_ids=[1, 3, 5],
                                    block_size=case.block, mask_token_id=case.V - 1))


def _batch(case: Case, g: torch.Generator, groups=None):
    """Random features, every row counting (loss mask 1, argmax in the draft vocab), as the SP rank
    of ``groups`` holds them."""
    from specforge.models.features import TrainBatch
    from specforge.training.slicing import sp_slice_batch

    B, T, H = case.B, case.T, case.H
    top = case.N if case.algo == "eagle3" else case.V - 1
    b = TrainBatch(torch.randint(0, top, (B, T), generator=g), torch.ones(B, T, dtype=torch.long),
                   torch.randn(B, T, 3 * H, generator=g).to(torch.bfloat16),
                   torch.randn(B, T, H, generator=g).to(torch.bfloat16), torch.randint(0, top, (B, T), generator=g))
    if groups is not None and groups.sp_size > 1:
        b = sp_slice_batch(b, groups.sp_rank, groups.sp_size, case.ttt + 1)
    return b


def measure(case: Case, groups=None) -> int:
    """The measured peak of the second step, bytes (this rank's)."""
    from specforge.parallel.fsdp import apply_fsdp, bf16_mp_policy
    from specforge.parallel.parallelize import sum_over_train_ranks
    from specforge.parallel.sp import apply_sp
    from specforge.registry import bound_algorithm, get_algorithm
    from specforge.training.trainer import DraftTrainer

    g = torch.Generator().manual_seed(0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        cfg, draft = _config(case), _draft(case)
        state = torch.randn(case.N, case.H, generator=g) if case.algo == "eagle3" else None
        if groups is not None:  # the GPU's layout: SP core swap, then FSDP2 (bf16 mixed precision if asked)
            if groups.sp_size > 1:
                from specforge.registry import get_algorithm

                apply_sp(draft, get_algorithm(case.algo).sp_cores(draft), groups.ulysses_group, groups.ring_group)
            apply_fsdp(draft, groups.fsdp_mesh, mp_policy=bf16_mp_policy() if case.mp else None)
        trainer = DraftTrainer(bound_algorithm(cfg), draft, state, cfg, torch.device("cpu"),
                               reduce_sum=sum_over_train_ranks(groups))
        first = _batch(case, g, groups)
        trainer.step([first])
        del first
        second = _batch(case, g, groups)
        with record_function(MARK):
            trainer.step([second])
    return peak_in_mark(prof)


def predict(case: Case) -> memory.DeviceMemory:
    """memory.train_device for the case (the fullest rank)."""
    from specforge.algorithms.eagle3.loss import loss_chunk

    draft = _draft(case)
    p = memory.StepPrecision(compute=2 if case.precision == "bf16" else 4, mp=case.mp, world=case.world,
                             step0_fused=case.attention == "sdpa", recompute_mlp=case.recompute)
    s = memory.SeqShape(case.B, case.T, case.ulysses, case.ring, case.ttt)
    if case.algo == "eagle3":
        from specforge.algorithms.eagle3.memory import Eagle3Dims, attention_chunk, eagle3_step

        step = eagle3_step(Eagle3Dims.of(draft.config), s, p, attention_chunk(False),
                           loss_chunk(torch.device("cpu"), case.N), case.window)
        state = 4 * case.N * case.H
    else:
        from specforge.algorithms.dflash.memory import DFlashDims, dflash_step

        step = dflash_step(DFlashDims.of(draft.config), s.B, s.T, min(case.anchors, s.T - 1), p)
        state = 0
    aux_rows = s.R if s.sp > 1 else s.T
    features = s.B * (aux_rows * 3 * case.H * 2 + s.window * (case.H * 2 + 3 * 8))
    upcast = s.B * (aux_rows * 3 + s.window) * case.H * 4 if p.compute == 4 else 0
    return memory.train_device("train", case.world, memory.DraftParams.of(draft), p, step, state, features, upcast)


def predicted_peak(dev: memory.DeviceMemory) -> tuple[int, str]:
    """Held + the largest phase a train step runs (a save is not measured here)."""
    phase = max((k for k in dev.phases if k != "checkpoint save"), key=dev.phase_bytes)
    return dev.held_bytes + dev.phase_bytes(phase), phase


def _rank(rank: int, world: int, case_json: str, out_dir: str) -> None:
    from specforge.parallel.dims import ParallelDims

    case = Case(**json.loads(case_json))
    torch.manual_seed(0)
    groups = ParallelDims(case.dp, case.ulysses, case.ring).build(list(range(world)), rank, timeout_s=600)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"peak": measure(case, groups)}))


def measure_case(case: Case, threads: int) -> int:
    if case.world == 1:
        return measure(case)
    from dataclasses import asdict

    from specforge.parallel.launch import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        run_ranks(_rank, case.world, json.dumps(asdict(case)), tmp, workdir=tmp, timeout_s=900, threads=threads)
        return max(json.loads(Path(tmp, f"rank{r}.json").read_text())["peak"] for r in range(case.world))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two small single-process cases")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--only", default=None, help="the cases whose name contains this text")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    commit = git.stdout.strip()
    load = os.getloadavg()[0]
    print(f"commit {commit}, {os.cpu_count()} CPU cores, load {load:.2f}, torch {torch.__version__}")
    print("| case | predicted peak (MiB) | phase | measured peak (MiB) | predicted / measured |")
    print("|---|---:|---|---:|---:|")
    worst = 0.0
    for case in QUICK if args.quick else CASES:
        if args.only and args.only not in case.name:
            continue
        t0 = time.time()
        got = measure_case(case, args.threads)
        want, phase = predicted_peak(predict(case))
        worst = max(worst, abs(want / got - 1))
        print(f"| {case.name} | {want / 2**20:,.1f} | {phase} | {got / 2**20:,.1f} | {want / got:.2f} |  "
              f"<!-- {time.time() - t0:.0f} s -->", flush=True)
    print(f"largest deviation {worst:.1%} (load {os.getloadavg()[0]:.2f} at the end)")
    return 0 if worst <= 0.20 else 1


if __name__ == "__main__":
    sys.exit(main())
