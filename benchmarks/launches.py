"""A CPU proxy for the kernel launches and host syncs of one EAGLE-3 train step on a GPU.

``bench_ttt.py --launches``: one train step (zero_grad, the 7-step TTT forward, backward, fused AdamW)
under bf16 autocast with the loops chunked as on a GPU (``device.loop_chunk`` answers the GPU value:
512 query rows per attention chunk, ``LOSS_CHUNK_BYTES`` of fp32 logits per loss chunk), profiled on
the CPU with torch.profiler, per attention core. A launch = an aten op that would run a device kernel:
an op none of whose descendants counts, less views, metadata and allocation (``NOT_KERNELS``); a fused
attention call (SDPA, flex_attention) is one launch forward and one backward whatever its CPU
implementation runs below it, since on CUDA it is one kernel (flex: torch.compile's fused kernel; on
the CPU torch runs a dense reference).

``python benchmarks/launches.py --compare --old-project DIR``: our step (``DraftTrainer.step``, at this
checkout and at the older one in DIR) and SpecForge v0.2.0's (``../shared/gpu-bench/sfup/``) on the
same problem, each as the H200 run drove it, launches and host syncs (``benchmarks/syncs.py``) per
step, against the H200's figures. Besides the rules above, what a GPU runs fused counts as it runs
there: each Triton kernel of v0.2.0's loss one launch; each of its torch.compile regions (run eagerly,
marked) as inductor would fuse it, one kernel per reduction, sort, scatter or matmul it runs, at least
one (``compiled_kernels``), its backward apart; a foreach or fused optimizer op (torch.optim's CUDA
path, which ``gpu_optimizer`` turns on) as multi_tensor_apply's launches at the 8B widths; a
same-dtype copy between contiguous tensors (a ``cudaMemcpyAsync``) none.

What this misses: kernels a GPU library splits or adds (cuBLAS split-K, a flash or flex backward's
preprocessing kernel, inductor's split reductions), pointwise chains inductor would split, ops that
run on the host in a GPU run, CUDA's own syncs and copies. Checked against the H200 at 356124e
(benchmarks/README.md, "Step proxy vs SpecForge v0.2.0"): a proxy, never a GPU measurement.

Shapes: the 8B draft's draft vocabulary (32000), target vocabulary (128256), GQA ratio (4:1) and T,
with narrow widths and fewer heads so a CPU runs it in minutes (flex's dense CPU reference at 32 heads
took 148 s a step): launches depend on the chunk counts, not on widths or head counts, except
multi_tensor_apply's (mapped to the 8B widths, ``WIDTHS_8B``); host syncs on neither.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.attention.flex_attention as flex_module
from torch.profiler import profile, record_function

REPO = Path(__file__).resolve().parent.parent

TITLE = "TTT step kernel-launch proxy (CPU profile)"
SHAPE = dict(hidden=512, intermediate=1792, heads=8, kv_heads=2, head_dim=16, vocab=128256)
N, B, T = 32000, 1, 1024
NOT_KERNELS = frozenset("aten::" + n for n in (
    "view", "reshape", "_reshape_alias", "_unsafe_view", "as_strided", "expand", "expand_as", "t", "transpose",
    "permute", "slice", "select", "unsqueeze", "squeeze", "detach", "detach_", "alias", "lift_fresh", "empty",
    "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_", "split", "split_with_sizes",
    "chunk", "narrow", "unbind", "view_as", "unflatten", "flatten", "contiguous", "to", "_to_copy", "set_",
    "is_nonzero", "_local_scalar_dense", "item", "result_type", "promote_types", "can_cast", "resolve_conj",
    "resolve_neg", "conj", "_conj",
    "size", "stride", "numel", "dim", "is_same_size", "_has_compatible_shallow_copy_type"))
FUSED = ("scaled_dot_product", "flex_attention", "FlexAttention")  # one kernel on CUDA, whatever runs below


def kind(name: str) -> str:
    if name in ("aten::copy_", "aten::_copy_from", "aten::_copy_from_and_resize"):
        return "copies / casts"
    if name in ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::addmm_", "aten::matmul"):
        return "matmuls"
    return "other (elementwise, reductions, indexing)"


# Marked regions (record_function names) a GPU runs as fused kernels: a Triton kernel of the step's
# own (v0.2.0's loss) and a torch.compile region (v0.2.0's decorated functions), which the CPU runs eagerly
TRITON, COMPILED = "triton kernel: ", "compiled region: "
BACKWARD = "autograd::engine::evaluate_function: "
FOREACH = ("aten::_foreach_", "aten::_fused_adam")
# multi_tensor_apply (ATen's foreach and fused-optimizer kernels): a launch per 320 chunks of 65,536
# elements, or per 30 tensors (its smallest per-launch tensor limit; a step's lists hold fewer)
MTA_CHUNK, MTA_BLOCKS, MTA_TENSORS = 65536, 320, 30
FUSED_KINDS = ("fused attention", "Triton loss", "compiled regions", "foreach / fused optimizer")


def multi_tensor_launches(numels) -> int:
    """Kernel launches of one multi_tensor_apply over tensors of ``numels`` elements."""
    launches = blocks = tensors = 0
    for n in numels:
        if not n:
            continue
        tensors += 1
        chunks = -(-n // MTA_CHUNK)
        for c in range(chunks):
            blocks += 1
            if blocks == MTA_BLOCKS or (tensors == MTA_TENSORS and c == chunks - 1):
                launches, blocks = launches + 1, 0
                tensors = 0 if c == chunks - 1 else 1
    return launches + (blocks > 0)


def foreach_launches(ev, widths: dict | None) -> int:
    """Launches of a foreach / fused-optimizer op on a GPU. On the CPU it runs one op per tensor (its
    children, whose input shapes the profiler records): their shapes, each width mapped to the GPU
    problem's (``widths``), give multi_tensor_apply's chunks. A list of 0-dim tensors is a
    non-capturable optimizer's step counters, which live on the host: no launch. ``_foreach_norm``
    adds its reduction's second kernel."""
    shapes = [c.input_shapes[0] for c in ev.cpu_children if c.input_shapes and c.name not in NOT_KERNELS]
    if not shapes:  # one CPU kernel (a fused optimizer), no per-tensor children to size it by
        return 1
    if all(len(sh) == 0 for sh in shapes):
        return 0
    numels = []
    for sh in shapes:
        n = 1
        for d in sh:
            n *= (widths or {}).get(d, d)
        numels.append(n)
    return multi_tensor_launches(numels) + (ev.name == "aten::_foreach_norm")


