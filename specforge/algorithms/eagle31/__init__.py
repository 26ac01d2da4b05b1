"""EAGLE-3.1: EAGLE-3 (``algorithms/eagle3``) with speculators' four normalisation switches
(``norm_before_fc``, ``fc_norm``, ``norm_before_residual``, ``norm_output``), the draft the
speculators trainer writes for EAGLE-3 and vLLM, SGLang and llama.cpp serve, each reading some of them.

``model`` (the draft and its chain drafter: EAGLE-3's with the switches), ``loss`` (EAGLE-3's TTT loss
on it), ``propose`` (the eval's proposer), ``export`` (the saved folder, the engines' formats and the
flags each engine refuses), ``memory`` (what the switches add to EAGLE-3's memory terms),
``algorithm`` (the seam's hooks and ``draft.*`` keys).
"""

from .algorithm import ALGORITHM

__all__ = ["ALGORITHM"]
