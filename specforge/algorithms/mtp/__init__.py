"""MTP: one multi-token-prediction layer applied recursively over the target's last hidden state
(speculators 0.9.0 ``models/mtp``: the layout of Qwen3-Next's and Qwen3.5's own MTP heads).

``model`` (the draft: input norms, ``input_proj``, a Qwen3 decoder layer, ``final_layernorm``), ``loss``
(FastMTP's weighted per-step cross-entropy, metrics), ``propose`` (the greedy chain at the last target
position), ``export`` (speculators' folder: ours and vLLM's), ``memory`` (its memory terms),
``algorithm`` (the hooks).
"""

from .algorithm import ALGORITHM

__all__ = ["ALGORITHM"]