def _walk(events):
    for ev in events:
        yield ev
        yield from _walk(ev.cpu_children)


# ops that end an inductor kernel: reductions, sorts and scans, scatters, matmuls, data-dependent sizes;
# the pointwise ops around them fuse into their kernels
REDUCING = frozenset("aten::" + n for n in (
    "sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "sort", "argsort", "topk", "cumsum", "cumprod",
    "logsumexp", "_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data", "prod", "any",
    "all", "linalg_vector_norm", "var", "std", "var_mean", "scatter", "scatter_", "scatter_add", "scatter_add_",
    "scatter_reduce", "index_put_", "_index_put_impl_", "index_add_", "mm", "bmm", "addmm", "nonzero",
    "masked_select"))


def compiled_kernels(events) -> int:
    """Launches of what a torch.compile region ran (``events``: its forward's ops, or its backward's) on a
    GPU, by inductor's fusion: one kernel per op that ends one (``REDUCING``), at least one if any op
    ran a kernel on the CPU, none for views alone."""
    def reducing(evs):
        return sum(1 if ev.name in REDUCING else reducing(ev.cpu_children) for ev in evs)

    return max(reducing(events), 1 if _count(events, {}, {}, None) else 0)


REGIONS: Counter = Counter()  # the last count's compiled-region launches, by region (forward / backward)


def count(events, widths: dict | None = None) -> Counter:
    """Launches under ``events`` (profiler events, each with ``cpu_children``), by op name; what a GPU
    fuses by kind: a fused attention call (``FUSED``) and a Triton kernel one launch each, a compiled
    region as ``compiled_kernels`` of its forward ops and, apart, of its backward ops (the autograd
    nodes of the ops it ran, matched by ``sequence_nr``), a foreach op as ``foreach_launches``
    (``widths``: see there)."""
    regions = {}
    for ev in _walk(events):
        if ev.name.startswith(COMPILED):
            regions.update((d.sequence_nr, id(ev)) for d in _walk(ev.cpu_children) if d.sequence_nr >= 0)
    backward: dict = {}
    REGIONS.clear()
    out = _count(events, regions, backward, widths)
    names = {id(ev): ev.name[len(COMPILED):] for ev in _walk(events) if ev.name.startswith(COMPILED)}
    for rid, evs in backward.items():
        k = compiled_kernels(evs)
        out["compiled regions"] += k
        REGIONS[names[rid] + " backward"] += k
    return +out


def _count(events, regions: dict, backward: dict, widths) -> Counter:
    out = Counter()
    for ev in events:
        if any(f in ev.name for f in FUSED):
            out["fused attention"] += 1
        elif ev.name.startswith(TRITON):
            out["Triton loss"] += 1
        elif ev.name.startswith(COMPILED):
            k = compiled_kernels(ev.cpu_children)
            out["compiled regions"] += k
            REGIONS[ev.name[len(COMPILED):]] += k
        elif ev.name.startswith(BACKWARD) and ev.sequence_nr in regions:
            backward.setdefault(regions[ev.sequence_nr], []).append(ev)  # counted with its region's backward
        elif ev.name.startswith(FOREACH):
            out["foreach / fused optimizer"] += foreach_launches(ev, widths)
        else:
            below = _count(ev.cpu_children, regions, backward, widths)
            if not below and ev.name.startswith("aten::") and ev.name not in NOT_KERNELS:
                below[ev.name] += 1
            out += below
    return out


