"""EAGLE-3.1's terms of the memory model: EAGLE-3's (``algorithms/eagle3/memory.py``) plus what the
switches add to one micro-batch's step. A rough model, read off ``model.py`` like EAGLE-3's:

* ``norm_before_fc`` / ``fc_norm``: one RMSNorm over the ``3 * H_t`` target features of every row it
  owns (or three over ``H_t`` each: the same bytes), its fp32 copies, and its output, which ``fc``
  keeps for its weight gradient (EAGLE-3's ``fc`` keeps the features, already counted as features).
* ``norm_before_residual``: ``hidden_norm`` runs twice a step (q/k/v and the residual); the second
  call's saved fp32 copies on every row the step computes.
* ``norm_output``: nothing counted: the final norm moves from the loss head (its counted rows) into
  the layer (every computed row); in the worst case the model assumes (every row counts) they are the
  same rows.
"""

from __future__ import annotations

from specforge.algorithms.eagle3.memory import Eagle3Dims
from specforge.memory import SeqShape, StepPrecision, Term, norm_saved


def eagle31_terms(d: Eagle3Dims, s: SeqShape, p: StepPrecision, flags: dict[str, bool]) -> list[Term]:
    """What the set flags add to EAGLE-3's step terms (held through the forward and the backward)."""
    c, B = p.compute, s.B
    rows = [s.R if s.sp > 1 else max(s.T - 2 - i, 1) for i in range(s.ttt)]  # as eagle3_step counts them
    out = []
    if flags.get("norm_before_fc") or flags.get("fc_norm"):
        n0 = B * (s.R if s.sp > 1 else s.T)
        out.append(Term("activations: EAGLE-3.1 fc-side norm (fp32 copies, fc's normed input)",
                        (norm_saved(3 * d.Ht, p) + c * 3 * d.Ht) * n0))
    if flags.get("norm_before_residual"):
        out.append(Term("activations: EAGLE-3.1 normed residual (hidden_norm's second call)",
                        sum(norm_saved(d.H, p) * B * r for r in rows)))
    return out

