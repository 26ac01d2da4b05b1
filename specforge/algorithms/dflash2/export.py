"""Save / load a DFlash2 draft: DFlash's flat folder (:mod:`specforge.algorithms.dflash.export`: a
Qwen3 config of the draft with ``block_size``, ``num_target_layers`` and ``dflash_config:
{mask_token_id, target_layer_ids}``, layer OUTPUT ids) with ``architectures: ["DFlash2DraftModel"]``
and speculators' DFlash2 keys: ``conv_kernel_size``, ``conv_group_size``, ``selector_rank``,
``selector_top_k``, ``sample_from_anchor``, ``sliding_window_non_causal`` and ``draft_vocab_size``
(= ``vocab_size``: DFlash2 drafts over the target's whole vocabulary). Tensors: DFlash's, plus each
layer's ``attention_conv`` / ``mlp_conv`` (``base_kernel [2, t, H]``, ``kernel_projection.weight
[2 t G, H]``) and ``candidate_selector.{predecessor_codebook, successor_codebook} [V, r]``,
``candidate_selector.hidden_projection.weight [r, H]``; no embedding, no lm_head (the target's).

No engine serves this folder yet (``algorithm.DFlash2.export`` refuses each one in a line).
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Mapping, Optional

import torch

from specforge.algorithms.dflash import export as dflash_export
from specforge.algorithms.dflash.export import check_block_checkpoint

from .model import DFlash2Config, DFlash2Draft

__all__ = ["ARCHITECTURE", "to_hf_config", "from_hf_config", "save_dflash2", "load_dflash2", "check_checkpoint",
           "tokens_per_round"]

ARCHITECTURE = "DFlash2DraftModel"
KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def to_hf_config(cfg: DFlash2Config, dtype: torch.dtype = torch.bfloat16) -> dict:
    return {**dflash_export.to_hf_config(cfg, dtype), "architectures": [ARCHITECTURE],
            **{k: getattr(cfg, k) for k in KEYS}, "sample_from_anchor": bool(cfg.sample_from_anchor),
            "sliding_window_non_causal": bool(cfg.sliding_window_non_causal), "draft_vocab_size": cfg.vocab_size}


def from_hf_config(d: Mapping) -> DFlash2Config:
    if ARCHITECTURE not in (d.get("architectures") or []):
        raise ValueError(f"architectures={d.get('architectures')}: expected [{ARCHITECTURE!r}]")
    problems = [f"{k} is missing" for k in KEYS if k not in d]
    if d.get("draft_vocab_size") not in (None, d.get("vocab_size")):
        problems.append(f"draft_vocab_size={d['draft_vocab_size']} != vocab_size={d.get('vocab_size')} "
                        "(DFlash2 drafts over the target's whole vocabulary)")
    if problems:
        raise ValueError("; ".join(problems))
    base = dflash_export.from_hf_config({**d, "architectures": [dflash_export.ARCHITECTURE]})
    return DFlash2Config(**{f.name: getattr(base, f.name) for f in fields(base)}, **{k: int(d[k]) for k in KEYS},
                         sample_from_anchor=bool(d.get("sample_from_anchor", False)),
                         sliding_window_non_causal=bool(d.get("sliding_window_non_causal", True)))


def tokens_per_round(d: Mapping) -> int:
    """Tokens one block drafts: block_size anchor-first, block_size - 1 otherwise."""
    return from_hf_config(d).drafts_per_block


def save_dflash2(draft: DFlash2Draft, out_dir, dtype: torch.dtype = torch.bfloat16) -> Path:
    return dflash_export.save_block_draft(draft, out_dir, to_hf_config(draft.config, dtype), dtype)


def load_dflash2(path, embed_VH: Optional[torch.Tensor] = None, lm_head_VH: Optional[torch.Tensor] = None,
                 dtype: torch.dtype = torch.float32) -> DFlash2Draft:
    """Rebuild the draft from a folder; pass the target's embedding and lm_head to make it usable."""
    return dflash_export.load_block_draft(path, lambda d: DFlash2Draft(from_hf_config(d)), embed_VH, lm_head_VH,
                                          dtype)


def check_checkpoint(draft_dir) -> tuple[dict, None]:
    """(config.json, None) of a valid DFlash2 checkpoint: every tensor present and shaped as its config
    says, the mask token set; one ValueError naming what is wrong."""
    return check_block_checkpoint(draft_dir, from_hf_config, DFlash2Draft, ARCHITECTURE, "dflash2",
                                  "every block is drafted from it")
