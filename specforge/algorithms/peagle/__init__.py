"""P-EAGLE (parallel EAGLE; speculators' ``peagle``, vLLM's ``parallel_drafting``): an EAGLE-3 draft
that drafts K tokens in ONE forward, the last real row followed by K - 1 mask rows (a trained mask
embedding and a trained ``mask_hidden`` feature vector) at the next positions.

``model`` (the draft: EAGLE-3's plus the mask; its forward trains every depth at once), ``propose``
(the eval's block proposer), ``export`` (our saved folder and speculators' vLLM format), ``published``
(speculators' folder read back, ``draft.init_from``),
``algorithm`` (the seam's hooks, EAGLE-3's where nothing differs).
"""

from .algorithm import ALGORITHM

__all__ = ["ALGORITHM"]
