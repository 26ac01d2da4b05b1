"""Peak memory per device of a run, term by term: what ``--dry-run`` prints and the driver refuses on.

A device (a train GPU, a rollout GPU; colocated: one GPU holding both) holds ``held`` terms through
the whole run (weights as FSDP2 places them, optimizer state, the frozen train state, the CUDA/NCCL
context) and, on top, the transient terms of one phase at a time: the train step's forward end and
its backward (activations autograd saves for one micro-batch), FSDP2's reduce-scatter after the
backward, the optimizer step, the target's capture forward, a checkpoint save. The peak is ``held``
plus the largest phase. Every term is bytes, computed from the shapes and dtypes the code uses:

* the activations of one micro-batch are the algorithm's (its ``memory_step`` hook):
  ``algorithms/eagle3/memory.py`` (what autograd saves per TTT step; the fast core keeps the
  causal-block probabilities, ``B x Hq x ~T^2/2`` in the compute dtype, at every step that runs
  it: steps >= 1 always, step 0 too on CPU where ``auto`` is the fast core; SDPA's fused kernel,
  step 0 on GPUs, keeps ``B x Hq x T`` statistics only), ``algorithms/dflash/memory.py`` (blocks of
  anchors, chunked logits);
* FSDP2 (``parallel/fsdp.py``): one unit = the whole trainable draft, so its unsharded params (bf16
  under the GPU mixed-precision policy) live through forward and backward, its unsharded grads
  through the backward, and the reduce-scatter input (fp32) after it; frozen params (the target's
  embedding, DFlash's lm_head) stay whole on every rank (``ignored_params``).

``benchmarks/bench_memory.py`` checks the train-step terms against the allocator's measured peak on
CPU (same code, same dtypes, small shapes; the table is in benchmarks/README.md, "Memory model").
What the CPU cannot measure is stated as an allowance: the CUDA context and NCCL communicators
(``CONTEXT_BYTES``, ``NCCL_BYTES``) and the caching allocator's fragmentation (``FRAGMENTATION``).

Legend: B micro-batch, T tokens (max_length), R rows one SP rank owns, L TTT steps, H draft hidden,
Ht target hidden, Hq/Hkv heads, D head dim, F* projection widths, I MLP width, N draft vocab,
V target vocab, c compute bytes (2 under bf16 autocast, 4 in fp32).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Sequence

from specforge.contracts import DTYPE_BYTES, MAX_STEPS_AHEAD, FeatureSpec
from specforge.seam import MemoryTerms
from specforge.targets import family_of, target_head_dim, text_config

GiB = 2**30
# The CUDA context with cuBLAS/cuBLASLt workspaces on an H100/A100 (torch 2.x, lazy module loading):
# 0.5-1 GB (shared/DESIGN.md, "Memory you can measure on CPU"); the upper end is taken.
CONTEXT_BYTES = 1 * GiB
# One NCCL communicator's buffers on an 8-GPU NVLink node: ~1 GB once used (NVIDIA/nccl issues #864,
# #1685: per-channel buffers, up to 32 channels per peer for all-to-all); counted per communicator a
# rank uses (the data plane, FSDP, each sequence-parallel group).
NCCL_BYTES = 1 * GiB
# The caching allocator keeps freed blocks; peak reserved runs above peak allocated. Counted as this
# share of the transient (per-step) bytes, which is what churns.
FRAGMENTATION = 0.10
POOL_HEADROOM = 1.25  # runtime/dataplane.py BufferPool: a new buffer is 25% larger than asked


@dataclass(frozen=True)
class Term:
    """``nbytes`` of one named thing on a device (the name says what and how it is counted)."""

    name: str
    nbytes: int


@dataclass
class DeviceMemory:
    """One device's memory: ``held`` through the run, plus the transient terms of each phase."""

    device: str  # e.g. "train GPU", "rollout GPU (fullest of model.num_gpus)"
    count: int  # devices of this kind in the placement
    held: list[Term]
    phases: dict[str, list[Term]] = field(default_factory=dict)

    def phase_bytes(self, phase: str) -> int:
        return sum(t.nbytes for t in self.phases[phase])

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phase_bytes) if self.phases else ""

    @property
    def held_bytes(self) -> int:
        return sum(t.nbytes for t in self.held)

    @property
    def peak(self) -> int:
        return self.held_bytes + (self.phase_bytes(self.peak_phase) if self.phases else 0)


