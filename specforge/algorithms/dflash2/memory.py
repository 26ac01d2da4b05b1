"""DFlash2's terms of the memory model (``specforge.memory``): DFlash's, plus what it adds.

A rough but honest model, read off ``model.py`` and ``loss.py`` (not measured). Parameters (the
convolutions' ``2 (2 t H + 2 t G H)`` per layer, the selector's ``2 V r + H r``) and their
optimizer state are counted by the runtime from the draft's parameters. Per layer and block row
the convolutions keep their kernels (``4 t G``) and the convolved input and output of the
attention and the MLP (``4 H``, compute dtype) for backward. Per loss chunk (``CHUNK_BLOCKS``
blocks, or all when fewer) and predicted row: the teacher's fp32 logits and log-softmax (V wide, 8
bytes), the unary fp32 log-softmax (4 bytes) and, for the selector, ``k`` candidates' codebook rows
(``k r``, fp32); the backward adds the unary logits' gradient (fp32).
"""

from __future__ import annotations

from specforge.algorithms.dflash.memory import DFlashDims, dflash_step
from specforge.memory import StepPrecision, Term


def dflash2_step(config, B: int, T: int, anchors: int, p: StepPrecision,
                 chunk_blocks: int = 16) -> dict[str, list[Term]]:
    d = DFlashDims.of(config)
    step = dflash_step(d, B, T, anchors, p, chunk_blocks)
    block_rows = B * anchors * d.K
    t, G, k, r = config.conv_kernel_size, config.num_groups, config.selector_top_k, config.selector_rank
    conv = Term("DFlash2 convolutions: kernels and convolved rows, every layer", block_rows * d.layers *
                (4 * t * G + 4 * d.H) * p.compute)
    rows = B * min(anchors, chunk_blocks) * d.K  # predicted rows whose logits exist at once
    fwd = Term("DFlash2 loss per chunk: teacher fp32 logits + log-softmax, unary log-softmax, selector rows",
               rows * (d.V * (8 + 4) + 2 * k * r * 4))
    bwd = Term("DFlash2 loss backward per chunk: the unary logits' gradient (fp32)", rows * d.V * 4)
    return {"forward": step["forward"] + [conv, fwd], "backward": step["backward"] + [conv, fwd, bwd],
            **{key: v for key, v in step.items() if key not in ("forward", "backward")}}
