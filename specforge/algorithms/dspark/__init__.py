"""DSpark: DFlash's block-diffusion draft plus a low-rank Markov head (each drafted token's logits
biased by the token before it, drafted as a greedy chain) and an optional confidence head.

``model`` (the draft and its heads), ``loss`` (Markov-biased KL / CE, the confidence BCE, metrics),
``propose`` (llama-server's ``draft-dspark`` drafting), ``export`` (the folder llama.cpp's
converter reads as ``DSparkDraftModel``), ``memory`` (its memory terms), ``algorithm`` (the hooks).
"""

from .algorithm import ALGORITHM

__all__ = ["ALGORITHM"]