# ---------------------------------------------------------------- shapes and precision


@dataclass(frozen=True)
class StepPrecision:
    """How a train rank computes: ``compute`` bytes (2 under bf16/fp16 autocast, 4 in fp32),
    ``mp``: FSDP2's bf16 mixed-precision policy (GPUs with several train ranks: the unsharded params
    are bf16, no autocast copies of fp32 weights), ``world``: FSDP2 ranks (1 = no FSDP), and
    whether TTT step 0 runs SDPA's fused kernel (``auto``/``sdpa`` on a GPU) or the fast core;
    ``tables16``: the frozen tables held in 16 bits (``models.layers.hold_frozen_tables``: no autocast
    copy of them); ``recompute_mlp``: ``train.recompute_mlp`` (the MLPs keep their input only)."""

    compute: int = 2
    mp: bool = False
    world: int = 1
    step0_fused: bool = False
    tables16: bool = False
    recompute_mlp: bool = False

    @property
    def cast(self) -> bool:
        """fp32 weights under a 16-bit autocast: each weight a matmul reads is copied to 16 bits."""
        return self.compute == 2 and not self.mp

    @property
    def unsharded_param(self) -> int:
        return 2 if self.mp else 4


@dataclass(frozen=True)
class SeqShape:
    """One micro-batch as one train rank holds it: ``B`` samples, ``T`` tokens each, split over
    ``ulysses`` x ``ring`` sequence-parallel ranks (``ttt`` = TTT steps, for the halo)."""

    B: int
    T: int
    ulysses: int = 1
    ring: int = 1
    ttt: int = 7

    @property
    def sp(self) -> int:
        return self.ulysses * self.ring

    @property
    def R(self) -> int:
        """Rows this rank owns (the sequence padded to a multiple of sp)."""
        return -(-self.T // self.sp)

    @property
    def window(self) -> int:
        """Rows of ids / mask / argmax / last hidden it holds: owned rows + the TTT halo."""
        return self.R + self.ttt + 1 if self.sp > 1 else self.T


def norm_saved(width: int, p: StepPrecision) -> int:
    """Bytes per row RMSNorm (``models/layers.py``) leaves saved for backward, besides its output: its
    input in the compute dtype and the fp32 row scale (its backward recomputes the normalized value)."""
    return p.compute * width + 4


# ---------------------------------------------------------------- the target's capture forward


@dataclass(frozen=True)
class TargetDims:
    """What the frozen target's no-grad forward (``models/target.capture``) allocates per token."""

    H: int
    I: int
    Hq: int
    Hkv: int
    D: int
    V: int
    dtype_bytes: int
    eager: bool  # the HF class's attention has no SDPA path (gpt-oss): B x Hq x T x T scores
    sliding: bool  # a second (sliding-window) mask
    experts: int = 0
    top_k: int = 0
    moe_I: int = 0

    @classmethod
    def of(cls, model, text, dtype_bytes: int, gpu: bool = False) -> "TargetDims":
        """``gpu``: where the capture runs, which decides its attention (``target.capture_attention``:
        a class without SDPA captures with flex attention on CUDA, eager on the CPU)."""
        import torch  # lazy: keeps specforge.memory torch-free

        from specforge.models.target import capture_attention  # lazy: keeps specforge.memory torch-free

        heads = int(text.num_attention_heads)
        experts = int(getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or 0)
        moe_I = int(getattr(text, "moe_intermediate_size", None) or (text.intermediate_size if experts else 0))
        impl = capture_attention(family_of(model.config), torch.device("cuda" if gpu else "cpu"))
        if impl == "default":
            impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
        return cls(int(text.hidden_size), int(text.intermediate_size), heads, int(text.num_key_value_heads or heads),
                   int(target_head_dim(text) or text.hidden_size // heads), int(text.vocab_size), dtype_bytes,
                   impl == "eager", bool(getattr(text, "sliding_window", None)), experts,
                   int(getattr(text, "num_experts_per_tok", None) or 0), moe_I)


def capture_terms(t: TargetDims, B: int, T: int, aux_layers: int, chunk_tokens: int) -> list[Term]:
    """The capture forward of ``B`` samples of ``T`` tokens at its peak: the aux layer outputs the
    hooks keep, the residual stream, and the largest layer transient (eager attention's scores in
    16 bits plus the fp32 softmax; SDPA: K/V repeated for the padded batch's mask; the MLP; a MoE
    layer's routing one-hot and the busiest expert, taken as 4x the mean load), then the fused
    features and one argmax chunk of logits."""
    n, db = B * T, t.dtype_bytes
    masks = (2 if t.sliding else 1) * B * T * T * (db if t.eager else 1)  # HF 4D masks: additive (eager), bool (sdpa)
    qkv = (t.Hq + 2 * t.Hkv) * t.D * db * n + 2 * t.Hq * t.D * db * n  # projections, K/V repeated to the query heads
    scores = B * t.Hq * T * (T + 1) * (2 * db + 4) if t.eager else 0
    if t.experts:
        load = min(n, 4 * -(-n * t.top_k // t.experts))
        mlp = n * t.top_k * (t.experts + 1) * 8 + 4 * n * t.experts + load * (3 * t.H + 4 * t.moe_I) * db
    else:
        mlp = 3 * t.I * db * n
    layer = max(qkv + scores, mlp)
    which = "MLP" if layer == mlp else "eager attention's scores" if t.eager else "attention"
    kept = aux_layers * t.H * db * n
    stream = 3 * t.H * db * n  # the hidden going in and out of a layer, its norm
    during = kept + stream + masks + layer
    # at the end: the hooks' outputs and their concatenation, the last hidden, one argmax chunk of logits
    after = 2 * kept + t.H * db * n + min(chunk_tokens, n) * t.V * (db + 8)
    if during >= after:
        return [Term("capture: aux layer outputs kept by the hooks", kept),
                Term("capture: residual stream (in, out, norm)", stream),
                Term("capture: attention masks (4D)", masks),
                Term(f"capture: largest layer transient ({which})", layer)]
    return [Term("capture: aux layer outputs and their concatenation", 2 * kept),
            Term("capture: last hidden state, one argmax chunk of logits", after - 2 * kept)]


def forward_terms(t: TargetDims, B: int, T: int, aux_layers: int, chunk_tokens: int,
                  pack_tokens: Optional[int]) -> list[Term]:
    """A capture of ``B`` padded samples of ``T`` tokens: one forward (``capture_terms``), or with
    ``rollout.pack_tokens`` forwards of one packed row of at most that many (and no more than the
    batch's) tokens each, plus the batch's features in the padded layout they are copied into."""
    if pack_tokens is None:
        return capture_terms(t, B, T, aux_layers, chunk_tokens)
    row = min(pack_tokens, B * T)
    padded = B * T * ((aux_layers + 1) * t.H * t.dtype_bytes + 8)
    return ([Term("capture: the batch's features in the padded layout (rollout.pack_tokens)", padded)]
            + [dataclasses.replace(x, name=f"{x.name}, one packed row of {row:,} tokens")
               for x in capture_terms(t, 1, row, aux_layers, chunk_tokens)])


# ---------------------------------------------------------------- a device, assembled


@dataclass(frozen=True)
class DraftParams:
    """The draft's parameters as FSDP2 places them: ``trainable`` numel (sharded), ``frozen`` bytes
    (whole on every rank), buffers' bytes, the largest trainable tensor's numel (a save gathers it);
    with ``train.optimizer=muon`` the numel Muon takes (one fp32 momentum each, not AdamW's two), its
    largest matrix's numel and its largest Gram matrix's (``min(A, B)**2``)."""

    trainable: int
    frozen_bytes: int
    buffer_bytes: int
    largest: int

    tables16: bool = False  # the frozen tables held in 16 bits (models.layers.hold_frozen_tables)
    muon: int = 0
    muon_largest: int = 0
    muon_gram: int = 0
    muon_ns_bytes: int = 2  # the iterations' dtype (training/optim.ns_dtype): bf16 on a GPU, fp32 on a CPU

    @classmethod
    def of(cls, draft, tables16: bool = False, optimizer: str = "adamw", gpu: bool = True) -> "DraftParams":
        """``tables16``: the run computes under a bf16 autocast from a bf16 target, so the trainer holds
        the frozen fp32 tables (``models.layers.frozen_tables``) in bf16: 2 bytes an element.
        ``optimizer``: ``train.optimizer``; ``gpu``: where Muon's iterations run (bf16 there, else fp32)."""
        muon = []
        if optimizer == "muon":
            from specforge.training.optim import muon_params  # lazy: keeps specforge.memory torch-free

            muon = muon_params(draft.named_parameters())[0]
        train = [p for p in draft.parameters() if p.requires_grad]
        frozen = sum(p.numel() * p.element_size() for p in draft.parameters() if not p.requires_grad)
        if tables16:
            from specforge.models.layers import frozen_tables  # lazy: keeps specforge.memory torch-free

            frozen -= sum(m.weight.numel() * (m.weight.element_size() - 2) for m in frozen_tables(draft)
                          if m.weight.element_size() == 4)
        return cls(sum(p.numel() for p in train), frozen, sum(b.numel() * b.element_size() for b in draft.buffers()),
                   max((p.numel() for p in train), default=0), tables16, sum(p.numel() for p in muon),
                   max((p.numel() for p in muon), default=0), max((min(p.shape) ** 2 for p in muon), default=0),
                   2 if gpu else 4)


def train_phases(params: DraftParams, p: StepPrecision, step: dict[str, list[Term]], features: int,
                 upcast: int = 0) -> dict[str, list[Term]]:
    """A train rank's transient phases around one micro-batch's ``step`` terms: FSDP2's unsharded
    params and grads (or the plain fp32 grads), the reduce-scatter after the backward, AdamW's step,
    a checkpoint save; ``features`` = the step's micro-batches on the device (all of them exist
    before the first trains), ``upcast`` = one micro-batch's fp32 copy when the draft computes in fp32."""
    P, W = params.trainable, p.world
    shard = -(-P // W)
    feats = [Term("features of the step's micro-batches", features)] + ([Term("fp32 copy of one micro-batch's "
                                                                              "features", upcast)] if upcast else [])
    if W > 1:
        unsharded = [Term(f"FSDP2 unsharded params ({'bf16' if p.mp else 'fp32'}, one unit = the whole draft) + the "
                          "all-gather output it keeps until the next all-gather", 2 * p.unsharded_param * P)]
        grads = [Term(f"FSDP2 unsharded grads ({'bf16' if p.mp else 'fp32'})", p.unsharded_param * P)]
        phases = {"forward end": unsharded + step["forward"] + feats,
                  "reduce-scatter": grads + [Term("reduce-scatter input (fp32) + output shard", 4 * P + 4 * shard)]
                  + feats}
    else:
        unsharded, grads = [], [Term("grads (fp32)", 4 * P)]
        phases = {"forward end": step["forward"] + feats}
    late = step.get("backward (decoder layers)")  # DFlash: the loss's backward peaks before any parameter gradient
    phases["backward"] = unsharded + step["backward"] + ([] if late else grads) + feats
    if late:
        phases["backward (decoder layers)"] = unsharded + late + grads + feats
    sharded_grads = Term("grads (fp32, sharded)" if W > 1 else "grads (fp32)", 4 * shard)
    phases["optimizer step"] = [sharded_grads, Term("AdamW foreach temporaries (fp32)",
                                                    4 * -(-(P - params.muon) // W))] + feats
    if params.muon:  # training/optim.py: each matrix orthogonalized whole, one at a time
        m, g, b = params.muon_largest, params.muon_gram, params.muon_ns_bytes
        phases["optimizer step"].append(Term(f"Muon: the largest matrix orthogonalized whole (fp32 update; iterates "
                                             f"and Gram matrices in {'bf16' if b == 2 else 'fp32'})",
                                             4 * m + 3 * b * m + 2 * b * g))
    phases["checkpoint save"] = [sharded_grads, Term("the largest tensor gathered whole on the writer (fp32)",
                                                     4 * params.largest * (2 if W > 1 else 1))]
    return phases


def draft_held(params: DraftParams, p: StepPrecision, state_bytes: int) -> list[Term]:
    shard = -(-params.trainable // p.world)
    muon = -(-params.muon // p.world)
    where = f"sharded over {p.world}" if p.world > 1 else "one rank"
    moments = [Term(f"AdamW m, v (fp32, {where})", 8 * (shard - muon))]
    if params.muon:
        moments.append(Term(f"Muon momentum (fp32, {where})", 4 * muon))
    return [Term(f"draft params (fp32, {where})", 4 * shard),
            Term("frozen draft params (full replica on every rank, fp32" + ("; the tables bf16)" if params.tables16
                                                                             else ")"), params.frozen_bytes),
            *moments,
            Term("buffers (d2t, t2d, RoPE) + train state (teacher rows, fp32)", params.buffer_bytes + state_bytes)]


def train_device(name: str, count: int, params: DraftParams, p: StepPrecision, step: dict[str, list[Term]],
                 state_bytes: int, features: int, upcast: int = 0, extra_held: Sequence[Term] = ()) -> DeviceMemory:
    """A train rank without the GPU-only allowances (what ``bench_memory.py`` measures on CPU)."""
    return DeviceMemory(name, count, draft_held(params, p, state_bytes) + list(extra_held),
                        train_phases(params, p, step, features, upcast))


def context_terms(gpu: bool, communicators: int) -> list[Term]:
    if not gpu:
        return []
    out = [Term("CUDA context + cuBLAS workspaces (allowance)", CONTEXT_BYTES)]
    if communicators:
        out.append(Term(f"NCCL buffers ({communicators} communicator(s), allowance)", communicators * NCCL_BYTES))
    return out


def with_fragmentation(dev: DeviceMemory) -> DeviceMemory:
    """Add the CUDA caching allocator's fragmentation allowance to every phase (a share of its bytes)."""
    for terms in dev.phases.values():
        churn = sum(t.nbytes for t in terms)
        terms.append(Term(f"allocator fragmentation ({FRAGMENTATION:.0%} of the phase's transient bytes)",
                          int(FRAGMENTATION * max(churn, 0))))
    return dev


# ---------------------------------------------------------------- a run's devices


def _compute_bytes(precision: str, gpu: bool) -> int:
    """2 when the draft computes under a 16-bit autocast (``device.autocast_dtype``; fp16 is refused),
    else 4."""
    if precision == "fp32":
        return 4
    if gpu or precision == "bf16":
        return 2
    from specforge.device import cpu_fast_bf16  # lazy: keeps specforge.memory torch-free

    return 2 if cpu_fast_bf16() else 4


# What a GPU holds when neither a GPU nor ray.gpu_memory_gib says (the dry run's verdict, vLLM's share of it)
H100_80GB = 81559 * 2**20  # what an 80 GB H100 reports (nvidia-smi: 81559 MiB)


def engine_terms(cfg, target_bytes: int, gpu: bool, gpu_bytes: Optional[int]) -> list[Term]:
    """``rollout.backend=vllm``: what the engine holds on each of its ``rollout.tp_size`` devices. On a
    GPU vLLM takes ``rollout.vllm_gpu_memory_utilization`` of it and fits the weights (as loaded,
    over TP), its KV and hidden-states cache and its activations inside; on the CPU its weights plus
    ``rollout.vllm_cpu_kvcache_gib``."""
    r = cfg.rollout
    weights = -(-target_bytes // r.tp_size)
    if not gpu:
        return [Term(f"vLLM engine: target weights / rollout.tp_size={r.tp_size}", weights),
                Term("vLLM engine: KV and hidden-states cache (rollout.vllm_cpu_kvcache_gib)",
                     int(r.vllm_cpu_kvcache_gib * GiB))]
    share = int(r.vllm_gpu_memory_utilization * (gpu_bytes or H100_80GB))
    return [Term(f"vLLM engine: target weights / rollout.tp_size={r.tp_size}", weights),
            Term("vLLM engine: KV and hidden-states cache, activations, CUDA graphs (the rest of "
                 f"rollout.vllm_gpu_memory_utilization={r.vllm_gpu_memory_utilization} x the GPU)",
                 max(share - weights, 0))]


def engine_client_terms(t: "TargetDims", B: int, T: int, aux_layers: int, chunk_tokens: int) -> list[Term]:
    """This process's side of a vLLM capture of ``B`` samples of ``T`` tokens (``models/target._capture_engine``):
    the engine's per-sample arrays read back, the padded features, the final norm, one argmax chunk of logits."""
    n = B * T
    back = n * (aux_layers + 1) * t.H * t.dtype_bytes
    return [Term("capture (vLLM): the engine's hidden states read back (K + 1 layers per token)", back),
            Term("capture (vLLM): features in the padded layout + the final norm", back),
            Term("capture (vLLM): one argmax chunk of logits", min(chunk_tokens, n) * t.V * (t.dtype_bytes + 8))]


def plan(cfg, algo: MemoryTerms, target, draft, state_bytes: int, target_shares: Sequence[int],
         gpu: bool) -> list[DeviceMemory]:
    """Every kind of device of ``cfg``'s placement at its peak. ``algo``: the run's algorithm (its
    ``memory_step`` terms), ``target``: the ``TargetModel`` (meta
    device is enough), ``draft``: the run's draft (meta), ``state_bytes``: the algorithm's frozen train
    state in fp32, ``target_shares``: the target's bytes on each GPU of a worker that runs it (one
    entry: the whole target), ``gpu``: whether the workers get GPUs (the CUDA/NCCL allowances)."""
    from specforge.parallel.dims import ParallelDims  # lazy: keeps specforge.memory torch-free
    from specforge.runtime.plan import wire_dtype  # lazy: keeps specforge.memory torch-free

    mode, dims, tr = cfg.placement.mode, ParallelDims.from_config(cfg), cfg.train
    text = text_config(target.model.config)
    Ht, layers = int(text.hidden_size), len(target.aux_layer_ids)
    compute = _compute_bytes(tr.precision, gpu)
    # the trainer holds the target's frozen tables in bf16 when it computes in bf16 from a bf16 target
    p = StepPrecision(compute=compute, mp=gpu and tr.num_workers > 1 and compute == 2, world=tr.num_workers,
                      tables16=compute == 2 and str(target.model.dtype) == "torch.bfloat16",
                      recompute_mlp=tr.recompute_mlp)
    s = SeqShape(tr.batch_size, cfg.data.max_length, cfg.parallel.sp_ulysses, cfg.parallel.sp_ring,
                 max(algo.sp_halo() - 1, 0))
    params = DraftParams.of(draft, tables16=p.tables16, optimizer=tr.optimizer, gpu=gpu)
    # train.pack_tokens: a step's micro-batch is one packed row of up to pack_tokens tokens (B = 1). Every
    # placement's plans carry packed rows (runtime/plan.plan_step); the capture source (single process, colocated)
    # lays its padded capture out in them, a second copy: counted for every placement (an upper bound by one copy)
    packed = tr.pack_tokens is not None
    step = algo.memory_step(draft, dataclasses.replace(s, B=1, T=tr.pack_tokens) if packed else s, p, gpu)
    wire = wire_dtype(cfg.model.dtype, gpu)
    wb = DTYPE_BYTES[wire]
    aux_rows = s.R if s.sp > 1 else s.T
    per_sample = aux_rows * layers * Ht * wb + s.window * (Ht * wb + 3 * 8)  # TrainBatch: ids, mask, argmax int64
    features = tr.grad_accum * s.B * per_sample
    upcast = s.B * (aux_rows * layers + s.window) * Ht * 4 if compute == 4 and wb < 4 else 0
    comms = int(tr.num_workers > 1) + int(s.ulysses > 1) + int(s.ring > 1) + int(mode == "disaggregated")
    extra = context_terms(gpu, comms)
    if packed:  # at most all the step's real tokens, in packed rows (no padding)
        extra.append(Term("packed rows (train.pack_tokens: a copy of the step's samples; single process)", features))
    spec = FeatureSpec.hidden_states(Ht, wire, layers)
    if mode == "disaggregated":
        step_bytes = tr.grad_accum * s.B * s.window * spec.bytes_per_token()
        extra.append(Term("receive buffers (the step in use + the next one posted, BufferPool +25%)",
                          int(2 * POOL_HEADROOM * step_bytes)))
    gpu_word = "GPU" if gpu else "process"
    train = train_device(f"train {gpu_word}", tr.num_workers, params, p, step, state_bytes, features, upcast, extra)
    tdims = TargetDims.of(target.model, text, target.model.dtype.itemsize, gpu)
    if cfg.rollout.backend == "vllm":
        return _plan_vllm(cfg, mode, dims, s, layers, tdims, target_shares, gpu, train, features, spec, gpu_word)
    if mode == "colocated":
        train.held.insert(0, Term("target weights" + (" (its first share)" if len(target_shares) > 1 else ""),
                                  target_shares[0]))
        before = Term("features of the micro-batches captured before it", features)
        train.phases["capture (one micro-batch)"] = [before] + forward_terms(
            tdims, s.B, s.T, layers, cfg.model.argmax_chunk_tokens, cfg.rollout.pack_tokens)
    out = [with_fragmentation(train) if gpu else train]
    if mode == "disaggregated":
        roll = -(-dims.dp // cfg.rollout.num_workers) * tr.grad_accum * s.B  # samples of one batched forward
        roll_step = roll * s.T * spec.bytes_per_token()
        budget = int(cfg.placement.max_inflight_mb * 2**20)
        share = " (the fullest share)" if len(target_shares) > 1 else ""
        rheld = [Term("target weights" + share, max(target_shares)),
                 Term("features sent, not yet received (SendWindow: <= placement.max_inflight_mb, <= 8 steps)",
                      min(budget, MAX_STEPS_AHEAD * roll_step))] + context_terms(gpu, 1)
        rphases = {"capture (one step's batched forward)": [Term("this step's features (wire copies)", roll_step)]
                   + forward_terms(tdims, roll, s.T, layers, cfg.model.argmax_chunk_tokens, cfg.rollout.pack_tokens)}
        rollout = DeviceMemory(f"rollout {gpu_word}", cfg.rollout.num_workers, rheld, rphases)
        out.append(with_fragmentation(rollout) if gpu else rollout)
    return out


def _plan_vllm(cfg, mode, dims, s, layers, tdims, target_shares, gpu, train, features, spec, gpu_word):
    """``plan`` with ``rollout.backend=vllm``: the engine's share (``engine_terms``) where the target
    runs, and this process's head (final norm + lm_head: the rest of the target stays memory-mapped)."""
    tr = cfg.train
    engine = engine_terms(cfg, sum(target_shares), gpu, available_bytes(cfg)[0] if gpu else None)
    head = Term("final norm + lm_head (this process; the other target weights memory-mapped in host memory)",
                tdims.V * tdims.H * tdims.dtype_bytes)
    chunk = cfg.model.argmax_chunk_tokens
    if mode == "colocated":
        train.held[:0] = engine + [head]
        train.phases["capture (one micro-batch, through vLLM)"] = (
            [Term("features of the micro-batches captured before it", features)]
            + engine_client_terms(tdims, s.B, s.T, layers, chunk))
    out = [with_fragmentation(train) if gpu else train]
    if mode == "disaggregated":
        roll = -(-dims.dp // cfg.rollout.num_workers) * tr.grad_accum * s.B
        roll_step = roll * s.T * spec.bytes_per_token()
        budget = int(cfg.placement.max_inflight_mb * 2**20)
        rheld = engine + [head, Term("features sent, not yet received (SendWindow: <= placement.max_inflight_mb, "
                                     "<= 8 steps)", min(budget, MAX_STEPS_AHEAD * roll_step))] + context_terms(gpu, 1)
        rphases = {"capture (one step's batch, through vLLM)": [Term("this step's features (wire copies)", roll_step)]
                   + engine_client_terms(tdims, roll, s.T, layers, chunk)}
        name = f"rollout {gpu_word}" + (f" (first of rollout.tp_size={cfg.rollout.tp_size})" if cfg.rollout.tp_size > 1
                                        else "")
        rollout = DeviceMemory(name, cfg.rollout.num_workers, rheld, rphases)
        out.append(with_fragmentation(rollout) if gpu else rollout)
    return out


def available_bytes(cfg) -> tuple[Optional[int], str]:
    """``(bytes, where from)`` one GPU of the run has: ``ray.gpu_memory_gib`` if set, else this
    machine's first CUDA device when the run uses GPUs; ``(None, why)`` when there is nothing to hold
    the plan against (a CPU run, or GPUs on other machines of a Ray cluster without the key)."""
    import torch  # lazy: keeps specforge.memory torch-free

    if cfg.ray.gpu_memory_gib is not None:
        if cfg.ray.gpu_memory_gib <= 0:
            raise ValueError(f"config key 'ray.gpu_memory_gib'={cfg.ray.gpu_memory_gib!r} must be > 0 or null "
                             "(null: read this machine's GPU)")
        return int(cfg.ray.gpu_memory_gib * GiB), f"ray.gpu_memory_gib={cfg.ray.gpu_memory_gib:g}"
    from specforge.device import wants_gpu  # lazy: keeps specforge.memory torch-free

    if wants_gpu(cfg.model.device) and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return int(props.total_memory), f"this machine's {props.name}"
    return None, "no GPU here and ray.gpu_memory_gib unset"


def check_fits(devices: Sequence[DeviceMemory], available: Optional[int], where: str, cfg, algo: MemoryTerms) -> None:
    """ValueError (one line) naming the device, its predicted peak, the GiB available and the keys
    that shrink it (``algo``'s ``memory_keys`` among them), when a device's peak exceeds ``available``."""
    if available is None:
        return
    for dev in devices:
        if dev.peak > available:
            raise ValueError(
                f"predicted peak {dev.peak / GiB:.1f} GiB on each {dev.device} ({dev.peak_phase}) exceeds the "
                f"{available / GiB:.1f} GiB available ({where}); lower {_keys_for(dev, cfg, algo)}, or set "
                "ray.gpu_memory_gib if the GPUs have more (python -m specforge.ray_train --dry-run prints every term)")


def host_available_bytes() -> Optional[int]:
    """This machine's available memory (``MemAvailable`` of /proc/meminfo), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_host_fits(devices: Sequence[DeviceMemory], available: Optional[int], cfg, algo: MemoryTerms) -> None:
    """A CPU run: ValueError (one line) when its processes' predicted peaks together exceed this
    machine's available memory, naming the largest process and the keys that shrink it."""
    if available is None or not devices:
        return
    total = sum(dev.peak * dev.count for dev in devices)
    if total > available:
        big = max(devices, key=lambda d: d.peak)
        parts = ", ".join(f"{d.count} x {d.device} {d.peak / GiB:.1f} GiB" for d in devices)
        raise ValueError(
            f"predicted peak {total / GiB:.1f} GiB in all ({parts}) exceeds the {available / GiB:.1f} GiB this "
            f"machine has available; lower {_keys_for(big, cfg, algo)} (python -m specforge.ray_train --dry-run "
            "prints every term)")


def _keys_for(dev: DeviceMemory, cfg, algo: MemoryTerms) -> str:
    if dev.device.startswith("rollout"):
        return ("rollout batch (train.batch_size, train.grad_accum; more rollout.num_workers), data.max_length, "
                "placement.max_inflight_mb or model.num_gpus")
    keys = ["train.batch_size", "data.max_length", *algo.memory_keys()]
    if not cfg.train.recompute_mlp:
        keys.append("train.recompute_mlp=true")
    if cfg.placement.mode == "colocated":
        keys.append("placement.mode=disaggregated (the target off the train GPUs)")
    return ", ".join(keys)
