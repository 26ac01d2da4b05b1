"""Save / load an XPress draft: DFlash's flat folder (:mod:`specforge.algorithms.dflash.export`: a
Qwen3 config of the draft with ``block_size``, ``num_target_layers`` and ``dflash_config:
{mask_token_id, target_layer_ids}``, layer OUTPUT ids) with ``architectures: ["XPressDraftModel"]``
and speculators' XPress keys: ``xpress_rank``, ``xpress_mlp_ratio``, ``num_jacobi_passes``,
``sample_from_anchor`` and ``draft_vocab_size`` (= ``vocab_size``: XPress drafts over the target's
whole vocabulary). Tensors: DFlash's, plus ``refiner_head.{token_embed.weight [V, r], down_h.weight,
down_g.weight [r, H], in_proj.weight [r, 3r], mix_l [r, K, K], mlp_gate.weight, mlp_up.weight
[m, r], mlp_down.weight [r, m], readout.weight [V, r]}`` (m = r x mlp ratio); no embedding, no
lm_head (the target's).

No engine serves this folder (``algorithm.NO_ENGINE``: vLLM, SGLang and llama.cpp have no XPress
model), so nothing exports it; ``python -m specforge.export`` refuses each engine in a line.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Mapping, Optional

import torch

from specforge.algorithms.dflash import export as dflash_export
from specforge.algorithms.dflash.export import check_block_checkpoint

from .model import XPressConfig, XPressDraft

__all__ = ["ARCHITECTURE", "to_hf_config", "from_hf_config", "save_xpress", "load_xpress", "check_checkpoint",
           "tokens_per_round"]

ARCHITECTURE = "XPressDraftModel"
KEYS = {"xpress_rank": "refiner_rank", "xpress_mlp_ratio": "refiner_mlp_ratio", "num_jacobi_passes": "jacobi_passes"}


def to_hf_config(cfg: XPressConfig, dtype: torch.dtype = torch.bfloat16) -> dict:
    return {**dflash_export.to_hf_config(cfg, dtype), "architectures": [ARCHITECTURE],
            **{k: getattr(cfg, ours) for k, ours in KEYS.items()}, "sample_from_anchor": bool(cfg.sample_from_anchor),
            "draft_vocab_size": cfg.vocab_size}


def from_hf_config(d: Mapping) -> XPressConfig:
    if ARCHITECTURE not in (d.get("architectures") or []):
        raise ValueError(f"architectures={d.get('architectures')}: expected [{ARCHITECTURE!r}]")
    problems = [f"{k} is missing" for k in KEYS if k not in d]
    if d.get("draft_vocab_size") not in (None, d.get("vocab_size")):
        problems.append(f"draft_vocab_size={d['draft_vocab_size']} != vocab_size={d.get('vocab_size')} "
                        "(XPress drafts over the target's whole vocabulary)")
    if problems:
        raise ValueError("; ".join(problems))
    base = dflash_export.from_hf_config({**d, "architectures": [dflash_export.ARCHITECTURE]})
    return XPressConfig(**{f.name: getattr(base, f.name) for f in fields(base)},
                        **{ours: int(d[k]) for k, ours in KEYS.items()},
                        sample_from_anchor=bool(d.get("sample_from_anchor", False)))


def tokens_per_round(d: Mapping) -> int:
    """Tokens one block drafts: block_size anchor-first, block_size - 1 otherwise."""
    return from_hf_config(d).drafts_per_block


def save_xpress(draft: XPressDraft, out_dir, dtype: torch.dtype = torch.bfloat16) -> Path:
    return dflash_export.save_block_draft(draft, out_dir, to_hf_config(draft.config, dtype), dtype)


def load_xpress(path, embed_VH: Optional[torch.Tensor] = None, lm_head_VH: Optional[torch.Tensor] = None,
                dtype: torch.dtype = torch.float32) -> XPressDraft:
    """Rebuild the draft from a folder; pass the target's embedding and lm_head to make it usable."""
    return dflash_export.load_block_draft(path, lambda d: XPressDraft(from_hf_config(d)), embed_VH, lm_head_VH,
                                          dtype)


def check_checkpoint(draft_dir) -> tuple[dict, None]:
    """(config.json, None) of a valid XPress checkpoint: every tensor present and shaped as its config
    says, the mask token set; one ValueError naming what is wrong."""
    return check_block_checkpoint(draft_dir, from_hf_config, XPressDraft, ARCHITECTURE, "xpress",
                                  "every block is drafted from it")


FORMAT = dflash_export.BlockFormat(to_hf_config, check_checkpoint, load_xpress, tokens_per_round)