"""A CPU proxy for the kernel launches of one EAGLE-3 train step on a GPU (``bench_ttt.py --launches``).

One train step (zero_grad, the 7-step TTT forward, backward, fused AdamW) under bf16 autocast with the
loops chunked as on a GPU (``device.loop_chunk`` answers the GPU value: 512 query rows per attention
chunk, ``LOSS_CHUNK_BYTES`` of fp32 logits per loss chunk), profiled on the CPU with torch.profiler.
A launch = an aten op that would run a device kernel: an op none of whose descendants counts, less
views, metadata and allocation (``NOT_KERNELS``); a fused attention call (SDPA, flex_attention) is one
launch forward and one backward whatever its CPU implementation runs below it, since on CUDA it is one
kernel (flex: torch.compile's fused kernel; on the CPU torch runs a dense reference). What this
misses: ops a GPU kernel splits or merges, host-side ops on CPU tensors, CUDA's own copies. A proxy
to compare the cores and the cast hoist with each other, never a GPU measurement.

Shapes: the 8B draft's draft vocabulary (32000), target vocabulary (128256), GQA ratio (4:1) and T,
with narrow widths and fewer heads (8 query / 2 kv heads, head_dim 16, hidden 512, intermediate 1792)
so a CPU runs it in minutes (flex's dense CPU reference at 32 heads took 148 s a step): launches
depend on the chunk counts, not on widths or head counts.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
import torch.nn.attention.flex_attention as flex_module
from torch.profiler import profile, record_function

from benchmarks import ttt_step
from benchmarks.common import header_markdown, markdown_table
from specforge.algorithms.eagle3 import attention
from specforge.algorithms.eagle3 import loss as loss_module
from specforge.algorithms.eagle3 import model as model_module

TITLE = "TTT step kernel-launch proxy (CPU profile)"
SHAPE = dict(hidden=512, intermediate=1792, heads=8, kv_heads=2, head_dim=16, vocab=128256)
N, B, T = 32000, 1, 1024
NOT_KERNELS = frozenset("aten::" + n for n in (
    "view", "reshape", "_reshape_alias", "_unsafe_view", "as_strided", "expand", "expand_as", "t", "transpose",
    "permute", "slice", "select", "unsqueeze", "squeeze", "detach", "detach_", "alias", "lift_fresh", "empty",
    "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_", "split", "split_with_sizes",
    "chunk", "narrow", "unbind", "view_as", "unflatten", "flatten", "contiguous", "to", "_to_copy", "set_",
    "is_nonzero", "result_type", "promote_types", "can_cast", "resolve_conj", "resolve_neg", "conj", "_conj",
    "size", "stride", "numel", "dim", "is_same_size", "_has_compatible_shallow_copy_type"))
FUSED = ("scaled_dot_product", "flex_attention", "FlexAttention")  # one kernel on CUDA, whatever runs below


def kind(name: str) -> str:
    if name in ("aten::copy_", "aten::_copy_from", "aten::_copy_from_and_resize"):
        return "copies / casts"
    if name in ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::addmm_", "aten::matmul"):
        return "matmuls"
    return "other (elementwise, reductions, indexing)"


def count(events) -> Counter:
    """Launches under ``events`` (profiler events, each with ``cpu_children``), by op name (a fused
    attention call as ``fused attention``)."""
    out = Counter()
    for ev in events:
        if any(f in ev.name for f in FUSED):
            out["fused attention"] += 1
            continue
        below = count(ev.cpu_children)
        if not below and ev.name.startswith("aten::") and ev.name not in NOT_KERNELS:
            below[ev.name] += 1
        out += below
    return out


def by_kind(names: Counter) -> Counter:
    out = Counter()
    for name, n in names.items():
        out[name if name == "fused attention" else kind(name)] += n
    return out


@contextlib.contextmanager
def gpu_loops():
    """The TTT attention core and the fused loss chunk their loops as on a GPU."""
    saved = attention.loop_chunk, loss_module.loop_chunk
    attention.loop_chunk = loss_module.loop_chunk = lambda device, cpu, gpu: gpu
    try:
        yield
    finally:
        attention.loop_chunk, loss_module.loop_chunk = saved


@contextlib.contextmanager
def cpu_flex_backward():
    """Lift torch 2.13's guard against flex_attention's backward on the CPU (its dense reference math
    runs; tests/test_attention_flex.py checks it exact), and mark each flex call in the profile."""
    guard, fn = flex_module._validate_device, attention._flex_fn

    def marked(device_type):
        def call(*args, **kwargs):
            with record_function("flex_attention"):
                return fn(device_type)(*args, **kwargs)
        return call

    flex_module._validate_device, attention._flex_fn = (lambda *tensors: None), marked
    try:
        yield
    finally:
        flex_module._validate_device, attention._flex_fn = guard, fn


@contextlib.contextmanager
def per_step_casts():
    """The weights cast at every TTT step, as before ``models.layers.cast_once``."""
    saved = loss_module.cast_once, model_module.cast_once
    loss_module.cast_once = model_module.cast_once = lambda W: (lambda: W)
    try:
        yield
    finally:
        loss_module.cast_once, model_module.cast_once = saved


def step_launches(impl: str, hoisted: bool) -> Counter:
    ttt_step.AMP = torch.bfloat16
    torch.manual_seed(0)
    draft = ttt_step.make_draft(N, SHAPE, attention=impl)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4, fused=True)
    batch = ttt_step.make_batch(B, T, draft)
    teacher_W = (torch.randn(N, SHAPE["hidden"]) * 0.02).to(torch.bfloat16)
    casts = contextlib.nullcontext() if hoisted else per_step_casts()
    with gpu_loops(), cpu_flex_backward(), casts:
        ttt_step.train_step(draft, opt, batch, teacher_W, loss_module.ttt_loss)  # warm-up (block masks cached)
        with profile() as prof:
            ttt_step.train_step(draft, opt, batch, teacher_W, loss_module.ttt_loss)
    top = [ev for ev in prof.events() if ev.cpu_parent is None]
    return count(top)


def section(info: dict, threads: int) -> str:
    kinds = ["copies / casts", "matmuls", "fused attention", "other (elementwise, reductions, indexing)"]
    rows, top = [], ""
    for impl, what in (("fast", "fast (chunked core every step)"), ("sdpa", "sdpa (as `auto` on a GPU)"),
                       ("flex", "flex (flex_attention every step)")):
        for hoisted in (False, True):
            names = step_launches(impl, hoisted)
            c = by_kind(names)
            if impl == "fast" and hoisted:
                top = ", ".join(f"`{n}` {k}" for n, k in names.most_common(10))
            rows.append([what, "once per unroll" if hoisted else "per TTT step", sum(c.values())]
                        + [c.get(k, 0) for k in kinds])
            print(" | ".join(str(x) for x in rows[-1]), flush=True)
    table = markdown_table(["core", "q/k/v + lm_head weight casts", "launches"] + kinds, rows)
    return (f"`python benchmarks/bench_ttt.py --launches` -- {header_markdown(info)}\n\n"
            "**A CPU proxy, not a GPU measurement**: one EAGLE-3 train step (7 TTT steps, backward, fused "
            f"AdamW) under bf16 autocast, B={B} T={T}, the 8B draft's draft vocab {N}, target vocab 128256 and "
            "GQA ratio with narrow widths and fewer heads (8/2 heads x 16, hidden 512, intermediate 1792), "
            "the loops chunked as on a GPU (512 attention rows, 256 MiB loss chunks), profiled with torch.profiler "
            "on this CPU "
            f"({threads} threads). Launches = aten ops with no counted descendant, less views, metadata and "
            "allocations; SDPA and flex_attention count one launch forward and one backward (one fused kernel "
            "each on CUDA; the CPU runs a dense reference for flex). Method and limits: `benchmarks/launches.py`. "
            "A GPU profile (the external gpu-bench harness's prof.py) counted 4,442 launches per step for this "
            "codebase and 1,068 for "
            "upstream SpecForge v0.2.0 (other shapes and batch); only the differences between rows here mean "
            "something.\n\n" + table + f"\n\nMost frequent launches, fast core, casts once: {top}.")
