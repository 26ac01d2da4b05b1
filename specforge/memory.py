"""Peak memory per device of a run, term by term: what ``--dry-run`` prints and the driver refuses on.

A device (a train GPU, a rollout GPU; colocated: one GPU holding both) holds ``held`` terms through
the whole run (weights as FSDP2 places them, optimizer state, the frozen train state, the CUDA/NCCL
context) and, on top, the transient terms of one phase at a time: the train step's forward end and
its backward (activations autograd saves for one micro-batch), FSDP2's reduce-scatter after the
backward, the optimizer step, the target's capture forward, a checkpoint save. The peak is ``held``
plus the largest phase. Every term is bytes, computed from the shapes and dtypes the code uses:

* what autograd saves per TTT step is read off ``models/draft.py``, ``models/attention.py`` and
  ``train/ttt.py`` (the fast core keeps the causal-block probabilities, ``B x Hq x ~T^2/2`` in the
  compute dtype, at every step that runs it: steps >= 1 always, step 0 too on CPU where ``auto`` is
  the fast core; SDPA's fused kernel, step 0 on GPUs, keeps ``B x Hq x T`` statistics only);
* DFlash from ``algorithms/dflash/{model,loss}.py`` (blocks of anchors, chunked logits);
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

from dataclasses import dataclass, field
from typing import Optional, Sequence

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
MAX_STEPS_AHEAD = 8  # runtime/contracts.py: plans the driver lets run ahead of training


def attention_chunk(gpu: bool) -> int:
    """Query rows per iteration of the fast TTT core on that device (models/attention.py)."""
    from specforge.models import attention

    return int(getattr(attention, "CHUNK_GPU" if gpu else "CHUNK_CPU", 128))


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
    whether TTT step 0 runs SDPA's fused kernel (``auto``/``sdpa``/``flash`` on a GPU) or the fast core."""

    compute: int = 2
    mp: bool = False
    world: int = 1
    step0_fused: bool = False

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


def _norm_saved(width: int, p: StepPrecision) -> int:
    """Bytes per row RMSNorm (models/draft.py) leaves saved for backward, besides its output: the
    fp32 input copy ``xf`` and the normalized value (fp32, or the 16-bit copy the weight multiplies)."""
    if p.compute == 4:
        return 8 * width
    return (4 + 2) * width if p.mp else (4 + 4) * width


def _probs_bytes(B: int, heads: int, rows: int, q_offset: int, c: int, chunk: int) -> int:
    """The fast core's saved causal-block probabilities: chunk [c0, c1) of the queries keeps
    ``B x heads x (c1 - c0) x (q_offset + c1)`` values in the compute dtype (models/attention.py)."""
    total, c0 = 0, 0
    while c0 < rows:
        c1 = min(rows, c0 + chunk)
        total += (c1 - c0) * (q_offset + c1)
        c0 = c1
    return B * heads * total * c


# ---------------------------------------------------------------- EAGLE-3: the TTT unroll


@dataclass(frozen=True)
class Eagle3Dims:
    """The EAGLE-3 draft's widths (``models/draft.py`` ``Eagle3DraftConfig``)."""

    H: int
    Ht: int
    Hq: int
    Hkv: int
    D: int
    I: int
    N: int
    V: int

    @classmethod
    def of(cls, c) -> "Eagle3Dims":
        return cls(c.hidden_size, c.target_hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                   c.intermediate_size, c.draft_vocab_size, c.vocab_size)

    @property
    def Fq(self) -> int:
        return self.Hq * self.D

    @property
    def Fk(self) -> int:
        return self.Hkv * self.D

    @property
    def Fqkv(self) -> int:
        return self.Fq + 2 * self.Fk


def _core_heads(d: Eagle3Dims, u: int) -> tuple[int, int]:
    """(query heads, kv heads) the attention core of one Ulysses rank runs (parallel/sp.py: kv heads
    repeated by the least factor that splits, or MHA + zero heads when the query heads do not split)."""
    if u == 1:
        return d.Hq, d.Hkv
    if d.Hq % u == 0:
        G = d.Hq // d.Hkv
        rep = next(r for r in range(1, G + 1) if G % r == 0 and (d.Hkv * r) % u == 0)
        return d.Hq // u, d.Hkv * rep // u
    heads = (d.Hq + (-d.Hq % u)) // u
    return heads, heads


