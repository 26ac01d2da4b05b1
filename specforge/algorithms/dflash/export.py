"""Save / load a DFlash draft in the public format (z-lab's ``DFlashDraftModel``).

That format is what z-lab's ``dflash`` package, SpecForge (``configs/*-dflash.json``), SGLang and
llama.cpp's converter (``conversion/qwen.py`` ``DFlashModel``, with ``--target-model-dir``) read:

* ``config.json``: a Qwen3 config of the DRAFT (``model_type`` "qwen3", its own
  ``num_hidden_layers``; ``hidden_size`` and ``vocab_size`` equal the target's) plus
  ``architectures: ["DFlashDraftModel"]``, top-level ``block_size``, ``num_target_layers`` and
  ``dflash_config: {mask_token_id, target_layer_ids}`` (layer OUTPUT ids: HF
  ``hidden_states[i + 1]``; llama.cpp writes ``i + 1`` as its extract layers and refuses a draft
  without them).
* ``model.safetensors``: ``fc.weight``, ``hidden_norm.weight``, ``norm.weight`` and
  ``layers.{i}.{self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, mlp.{gate,up,down}_proj,
  input_layernorm, post_attention_layernorm}.weight``. No embedding, no ``lm_head``: both come
  from the target at load time.

Sliding window (``draft.sliding_window`` = W): every engine that reads one
counts it from the query's position (row at position q sees keys p with q - p < W: vLLM
``qwen3_dflash._resolve_layer_attention`` -> per-layer sliding window, llama.cpp
``LLAMA_SWA_TYPE_STANDARD`` via the converter's ``use_sliding_window`` + ``sliding_window`` +
``layer_types``, z-lab's ``_attention_mask``), as our training mask does. The config says it as
``layer_types`` all ``sliding_attention``, ``sliding_window`` W, ``use_sliding_window`` true and
``is_causal`` false: a sliding layer is causal by default in vLLM and z-lab's model unless
``is_causal`` says otherwise, and llama.cpp's converter writes ``is_causal`` into the GGUF. SGLang
(``sglang/srt/models/dflash.py``) makes every ``sliding_attention`` layer causal DECODER attention and
never reads ``is_causal``: it would serve another model, so its export is refused.

No draft vocabulary: the format has no ``d2t`` (llama.cpp reads one only for its DSpark family),
so the draft's logits are the target's full vocabulary.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch
from safetensors.torch import save_file

from specforge.engines import sglang
from specforge.engines.vllm import quiet_speculators
from specforge.files import open_safetensors, read_safetensors
from specforge.training.checkpoint import load_draft_folder

from .model import DFlashConfig, DFlashDraft

__all__ = ["ARCHITECTURE", "to_hf_config", "from_hf_config", "save_dflash", "load_dflash", "check_checkpoint", "export",
           "llamacpp_config", "tokens_per_round"]

ARCHITECTURE = "DFlashDraftModel"


def _window_keys(cfg: DFlashConfig) -> dict:
    """The sliding window as the engines read it (the module docstring): every layer a
    ``sliding_attention`` layer of ``sliding_window`` tokens, made non-causal by ``is_causal``."""
    n, w = cfg.num_hidden_layers, cfg.sliding_window
    if w is None:
        return {"layer_types": ["full_attention"] * n, "max_window_layers": n, "sliding_window": None,
                "use_sliding_window": False}
    return {"layer_types": ["sliding_attention"] * n, "max_window_layers": 0, "sliding_window": w,
            "use_sliding_window": True, "is_causal": False}


def to_hf_config(cfg: DFlashConfig, dtype: torch.dtype = torch.bfloat16) -> dict:
    n = cfg.num_hidden_layers
    dtype_name = str(dtype).removeprefix("torch.")
    return {**{
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": cfg.block_size,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)},
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "num_attention_heads": cfg.num_attention_heads,
        "num_hidden_layers": n,
        "num_key_value_heads": cfg.num_key_value_heads,
        "num_target_layers": cfg.num_target_layers,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": cfg.vocab_size,
    }, **_window_keys(cfg)}


def from_hf_config(d: Mapping) -> DFlashConfig:
    if ARCHITECTURE not in d.get("architectures", []):
        raise ValueError(f"architectures={d.get('architectures')}: expected [{ARCHITECTURE!r}]")
    extra = d.get("dflash_config") or {}
    unsupported = [k for k in ("use_swa", "causal", "conv_kernel_size", "output_multiplier",
                               "final_logit_softcapping", "input_embedding_scale") if extra.get(k)]
    if d.get("is_causal") or d.get("rope_scaling") or unsupported:
        raise ValueError(f"DFlash config uses features this draft does not implement: "
                         f"{unsupported or 'causal / rope_scaling'}")
    window = None
    if d.get("use_sliding_window"):  # ours (_window_keys): every layer sliding, explicitly non-causal
        if set(d.get("layer_types") or ()) != {"sliding_attention"} or d.get("is_causal") is not False:
            raise ValueError("DFlash config uses features this draft does not implement: a sliding window other than "
                             "every layer 'sliding_attention' with is_causal false (mixed or causal sliding layers)")
        window = d["sliding_window"]
    theta = d.get("rope_theta") or (d.get("rope_parameters") or {}).get("rope_theta")
    heads = d["num_attention_heads"]
    return DFlashConfig(
        hidden_size=d["hidden_size"], num_hidden_layers=d["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=d.get("num_key_value_heads", heads),
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        intermediate_size=d["intermediate_size"], rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=theta, max_position_embeddings=d.get("max_position_embeddings", 8192),
        vocab_size=d["vocab_size"], num_target_layers=d["num_target_layers"],
        target_layer_ids=list(extra.get("target_layer_ids") or d.get("target_layer_ids") or []),
        block_size=extra.get("block_size") or d.get("block_size") or 16,
        mask_token_id=extra.get("mask_token_id", d.get("mask_token_id")), sliding_window=window)


def tokens_per_round(d: Mapping) -> int:
    """Tokens a DFlash draft (its config.json) drafts a round: one block, the anchor + block_size - 1 masks."""
    return from_hf_config(d).block_size - 1


def save_block_draft(draft: torch.nn.Module, out_dir, hf_config: dict, dtype: torch.dtype) -> Path:
    """A block draft's served tensors (``export_state_dict``) in ``dtype`` and its ``hf_config``
    into ``out_dir``; DFlash's and DSpark's folders are written by this one function."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to("cpu", dtype).contiguous() for k, v in draft.export_state_dict().items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    return out


