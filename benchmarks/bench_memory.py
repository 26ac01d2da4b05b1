"""The memory model (specforge/memory.py) against the measured peak of the same train step on CPU.

Each case builds a real draft of any registered algorithm at a small size (the algorithm's own
``build_draft`` from a tiny random Llama target, through ``registry.bound_algorithm``), its
DraftTrainer, and runs two optimizer steps on random features (every row counts: the model's worst
case); the second step is measured (steady state: AdamW's moments exist, the first step's grads are
freed by zero_grad).
The prediction is memory.train_device's peak for the same shapes, dtypes and parallel layout, with
the algorithm's own step terms (its ``memory_step`` hook, as ``memory.plan`` and the dry run ask it),
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
from dataclasses import dataclass, field, fields
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
    """One measured train step. ``algo``: any registered algorithm (its draft built by its own
    ``build_draft`` from a tiny target of the case's shape); the fields below that its options class
    has set its ``draft.*`` keys, ``extra`` its own keys; ``dp``/``ulysses``/``ring``: ranks."""

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
    layers: int = 2  # the DFlash family's draft.num_layers
    block: int = 8  # draft.block_size
    anchors: int = 40  # draft.num_anchors
    window: Optional[int] = None  # draft.sliding_window
    recompute: bool = False  # train.recompute_mlp
    extra: dict = field(default_factory=dict)  # other draft.* keys of the algorithm

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
    Case("DSpark, 1 process, B=2 T=512, 40 anchors x 8", algo="dspark", T=512),
    Case("DFlash2, 1 process, B=2 T=512, 40 anchors x 8", algo="dflash2", T=512),
    Case("XPress, 1 process, B=2 T=512, 40 anchors x 8", algo="xpress", T=512),
    Case("MTP, 1 process, 3 steps, B=2 T=512", algo="mtp", T=512),
    Case("EAGLE-3.1, 1 process, B=2 T=512", algo="eagle31", T=512),
    Case("P-EAGLE, 1 process, 8 parallel tokens, B=2 T=512", algo="peagle", T=512,
         extra={"mask_token_id": 3999, "parallel_tokens": 8}),
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

TARGET_LAYERS = 8  # the tiny target's decoder layers (each algorithm picks its feature layers among them)


def _config(case: Case):
    """The case's run config: ``draft.*`` from the case's fields the algorithm's options class has,
    then ``case.extra`` (its own keys)."""
    from specforge.config import Config, TrainConfig
    from specforge.registry import get_algorithm

    options = get_algorithm(case.algo).options
    known = {f.name for f in fields(options)}
    mine = {"vocab_size": case.N, "ttt_length": case.ttt, "attention": case.attention, "sliding_window": case.window,
            "num_layers": case.layers, "block_size": case.block, "num_anchors": case.anchors}
    draft = options(algorithm=case.algo, **{k: v for k, v in {**mine, **case.extra}.items() if k in known})
    return Config(draft=draft, train=TrainConfig(precision=case.precision, warmup_steps=0, num_workers=case.world,
                                                 recompute_mlp=case.recompute))


def _target(case: Case):
    """A tiny random Llama target of the case's shape (``TARGET_LAYERS`` layers, untied head), its
    feature layers the algorithm's defaults: what the algorithm's ``build_draft`` reads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specforge.models.target import TargetModel
    from specforge.registry import bound_algorithm

    cfg = LlamaConfig(hidden_size=case.H, intermediate_size=case.I, num_attention_heads=case.Hq,
                      num_key_value_heads=case.Hkv, head_dim=case.D, vocab_size=case.V,
                      num_hidden_layers=TARGET_LAYERS, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    layers = bound_algorithm(_config(case)).feature_layers(TARGET_LAYERS)
    return TargetModel(model=model, tokenizer=None, aux_layer_ids=layers, device=torch.device("cpu"))


def _build(case: Case):
    """``(bound algorithm, draft, train state, feature layers)`` as a run builds them: the algorithm's
    own ``build_draft`` and ``train_state`` from a tiny target (freed after: only what the draft and
    the state keep of it stays), a draft vocab of the ``algorithm.draft_vocab_size`` first ids."""
    import gc

    from specforge.data.vocab import DraftVocab
    from specforge.registry import bound_algorithm

    # the collection below need only walk what this case made: the objects that were here before (a test
    # process' imports and fixtures: ~0.2 s a full collection walking them) are set aside until it is done
    gc.freeze()
    try:
        algo = bound_algorithm(_config(case))
        torch.manual_seed(0)
        target = _target(case)
        n = algo.draft_vocab_size(case.V)
        vocab = DraftVocab(torch.zeros(n, dtype=torch.long), torch.arange(case.V) < n)
        draft, state = algo.build_draft(target, vocab), algo.train_state(target, vocab)
        layers = len(target.aux_layer_ids)
        del target
        gc.collect()
    finally:
        gc.unfreeze()
    return algo, draft, state, layers


def _state_bytes(state) -> int:
    """The train state's bytes as the trainer holds it (fp32), as the dry run counts them."""
    if state is None:
        return 0
    tensors = [state] if isinstance(state, torch.Tensor) else [v for v in vars(state).values()
                                                                if isinstance(v, torch.Tensor)]
    return sum(t.numel() * 4 for t in tensors)


def _batch(case: Case, algo, layers: int, g: torch.Generator, groups=None):
    """Random features, every row counting (loss mask 1, argmax in the draft vocab), as the SP rank
    of ``groups`` holds them."""
    from specforge.models.features import TrainBatch
    from specforge.training.slicing import sp_slice_batch

    B, T, H = case.B, case.T, case.H
    top = min(algo.draft_vocab_size(case.V), case.V - 1)
    b = TrainBatch(torch.randint(0, top, (B, T), generator=g), torch.ones(B, T, dtype=torch.long),
                   torch.randn(B, T, layers * H, generator=g).to(torch.bfloat16),
                   torch.randn(B, T, H, generator=g).to(torch.bfloat16), torch.randint(0, top, (B, T), generator=g))
    if groups is not None and groups.sp_size > 1:
        b = sp_slice_batch(b, groups.sp_rank, groups.sp_size, algo.sp_halo())
    return b


def measure(case: Case, groups=None) -> int:
    """The measured peak of the second step, bytes (this rank's)."""
    from specforge.parallel.fsdp import apply_fsdp, bf16_mp_policy
    from specforge.parallel.parallelize import sum_over_train_ranks
    from specforge.parallel.sp import apply_sp
    from specforge.training.trainer import DraftTrainer

    g = torch.Generator().manual_seed(0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        algo, draft, state, layers = _build(case)
        if groups is not None:  # the GPU's layout: SP core swap, then FSDP2 (bf16 mixed precision if asked)
            if groups.sp_size > 1:
                apply_sp(draft, algo.sp_cores(draft), groups.ulysses_group, groups.ring_group)
            apply_fsdp(draft, groups.fsdp_mesh, mp_policy=bf16_mp_policy() if case.mp else None)
        trainer = DraftTrainer(algo, draft, state, _config(case), torch.device("cpu"),
                               reduce_sum=sum_over_train_ranks(groups))
        first = _batch(case, algo, layers, g, groups)
        trainer.step([first])
        del first
        second = _batch(case, algo, layers, g, groups)
        with record_function(MARK):
            trainer.step([second])
    return peak_in_mark(prof)


def predict(case: Case) -> memory.DeviceMemory:
    """memory.train_device for the case (the fullest rank): the algorithm's own ``memory_step`` terms
    (its CPU terms: ``gpu=False``), as ``memory.plan`` asks them."""
    algo, draft, state, layers = _build(case)
    p = memory.StepPrecision(compute=2 if case.precision == "bf16" else 4, mp=case.mp, world=case.world,
                             step0_fused=case.attention == "sdpa", recompute_mlp=case.recompute)
    s = memory.SeqShape(case.B, case.T, case.ulysses, case.ring, max(algo.sp_halo() - 1, 0))
    step = algo.memory_step(draft, s, p, False)
    aux_rows = s.R if s.sp > 1 else s.T
    features = s.B * (aux_rows * layers * case.H * 2 + s.window * (case.H * 2 + 3 * 8))
    upcast = s.B * (aux_rows * layers + s.window) * case.H * 4 if p.compute == 4 else 0
    return memory.train_device("train", case.world, memory.DraftParams.of(draft), p, step, _state_bytes(state),
                               features, upcast)


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
