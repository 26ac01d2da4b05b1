"""EAGLE-3's saved folder and what each engine serves of it.

The training output IS SGLang's format (``LlamaForCausalLMEagle3``)::

    config.json          architectures ["LlamaForCausalLMEagle3"], num_hidden_layers 1,
                         draft_vocab_size, tie_word_embeddings false, target_hidden_size (if it
                         differs), eagle_config.eagle_aux_hidden_state_layer_ids = target layer
                         OUTPUTS (SGLang captures the input of layer k + 1), torch_dtype
    model.safetensors    fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t (int64 offsets:
                         target = draft + d2t[draft]), t2d (bool[V]) (+ embed_tokens.weight when
                         the draft has its own embedding); floats in config.json's torch_dtype

SGLang's loader (``python/sglang/srt/models/llama_eagle3.py``) maps every name that matches no
parameter to nothing, silently: a checkpoint with a wrong key loads "fine" with a random weight.
So :func:`check_checkpoint` compares the file against the draft model's own export keys and
shapes (the model built on the meta device, no memory) and the vocab mapping against itself.
The same check is the gate of every engine's export (:func:`export`): each starts from a valid
checkpoint. vLLM's format is written by speculators' converter (``engines/vllm.py`` says what we
tell it), llama.cpp's GGUF by llama.cpp's converter on a staged copy (:func:`llamacpp_config`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from specforge.algorithms.eagle3.model import Eagle3Draft, Eagle3DraftConfig, window_of
from specforge.engines import sglang
from specforge.engines.vllm import quiet_speculators
from specforge.files import read_safetensors_folder
from specforge.training.checkpoint import load_draft_folder

ARCHITECTURE = "LlamaForCausalLMEagle3"
DEFAULT_SPECULATIVE_TOKENS = 3  # speculators' converter default; vLLM's --speculative-config overrides it


def expected_tensors(hf_config: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) the served file must hold, from the draft model itself."""
    cfg = Eagle3DraftConfig.from_hf_config(hf_config)
    with torch.device("meta"):
        draft = Eagle3Draft(cfg)
    dtype = getattr(torch, cfg.torch_dtype)
    return {k: (tuple(v.shape), dtype if v.is_floating_point() else v.dtype)
            for k, v in draft.export_state_dict().items()}


