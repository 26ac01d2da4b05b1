"""Save / load an MTP draft. Our folder IS speculators' format (what speculators'
``MTPDraftModel.from_pretrained`` loads; vLLM 0.32 does not read it: ``algorithm.NO_ENGINE``):
config.json with ``speculators_model_type: mtp``,
``architectures: ["MTPDraftModel"]``, ``num_nextn_predict_layers: 1``, a Qwen3
``transformer_layer_config`` of the draft's sizes (``num_hidden_layers``: the target's, whose last
hidden state it reads) and ``speculators_config`` (greedy proposals of ``num_speculative_steps`` tokens,
the verifier); tensors ``mtp_layers.0.*`` (no embedding, no lm_head: the verifier's).

:func:`export` writes the folder with the verifier named (the target's path and architectures), as
speculators' loader wants it; no engine here serves it, so the export CLI does not offer it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Mapping, Optional

import torch
from safetensors.torch import save_file

from specforge.files import open_safetensors, read_safetensors
from specforge.training.checkpoint import load_draft_folder

from .model import MTPConfig, MTPDraft

__all__ = ["ARCHITECTURE", "to_hf_config", "from_hf_config", "save_mtp", "load_mtp", "check_checkpoint", "export",
           "tokens_per_round"]

ARCHITECTURE = "MTPDraftModel"
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def to_hf_config(cfg: MTPConfig, dtype: torch.dtype = torch.bfloat16,
                 verifier: Optional[dict] = None) -> dict:
    rope = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
    layer = {"model_type": "qwen3", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
             "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_target_layers,
             "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
             "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_parameters": rope,
             "max_position_embeddings": cfg.max_position_embeddings, "hidden_act": "silu", "attention_bias": False,
             "tie_word_embeddings": False}
    proposal = {"proposal_type": "greedy", "speculative_tokens": cfg.num_speculative_steps, "accept_tolerance": 0.0,
                "verifier_accept_k": 1}
    return {"architectures": [ARCHITECTURE], "speculators_model_type": "mtp", "speculators_version": "0.9.0",
            "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": _DTYPES[dtype],
            "transformer_layer_config": layer,
            "speculators_config": {"algorithm": "mtp", "default_proposal_method": "greedy",
                                   "proposal_methods": [proposal],
                                   "verifier": verifier or {"name_or_path": None, "architectures": []}}}


def from_hf_config(d: Mapping, target_norm_eps: Optional[float] = None) -> MTPConfig:
    if ARCHITECTURE not in (d.get("architectures") or []) or d.get("speculators_model_type") != "mtp":
        raise ValueError(f"architectures={d.get('architectures')}, speculators_model_type="
                         f"{d.get('speculators_model_type')!r}: expected [{ARCHITECTURE!r}] and 'mtp'")
    if d.get("num_nextn_predict_layers", 1) != 1:
        raise ValueError(f"num_nextn_predict_layers={d['num_nextn_predict_layers']}: one MTP layer is supported")
    layer = d.get("transformer_layer_config")
    if not isinstance(layer, Mapping):
        raise ValueError("transformer_layer_config is missing")
    if layer.get("model_type", "qwen3") != "qwen3":
        raise ValueError(f"transformer_layer_config.model_type={layer['model_type']!r}: the draft's layer is a "
                         "Qwen3 layer (qwen3)")
    return MTPConfig.from_target(layer, num_speculative_steps=tokens_per_round(d),
                                 target_norm_eps=target_norm_eps or layer.get("rms_norm_eps"))


def tokens_per_round(d: Mapping) -> int:
    """The greedy proposal's ``speculative_tokens`` (= the steps the draft was trained on)."""
    try:
        return int(d["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
    except (KeyError, IndexError, TypeError):
        raise ValueError("speculators_config.proposal_methods[0].speculative_tokens is missing") from None


def save_mtp(draft: MTPDraft, out_dir, dtype: torch.dtype = torch.bfloat16) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to("cpu", dtype).contiguous() for k, v in draft.export_state_dict().items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(to_hf_config(draft.config, dtype), indent=2))
    return out


def load_mtp(path, target=None, dtype: torch.dtype = torch.float32) -> MTPDraft:
    """The draft of a folder; with ``target`` (a ``TargetModel``) its frozen parts are the target's."""
    p = Path(path)
    eps = None if target is None else getattr(target.config, "rms_norm_eps", None)
    draft = MTPDraft(from_hf_config(json.loads((p / "config.json").read_text()), eps)).to(dtype)
    weights = read_safetensors(p / "model.safetensors", "MTP draft file", "give a complete draft folder")
    missing, unexpected = draft.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.startswith(MTPDraft.FROZEN)]
    if missing or unexpected:
        raise ValueError(f"{p / 'model.safetensors'}: missing {missing}, unexpected {unexpected}")
    if target is not None:
        draft.set_target_weights(target.embed_weight_VH, target.lm_head_weight_VH, target.final_norm_scale_H)
    return draft


def check_checkpoint(draft_dir) -> tuple[dict, None]:
    """(config.json, None) of a valid MTP folder: every tensor present and shaped as its config says."""
    draft_dir = Path(draft_dir)
    config, _ = load_draft_folder(draft_dir)
    try:
        with torch.device("meta"):
            want = {k: tuple(v.shape) for k, v in MTPDraft(from_hf_config(config)).export_state_dict().items()}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"draft {str(draft_dir)!r} is not a valid {ARCHITECTURE} checkpoint: {e}") from None
    with open_safetensors(draft_dir / "model.safetensors", "draft checkpoint file",
                          "use another checkpoint folder") as st:
        got = {k: tuple(st.get_slice(k).get_shape()) for k in st.keys()}
    bad = sorted(k for k in want if got.get(k) != want[k]) + sorted(k for k in got if k not in want)
    if bad:
        raise ValueError(f"draft {str(draft_dir)!r} is not a valid {ARCHITECTURE} checkpoint: tensors missing, "
                         f"misshapen or unexpected: {bad[:8]}. Export a checkpoint written by specforge training "
                         "with draft.algorithm=mtp (a step-* folder)")
    return config, None


def export(engine: str, draft_dir: Path, out_dir: Path, req) -> str:
    """speculators' MTP folder (``engine`` "vllm": vLLM's library's format), its verifier named
    (``req.target``) and ``speculative_tokens`` set when asked; returns what loads it."""
    if engine != "vllm":
        raise ValueError(f"--engine {engine}: speculators' MTP folder is the only format written")
    config = json.loads((Path(draft_dir) / "config.json").read_text())
    tc = req.target_config
    arch = list(getattr(tc, "architectures", None) or (tc.get("architectures") if isinstance(tc, dict) else None)
                or [])
    spec = config["speculators_config"]
    spec["verifier"] = {"name_or_path": str(req.target), "architectures": arch}
    if req.num_speculative_tokens:
        spec["proposal_methods"][0]["speculative_tokens"] = int(req.num_speculative_tokens)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(draft_dir) / "model.safetensors", Path(out_dir) / "model.safetensors")
    (Path(out_dir) / "config.json").write_text(json.dumps(config, indent=2))
    return (f"speculators.models.mtp.MTPDraftModel.from_pretrained({str(req.out)!r})  # its verifier "
            f"({req.target}) named in config.json")
