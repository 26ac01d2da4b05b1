"""vLLM's contract: the ``speculators`` format (``speculators_model_type: eagle3``).

    config.json          speculators_model_type "eagle3", architectures ["Eagle3Speculator"],
                         transformer_layer_config (a 1-layer LlamaConfig dict: the draft's shape,
                         vocab_size = the TARGET vocab, rope, dtype), draft_vocab_size,
                         norm_before_residual false, target_hidden_size (if it differs),
                         eagle_aux_hidden_state_layer_ids ("after k layers"), speculators_config
                         {algorithm, proposal_methods [greedy, speculative_tokens], verifier
                         {name_or_path, architectures}}
    model.safetensors    fc.weight, layers.0.* (our midlayer.*), norm.weight, lm_head.weight,
                         d2t, t2d (+ embed_tokens.weight when the draft has its own); same dtype

Facts this code depends on, read at the sources (tests/test_export.py checks them by loading the
export with ``speculators.models.eagle3.Eagle3DraftModel`` and comparing logits with ours):
* Layer ids. vLLM's targets capture ``hidden_states + residual`` at the INPUT of each layer in
  ``eagle_aux_hidden_state_layer_ids`` (``vllm/model_executor/models/llama.py``), i.e. "after k
  layers"; default (2, L // 2, L - 3). Our ids (SGLang's) are layer OUTPUTS: ours k = theirs k + 1.
  The default [1, L/2-1, L-4] thus becomes [2, L/2, L-3], the same physical layers.
* ``norm_before_residual``: vLLM's ``update_eagle3`` (``transformers_utils/configs/speculators/
  algos.py``) defaults it to TRUE when absent; our layer keeps the un-normed hidden as the
  residual, so the key is always written, false.
* d2t holds offsets (vLLM ``llama_eagle3.py`` ``compute_logits``: target = arange + d2t), as ours;
  t2d is skipped by vLLM and read by speculators; the embedding comes from the verifier.
* speculators' converter ignores ``eagle_config``; its ids are top-level keys.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import save_file

from specforge.engines.sglang import check_checkpoint

DEFAULT_SPECULATIVE_TOKENS = 3  # speculators' converter default; vLLM's --speculative-config overrides it


def speculators_layer_ids(sglang_ids: list[int]) -> list[int]:
    """Our (SGLang) layer-output ids -> speculators/vLLM "after k layers" ids."""
    return [int(k) + 1 for k in sglang_ids]


def transformer_layer_config(hf_config: dict) -> dict:
    """The draft's decoder layer as a LlamaConfig dict (read by transformers 4 and 5 alike)."""
    rope = {"rope_type": "default", "rope_theta": hf_config["rope_theta"]}
    if hf_config.get("rope_scaling"):
        rope = {**hf_config["rope_scaling"], "rope_theta": hf_config["rope_theta"]}
    d = {key: hf_config[key] for key in (
        "hidden_size", "intermediate_size", "num_attention_heads", "rms_norm_eps", "max_position_embeddings",
        "vocab_size")}
    d["num_key_value_heads"] = hf_config.get("num_key_value_heads") or d["num_attention_heads"]
    d["head_dim"] = hf_config.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    d["bos_token_id"], d["eos_token_id"] = hf_config.get("bos_token_id"), hf_config.get("eos_token_id")
    return {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], **d,
        "num_hidden_layers": 1, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "rope_theta": hf_config["rope_theta"],
        "rope_scaling": hf_config.get("rope_scaling"), "rope_parameters": rope,
        "torch_dtype": hf_config["torch_dtype"], "dtype": hf_config["torch_dtype"],
    }


def speculators_config(hf_config: dict, verifier: str, verifier_architectures: list[str],
                       speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS) -> dict:
    """config.json of the speculators format from our config.json."""
    d: dict[str, Any] = {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": transformer_layer_config(hf_config),
        "draft_vocab_size": hf_config["draft_vocab_size"],
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "eagle_aux_hidden_state_layer_ids": speculators_layer_ids(
            hf_config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens)}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
        "torch_dtype": hf_config["torch_dtype"],
    }
    if hf_config.get("target_hidden_size", hf_config["hidden_size"]) != hf_config["hidden_size"]:
        d["target_hidden_size"] = hf_config["target_hidden_size"]
    return d


def speculators_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our keys -> speculators keys: ``midlayer.`` becomes ``layers.0.``; the rest is unchanged."""
    return {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v.contiguous()
            for k, v in weights.items()}


def export(draft_dir: str | Path, out_dir: str | Path, target: str, target_config: Any,
           speculative_tokens: Optional[int] = None) -> Path:
    """Write the speculators-format draft into ``out_dir`` (which must exist). ``target`` is the
    verifier's HF folder or hub id (recorded as ``verifier.name_or_path``), ``target_config`` its
    transformers config (that it is the draft's target: ``specforge.compat``, checked by the CLI)."""
    if speculative_tokens is not None and speculative_tokens < 1:
        raise ValueError(f"--num-speculative-tokens is {speculative_tokens}, expected at least 1")
    hf_config, weights = check_checkpoint(draft_dir)
    archs = list(getattr(target_config, "architectures", None) or ["LlamaForCausalLM"])
    config = speculators_config(hf_config, target, archs, speculative_tokens or DEFAULT_SPECULATIVE_TOKENS)
    out = Path(out_dir)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    save_file(speculators_weights(weights), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