def config_errors(hf_config: dict) -> list[str]:
    """What in config.json SGLang would read wrongly (each entry names the key)."""
    errors = []
    if hf_config.get("architectures") != [ARCHITECTURE]:
        errors.append(f"architectures is {hf_config.get('architectures')!r}, expected [{ARCHITECTURE!r}]")
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size", "draft_vocab_size"):
        if not isinstance(hf_config.get(key), int):
            errors.append(f"{key} is {hf_config.get(key)!r}, expected an integer")
    if hf_config.get("num_hidden_layers") != 1:  # more layers = SGLang's additional_layers, not ours
        errors.append(f"num_hidden_layers is {hf_config.get('num_hidden_layers')!r}, expected 1")
    if hf_config.get("tie_word_embeddings"):  # tied: SGLang makes lm_head the (full-vocab) embedding
        errors.append("tie_word_embeddings is true, expected false (the draft has its own lm_head)")
    ids = (hf_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not (isinstance(ids, list) and len(ids) == 3 and all(isinstance(i, int) and i >= 0 for i in ids)):
        errors.append(f"eagle_config.eagle_aux_hidden_state_layer_ids is {ids!r}, expected 3 target layer ids")
    dtype = hf_config.get("torch_dtype")
    if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
        errors.append(f"torch_dtype is {dtype!r}, expected a torch dtype name such as 'bfloat16'")
    return errors


def tensor_errors(hf_config: dict, weights: dict[str, torch.Tensor],
                  want: Optional[dict[str, tuple[tuple[int, ...], torch.dtype]]] = None,
                  unexpected: str = " (SGLang would drop it silently)",
                  why: Optional[dict[str, str]] = None) -> list[str]:
    """Missing / unexpected keys, wrong shapes or dtypes, and an inconsistent vocab mapping.

    ``want`` (name -> shape, dtype; default EAGLE-3's ``expected_tensors``) lets a variant of the
    format (EAGLE-3.1's norms, P-EAGLE's mask embedding) check its own set with these rules;
    ``unexpected`` follows an extra key's name, ``why`` a missing key's (name -> reason)."""
    want = expected_tensors(hf_config) if want is None else want
    why = why or {}
    errors = [f"missing {k}" + (f" ({why[k]})" if k in why else "") for k in sorted(set(want) - set(weights))]
    errors += [f"unexpected {k}{unexpected}" for k in sorted(set(weights) - set(want))]
    for k in sorted(set(want) & set(weights)):
        shape, dtype = want[k]
        if tuple(weights[k].shape) != shape or weights[k].dtype != dtype:
            errors.append(f"{k} is {list(weights[k].shape)} {weights[k].dtype}, expected {list(shape)} {dtype}")
    if not errors:
        errors += vocab_errors(weights["d2t"], weights["t2d"])
    return errors


def vocab_errors(d2t: torch.Tensor, t2d: torch.Tensor) -> list[str]:
    """d2t (offsets) and t2d (mask) must describe the same N distinct target ids."""
    target_ids = torch.arange(d2t.numel(), device=d2t.device) + d2t
    if target_ids.min() < 0 or target_ids.max() >= t2d.numel():
        return [f"d2t maps draft ids outside the target vocab 0..{t2d.numel() - 1}"]
    if target_ids.unique().numel() != d2t.numel():
        return ["d2t maps two draft ids to the same target id"]
    if int(t2d.sum()) != d2t.numel() or not bool(t2d[target_ids].all()):
        return ["t2d does not mark exactly the target ids d2t maps to"]
    return []


def check_checkpoint(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, weights) of a valid draft checkpoint; a ValueError naming every problem."""
    hf_config, weights = load_draft_folder(path)
    errors = config_errors(hf_config)
    if not errors:
        errors = tensor_errors(hf_config, weights)
    if errors:
        raise ValueError(f"{str(path)!r} is not a valid {ARCHITECTURE} checkpoint: " + "; ".join(errors)
                         + ". Export a checkpoint written by specforge training (a step-* folder)")
    return hf_config, weights


def load_eagle3(path: str | Path, target=None):
    """An ``Eagle3Draft`` from a saved folder; the frozen embedding comes from ``target``
    (``specforge.algorithms.load_draft`` loads a draft of any algorithm)."""
    hf_config, weights = load_draft_folder(path)
    draft = Eagle3Draft(Eagle3DraftConfig.from_hf_config(hf_config))
    if target is not None and "embed_tokens.weight" not in weights:
        draft.init_embeddings_from_target(target.embed_weight_VH)
    elif "embed_tokens.weight" not in weights:
        raise ValueError(f"{str(path)!r} has no embedding: pass the target to take it from")
    draft.load_export_state_dict(weights)
    return draft.eval()


def speculators_layer_ids(sglang_ids: list[int]) -> list[int]:
    """Our (SGLang) layer-output ids -> speculators/vLLM "after k layers" ids."""
    return [int(k) + 1 for k in sglang_ids]


def export_vllm(draft_dir: str | Path, out_dir: str | Path, target: str, target_config: Any,
           speculative_tokens: Optional[int] = None) -> Path:
    """Convert the (validated) EAGLE-3 checkpoint into ``out_dir`` (which must exist) with
    speculators' converter. ``target`` is the verifier's HF folder or hub id (recorded as
    ``verifier.name_or_path``; the converter reads its config.json), ``target_config`` its
    transformers config (that it is the draft's target: ``specforge.compat``, checked by the CLI)."""
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter  # lazy: optional (speculators)

    if speculative_tokens is not None and speculative_tokens < 1:
        raise ValueError(f"--num-speculative-tokens is {speculative_tokens}, expected at least 1")
    hf_config, weights = check_checkpoint(draft_dir)
    ids = speculators_layer_ids(hf_config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    out = Path(out_dir)
    with quiet_speculators():
        Eagle3Converter().convert(draft_dir, out, base_model=str(target), validate=False,
                                  norm_before_residual=False, eagle_aux_hidden_state_layer_ids=ids)
        finish_config(out, speculative_tokens, window_of(hf_config))
    check_converted(weights, out, ids, {"norm_before_residual": False}, window_of(hf_config))
    return out


def finish_config(out: Path, speculative_tokens: Optional[int], window: Optional[int]) -> None:
    """What the converter does not take, set on its written config (speculators' own class saves it):
    the tokens per round, and the sliding window where the transformer layer's config carries it
    (``sliding_window`` + ``layer_types`` ["sliding_attention"]: what speculators' Eagle3 model and
    vLLM's Llama layers read; the converter drops it)."""
    from speculators.models.eagle3 import Eagle3SpeculatorConfig  # lazy: optional (speculators)

    if speculative_tokens is None and window is None:
        return
    config = Eagle3SpeculatorConfig.from_pretrained(str(out))
    if speculative_tokens is not None:
        config.speculators_config.proposal_methods[0].speculative_tokens = int(speculative_tokens)
    if window is not None:
        tl = config.transformer_layer_config
        tl.sliding_window, tl.layer_types, tl.use_sliding_window = int(window), ["sliding_attention"], True
    config.save_pretrained(str(out))


def refuse_window(engine: str, hf_config: dict, where: str = "") -> None:
    """One ValueError where ``engine`` would serve a sliding-window draft with full attention."""
    w = window_of(hf_config)
    if w is not None and engine in WINDOW_DROPPED:
        raise ValueError(f"--engine {engine}: the draft{f' {where}' if where else ''} was trained with "
                         f"draft.sliding_window={w}, which {engine}'s {WINDOW_DROPPED[engine]} does not read (it would "
                         "attend the whole context, silently computing other logits); export it for vllm, or train "
                         "it without draft.sliding_window")


# engines whose EAGLE-3 layer has no sliding window (read: SGLang's llama_eagle3.py, llama.cpp's eagle3.cpp)
WINDOW_DROPPED = {"sglang": "LlamaForCausalLMEagle3", "llama.cpp": "eagle3 graph"}


def read_written(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an export folder's safetensors files (one or sharded)."""
    return read_safetensors_folder(out, "draft weights file", "give a complete draft folder (copy or export it again)")


def check_converted(ours: dict[str, torch.Tensor], out: Path, ids: list[int], flags: dict[str, bool],
                    window: Optional[int] = None) -> None:
    """The converter logs, and does not raise on, tensors it could not place: every one of ours must
    be in the written files, equal in the written dtype (``midlayer.*`` as ``layers.0.*``), and the
    written config.json must hold the layer ids, the norm ``flags`` (name -> value) we passed and the
    sliding ``window`` (in ``transformer_layer_config``)."""
    written = read_written(out)
    errors = []
    for k, v in ours.items():
        name = "layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k
        if name not in written:
            errors.append(f"{name} missing")
        elif written[name].shape != v.shape or not torch.equal(written[name], v.to(written[name].dtype)):
            errors.append(f"{name} differs from our {k}")
    config = json.loads((Path(out) / "config.json").read_text())
    if config.get("eagle_aux_hidden_state_layer_ids") != ids:
        errors.append(f"eagle_aux_hidden_state_layer_ids {config.get('eagle_aux_hidden_state_layer_ids')}, "
                      f"expected {ids}")
    errors += [f"{k} is {config.get(k)!r}, expected {v}" for k, v in flags.items() if config.get(k) is not v]
    got = window_of(config.get("transformer_layer_config") or {})
    if got != window:
        errors.append(f"transformer_layer_config's sliding window is {got}, expected {window}")
    if errors:
        raise ValueError(f"speculators' converter wrote {str(out)!r} wrongly: " + "; ".join(errors))


def export(engine: str, draft_dir: Path, out_dir: Path, req) -> str:
    """SGLang: the checkpoint's served files as they are; vLLM: speculators' converter. Returns the
    serve command. ``req``: the ``ExportRequest`` (``specforge.seam``)."""
    refuse_window(engine, json.loads((Path(draft_dir) / "config.json").read_text()), repr(str(draft_dir)))
    if engine == "sglang":
        sglang.copy_served(draft_dir, out_dir)
        return (f"python -m sglang.launch_server --model-path {req.target or '<target>'} --speculative-algorithm "
                f"EAGLE3 --speculative-draft-model-path {req.out} --speculative-num-steps 3 --speculative-eagle-topk 1 "
                "--speculative-num-draft-tokens 4")
    export_vllm(draft_dir, out_dir, req.target, req.target_config, req.num_speculative_tokens)
    return (f"vllm serve {req.target} --speculative-config '{{\"method\": \"eagle3\", \"model\": \"{req.out}\", "
            f"\"num_speculative_tokens\": {req.num_speculative_tokens or DEFAULT_SPECULATIVE_TOKENS}}}'")


def llamacpp_layer_ids(sglang_ids: Sequence[int]) -> list[int]:
    """SGLang's ids are layer OUTPUTS; llama.cpp captures layer INPUTS: output k = input of k + 1."""
    return [int(k) + 1 for k in sglang_ids]


def draft_layer_ids(draft_config: dict, num_target_layers: int) -> list[int]:
    """The layer outputs the draft was trained on (its eagle_config, else the EAGLE-3 default)."""
    ids = (draft_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    L = num_target_layers
    return [int(i) for i in ids] if ids else [1, L // 2 - 1, L - 4]


def llamacpp_config(draft_config: dict, target_config: dict, layer_ids: Optional[Sequence[int]] = None) -> dict:
    """The config.json llama.cpp's converter reads: a TOP-LEVEL ``eagle_aux_hidden_state_layer_ids``
    naming the layer INPUTS it captures (ours + 1); ``layer_ids`` (ours) overrides the checkpoint's."""
    refuse_window("llama.cpp", draft_config)
    L = int(target_config.get("num_hidden_layers") or target_config["text_config"]["num_hidden_layers"])
    ids = list(layer_ids) if layer_ids is not None else draft_layer_ids(draft_config, L)
    return {**draft_config, "eagle_aux_hidden_state_layer_ids": llamacpp_layer_ids(ids)}
