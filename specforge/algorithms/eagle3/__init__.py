"""EAGLE-3 (arXiv 2503.01840): a one-layer draft fed the target's hidden states, trained with
training-time test (TTT): it drafts a chain of tokens, one forward a token.

``model`` (the draft in SGLang's ``LlamaForCausalLMEagle3`` layout, and the chain drafter),
``attention`` (the TTT attention cores), ``loss`` (the TTT unroll, loss and metrics), ``propose``
(the eval's proposer), ``export`` (load a saved folder), ``published`` (SGLang's and speculators'
folders read back, ``draft.init_from``), ``memory`` (its memory terms), ``algorithm`` (the seam's hooks).
"""

from .algorithm import ALGORITHM

__all__ = ["ALGORITHM"]