def by_kind(names: Counter) -> Counter:
    out = Counter()
    for name, n in names.items():
        out[name if name in FUSED_KINDS else kind(name)] += n
    return out


@contextlib.contextmanager
def gpu_loops():
    """The TTT attention core and the fused loss chunk their loops as on a GPU."""
    from specforge.algorithms.eagle3 import attention
    from specforge.algorithms.eagle3 import loss as loss_module

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
    from specforge.algorithms.eagle3 import attention

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
    from specforge.algorithms.eagle3 import loss as loss_module
    from specforge.algorithms.eagle3 import model as model_module

    saved = loss_module.cast_once, model_module.cast_once
    loss_module.cast_once = model_module.cast_once = lambda W: (lambda: W)
    try:
        yield
    finally:
        loss_module.cast_once, model_module.cast_once = saved


def step_launches(impl: str, hoisted: bool) -> Counter:
    from benchmarks import ttt_step
    from specforge.algorithms.eagle3 import loss as loss_module

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
    from benchmarks.common import header_markdown, markdown_table

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


# ---------------------------------------------------------------- ours vs SpecForge v0.2.0, same problem

COMPARE_TITLE = "Step proxy vs SpecForge v0.2.0"
SFUP = REPO.parent / "shared" / "gpu-bench"  # holds sfup/, SpecForge v0.2.0's train-step code (read-only)
# Narrow widths with the 8B draft's vocabularies (draft 32,000, target 128,256) and GQA ratio. Every
# width differs from every other one, so a width maps to its 8B value (WIDTHS_8B) where a count depends
# on widths: multi_tensor_apply's chunks (foreach_launches).
NARROW = dict(H=256, I=896, Hq=8, Hkv=2, D=16, V=128256, N=32000)
BIG = dict(H=4096, I=14336, Hq=32, Hkv=8, D=128, V=128256, N=32000)  # Llama-3.1-8B's draft
WIDTHS_8B = {NARROW["H"]: BIG["H"], 3 * NARROW["H"]: 3 * BIG["H"], NARROW["I"]: BIG["I"],
             NARROW["Hq"] * NARROW["D"]: BIG["Hq"] * BIG["D"], NARROW["Hkv"] * NARROW["D"]: BIG["Hkv"] * BIG["D"]}
assert len(WIDTHS_8B) == 5 and not set(WIDTHS_8B) & {NARROW["N"], NARROW["V"], NARROW["D"]}
TTT_LENGTH, DECAY, LR, CLIP, EPS, THETA = 7, 0.8, 1e-4, 0.5, 1e-5, 500000.0
# the H200 run's prof.py at 356124e, T=4096: launches, and cudaMemcpyAsync + stream and device syncs, a step
H200 = {"ours at 356124e": (4442, 113), "v0.2.0": (1068, 47)}


@contextlib.contextmanager
def gpu_optimizer():
    """torch.optim and clip_grad_norm_ take their CUDA path on the CPU: foreach (multi-tensor) ops."""
    import torch.optim.optimizer as optimizer

    saved = optimizer._get_foreach_kernels_supported_devices
    optimizer._get_foreach_kernels_supported_devices = lambda: [*saved(), "cpu"]
    try:
        yield
    finally:
        optimizer._get_foreach_kernels_supported_devices = saved


def problem(T: int, logits: bool, seed: int = 0) -> dict:
    """One packed row of T tokens: ids, a chat-like loss mask, bf16 aux and last hidden states, the
    target's argmax (90% in the draft vocab) and, for v0.2.0, its full-vocabulary logits (bf16)."""
    from benchmarks.ttt_step import realistic_loss_mask

    H, V, N = NARROW["H"], NARROW["V"], NARROW["N"]
    g = torch.Generator().manual_seed(seed)
    vocab = torch.sort(torch.randperm(V, generator=g)[:N]).values  # the draft vocab's target ids
    out = dict(vocab=vocab, input_ids=torch.randint(0, V, (1, T), generator=g),
               loss_mask=realistic_loss_mask(1, T, g),
               aux=torch.randn(1, T, 3 * H, generator=g).to(torch.bfloat16),
               last=torch.randn(1, T, H, generator=g).to(torch.bfloat16))
    tgt = vocab[torch.randint(0, N, (1, T), generator=g)]
    out["target_ids"] = torch.where(torch.rand(1, T, generator=g) < 0.9, tgt, torch.randint(0, V, (1, T), generator=g))
    if logits:
        z = torch.randn(1, T, V, generator=g, dtype=torch.bfloat16)
        z.scatter_(-1, out["target_ids"][..., None], 8.0)  # the argmax
        out["logits"] = z
    return out


