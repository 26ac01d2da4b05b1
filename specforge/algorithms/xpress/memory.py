"""XPress's terms of the memory model (``specforge.memory``): DFlash's, plus what it adds.

A rough but honest model, read off ``model.py`` and ``loss.py`` (not measured). Parameters (the
refiner's ``2 V r + 2 H r + 3 r^2 + r K^2 + 3 r m``, m = r x mlp ratio) and their optimizer state
are counted by the runtime from the draft's parameters. Per loss chunk (``CHUNK_BLOCKS`` blocks, or
all when fewer) and block row, with ``P`` free-running passes (0 without the consistency term) and
``Z = 2 + P`` logits tensors (teacher-forced, P passes, the base): the teacher's fp32 logits and
log-softmax (8 bytes a vocab entry), each logits tensor's fp32 log-softmax and probabilities (8
bytes), the refiner's activations per pass (``in_proj``, mix, MLP: ``4 r + 3 m`` floats); the
backward adds each logits tensor's gradient (fp32).
"""

from __future__ import annotations

from specforge.algorithms.dflash.memory import DFlashDims, dflash_step
from specforge.memory import StepPrecision, Term


def xpress_step(config, B: int, T: int, anchors: int, p: StepPrecision, passes: int,
                chunk_blocks: int = 16) -> dict[str, list[Term]]:
    """``passes``: the consistency term's free-running passes that run (0 when it is off)."""
    d = DFlashDims.of(config)
    step = dflash_step(d, B, T, anchors, p, chunk_blocks)
    r = config.refiner_rank
    m = r * config.refiner_mlp_ratio
    Z = 2 + passes
    rows = B * min(anchors, chunk_blocks) * d.K  # block rows whose logits exist at once
    fwd = Term("XPress loss per chunk: teacher fp32 logits + log-softmax, each pass's log-softmax and "
               "probabilities, the refiner's activations", rows * (d.V * (8 + 8 * Z) + Z * (4 * r + 3 * m) * 4))
    bwd = Term("XPress loss backward per chunk: each logits tensor's gradient (fp32)", rows * d.V * 4 * Z)
    return {"forward": step["forward"] + [fwd], "backward": step["backward"] + [fwd, bwd],
            **{key: v for key, v in step.items() if key not in ("forward", "backward")}}
