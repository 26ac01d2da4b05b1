"""MTP's terms of the memory model (``specforge.memory``), read off ``model.py`` and ``loss.py`` (a
rough model, not measured). Parameters (one decoder layer + ``input_proj`` 2H x H + four norms) and their
optimizer state are counted by the runtime from the draft's parameters.

Every step runs the layer over (at most) the micro-batch's ``B T`` rows and keeps, for backward: the
frozen embedding of its tokens and both input norms' saved copies and outputs (2H each), the
``[embedding ; hidden]`` concatenation (2H), the decoder layer (the normed stream, q/k/v with their head
norms, SDPA's output and log-sum-exp, the MLP's 3 I), ``final_layernorm``'s copies and output (the next
step's hidden); a packed row adds each step's boolean T x T mask. The loss computes each step's counted
rows' logits (worst case every row) in fp32 and keeps their log-softmax (4 V bytes a row) until the
backward, which adds their gradient (8 V bytes a row). The steps' activations all exist at the end of
the forward (the last step's loss runs last).
"""

from __future__ import annotations

from dataclasses import dataclass

from specforge.memory import StepPrecision, Term, norm_saved


@dataclass(frozen=True)
class MTPDims:
    H: int
    Hq: int
    Hkv: int
    D: int
    I: int  # noqa: E741 (the MLP's inner width, as the other drafts' dims name it)
    V: int
    S: int

    @classmethod
    def of(cls, c) -> "MTPDims":
        return cls(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size,
                   c.vocab_size, c.num_speculative_steps)


def mtp_step(d: MTPDims, B: int, T: int, p: StepPrecision, packed: bool) -> dict[str, list[Term]]:
    """One micro-batch's forward + loss + backward: ``S`` steps over ``B x T`` rows each (the worst case)."""
    c, n = p.compute, B * T
    Fq, Fk = d.Hq * d.D, d.Hkv * d.D
    fuse = 4 * d.H + 2 * norm_saved(d.H, p) + 2 * c * d.H + c * 2 * d.H  # embedding, input norms, concatenation
    layer = (2 * norm_saved(d.H, p) + 2 * c * d.H  # input / post-attention norms and their outputs
             + norm_saved(Fq, p) + norm_saved(Fk, p) + c * (Fq + 2 * Fk)  # q/k head norms; q, k, v
             + c * Fq + 4 * d.Hq  # SDPA's output and log-sum-exp
             + (0 if p.recompute_mlp else 3 * c * d.I))  # MLP: gate, up, their product (train.recompute_mlp: none)
    final = norm_saved(d.H, p) + c * d.H
    acts = Term(f"activations: {d.S} MTP steps (input norms and projection, decoder layer, final norm)",
                d.S * n * (fuse + layer + final))
    rope = Term("RoPE cos/sin (fp32, one table for every step)", 8 * d.D * n)
    mask = [Term("packed rows: each step's boolean causal same-sample mask", d.S * B * T * T)] if packed else []
    kept = Term("loss: each step's fp32 log-softmax over its counted rows, kept for backward", d.S * n * d.V * 4)
    logits = Term("loss: one step's fp32 logits while its log-softmax runs", n * d.V * 4)
    grad = Term("loss backward: one step's logits' gradients (fp32)", n * d.V * 8)
    weights = [Term("16-bit weight copies (autocast, cached)", (2 * d.H * d.H + 2 * Fq * d.H + 2 * Fk * d.H
                                                               + 3 * d.I * d.H + (0 if p.tables16 else d.V * d.H))
                                                              * 2)] if p.cast else []
    forward = [acts, rope, kept, logits] + mask + weights
    # train.recompute_mlp: one step's MLP recomputed in its backward (gate, up, product, their gradients, fp32 input)
    again = [Term("one step's MLP recomputed in backward", (6 * c * d.I + 4 * d.H) * n)] if p.recompute_mlp else []
    return {"forward": forward, "backward": [acts, rope, kept, grad] + mask + weights + again}