def optimizer_steps(opt) -> list:
    """The step counters of a non-capturable, unfused torch optimizer: host tensors on a GPU too."""
    groups = {id(p): gr for gr in opt.param_groups for p in gr["params"]}
    return [st["step"] for p, st in opt.state.items() if torch.is_tensor(st.get("step"))
            and not (groups[id(p)].get("capturable") or groups[id(p)].get("fused"))]


def ours_side(T: int, attention: str = "sdpa"):
    """Our step as the H200 ran it: ``DraftTrainer.step`` (normalizer, TTT forward with the fused loss
    under bf16 autocast over fp32 weights, backward, clip, AdamW, schedule, its host read), the
    ``sdpa`` core (what ``draft.attention: auto`` runs on a GPU) or ``attention``, the loops chunked as
    on a GPU. The trainer lives in ``specforge.training`` now and in ``specforge.train`` at 356124e:
    both are tried. ``flex``: each flex_attention call a stand-in counted as one fused launch each way
    (as v0.2.0's), its block masks built anew every step (a new shape: padded rows of another length);
    ``flex:cached``: the masks of the warm-up step reused (rows of one fixed length: a step's span is
    rounded up to whole blocks, so its shapes recur). A ``+triton`` suffix: the loss's row-wise part
    through the fused soft-CE kernel (``kernels/soft_ce.py``), run here as its torch twin marked as one
    Triton launch a chunk, as v0.2.0's loss kernels are counted. ``+norm``: RMSNorm's math as
    ``models.layers.COMPILE_NORM`` runs it on a GPU, each call a compiled region counted as v0.2.0's;
    ``+rotary``: ``apply_rotary`` as ``COMPILE_ROTARY`` runs it, likewise."""
    attention, *extras = attention.split("+")
    cached = attention.endswith(":cached")
    attention = attention.split(":")[0]
    kernel, norm, rotary = "triton" in extras, "norm" in extras, "rotary" in extras
    from specforge.algorithms.eagle3.algorithm import ALGORITHM, Eagle3Options
    from specforge.algorithms.eagle3.loss import TeacherHead
    from specforge.algorithms.eagle3.model import Eagle3Draft, Eagle3DraftConfig
    from specforge.config import Config, TrainConfig
    from specforge.models.features import TrainBatch

    try:
        from specforge.training.trainer import DraftTrainer
    except ImportError:  # the tree at 356124e
        from specforge.train.trainer import DraftTrainer

    w = NARROW
    P = problem(T, logits=False)
    torch.manual_seed(0)
    draft = Eagle3Draft(Eagle3DraftConfig(
        hidden_size=w["H"], intermediate_size=w["I"], num_attention_heads=w["Hq"], num_key_value_heads=w["Hkv"],
        head_dim=w["D"], vocab_size=w["V"], draft_vocab_size=w["N"], rms_norm_eps=EPS, rope_theta=THETA,
        max_position_embeddings=131072, aux_layer_ids=[1, 15, 28], attention=attention))
    draft.set_vocab(P["vocab"] - torch.arange(w["N"]))
    cfg = Config(draft=Eagle3Options(ttt_length=TTT_LENGTH, ttt_decay=DECAY, attention=attention),
                 train=TrainConfig(precision="bf16", lr=LR, max_grad_norm=CLIP, max_steps=1000))
    teacher = TeacherHead((torch.randn(w["N"], w["H"], generator=torch.Generator().manual_seed(1)) * 0.02))
    algo = ALGORITHM.bind(cfg) if hasattr(ALGORITHM, "bind") else ALGORITHM  # bound since the seam (5b68ce3)
    trainer = DraftTrainer(algo, draft, teacher, cfg, torch.device("cpu"))
    batch = TrainBatch(P["input_ids"], P["loss_mask"], P["aux"], P["last"], P["target_ids"])

    def step():
        if attention == "flex" and not cached:
            from specforge.algorithms.eagle3 import attention as core

            core._block_mask.cache_clear()
        trainer.step([batch])

    loops = gpu_loops if attention != "flex" else flex_gpu_loops
    with_kernel = (lambda: soft_ce_kernel(loops)) if kernel else loops
    with_norm = (lambda: compiled_norm(with_kernel)) if norm else with_kernel
    context = (lambda: compiled_rotary(with_norm)) if rotary else with_norm
    return step, lambda: optimizer_steps(trainer.optimizer), context


@contextlib.contextmanager
def compiled_rotary(inner):
    """``inner()``, and each ``apply_rotary`` a compiled region (``COMPILE_ROTARY``), its backward apart."""
    from specforge.models import layers

    saved = layers._rotary

    def run(*args):
        with fused(COMPILED + "apply_rotary"):
            return saved(*args)

    layers._rotary = run
    try:
        with inner():
            yield
    finally:
        layers._rotary = saved


