"""SGLang's contract: the training output IS the served format (``LlamaForCausalLMEagle3``).

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
The same check is the gate of every other engine's export: each starts from a valid checkpoint.
"""

from __future__ import annotations

import shutil
from pathlib import Path
import torch

from specforge.train.checkpoint import latest_checkpoint, load_draft_folder

ARCHITECTURE = "LlamaForCausalLMEagle3"
SERVED_FILES = ("config.json", "model.safetensors")  # training_state.pt is resume state, not served


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder (``step-*``), or a checkpoint root: its ``latest`` checkpoint."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"--draft {str(path)!r} does not exist; pass a checkpoint folder (step-*) "
                         "or the run's checkpoint root")
    if (path / "config.json").is_file() or not path.is_dir():
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise ValueError(f"--draft {str(path)!r} is not a draft checkpoint: no config.json and no step-* "
                         "checkpoint inside; pass a checkpoint folder (step-*) or the run's checkpoint root")
    return found


def expected_tensors(hf_config: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) the served file must hold, from the draft model itself."""
    from specforge.models.draft import Eagle3Draft, Eagle3DraftConfig

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


def tensor_errors(hf_config: dict, weights: dict[str, torch.Tensor]) -> list[str]:
    """Missing / unexpected keys, wrong shapes or dtypes, and an inconsistent vocab mapping."""
    want = expected_tensors(hf_config)
    errors = [f"missing {k}" for k in sorted(set(want) - set(weights))]
    errors += [f"unexpected {k} (SGLang would drop it silently)" for k in sorted(set(weights) - set(want))]
    for k in sorted(set(want) & set(weights)):
        shape, dtype = want[k]
        if tuple(weights[k].shape) != shape or weights[k].dtype != dtype:
            errors.append(f"{k} is {list(weights[k].shape)} {weights[k].dtype}, expected {list(shape)} {dtype}")
    if not errors:
        errors += vocab_errors(weights["d2t"], weights["t2d"])
    return errors


def vocab_errors(d2t: torch.Tensor, t2d: torch.Tensor) -> list[str]:
    """d2t (offsets) and t2d (mask) must describe the same N distinct target ids."""
    target_ids = torch.arange(d2t.numel()) + d2t
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


def export(draft_dir: str | Path, out_dir: str | Path) -> Path:
    """Copy the validated served files of ``draft_dir`` into ``out_dir`` (which must exist)."""
    check_checkpoint(draft_dir)
    for name in SERVED_FILES:
        shutil.copy2(Path(draft_dir) / name, Path(out_dir) / name)
    return Path(out_dir)