def eagle3_step(d: Eagle3Dims, s: SeqShape, p: StepPrecision, chunk: int = 128,
                loss_rows: int = 64) -> dict[str, list[Term]]:
    """One EAGLE-3 micro-batch (the TTT unroll of ``train/ttt.py`` through ``Eagle3Draft.forward``):
    ``{"forward": ..., "backward": ...}``, the transient terms at the forward's end (everything autograd
    saved for the L steps, the teacher distribution, what only the forward still holds) and at the
    backward's peak (the last step's attention backward: the saved tensors less that step's MLP and
    loss head, plus the core's fp32 working set). Worst case: every row counts. ``chunk``: the fast
    core's query rows per iteration; ``loss_rows``: the fused loss's rows per chunk."""
    c, B, L = p.compute, s.B, s.ttt
    hq, hkv = _core_heads(d, s.ulysses)
    sp = s.sp > 1
    rows = [s.R if sp else max(s.T - 2 - i, 1) for i in range(L)]  # rows step i computes (ttt._step_rows)
    uly = s.ulysses > 1
    offset = (s.ring - 1) * s.ulysses * s.R  # the last ring rank's queries start there: the fullest rank
    saved = dict.fromkeys(("norms (fp32 copies) + RoPE", "layer inputs (16-bit)", "q/k/v", "attention core (q, out, "
                           "diagonal k/v)", "causal-block probabilities", "MLP (gate, up, act, product)",
                           "loss head (rows, logit gradients)"), 0)
    fwd_only = 0
    last = {}  # the last step's tensors the backward frees before its attention backward
    for i, n_rows in enumerate(rows):
        n = B * n_rows
        qrows = s.ulysses * n_rows if uly else n_rows  # rows inside the core (a Ulysses group's range)
        norms = 2 * _norm_saved(d.H, p) * n + 4 * c * d.D * n  # hidden_norm, post-attention norm; cos/sin copies
        inputs = 2 * d.H * c * n  # q/k/v's and the MLP's inputs (o_proj's is the core's output)
        mlp = 4 * d.I * c * n
        head = (_norm_saved(d.H, p) + c * d.H + c * d.N + 8) * n  # norm, its output, G = softmax - p, row ids
        saved["norms (fp32 copies) + RoPE"] += norms
        saved["layer inputs (16-bit)"] += inputs
        saved["MLP (gate, up, act, product)"] += mlp
        saved["loss head (rows, logit gradients)"] += head
        if i == 0 or uly:  # step 0's qkv (v0 is a view of it) and rotated k; the Ulysses cache keeps every step's
            saved["q/k/v"] += (d.Fqkv + d.Fk) * c * n
        else:  # qkv, rotated k of later steps: only the forward's lists hold them
            fwd_only += (d.Fqkv + d.Fk) * c * n
        core = (2 * hq * d.D * c + 4 * hq) * B * qrows  # q (rotated), out, lse (fp32)
        fused = i == 0 and p.step0_fused and s.ring == 1
        if not fused:
            core += 2 * i * hkv * d.D * c * B * qrows  # the stacked diagonal keys and values
            saved["causal-block probabilities"] += _probs_bytes(B, hq, qrows, offset if s.ring > 1 else 0, c, chunk)
        if uly:
            saved["q/k/v"] += 2 * hkv * d.D * c * B * qrows  # k, v after the all-to-all (cached per unroll)
        saved["attention core (q, out, diagonal k/v)"] += core
        last = dict(free=mlp + head + norms // 2 + d.H * c * n, n=B * qrows, i=i,
                    L0=(offset if s.ring > 1 else 0) + qrows)
    if s.ring > 1:
        saved["q/k/v"] += 2 * hkv * d.D * c * B * s.ring * s.ulysses * s.R  # step-0 k, v gathered over the ring
    saved["layer inputs (16-bit)"] += (4 + c) * d.H * B * s.window  # step 0's input_layernorm(embeddings), 16-bit copy
    weights = _weight_copies(d, p, L)
    P = B * ((s.R + L - 1) if sp else (s.T - 1))  # positions whose teacher a counted row reads
    acts = [Term(f"activations: {k}", v) for k, v in saved.items() if v]
    loss_chunk = 2 * 4 * loss_rows * d.N  # the fused loss's fp32 logits and teacher rows of one chunk
    forward = acts + weights + [
        Term("teacher distribution (fp32, positions x N)", 4 * P * d.N),
        Term("forward-only: embedding half of q/k/v, later steps' q/k/v, fused weight",
             fwd_only + d.Fqkv * c * B * s.window + (4 * d.Fqkv * 2 * d.H if p.cast else 0)),
        Term("loss head chunk (fp32 logits, teacher rows)", loss_chunk)]
    # the backward's peak: inside the last step's attention backward (its MLP and loss head are freed)
    n, Fq, Fk = last["n"], hq * d.D, hkv * d.D
    common = (2 * c * Fq + c * d.H) * n + 8 * Fk * B * last["L0"] + 4 * hq * n  # dout, dq, dhidden; dk0, dv0 fp32
    chunks = B * hq * chunk * last["L0"] * (2 + 4 + 2)  # one chunk's dP (16-bit, fp32) and dS
    diag = (12 * Fq + 16 * last["i"] * Fk) * n  # fp32 q, dout, dq; diagonal k, v and their grads in fp32
    backward = acts + weights + [
        Term("freed before the peak: the last step's MLP, loss head, post-attention norm", -last["free"]),
        Term("attention backward working set (fp32)", common + max(chunks, diag))]
    return {"forward": forward, "backward": backward}


