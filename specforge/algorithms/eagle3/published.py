"""Published EAGLE-3 folders read back as our saved format (``draft.init_from``): only names are mapped.

* Ours / SGLang (``LlamaForCausalLMEagle3``): our keys as saved. A folder written by upstream
  SpecForge may prefix names with ``model.``, carry the target's embedding (``embed_tokens.weight``,
  frozen: the run takes it from its target), hold ``t2d`` as another dtype or lack it (derived from
  ``d2t``).
* speculators / vLLM (``speculators_model_type: eagle3``, what ``--engine vllm`` writes): the
  decoder layer is ``layers.0.*`` (ours ``midlayer.*``), the layer ids count "after k layers" (ours
  = theirs - 1); its config is read with speculators' own ``Eagle3SpeculatorConfig``. EAGLE-3.1's
  norm flags travel as they are (``eagle31`` claims a folder with one set).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specforge.algorithms.eagle3.export import ARCHITECTURE, read_written
from specforge.engines.vllm import quiet_speculators

FLAGS = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")  # speculators' keys = ours


def is_speculators(hf_config: dict) -> bool:
    return hf_config.get("speculators_model_type") == "eagle3"


def as_ours(hf_config: dict) -> dict:
    """The fields of a speculators config.json that say whose it is, named as our config.json."""
    return {"architectures": [ARCHITECTURE], **{f: bool(hf_config.get(f)) for f in FLAGS}}


def read_published(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    hf_config = json.loads((Path(path) / "config.json").read_text())
    weights = read_written(path)
    if is_speculators(hf_config):
        hf_config = from_speculators(path)
        weights = {"midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k: v
                   for k, v in weights.items()}
    else:
        weights = {k[len("model."):] if k.startswith("model.") else k: v for k, v in weights.items()}
    return hf_config, vocab_tensors(hf_config, frozen_embedding_dropped(hf_config, weights))


def from_speculators(path: Path) -> dict:
    """Our config.json's fields of a speculators export (sizes, vocabularies, layer ids, flags)."""
    from speculators.models.eagle3 import Eagle3SpeculatorConfig  # lazy: optional (speculators)

    with quiet_speculators():
        spec = Eagle3SpeculatorConfig.from_pretrained(str(path))
    layer = spec.transformer_layer_config
    ids = [int(k) - 1 for k in (spec.eagle_aux_hidden_state_layer_ids or [])]
    out = {"architectures": [ARCHITECTURE], "hidden_size": layer.hidden_size, "vocab_size": layer.vocab_size,
           "draft_vocab_size": spec.draft_vocab_size, "target_hidden_size": spec.target_hidden_size,
           "num_hidden_layers": 1, "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids},
           "rms_norm_eps": layer.rms_norm_eps,
           "rope_theta": (getattr(layer, "rope_parameters", None) or {}).get("rope_theta"),
           **window_keys(layer)}
    return {**out, **{f: bool(getattr(spec, f, False)) for f in FLAGS}}


def window_keys(layer) -> dict:
    """The sliding-window keys of speculators' transformer layer config (what its export sets)."""
    return {k: getattr(layer, k, None) for k in ("sliding_window", "layer_types", "use_sliding_window")}


def frozen_embedding_dropped(hf_config: dict, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Without a hidden size of its own the draft's embedding is the target's (frozen, not ours to load)."""
    own = hf_config.get("target_hidden_size") not in (None, hf_config.get("hidden_size"))
    return weights if own else {k: v for k, v in weights.items() if k != "embed_tokens.weight"}


def vocab_tensors(hf_config: dict, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``d2t`` as int64 offsets, ``t2d`` as bool[V] (derived from d2t when the folder lacks it)."""
    out = dict(weights)
    if "d2t" in out:
        out["d2t"] = out["d2t"].to(torch.int64)
        if "t2d" not in out and isinstance(hf_config.get("vocab_size"), int):
            dev = out["d2t"].device
            t2d = torch.zeros(hf_config["vocab_size"], dtype=torch.bool, device=dev)
            ids = torch.arange(out["d2t"].numel(), device=dev) + out["d2t"]
            t2d[ids[(ids >= 0) & (ids < t2d.numel())]] = True
            out["t2d"] = t2d
    if "t2d" in out:
        out["t2d"] = out["t2d"].to(torch.bool)
    return out