@contextlib.contextmanager
def compiled_norm(inner):
    """``inner()``, and RMSNorm's forward and backward math each a compiled region (``COMPILE_NORM``)."""
    from specforge.models import layers

    def marked(name, fn):
        def run(*args, **kwargs):
            with fused(COMPILED + name):
                return fn(*args, **kwargs)
        return run

    saved = layers._norm_math
    fwd, bwd = marked("rms_norm", layers._rms_norm_fwd), marked("rms_norm backward", layers._rms_norm_bwd)
    layers._norm_math = lambda device_type, compiled=None: (fwd, bwd)
    try:
        with inner():
            yield
    finally:
        layers._norm_math = saved


@contextlib.contextmanager
def soft_ce_kernel(loops):
    """``loops()``, and the fused loss's chunks through the soft-CE kernel: its torch twin, one Triton launch."""
    from specforge.algorithms.eagle3 import loss as loss_module

    def launch(z, teacher, tidx, out=None, g_dtype=None):
        with fused(TRITON + "soft_ce_rows"):
            return loss_module.soft_ce_rows_reference(z, teacher, tidx, out=out, g_dtype=g_dtype)

    saved = loss_module.SOFT_CE_KERNEL, loss_module.soft_ce_rows
    loss_module.SOFT_CE_KERNEL, loss_module.soft_ce_rows = True, launch
    try:
        with loops():
            yield
    finally:
        loss_module.SOFT_CE_KERNEL, loss_module.soft_ce_rows = saved


@contextlib.contextmanager
def flex_gpu_loops():
    """``gpu_loops``, and our flex core's flex_attention as the stand-in v0.2.0's is measured with."""
    from specforge.algorithms.eagle3 import attention as core

    def stand_in(device_type):
        def call(q, K, V, **kwargs):
            with fused(COMPILED + "flex_attention"):
                return FlexAttentionStandIn.apply(q, K, V)
        return call

    saved = core._flex_fn
    core._flex_fn = stand_in
    try:
        with gpu_loops():
            yield
    finally:
        core._flex_fn = saved


FUSING = [0]  # > 0 while a region a GPU fuses runs: its copies are inside its kernels, never a memcpy


@contextlib.contextmanager
def fused(name: str):
    """Mark a region the GPU runs as fused kernels (``name``: TRITON / COMPILED + what)."""
    FUSING[0] += 1
    try:
        with record_function(name):
            yield
    finally:
        FUSING[0] -= 1


class FlexAttentionStandIn(torch.autograd.Function):
    """In place of v0.2.0's compiled flex_attention (one fused kernel each way on a GPU, counted as
    such): q's shape out, gradients to q, k and v, none of flex's dense CPU math (T x 7T scores)."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.kv = k.shape, v.shape, k.dtype
        return q * 1.0

    @staticmethod
    def backward(ctx, grad):
        with fused(COMPILED + "flex_attention backward"):
            ks, vs, dt = ctx.kv
            return grad * 1.0, grad.new_zeros(ks, dtype=dt), grad.new_zeros(vs, dtype=dt)


class _Kernel:
    """A Triton kernel's launcher (``kernel[grid](*args)``) running ``fn`` in torch, marked as one launch."""

    def __init__(self, name, fn):
        self.name, self.fn = name, fn

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            with fused(TRITON + self.name):
                self.fn(*args, **kwargs)
        return launch


def _loss_forward(logits, _ls, target, _ts, mask, _ms, loss, _lss, m, d, _n, BLOCK_SIZE, num_warps):
    """v0.2.0's log_softmax_forward_kernel: per row, -sum(target * log_softmax(logits)), max and sum-exp."""
    x = logits.float()
    mx = x.amax(-1)
    se = torch.exp(x - mx[:, None]).sum(-1)
    row = -(target.float() * (x - mx[:, None] - se.log()[:, None])).sum(-1)
    keep = mask.reshape(-1)
    loss.view(-1).copy_(torch.where(keep, row, torch.zeros_like(row)))
    m.copy_(mx)
    d.copy_(se)


def _loss_backward(logits, _ls, target, _ts, mask, grad_out, scale, m, d, _n, BLOCK_SIZE, num_warps):
    """v0.2.0's log_softmax_backward_kernel: the logits' gradient, written over the saved logits."""
    g, t = grad_out.float() * scale, target.float()
    p = torch.exp(logits.float() - m[:, None]) / d[:, None]
    grad = p * (t * g).sum(-1, keepdim=True) - t * g
    logits.copy_(torch.where(mask.reshape(-1, 1), grad, torch.zeros_like(grad)))


