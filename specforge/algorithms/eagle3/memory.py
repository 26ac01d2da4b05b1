"""EAGLE-3's terms of the memory model (``specforge.memory``): what one micro-batch's TTT unroll
keeps, read off ``model.py``, ``attention.py`` and ``loss.py`` (the fast core keeps the causal-block
probabilities, ``B x Hq x ~T^2/2`` in the compute dtype; the flex core keeps the concatenated keys and
values, out and the row log-sum-exp and max, no probabilities; the fused loss's chunks) and, with ring
sequence parallelism, ``parallel/ring.py`` (no probabilities kept, K/V blocks in flight)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from specforge.algorithms.eagle3 import attention
from specforge.algorithms.eagle3.attention import FLEX_BLOCK, window_start
from specforge.memory import SeqShape, StepPrecision, Term, norm_saved


def attention_chunk(gpu: bool) -> int:
    """Query rows per iteration of the fast TTT core on that device (algorithms/eagle3/attention.py)."""
    return int(attention.CHUNK_GPU if gpu else attention.CHUNK_CPU)


def _probs_bytes(B: int, heads: int, rows: int, q_offset: int, c: int, chunk: int,
                 window: Optional[int] = None, step: int = 0) -> int:
    """The fast core's saved causal-block probabilities: chunk [c0, c1) of the queries keeps
    ``B x heads x (c1 - c0) x (q_offset + c1 - lo)`` values in the compute dtype, ``lo`` the first key
    its band reaches at TTT step ``step`` (0 without a sliding ``window``; algorithms/eagle3/attention.py)."""
    total, c0 = 0, 0
    while c0 < rows:
        c1 = min(rows, c0 + chunk)
        total += (c1 - c0) * (q_offset + c1 - window_start(q_offset + c0, step, window))
        c0 = c1
    return B * heads * total * c


# ---------------------------------------------------------------- EAGLE-3: the TTT unroll


@dataclass(frozen=True)
class Eagle3Dims:
    """The EAGLE-3 draft's widths (``algorithms/eagle3/model.py`` ``Eagle3DraftConfig``)."""

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
                loss_rows: int = 64, window: Optional[int] = None, core: str = "fast",
                loss_workset: int = 2) -> dict[str, list[Term]]:
    """One EAGLE-3 micro-batch (the TTT unroll of ``algorithms/eagle3/loss.py`` through ``Eagle3Draft.forward``):
    ``{"forward": ..., "backward": ...}``, the transient terms at the forward's end (everything autograd
    saved for the L steps, the teacher distribution, what only the forward still holds) and at the
    backward's peak (the last step's attention backward: the saved tensors less that step's MLP and
    loss head, plus the core's fp32 working set). Worst case: every row counts. ``chunk``: the fast
    core's query rows per iteration; ``loss_rows``: the fused loss's rows per chunk; ``window``: the
    draft's sliding window (its chunks keep and compute only the keys their band reaches); ``core``:
    ``"fast"`` (the chunked core, or SDPA for step 0 with ``p.step0_fused``) or ``"flex"``
    (``ttt_attention_flex``: every step keeps ``cat(keys)``, ``cat(values)``, out and the fp32 row
    log-sum-exp and max; its compiled backward's working set is the key gradients). ``loss_workset``: the fp32
    [rows x N] tensors a loss chunk holds (``kernels.losses.WORKSET`` of ``train.loss``)."""
    c, B, L = p.compute, s.B, s.ttt
    hq, hkv = _core_heads(d, s.ulysses)
    sp = s.sp > 1
    uly = s.ulysses > 1
    ring = s.ring > 1  # parallel/ring.py: step-0 K/V blocks passed around, nothing gathered, no probabilities kept
    flex = core == "flex" and not ring  # the ring runs its own kernels whatever the core (config refuses the pair)
    mult = FLEX_BLOCK if flex else 1  # the core's row_multiple: flex rounds a step's rows up to whole blocks
    # rows step i computes (loss._step_rows)
    rows = [s.R if sp else min(s.T, -(-max(s.T - 2 - i, 1) // mult) * mult) for i in range(L)]
    k0rows = s.ulysses * rows[0] if uly else rows[0]  # step-0 keys inside the core
    saved = dict.fromkeys(("norms (inputs, row scales) + RoPE", "layer inputs (16-bit)", "q/k/v",
                           "attention core (q, out, diagonal k/v)", "causal-block probabilities",
                           "MLP (gate, up, product)", "loss head (rows, logit gradients)"), 0)
    fwd_only = 0
    last = {}  # the last step's tensors the backward frees before its attention backward
    for i, n_rows in enumerate(rows):
        n = B * n_rows
        qrows = s.ulysses * n_rows if uly else n_rows  # rows inside the core (a Ulysses group's range)
        norms = 2 * norm_saved(d.H, p) * n + 4 * c * d.D * n  # hidden_norm, post-attention norm; cos/sin copies
        inputs = 2 * d.H * c * n  # q/k/v's and the MLP's inputs (o_proj's is the core's output)
        # gate, up, down_proj's input (layers._SiluMulFn recomputes silu); none with train.recompute_mlp
        mlp = 0 if p.recompute_mlp else 3 * d.I * c * n
        head = (norm_saved(d.H, p) + c * d.H + c * d.N + 8) * n  # norm, its output, G = softmax - p, row ids
        saved["norms (inputs, row scales) + RoPE"] += norms
        saved["layer inputs (16-bit)"] += inputs
        saved["MLP (gate, up, product)"] += mlp
        saved["loss head (rows, logit gradients)"] += head
        if i == 0 or uly:  # step 0's qkv (v0 is a view of it) and rotated k; the Ulysses cache keeps every step's
            saved["q/k/v"] += (d.Fqkv + d.Fk) * c * n
        else:  # qkv, rotated k of later steps: only the forward's lists hold them
            fwd_only += (d.Fqkv + d.Fk) * c * n
        core = (2 * hq * d.D * c + 4 * hq) * B * qrows  # q (rotated), out, lse (fp32)
        fused = i == 0 and p.step0_fused and not ring
        if flex:  # the row max too (fp32); later steps: the concatenated keys and values (step 0's are k, v)
            core += 4 * hq * B * qrows + (2 * hkv * d.D * c * B * (k0rows + i * qrows) if i else 0)
        elif not fused:
            core += 2 * i * hkv * d.D * c * B * qrows  # the stacked diagonal keys and values
            if not ring:  # the ring recomputes its blocks' probabilities in backward
                saved["causal-block probabilities"] += _probs_bytes(B, hq, qrows, 0, c, chunk, window, i)
        if uly:
            saved["q/k/v"] += 2 * hkv * d.D * c * B * qrows  # k, v after the all-to-all (cached per unroll)
        saved["attention core (q, out, diagonal k/v)"] += core
        last = dict(free=mlp + head + norms // 2 + d.H * c * n, n=B * qrows, i=i, rows=n)
    saved["layer inputs (16-bit)"] += (4 + c) * d.H * B * s.window  # step 0's input_layernorm(embeddings), 16-bit copy
    weights = _weight_copies(d, p, L)
    P = B * ((s.R + L - 1) if sp else (s.T - 1))  # positions whose teacher a counted row reads
    acts = [Term(f"activations: {k}", v) for k, v in saved.items() if v]
    loss_chunk = loss_workset * 4 * loss_rows * d.N  # the fused loss's fp32 working set of one chunk
    forward = acts + weights + [
        Term("teacher distribution (fp32, positions x N)", 4 * P * d.N),
        Term("forward-only: embedding half of q/k/v, later steps' q/k/v, fused weight",
             fwd_only + d.Fqkv * c * B * s.window + (4 * d.Fqkv * 2 * d.H if p.cast else 0)),
        Term("loss head chunk (fp32 logits, teacher rows, the loss's temporaries)", loss_chunk)]
    # the backward's peak: inside the last step's attention backward (its MLP and loss head are freed)
    n, Fq, Fk = last["n"], hq * d.D, hkv * d.D
    keys = n if window is None else min(n, B * (window + chunk))  # keys one chunk of rows scores
    common = (2 * c * Fq + c * d.H) * n + 4 * hq * n  # dout, dq, dhidden; delta (fp32)
    if flex:  # the fused backward's dK, dV of the concatenated keys (compute dtype), no score blocks
        common += 2 * c * Fk * B * (k0rows + last["i"] * last["n"] // B)
        backward = acts + weights + [
            Term("freed before the peak: the last step's MLP, loss head, post-attention norm", -last["free"]),
            Term("attention backward working set (flex: dK, dV of the concatenated keys)", common)]
        return {"forward": forward, "backward": _mlp_recompute_peak(backward, acts + weights, d, p, last)}
    if ring:  # a K/V block is Fk x n: the held and the received K/V (compute dtype); the block's dK/dV, its
        # stacked copy, the received accumulator and the sum (fp32); dq accumulated over the blocks (fp32)
        common += (4 * c + 32) * Fk * n + 4 * Fq * n
        chunks = hq * chunk * keys * (4 + 4 + c + 4 + 4 + c)  # one chunk's scores, P, dP, dS (fp32 and 16-bit)
    else:
        common += 8 * Fk * n  # dk0, dv0 fp32
        chunks = hq * chunk * keys * (2 + 4 + 2)  # one chunk's dP (16-bit, fp32) and dS
    diag = (12 * Fq + 16 * last["i"] * Fk) * n  # fp32 q, dout, dq; diagonal k, v and their grads in fp32
    backward = acts + weights + [
        Term("freed before the peak: the last step's MLP, loss head, post-attention norm", -last["free"]),
        Term("attention backward working set (fp32)", common + max(chunks, diag))]
    return {"forward": forward, "backward": _mlp_recompute_peak(backward, acts + weights, d, p, last)}


def _mlp_recompute_peak(backward: list[Term], held: list[Term], d: Eagle3Dims, p: StepPrecision,
                        last: dict) -> list[Term]:
    """With ``train.recompute_mlp`` the backward may peak earlier, in the last step's MLP backward: its
    gate, up and product recomputed, their gradients, the input's fp32 copy and the 16-bit weights
    (autocast's cache is gone by then). The larger of that and ``backward``."""
    if not p.recompute_mlp:
        return backward
    n = last["rows"]
    mlp = Term("the last step's MLP recomputed in backward (gate, up, product; their gradients; fp32 input)",
               6 * d.I * p.compute * n + 4 * d.H * n + (3 * d.I * d.H * 2 if p.cast else 0))
    early = held + [mlp]
    return early if sum(t.nbytes for t in early) > sum(t.nbytes for t in backward) else backward


def _weight_copies(d: Eagle3Dims, p: StepPrecision, L: int) -> list[Term]:
    """Weights the step reads besides the parameters themselves. Under a 16-bit autocast of fp32
    weights (``p.cast``), the copies autograd keeps: leaf weights once (autocast's cache), the fused
    q/k/v halves and the lm_head once per unroll (``models.layers.cast_once``: not leaves, cast once for
    all ``L`` steps). Else the fused q/k/v weight (cat)."""
    if not p.cast:
        return [Term("fused q/k/v weight (cat, kept for backward)", d.Fqkv * 2 * d.H * p.unsharded_param)]
    leaves = (3 * d.Ht * d.H + d.Fq * d.H + 3 * d.I * d.H) * 2
    return [Term("16-bit weight copies (autocast; q/k/v halves and lm_head once per unroll)",
                 leaves + 2 * d.Fqkv * d.H * 2 + d.N * d.H * 2)]
