"""DFlash's terms of the memory model (``specforge.memory``), read off ``model.py`` and ``loss.py``."""

from __future__ import annotations

from dataclasses import dataclass

from specforge.memory import StepPrecision, Term, norm_saved

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


def anchors_per_row(num_anchors: int, samples_per_row: int, T: int) -> int:
    """The most anchors a row of ``T`` tokens draws: ``num_anchors`` (``draft.num_anchors``) per
    sample, and a sample of n tokens has at most n - 1 (an anchor's next token is in its sample). A
    row holds up to ``samples_per_row`` samples (``seam.RunFacts``: packed, the rank's samples of a
    step, batch_size x grad_accum; else 1), each of at least num_anchors + 1 tokens in the worst case."""
    A = num_anchors
    fit = (T // (A + 1)) * A + max(0, T % (A + 1) - 1)
    return max(1, min(A * samples_per_row, fit))


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
    ctx = (norm_saved(d.H, p) + c * d.H + 2 * c * d.D) * n  # hidden_norm, its output, RoPE cos/sin
    ctx += d.layers * (norm_saved(Fk, p) + 2 * c * Fk) * n  # k_norm; k, v of the context (kept as the SDPA's keys)
    blk_norm = 4 * d.H + 4  # input/post-attention norms of an fp32 stream: the input (aliased), the fp32 row scale
    per_layer = (2 * blk_norm + (3 + 2) * c * d.H  # norms; 16-bit copies of the normed stream for q, k, v, gate, up
                 + norm_saved(Fq, p) + norm_saved(Fk, p)  # q_norm, k_norm
                 + 2 * c * Fq + 4 * d.Hq + c * Fk * 2  # SDPA's q copy, out, lse; the block's k (16-bit), v
                 + (0 if p.recompute_mlp else 3 * c * d.I)) * m  # MLP: gate, up, down_proj input (recompute: none)
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
    # the frozen lm_head's 16-bit copy (autocast casts it per call: not a leaf that trains); none when the
    # trainer holds it in bf16 (models.layers.hold_frozen_tables)
    head = 0 if p.tables16 else d.V * d.H * 2
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
    # train.recompute_mlp: the layer's gate, up and product recomputed in its backward, and its fp32 input
    recompute = (3 * c * d.I + 4 * d.H) * m if p.recompute_mlp else 0
    layers_bwd = acts + [Term("one block layer's backward working set", (4 * c * d.I + 8 * d.H) * m + recompute)]
    return {"forward": forward, "backward": backward, "backward (decoder layers)": layers_bwd}