@contextlib.contextmanager
def v020_as_on_gpu(sfup_root: Path):
    """SpecForge v0.2.0's GPU paths on the CPU. Each function it decorates with torch.compile
    (create_block_mask included) runs its eager body marked as a compiled region; its compiled
    flex_attention is a stand-in marked as fused attention (FlexAttentionStandIn; the block mask goes
    unused); its Triton loss kernels run in torch, each marked as one launch."""
    if str(sfup_root) not in sys.path:
        sys.path.insert(0, str(sfup_root))
    import sfup.core.eagle3 as core
    import sfup.core.loss as loss
    import sfup.modeling.draft.llama3_eagle as llama

    def region(name, fn):
        fn = getattr(fn, "_torchdynamo_orig_callable", fn)

        def run(*args, **kwargs):
            with fused(COMPILED + name):
                return fn(*args, **kwargs)
        return run

    def flex(query, key, value, **kwargs):
        with fused(COMPILED + "flex_attention"):
            return FlexAttentionStandIn.apply(query, key, value)

    patches = [(llama, "apply_rotary_pos_emb"), (llama.LlamaRMSNorm, "forward"),
               (llama.LlamaRotaryEmbedding, "forward"),
               (core, "_compute_target_p"), (core, "_compute_metric_acc")]
    saved = [(o, n, getattr(o, n)) for o, n in patches] + [
        (llama, "compile_friendly_flex_attention", llama.compile_friendly_flex_attention),
        (llama, "compile_friendly_create_block_mask", llama.compile_friendly_create_block_mask),
        (loss, "log_softmax_forward_kernel", loss.log_softmax_forward_kernel),
        (loss, "log_softmax_backward_kernel", loss.log_softmax_backward_kernel)]
    for owner, name in patches:
        setattr(owner, name, region(f"{owner.__name__.rsplit('.', 1)[-1]}.{name}", getattr(owner, name)))
    llama.compile_friendly_flex_attention = flex
    llama.compile_friendly_create_block_mask = region("create_block_mask", flex_module.create_block_mask)
    loss.log_softmax_forward_kernel = _Kernel("log_softmax_forward_kernel", _loss_forward)
    loss.log_softmax_backward_kernel = _Kernel("log_softmax_backward_kernel", _loss_backward)
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def v020_side(T: int, sfup_root: Path = SFUP):
    """SpecForge v0.2.0's step as the H200 ran it (the gpu-bench yardstick's ``upstream_step``, its GPU
    default): bf16 draft, ``OnlineEagle3Model`` with flex attention and the Triton loss, the decayed sum
    of its 7 losses, backward, ``BF16Optimizer.step`` (fp32 masters, clip 0.5, AdamW, schedule, bf16
    copy-back), one host copy of its losses and accuracies."""
    with v020_as_on_gpu(sfup_root):
        from sfup.core.eagle3 import OnlineEagle3Model
        from sfup.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
        from sfup.optimizer import BF16Optimizer
        from sfup.utils import padding
    from transformers import LlamaConfig

    w = NARROW
    P = problem(T, logits=True)
    config = LlamaConfig(architectures=["LlamaForCausalLMEagle3"], hidden_size=w["H"], intermediate_size=w["I"],
                         num_attention_heads=w["Hq"], num_key_value_heads=w["Hkv"], head_dim=w["D"], vocab_size=w["V"],
                         draft_vocab_size=w["N"], num_hidden_layers=1, rms_norm_eps=EPS, hidden_act="silu",
                         rope_theta=THETA, max_position_embeddings=131072, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLMEagle3(config, attention_backend="flex_attention")
    with torch.no_grad():
        model.t2d.zero_()
        model.t2d[P["vocab"]] = True
        model.d2t.copy_(P["vocab"] - torch.arange(w["N"]))
    model = model.to(torch.bfloat16)
    model.freeze_embedding()
    eagle3 = OnlineEagle3Model(draft_model=model, length=TTT_LENGTH, attention_backend="flex_attention",
                               loss_impl="triton")
    eagle3.train()
    opt = BF16Optimizer(model, lr=LR, max_grad_norm=CLIP, total_steps=1000, warmup_ratio=0.015)
    T_ = P["input_ids"].shape[1]
    batch = dict(input_ids=padding(P["input_ids"], left=False), attention_mask=torch.ones(1, T_, dtype=torch.long),
                 loss_mask=padding(padding(P["loss_mask"], left=False), left=False)[..., None],
                 target=padding(P["logits"], left=False), hidden_states=P["aux"])

    def step():
        plosses, _, acces = eagle3(**batch)
        total = sum(DECAY**i * plosses[i] for i in range(len(plosses)))
        total.backward()
        opt.step()
        torch.stack([total.detach().float()] + [p.detach().float() for p in plosses]
                    + [a.detach().float() for a in acces]).cpu().tolist()

    return step, lambda: optimizer_steps(opt.optimizer), lambda: v020_as_on_gpu(sfup_root)


def measure(side: str, T: int, sfup_root: Path = SFUP, attention: str = "sdpa") -> dict:
    """One side's launches and host syncs per step: a warm-up step, a profiled one, a counted one."""
    from benchmarks.syncs import HostSyncs

    torch.set_num_threads(int(os.environ.get("LAUNCHES_THREADS", "2")))
    step, host, context = ours_side(T, attention) if side == "ours" else v020_side(T, sfup_root)
    times = []
    with context(), gpu_optimizer(), cpu_flex_backward_guard():
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        with profile(record_shapes=True) as prof:
            step()
        names = count([ev for ev in prof.events() if ev.cpu_parent is None], WIDTHS_8B)
        t0 = time.perf_counter()
        with HostSyncs(memcpy_here=lambda: not FUSING[0]) as syncs:
            syncs.mark_host(host())
            step()
        times.append(time.perf_counter() - t0)
    kinds = by_kind(names)
    # a same-dtype copy between contiguous tensors is a cudaMemcpyAsync on a GPU, no kernel: the profile
    # counted it as an aten::copy_ launch
    kinds["copies / casts"] -= syncs.memcpys
    return dict(side=side, T=T, attention=attention if side == "ours" else "flex", launches=sum(kinds.values()),
                kinds=dict(kinds), top=names.most_common(12), syncs=syncs.count, sync_kinds=dict(syncs.kinds),
                sync_where=syncs.where.most_common(),
                memcpys=syncs.memcpys, regions=dict(REGIONS), step_s=times)


@contextlib.contextmanager
def cpu_flex_backward_guard():
    """flex_attention's CPU backward guard lifted (an argument check only), for a side that calls it."""
    guard = flex_module._validate_device
    flex_module._validate_device = lambda *tensors: None
    try:
        yield
    finally:
        flex_module._validate_device = guard


def _run_side(side: str, T: int, project: Path, sfup_root: Path, attention: str = "sdpa") -> dict:
    """``measure`` in a process of its own, ``project``'s specforge first on its path."""
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"launches-{side}-{os.getpid()}-{abs(hash(str(project)))}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--side", side, "--T", str(T), "--project", str(project),
           "--sfup", str(sfup_root), "--json", str(out),
           "--attention", attention]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    res = json.loads(out.read_text())
    out.unlink()
    return res