def _weight_copies(d: Eagle3Dims, p: StepPrecision, L: int) -> list[Term]:
    """Weights the step reads besides the parameters themselves. Under a 16-bit autocast of fp32
    weights (``p.cast``), the copies autograd keeps: leaf weights once (autocast's cache), the fused
    q/k/v halves and the lm_head once per TTT step (not leaves). Else the fused q/k/v weight (cat)."""
    if not p.cast:
        return [Term("fused q/k/v weight (cat, kept for backward)", d.Fqkv * 2 * d.H * p.unsharded_param)]
    leaves = (3 * d.Ht * d.H + d.Fq * d.H + 3 * d.I * d.H) * 2
    per_step = (d.Fqkv * d.H + d.N * d.H) * 2
    return [Term("16-bit weight copies (autocast; q/k/v and lm_head once per TTT step)",
                 leaves + d.Fqkv * d.H * 2 + L * per_step)]


# ---------------------------------------------------------------- DFlash: blocks after a context


@dataclass(frozen=True)
class DFlashDims:
    """The DFlash draft's widths (``algorithms/dflash/model.py`` ``DFlashConfig``)."""

    H: int
    Hq: int
    Hkv: int
    D: int
    I: int
    V: int
    F: int  # context width: captured layers x target hidden
    layers: int
    K: int  # block size

    @classmethod
    def of(cls, c) -> "DFlashDims":
        return cls(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size,
                   c.vocab_size, c.context_width, c.num_hidden_layers, c.block_size)


