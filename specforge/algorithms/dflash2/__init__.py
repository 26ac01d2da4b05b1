"""DFlash2: DFlash's block draft with a grouped dynamic causal convolution around each layer's
attention and MLP (inside a block), and a low-rank candidate selector that reranks the unary
top-k by the token before (speculators 0.9.0 ``models/dflash2``).

``model`` (the draft: convolutions, selector), ``loss`` (unary KL/CE + the selector's K-way CE,
metrics), ``propose`` (the selector's greedy chain over one block), ``export`` (our saved folder,
``DFlash2DraftModel``, and vLLM's: speculators' DFlash2 format), ``memory`` (its memory terms),
``algorithm`` (the hooks).
"""

from .algorithm import ALGORITHM

__all__ = ["ALGORITHM"]
