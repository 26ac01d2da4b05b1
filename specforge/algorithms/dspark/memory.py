"""DSpark's terms of the memory model (``specforge.memory``): DFlash's, plus what the heads add.

A rough but honest model. The heads' parameters (2 V r + (H + r + 1)) and their optimizer state
are counted by the runtime from the draft's parameters. Per loss chunk (``CHUNK_BLOCKS`` blocks at
a time, or all blocks when fewer, as DFlash) the heads add, for every predicted row: the Markov
bias ``W2 W1[prev]`` (V wide, compute dtype), the teacher's fp32 logits and log-softmax (V wide,
8 bytes) and the fp32 ``min(q, p)`` of the confidence target (4 bytes); the backward adds the
bias's gradient (fp32). W1's rows and the confidence head's input (r and H + r wide) are small
beside V and counted with the bias. Not measured: read off ``loss.py``.
"""

from __future__ import annotations

from specforge.algorithms.dflash.memory import DFlashDims, dflash_step
from specforge.memory import StepPrecision, Term


def dspark_step(config, B: int, T: int, anchors: int, p: StepPrecision,
                chunk_blocks: int = 16) -> dict[str, list[Term]]:
    d = DFlashDims.of(config)
    step = dflash_step(d, B, T, anchors, p, chunk_blocks)
    rows = B * min(anchors, chunk_blocks) * d.K  # predicted rows whose logits exist at once (at most K per block)
    r = config.markov_rank
    fwd = Term("DSpark heads per loss chunk: Markov bias, teacher fp32 logits + log-softmax, min(q, p)",
               rows * (d.V * (p.compute + 8 + 4) + (r + d.H + r) * 4))
    bwd = Term("DSpark heads backward per loss chunk: the bias's gradient (fp32)", rows * d.V * 4)
    return {"forward": step["forward"] + [fwd], "backward": step["backward"] + [fwd, bwd],
            **{k: v for k, v in step.items() if k not in ("forward", "backward")}}
