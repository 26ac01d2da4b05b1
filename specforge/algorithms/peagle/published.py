"""A published P-EAGLE folder read back as ours (``draft.init_from``): our folder as EAGLE-3's reader
reads it, or speculators' P-EAGLE format (``speculators_model_type: peagle``, what ``--engine vllm``
writes: ``export.py``), whose names are mapped back:

    embed_tokens.weight [V, H]    row mask_token_id -> our mask_embed [H] (the rest is the target's)
    mask_hidden [1, 1, 3H]        -> our mask_hidden [3H]
    layers.0.*                    -> our midlayer.*
and the layer ids "after k layers" -> ours (k - 1); its config read with speculators' own class.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specforge.algorithms.eagle3 import published as eagle3_published
from specforge.algorithms.eagle3.export import read_written
from specforge.algorithms.eagle3.published import window_keys
from specforge.algorithms.peagle.model import ARCHITECTURE
from specforge.engines.vllm import quiet_speculators


def is_speculators(hf_config: dict) -> bool:
    return hf_config.get("speculators_model_type") == "peagle"


def read_published(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    if not is_speculators(json.loads((Path(path) / "config.json").read_text())):
        return eagle3_published.read_published(path)
    from speculators.models.peagle import PEagleSpeculatorConfig  # lazy: optional (speculators)

    with quiet_speculators():
        spec = PEagleSpeculatorConfig.from_pretrained(str(path))
    layer, M = spec.transformer_layer_config, int(spec.mask_token_id)
    hf_config = {"architectures": [ARCHITECTURE], "hidden_size": layer.hidden_size, "vocab_size": layer.vocab_size,
                 "draft_vocab_size": spec.draft_vocab_size, "num_hidden_layers": 1,
                 "eagle_config": {
                     "eagle_aux_hidden_state_layer_ids": [int(k) - 1 for k in spec.eagle_aux_hidden_state_layer_ids]},
                 "peagle_config": {"mask_token_id": M}, "rms_norm_eps": layer.rms_norm_eps,
                 "rope_theta": (getattr(layer, "rope_parameters", None) or {}).get("rope_theta"),
                 **window_keys(layer)}
    weights = read_written(path)
    out = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in weights.items()
           if k not in ("embed_tokens.weight", "mask_hidden")}
    if "embed_tokens.weight" in weights:
        out["mask_embed"] = weights["embed_tokens.weight"][M]
    if "mask_hidden" in weights:
        out["mask_hidden"] = weights["mask_hidden"].reshape(-1)
    return hf_config, eagle3_published.vocab_tensors(hf_config, out)