def load_block_draft(path, build: Callable[[dict], torch.nn.Module], embed_VH: Optional[torch.Tensor] = None,
                     lm_head_VH: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """``build(config.json)`` with the folder's tensors loaded (every one but the target's embedding
    and lm_head, which ``embed_VH`` / ``lm_head_VH`` set when given)."""
    p = Path(path)
    draft = build(json.loads((p / "config.json").read_text())).to(dtype)
    weights = read_safetensors(p / "model.safetensors", "DFlash draft file", "give a complete draft folder")
    missing, unexpected = draft.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.startswith(("embed_tokens.", "lm_head."))]
    if missing or unexpected:
        raise ValueError(f"{p / 'model.safetensors'}: missing {missing}, unexpected {unexpected}")
    if embed_VH is not None and lm_head_VH is not None:
        draft.set_target_weights(embed_VH, lm_head_VH)
    return draft


def save_dflash(draft: DFlashDraft, out_dir, dtype: torch.dtype = torch.bfloat16) -> Path:
    return save_block_draft(draft, out_dir, to_hf_config(draft.config, dtype), dtype)


def load_dflash(path, embed_VH: Optional[torch.Tensor] = None, lm_head_VH: Optional[torch.Tensor] = None,
                dtype: torch.dtype = torch.float32) -> DFlashDraft:
    """Rebuild the draft from a folder; pass the target's embedding and lm_head to make it usable."""
    return load_block_draft(path, lambda d: DFlashDraft(from_hf_config(d)), embed_VH, lm_head_VH, dtype)


def check_checkpoint(draft_dir) -> tuple[dict, None]:
    """(config.json, None) of a valid DFlash checkpoint (our export's format): every tensor of the
    model present and shaped as its config says, the mask token set; a ValueError naming what is wrong."""
    return check_block_checkpoint(draft_dir, from_hf_config, DFlashDraft, ARCHITECTURE, "dflash",
                                  "every engine drafts with it")


@dataclass(frozen=True)
class BlockFormat:
    """A block draft's saved folder, as the family's algorithm hooks (``DFlash.saved``) use it: each
    member of the family names its own export module's functions here."""

    to_hf_config: Callable[..., dict]  # (draft config, dtype) -> config.json
    check_checkpoint: Callable[..., tuple]  # (folder) -> (config.json, None); a ValueError naming what is wrong
    load: Callable[..., torch.nn.Module]  # (folder, embed_VH, lm_head_VH) -> the draft
    tokens_per_round: Callable[[Mapping], int]  # (config.json) -> tokens one block drafts