def compare_section(rows: list, T: int, info: dict, load: tuple, old: str) -> str:
    """The README section: ours at ``old``, ours now, v0.2.0, with ratios and the H200's figures."""
    from benchmarks.common import header_markdown, markdown_table

    now = [f"ours now ({info['commit'][:7]}, {r['attention']})" for r in rows[1:-1]]
    names = (f"ours at {old}", *now, "SpecForge v0.2.0")
    up, table = rows[-1], []
    for name, r in zip(names, rows):
        h200 = H200["ours at 356124e"] if name == "ours at 356124e" else H200["v0.2.0"] if r is up else None
        fused = sum(r["kinds"].get(k, 0) for k in FUSED_KINDS)
        table.append([name, f"{r['launches']:,}", f"{fused:,}", r["syncs"], r["memcpys"],
                      "-" if r is up else f"{r['launches'] / up['launches']:.2f}x",
                      "-" if r is up else f"{r['syncs'] / max(up['syncs'], 1):.2f}x",
                      f"{h200[0]:,} / {h200[1]}" if h200 else "not measured",
                      f"{h200[0] / H200['v0.2.0'][0]:.2f}x / {h200[1] / H200['v0.2.0'][1]:.2f}x"
                      if h200 and r is not up else "-"])
    where = "; ".join(f"{n}: " + ", ".join(f"`{w}` {k}" for w, k in r["sync_where"]) for n, r in zip(names, rows))
    regions = ", ".join(f"{n} {k}" for n, k in up["regions"].items())
    return (f"`python benchmarks/launches.py --compare --T {T} --old-project <a worktree at {old}>` -- "
            f"{header_markdown(info)}\n\n"
            "**A CPU proxy, not a GPU measurement**: one train step per side on the same problem (B=1, T="
            f"{T}, the 8B draft's vocabularies 32,000 / 128,256 and GQA ratio, narrow widths: hidden {NARROW['H']}, "
            f"{NARROW['Hq']}/{NARROW['Hkv']} heads x {NARROW['D']}, bf16), each as the H200 run drove it: ours through "
            "`DraftTrainer.step` with the `sdpa` core (`auto` on a GPU) and the GPU's loop chunks, or with the "
            "`flex` core (each flex_attention call one fused launch each way, as v0.2.0's; `flex`: its block masks "
            "built every step, a new shape each batch; `flex:cached`: reused, the shapes of fixed-length rows, "
            "whose spans the core rounds to whole blocks; `+triton`, `+norm`: the soft-CE kernel and the compiled "
            "RMSNorm, each call counted as v0.2.0's Triton and compiled calls are); SpecForge v0.2.0 "
            "(`../shared/gpu-bench/sfup/`) through `OnlineEagle3Model` + `BF16Optimizer` with its GPU default (flex "
            "attention, Triton loss) and one host copy of its losses. Launches = leaf aten ops less views and "
            "allocations, profiled on the CPU, with what a GPU fuses counted as it runs there: SDPA, flex attention "
            "and each Triton loss kernel one launch each way; each of v0.2.0's torch.compile regions, run eagerly, "
            "one launch per reduction, sort, scatter or matmul in it, at least one, its backward apart (at this T: "
            f"{regions}); a foreach or fused optimizer op multi_tensor_apply's launches at the 8B widths; a "
            "same-dtype copy between contiguous tensors (a `cudaMemcpyAsync` on a GPU, column memcpys) none. "
            "Host syncs = device-to-host reads a GPU would make (`.item()`, truth values, `.tolist()`, `.cpu()`, "
            "`nonzero`, boolean-mask indexing: `benchmarks/syncs.py`). The H200 figures are "
            "`../shared/gpu-bench/prof.py` at 356124e: kernel launches, and `cudaMemcpyAsync` + stream and device "
            "syncs. Method and limits: `benchmarks/launches.py`. `cat /proc/loadavg` before: "
            f"`{load[0]}`; after: `{load[1]}`.\n\n"
            + markdown_table(["step", "launches", "of which fused / compiled / foreach", "host syncs", "memcpys",
                              "launches / v0.2.0", "syncs / v0.2.0", "H200 launches / syncs+copies",
                              "H200 ratios"], table)
            + f"\n\nWhere the syncs are: {where}.\n\n" + verdict(rows[0], up))