def dflash_step(d: DFlashDims, B: int, T: int, anchors: int, p: StepPrecision,
                chunk_blocks: int = 16) -> dict[str, list[Term]]:
    """One DFlash micro-batch (``DFlashDraft.forward`` + ``loss.block_loss``): ``anchors`` blocks of
    ``d.K`` rows per sample (worst case ``draft.num_anchors``; fewer when a sample has fewer assistant
    positions) attend to the T context positions. The block rows' residual stream is fp32 (the frozen
    embedding is), every layer's keys/values of the context are kept, SDPA's fused kernel keeps no
    scores (measured on CPU: flash with the block mask; on CUDA assumed the memory-efficient kernel,
    which takes a mask). With more than ``chunk_blocks`` blocks the logits exist that many blocks at a
    time and are recomputed in backward (checkpoint); with fewer, one pass keeps the log-softmax."""
    c, Q = p.compute, anchors * d.K
    Fq, Fk = d.Hq * d.D, d.Hkv * d.D
    n, m = B * T, B * Q  # context rows, block rows
    ctx = (_norm_saved(d.H, p) + c * d.H + 2 * c * d.D) * n  # hidden_norm, its output, RoPE cos/sin
    ctx += d.layers * (_norm_saved(Fk, p) + 2 * c * Fk) * n  # k_norm; k, v of the context (kept as the SDPA's keys)
    blk_norm = 8 * d.H  # input/post-attention norms of an fp32 stream: the input (aliased) and the normalized value
    per_layer = (2 * blk_norm + (3 + 2) * c * d.H  # norms; 16-bit copies of the normed stream for q, k, v, gate, up
                 + _norm_saved(Fq, p) + _norm_saved(Fk, p)  # q_norm, k_norm
                 + 2 * c * Fq + 4 * d.Hq + c * Fk * 2  # SDPA's q copy, out, lse; the block's k (16-bit), v
                 + 4 * c * d.I) * m  # MLP
    blocks = d.layers * per_layer + (blk_norm + 8 * d.D) * m  # final norm (its fp32 output is the hidden); fp32 cos/sin
    mask = d.layers * c * B * Q * (T + Q)  # each layer's SDPA keeps the block mask additive, in the compute dtype
    kv_cat = d.layers * 2 * c * Fk * B * Q  # the block rows' part of each layer's concatenated keys/values
    weights = []
    if p.cast:
        weights = [Term("16-bit weight copies (autocast, cached)",
                        (d.F * d.H + d.layers * (2 * Fq * d.H + 2 * Fk * d.H + 3 * d.I * d.H)) * 2)]
    acts = [Term("activations: context (norm, k/v of every layer)", ctx),
            Term("activations: block rows (norms, projections, SDPA, MLP)", blocks + kv_cat),
            Term("block mask (additive, per layer)", mask)] + weights
    head = d.V * d.H * 2  # the frozen lm_head's 16-bit copy (autocast casts it per call: not a leaf that trains)
    if anchors > chunk_blocks:  # chunked: logits of chunk_blocks blocks at a time, recomputed in backward
        r = B * chunk_blocks * d.K
        loss_fwd = [Term("loss chunk (lm_head 16-bit copy, fp32 logits, log-softmax)", head + r * d.V * 8)]
        loss_bwd = [Term("loss chunk backward (recomputed log-softmax, its gradients; fp32)", head + r * d.V * 12)]
    else:  # one pass: the log-softmax (fp32) and the lm_head copy stay for backward
        r = m
        kept = Term("loss: log-softmax (fp32) and the lm_head 16-bit copy, kept for backward", head + r * d.V * 4)
        loss_fwd = [kept, Term("loss: fp32 logits while the log-softmax runs", r * d.V * 4)]
        loss_bwd = [kept, Term("loss backward: the log-softmax's gradients (fp32)", r * d.V * 8)]
    forward = acts + [Term("forward-only: block embeddings, the concatenated fp32 keys, the boolean mask",
                           4 * d.H * m + 4 * Fk * B * (T + Q) + B * Q * (T + Q))] + loss_fwd
    backward = acts + loss_bwd  # the loss's backward runs first: no parameter has a gradient yet
    layers_bwd = acts + [Term("one block layer's backward working set", (4 * c * d.I + 8 * d.H) * m)]
    return {"forward": forward, "backward": backward, "backward (decoder layers)": layers_bwd}


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
        import torch

        from specforge.models.target import capture_attention
        from specforge.targets import family_of

        heads = int(text.num_attention_heads)
        experts = int(getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or 0)
        moe_I = int(getattr(text, "moe_intermediate_size", None) or (text.intermediate_size if experts else 0))
        impl = capture_attention(family_of(model.config), torch.device("cuda" if gpu else "cpu"))
        if impl == "default":
            impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
        return cls(int(text.hidden_size), int(text.intermediate_size), heads, int(text.num_key_value_heads or heads),
                   int(getattr(text, "head_dim", None) or text.hidden_size // heads), int(text.vocab_size), dtype_bytes,
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


# ---------------------------------------------------------------- a device, assembled


@dataclass(frozen=True)
class DraftParams:
    """The draft's parameters as FSDP2 places them: ``trainable`` numel (sharded), ``frozen`` bytes
    (whole on every rank), buffers' bytes, the largest trainable tensor's numel (a save gathers it)."""

    trainable: int
    frozen_bytes: int
    buffer_bytes: int
    largest: int

    @classmethod
    def of(cls, draft) -> "DraftParams":
        train = [p for p in draft.parameters() if p.requires_grad]
        return cls(sum(p.numel() for p in train),
                   sum(p.numel() * p.element_size() for p in draft.parameters() if not p.requires_grad),
                   sum(b.numel() * b.element_size() for b in draft.buffers()),
                   max((p.numel() for p in train), default=0))


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
    phases["optimizer step"] = [sharded_grads, Term("AdamW foreach temporaries (fp32)", 4 * shard)] + feats
    phases["checkpoint save"] = [sharded_grads, Term("the largest tensor gathered whole on the writer (fp32)",
                                                     4 * params.largest * (2 if W > 1 else 1))]
    return phases


def draft_held(params: DraftParams, p: StepPrecision, state_bytes: int) -> list[Term]:
    shard = -(-params.trainable // p.world)
    where = f"sharded over {p.world}" if p.world > 1 else "one rank"
    return [Term(f"draft params (fp32, {where})", 4 * shard),
            Term("frozen draft params (full replica on every rank, fp32)", params.frozen_bytes),
            Term(f"AdamW m, v (fp32, {where})", 8 * shard),
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
    from specforge.device import cpu_fast_bf16

    return 2 if cpu_fast_bf16() else 4


def _loss_rows(gpu: bool, N: int) -> int:
    """Rows per chunk of the fused EAGLE-3 loss on that device (train/ttt.py)."""
    from specforge.train import ttt

    if hasattr(ttt, "loss_chunk"):
        import torch

        return int(ttt.loss_chunk(torch.device("cuda" if gpu else "cpu"), N))
    return 64


def plan(cfg, target, draft, state_bytes: int, target_shares: Sequence[int], gpu: bool) -> list[DeviceMemory]:
    """Every kind of device of ``cfg``'s placement at its peak. ``target``: the ``TargetModel`` (meta
    device is enough), ``draft``: the run's draft (meta), ``state_bytes``: the algorithm's frozen train
    state in fp32, ``target_shares``: the target's bytes on each GPU of a worker that runs it (one
    entry: the whole target), ``gpu``: whether the workers get GPUs (the CUDA/NCCL allowances)."""
    from specforge.parallel.dims import ParallelDims
    from specforge.runtime.contracts import DTYPE_BYTES, FeatureSpec
    from specforge.runtime.plan import wire_dtype
    from specforge.targets import text_config

    mode, dims, tr = cfg.placement.mode, ParallelDims.from_config(cfg), cfg.train
    text = text_config(target.model.config)
    Ht, layers = int(text.hidden_size), len(target.aux_layer_ids)
    compute = _compute_bytes(tr.precision, gpu)
    p = StepPrecision(compute=compute, mp=gpu and tr.num_workers > 1 and compute == 2, world=tr.num_workers,
                      step0_fused=gpu and cfg.draft.attention in ("auto", "sdpa", "flash"))
    s = SeqShape(tr.batch_size, cfg.data.max_length, cfg.parallel.sp_ulysses, cfg.parallel.sp_ring,
                 cfg.draft.ttt_length if cfg.draft.algorithm == "eagle3" else 0)
    params = DraftParams.of(draft)
    if cfg.draft.algorithm == "eagle3":
        d = Eagle3Dims.of(draft.config)
        step = eagle3_step(d, s, p, attention_chunk(gpu), _loss_rows(gpu, d.N))
    else:
        step = dflash_step(DFlashDims.of(draft.config), s.B, s.T, min(cfg.draft.num_anchors, s.T - 1), p)
    wire = wire_dtype(cfg.model.dtype, gpu)
    wb = DTYPE_BYTES[wire]
    aux_rows = s.R if s.sp > 1 else s.T
    per_sample = aux_rows * layers * Ht * wb + s.window * (Ht * wb + 3 * 8)  # TrainBatch: ids, mask, argmax int64
    features = tr.grad_accum * s.B * per_sample
    upcast = s.B * (aux_rows * layers + s.window) * Ht * 4 if compute == 4 and wb < 4 else 0
    comms = int(tr.num_workers > 1) + int(s.ulysses > 1) + int(s.ring > 1) + int(mode == "disaggregated")
    extra = context_terms(gpu, comms)
    spec = FeatureSpec.eagle3(Ht, wire, layers)
    if mode == "disaggregated":
        step_bytes = tr.grad_accum * s.B * s.window * spec.bytes_per_token()
        extra.append(Term("receive buffers (the step in use + the next one posted, BufferPool +25%)",
                          int(2 * POOL_HEADROOM * step_bytes)))
    gpu_word = "GPU" if gpu else "process"
    train = train_device(f"train {gpu_word}", tr.num_workers, params, p, step, state_bytes, features, upcast, extra)
    tdims = TargetDims.of(target.model, text, target.model.dtype.itemsize, gpu)
    if mode == "colocated":
        train.held.insert(0, Term("target weights" + (" (its first share)" if len(target_shares) > 1 else ""),
                                  target_shares[0]))
        before = Term("features of the micro-batches captured before it", features)
        train.phases["capture (one micro-batch)"] = [before] + capture_terms(tdims, s.B, s.T, layers,
                                                                             cfg.model.argmax_chunk_tokens)
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
                   + capture_terms(tdims, roll, s.T, layers, cfg.model.argmax_chunk_tokens)}
        rollout = DeviceMemory(f"rollout {gpu_word}", cfg.rollout.num_workers, rheld, rphases)
        out.append(with_fragmentation(rollout) if gpu else rollout)
    return out


def available_bytes(cfg) -> tuple[Optional[int], str]:
    """``(bytes, where from)`` one GPU of the run has: ``ray.gpu_memory_gib`` if set, else this
    machine's first CUDA device when the run uses GPUs; ``(None, why)`` when there is nothing to hold
    the plan against (a CPU run, or GPUs on other machines of a Ray cluster without the key)."""
    import torch

    if cfg.ray.gpu_memory_gib is not None:
        if cfg.ray.gpu_memory_gib <= 0:
            raise ValueError(f"config key 'ray.gpu_memory_gib'={cfg.ray.gpu_memory_gib!r} must be > 0 or null "
                             "(null: read this machine's GPU)")
        return int(cfg.ray.gpu_memory_gib * GiB), f"ray.gpu_memory_gib={cfg.ray.gpu_memory_gib:g}"
    from specforge.device import wants_gpu

    if wants_gpu(cfg.model.device) and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return int(props.total_memory), f"this machine's {props.name}"
    return None, "no GPU here and ray.gpu_memory_gib unset"


def check_fits(devices: Sequence[DeviceMemory], available: Optional[int], where: str, cfg) -> None:
    """ValueError (one line) naming the device, its predicted peak, the GiB available and the keys
    that shrink it, when a device's peak exceeds ``available``."""
    if available is None:
        return
    for dev in devices:
        if dev.peak > available:
            raise ValueError(
                f"predicted peak {dev.peak / GiB:.1f} GiB on each {dev.device} ({dev.peak_phase}) exceeds the "
                f"{available / GiB:.1f} GiB available ({where}); lower {_keys_for(dev, cfg)}, or set "
                "ray.gpu_memory_gib if the GPUs have more (python -m specforge.ray_train --dry-run prints every term)")


def _keys_for(dev: DeviceMemory, cfg) -> str:
    if dev.device.startswith("rollout"):
        return ("rollout batch (train.batch_size, train.grad_accum; more rollout.num_workers), data.max_length, "
                "placement.max_inflight_mb or model.num_gpus")
    keys = ["train.batch_size", "data.max_length"]
    if cfg.draft.algorithm == "eagle3":
        keys.append("parallel.sp_ulysses / parallel.sp_ring (split T)")
    else:
        keys.append("draft.num_anchors")
    if cfg.placement.mode == "colocated":
        keys.append("placement.mode=disaggregated (the target off the train GPUs)")
    return ", ".join(keys)