FORMAT = BlockFormat(to_hf_config, check_checkpoint, load_dflash, tokens_per_round)


def check_block_checkpoint(draft_dir, parse, model_cls, architecture: str, algorithm: str,
                           mask_use: str) -> tuple[dict, None]:
    """The check of a block draft's folder (DFlash and its refinements): ``parse`` reads config.json
    into the model config, ``model_cls`` (built on meta) says which tensors and shapes must be there."""

    draft_dir = Path(draft_dir)
    config, _ = load_draft_folder(draft_dir)  # a missing or truncated file is named, as for every checkpoint
    try:
        cfg = parse(config)
        if cfg.mask_token_id is None:
            raise ValueError(f"dflash_config.mask_token_id is missing ({mask_use})")
        with torch.device("meta"):
            want = {k: tuple(v.shape) for k, v in model_cls(cfg).export_state_dict().items()}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"draft {str(draft_dir)!r} is not a valid {architecture} checkpoint: {e}") from None
    with open_safetensors(draft_dir / "model.safetensors", "draft checkpoint file",
                          "use another checkpoint folder") as st:
        got = {k: tuple(st.get_slice(k).get_shape()) for k in st.keys()}
    bad = sorted(k for k in want if got.get(k) != want[k]) + sorted(k for k in got if k not in want)
    if bad:
        raise ValueError(f"draft {str(draft_dir)!r} is not a valid {architecture} checkpoint: tensors missing, "
                         f"misshapen or unexpected: {bad[:8]}. Export a checkpoint written by specforge training "
                         f"with draft.algorithm={algorithm} (a step-* folder)")
    return config, None


def export(engine: str, draft_dir: Path, out_dir: Path, req) -> str:
    """SGLang (``--speculative-algorithm DFLASH``) and vLLM (``"method": "dflash"``) both serve z-lab's
    folder as it is: config.json and model.safetensors, copied (checked by :func:`check_checkpoint`).
    A draft with a sliding window is refused for SGLang (the module docstring)."""
    w = json.loads((Path(draft_dir) / "config.json").read_text()).get("sliding_window")
    if engine == "sglang" and w is not None:
        raise ValueError(f"draft.sliding_window={w}: SGLang serves a DFlash draft's sliding_attention layers as causal "
                         "attention (AttentionType.DECODER, is_causal ignored), not the bidirectional block this draft "
                         "was trained with; export it for vllm or llama.cpp, or train with draft.sliding_window=null")
    sglang.copy_served(draft_dir, out_dir)
    if engine == "sglang":
        return (f"python -m sglang.launch_server --model-path {req.target or '<target>'} --speculative-algorithm "
                f"DFLASH --speculative-draft-model-path {req.out}")
    n = req.num_speculative_tokens or tokens_per_round(json.loads((Path(draft_dir) / "config.json").read_text()))
    return (f"vllm serve {req.target} --speculative-config '{{\"method\": \"dflash\", \"model\": "
            f"\"{req.out}\", \"num_speculative_tokens\": {n}}}'")


def llamacpp_config(draft_config: dict, target_config: dict, layer_ids=None) -> dict:
    """The config.json llama.cpp's converter reads: ``dflash_config.target_layer_ids`` as layer
    OUTPUTS (ours: the converter adds 1 itself, ``DFlashModel.set_gguf_parameters``); ``layer_ids``
    overrides them."""
    dflash = dict(draft_config.get("dflash_config") or {})
    if layer_ids is not None:
        dflash["target_layer_ids"] = [int(i) for i in layer_ids]
    return {**draft_config, "dflash_config": dflash}


# ---------------------------------------------------------------- speculators' format (vLLM), for the family

# keys of a block draft's config.json that are not its draft layer's (Qwen3) config
NOT_LAYER_KEYS = frozenset({"architectures", "auto_map", "block_size", "dflash_config", "num_target_layers",
                            "draft_vocab_size", "sample_from_anchor", "sliding_window_non_causal"})