TRUSTED = 0.25  # issue 46: the proxy's ours/v0.2.0 ratios at 356124e within 25% of the H200's


def verdict(old: dict, up: dict) -> str:
    """Whether the proxy's ours(356124e)/v0.2.0 ratios are within ``TRUSTED`` of the H200's."""
    (ol, os_), (ul, us) = H200["ours at 356124e"], H200["v0.2.0"]
    dl = old["launches"] / up["launches"] / (ol / ul) - 1
    ds = old["syncs"] / max(up["syncs"], 1) / (os_ / us) - 1
    ok = abs(dl) <= TRUSTED and abs(ds) <= TRUSTED
    return (f"Against the H200 at 356124e: launch ratio {dl:+.0%}, sync ratio {ds:+.0%} "
            f"({'within' if ok else 'NOT within'} {TRUSTED:.0%}: the proxy is {'trusted' if ok else 'not trusted'}). "
            f"Each side against the H200's launches: ours at 356124e {old['launches'] / ol - 1:+.0%}, v0.2.0 "
            f"{up['launches'] / ul - 1:+.0%}; what the proxy misses is mostly on v0.2.0's side, kernels its GPU "
            "libraries add (flex's backward preprocessing, inductor's split reductions, cuBLAS split-K). Its host "
            "syncs are device-to-host reads only; the H200 column counts every `cudaMemcpyAsync` (host-to-device "
            "and same-dtype device copies too) and each read's stream sync, so only the ratios compare.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", action="store_true", help="ours at --old-project, ours here, v0.2.0: the table")
    ap.add_argument("--side", choices=["ours", "v0.2.0"], help="measure one side (a worker of --compare)")
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--project", type=Path, default=REPO, help="the checkout whose specforge --side ours runs")
    ap.add_argument("--old-project", type=Path, help="--compare: a worktree at the H200 run's commit (356124e)")
    ap.add_argument("--sfup", type=Path, default=SFUP, help="the folder holding sfup/ (SpecForge v0.2.0's code)")
    ap.add_argument("--json", type=Path, help="--side: write the result here")
    ap.add_argument("--attention", default="sdpa",
                    help="our attention core (sdpa: auto on a GPU); --compare: a comma list, a row each")
    ap.add_argument("--no-readme", action="store_true")
    a = ap.parse_args()
    if a.side:
        sys.path[:0] = [str(a.project.resolve()), str(REPO)]
        res = measure(a.side, a.T, a.sfup.resolve(), a.attention)
        import specforge

        res["specforge"] = str(Path(specforge.__file__).resolve().parent.parent)
        print(json.dumps(res, indent=1), flush=True)
        if a.json:
            a.json.write_text(json.dumps(res))
        return
    if not a.compare or not a.old_project:
        ap.error("--side, or --compare with --old-project")
    sys.path.insert(0, str(REPO))
    from benchmarks.common import append_section, git_commit, machine_info

    load = [open("/proc/loadavg").read().strip()]
    rows = [_run_side("ours", a.T, a.old_project.resolve(), a.sfup),
            *(_run_side("ours", a.T, REPO, a.sfup, core) for core in a.attention.split(",")),
            _run_side("v0.2.0", a.T, REPO, a.sfup)]
    load.append(open("/proc/loadavg").read().strip())
    body = compare_section(rows, a.T, machine_info(), tuple(load), git_commit(a.old_project.resolve())[:7])
    print(body)
    if not a.no_readme:
        append_section(COMPARE_TITLE, body)


if __name__ == "__main__":
    main()