@dataclass(frozen=True)
class SpeculatorsFormat:
    """How a block draft is written in speculators' format for vLLM (DFlash2's, DSpark's): speculators'
    config class (``config_class()``, imported when used), the architecture vLLM builds, vLLM's
    ``--speculative-config`` method, the algorithm's own keys (``keys``: config.json key -> the value
    written) and the layer-config keys to leave out besides ``NOT_LAYER_KEYS``."""

    algorithm: str  # speculators_model_type
    config_class: Callable[[], type]
    architectures: tuple[str, ...]
    method: str
    keys: Callable[[Mapping], dict]  # our config.json -> the algorithm's keys of speculators' config
    not_layer: frozenset = frozenset()


def speculators_layer_ids(ours) -> list[int]:
    """Our layer OUTPUT ids -> speculators' and vLLM's "after k layers" ids (the one bridge: + 1)."""
    return [int(i) + 1 for i in ours]


def speculators_config(fmt: SpeculatorsFormat, hf_config: Mapping, target: str, target_architectures: list[str],
                       speculative_tokens: int):
    """speculators' config (``fmt.config_class``) of a block draft's config.json (ours)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig  # lazy: optional (speculators)
    from speculators.proposals.greedy import GreedyTokenProposalConfig  # lazy: optional (speculators)

    cfg = from_hf_config({**hf_config, "architectures": [ARCHITECTURE]})
    layer = {k: v for k, v in hf_config.items() if k not in NOT_LAYER_KEYS | fmt.not_layer}
    return fmt.config_class()(
        transformer_layer_config=layer, draft_vocab_size=cfg.vocab_size, block_size=cfg.block_size,
        aux_hidden_state_layer_ids=speculators_layer_ids(cfg.target_layer_ids), mask_token_id=cfg.mask_token_id,
        # always true: our blocks are bidirectional; false would make vLLM's layers causal (its update_dflash
        # writes dflash_config.causal = not this) wherever the layer config sets no is_causal (unwindowed drafts)
        sliding_window_non_causal=True, architectures=list(fmt.architectures), **fmt.keys(hf_config),
        speculators_config=SpeculatorsConfig(
            algorithm=fmt.algorithm, default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=str(target), architectures=list(target_architectures)),
            proposal_methods=[GreedyTokenProposalConfig(proposal_type="greedy",
                                                        speculative_tokens=int(speculative_tokens))]))


def export_speculators(fmt: SpeculatorsFormat, draft_dir, out_dir, hf_config: Mapping, target: str,
                       target_architectures: list[str], speculative_tokens: int) -> Path:
    """Write speculators' folder of a (validated) block draft into ``out_dir``: the config by speculators'
    own class, our tensors copied (their names are speculators'); then reread it (``check_speculators``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with quiet_speculators():
        speculators_config(fmt, hf_config, target, target_architectures, speculative_tokens).save_pretrained(str(out))
    shutil.copyfile(Path(draft_dir) / "model.safetensors", out / "model.safetensors")
    check_speculators(fmt, out, hf_config, speculative_tokens)
    return out


def check_speculators(fmt: SpeculatorsFormat, out: Path, hf_config: Mapping, speculative_tokens: int) -> None:
    """Reread ``out``'s config.json with speculators' config class: what vLLM reads, as ours says."""
    cfg = from_hf_config({**hf_config, "architectures": [ARCHITECTURE]})
    theirs = fmt.config_class().from_pretrained(str(out))
    layer = theirs.transformer_layer_config
    want = {"speculators_model_type": fmt.algorithm, "architectures": list(fmt.architectures),
            "aux_hidden_state_layer_ids": speculators_layer_ids(cfg.target_layer_ids),
            "mask_token_id": cfg.mask_token_id, "block_size": cfg.block_size, "draft_vocab_size": cfg.vocab_size,
            "sliding_window_non_causal": True, **fmt.keys(hf_config)}
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
        raise ValueError(f"the {fmt.algorithm} export {str(out)!r} was written wrongly: " + "; ".join(errors))


def speculators_serve_command(fmt: SpeculatorsFormat, target: Any, out: Path, n: int) -> str:
    return (f"vllm serve {target} --speculative-config '{{\"method\": \"{fmt.method}\", \"model\": \"{out}\", "
            f"\"num_speculative_tokens\": {n}}}'")


def target_architectures(target_config) -> list[str]:
    """The ``architectures`` of a target's config (a transformers config or its dict)."""
    tc = target_config
    return list(getattr(tc, "architectures", None) or (tc.get("architectures") if isinstance(tc, dict) else None)
                or [])
