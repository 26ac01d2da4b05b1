"""EAGLE-3.1's saved folder and what each engine serves of it.

The saved folder is EAGLE-3's (``algorithms/eagle3/export.py``: SGLang's ``LlamaForCausalLMEagle3``
layout, ``architectures`` unchanged) plus, at the top level of config.json, the four booleans
``norm_before_fc``, ``fc_norm``, ``norm_before_residual``, ``norm_output`` (always written), and in
model.safetensors the fc-side norms their flags ask for: ``input_norm.weight`` ``[3 * H_t]``
(``norm_before_fc``) or ``fc_norm.{0,1,2}.weight`` ``[H_t]`` (``fc_norm``). A folder whose flags are all
false is an EAGLE-3 folder (``owns_checkpoint``): same math, same files.

What each engine reads of the flags (its model code, recent versions; a flag an engine does not read is
served as if false, silently, so the export refuses it with one error naming the flags and an engine
that reads them):

=========================  ==========================  ==========================  ========================
flag                       vLLM (speculators format)   SGLang                      llama.cpp (converter)
=========================  ==========================  ==========================  ========================
``norm_before_fc``         read                        ignored: refused            read (``enc.output_norm``)
``fc_norm``                read                        read                        no graph: refused
``norm_before_residual``   read (absent = true!)       ignored: refused            read
``norm_output``            read                        read                        ignored: refused
=========================  ==========================  ==========================  ========================

Minimum engine versions (older ones ignore what they do not know, silently; the export cannot see
which version will serve it): vLLM with ``norm_before_fc`` in its speculators config loader (PR
#38111) and ``fc_norm`` / ``norm_output`` (PR #46488, 2026-06); SGLang with ``fc_norm`` /
``norm_output`` in ``llama_eagle3.py`` (PR #24663); llama.cpp build 11434 (``eagle3.norm_before_fc``,
``eagle3.norm_before_residual``).

vLLM: speculators' converter writes the config with the flags, but it loads the weights into a model
without ``input_norm`` / ``fc_norm`` and drops them with a log line (and speculators' own loader then
initialises a missing ``input_norm`` to 1, silently). So :func:`export_vllm` adds them to the written
safetensors itself and checks that every one of our tensors is in the written files, equal.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import torch
from safetensors.torch import save_file

from specforge.algorithms.eagle3 import export as eagle3_export
from specforge.algorithms.eagle3.model import window_of
from specforge.algorithms.eagle31.model import FLAGS, Eagle31Draft, Eagle31DraftConfig, flag_conflict
from specforge.engines.vllm import quiet_speculators
from specforge.files import open_safetensors, read_safetensors
from specforge.training.checkpoint import load_draft_folder

ARCHITECTURE = eagle3_export.ARCHITECTURE
# flags each engine would serve as false, silently (the module docstring's table)
IGNORED = {"sglang": ("norm_before_fc", "norm_before_residual"), "vllm": (), "llama.cpp": ("fc_norm", "norm_output")}
GGUF_MARKER = "enc.output_norm.weight"  # llama.cpp's name for input_norm.weight: only an EAGLE-3.1 GGUF has it


def flags_of(hf_config: dict) -> dict[str, bool]:
    return {f: bool(hf_config.get(f, False)) for f in FLAGS}


def is_eagle31(hf_config: dict) -> bool:
    """An EAGLE-3 folder with a flag set (the flags' values are checked by :func:`check_checkpoint`)."""
    return ARCHITECTURE in (hf_config.get("architectures") or []) and any(hf_config.get(f) for f in FLAGS)


def refuse_ignored(engine: str, hf_config: dict, where: Optional[str] = None) -> None:
    """One ValueError when ``engine`` would serve a flag this draft sets as false."""
    bad = [f for f in IGNORED[engine] if hf_config.get(f)]
    if not bad:
        return
    flags = [f for f in FLAGS if hf_config.get(f)]
    ok = [e for e, ignored in IGNORED.items() if not set(ignored) & set(flags)]
    raise ValueError(f"--engine {engine}: the EAGLE-3.1 draft{f' {where}' if where else ''} sets "
                     f"{' and '.join(f'{f}=true' for f in bad)}, which {engine} does not read "
                     "(it would serve the draft "
                     f"without {'them' if len(bad) > 1 else 'it'}, silently computing other logits); export it for "
                     f"{' or '.join(ok)}, or train it with {' and '.join(f'draft.{f}=false' for f in bad)}")


# ---------------------------------------------------------------- the checkpoint


def flag_errors(hf_config: dict) -> list[str]:
    errors = [f"{f} is {hf_config[f]!r}, expected true or false" for f in FLAGS
              if f in hf_config and not isinstance(hf_config[f], bool)]
    if not errors and (msg := flag_conflict(hf_config)):
        errors.append(msg)
    return errors


def extra_tensors(hf_config: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors an EAGLE-3.1 file holds beyond EAGLE-3's (name -> shape, dtype), from the model itself."""
    cfg = Eagle31DraftConfig.from_hf_config(hf_config)
    with torch.device("meta"):
        draft = Eagle31Draft(cfg)
    dtype = getattr(torch, cfg.torch_dtype)
    plain = eagle3_export.expected_tensors(hf_config)
    return {k: (tuple(v.shape), dtype) for k, v in draft.export_state_dict().items() if k not in plain}


def check_checkpoint(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, weights) of a valid EAGLE-3.1 checkpoint; a ValueError naming every problem:
    EAGLE-3's checks of the shared part, the flags, and the fc-side norms the flags ask for."""
    hf_config, weights = load_draft_folder(path)
    errors = eagle3_export.config_errors(hf_config) + flag_errors(hf_config)
    if not errors:
        extra = extra_tensors(hf_config)
        why = {k: f"config.json sets {'norm_before_fc' if k.startswith('input_norm.') else 'fc_norm'}: true"
               for k in extra}
        errors = eagle3_export.tensor_errors(hf_config, weights,
                                             want={**eagle3_export.expected_tensors(hf_config), **extra}, why=why)
    if errors:
        raise ValueError(f"{str(path)!r} is not a valid EAGLE-3.1 {ARCHITECTURE} checkpoint: " + "; ".join(errors)
                         + ". Export a checkpoint written by specforge training (a step-* folder)")
    return hf_config, weights


def load_eagle31(path: str | Path, target=None) -> Eagle31Draft:
    """An ``Eagle31Draft`` from a saved folder; the frozen embedding comes from ``target``."""
    hf_config, weights = load_draft_folder(path)
    draft = Eagle31Draft(Eagle31DraftConfig.from_hf_config(hf_config))
    if "embed_tokens.weight" not in weights:
        if target is None:
            raise ValueError(f"{str(path)!r} has no embedding: pass the target to take it from")
        draft.init_embeddings_from_target(target.embed_weight_VH)
    draft.load_export_state_dict(weights)
    return draft.eval()


# ---------------------------------------------------------------- vLLM (speculators' converter)


def export_vllm(draft_dir: str | Path, out_dir: str | Path, target: str,
                speculative_tokens: Optional[int] = None) -> Path:
    """EAGLE-3's vLLM export (speculators' converter, our layer ids renumbered) told all four flags,
    then the fc-side norms it drops added to the written safetensors, then everything checked."""
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter  # lazy: optional (speculators)

    if speculative_tokens is not None and speculative_tokens < 1:
        raise ValueError(f"--num-speculative-tokens is {speculative_tokens}, expected at least 1")
    hf_config, weights = check_checkpoint(draft_dir)
    flags = flags_of(hf_config)
    ids = eagle3_export.speculators_layer_ids(hf_config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    out = Path(out_dir)
    window = window_of(hf_config)
    with quiet_speculators():
        Eagle3Converter().convert(draft_dir, out, base_model=str(target), validate=False,
                                  eagle_aux_hidden_state_layer_ids=ids, **flags)
        eagle3_export.finish_config(out, speculative_tokens, window)
    add_tensors(out, {k: weights[k] for k in extra_tensors(hf_config)})
    eagle3_export.check_converted(weights, out, ids, flags, window)
    return out


def add_tensors(out: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``tensors`` into the export's safetensors (in the dtype of its ``fc.weight``): into
    model.safetensors, or, for a sharded export, a file of their own registered in the index."""
    if not tensors:
        return
    index = out / "model.safetensors.index.json"
    if index.is_file():
        meta = json.loads(index.read_text())
        with open_safetensors(out / meta["weight_map"]["fc.weight"], "export weights file", "export again") as f:
            dtype = f.get_tensor("fc.weight").dtype
        name = "model-eagle31-norms.safetensors"
        save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, str(out / name), metadata={"format": "pt"})
        meta["weight_map"].update({k: name for k in tensors})
        index.write_text(json.dumps(meta, indent=2))
        return
    f = out / "model.safetensors"
    written = read_safetensors(f, "export weights file", "export again")
    dtype = written["fc.weight"].dtype
    written.update({k: v.to(dtype).contiguous() for k, v in tensors.items()})
    save_file(written, str(f), metadata={"format": "pt"})


# ---------------------------------------------------------------- the export hook and llama.cpp


def export(engine: str, draft_dir: Path, out_dir: Path, req) -> str:
    """SGLang: the checkpoint's files as they are (refusing the flags SGLang does not read); vLLM:
    :func:`export_vllm`. Returns the serve command."""
    refuse_ignored(engine, json.loads((Path(draft_dir) / "config.json").read_text()), repr(str(draft_dir)))
    if engine == "sglang":
        return eagle3_export.export(engine, draft_dir, out_dir, req)
    export_vllm(draft_dir, out_dir, req.target, req.num_speculative_tokens)
    return (f"vllm serve {req.target} --speculative-config '{{\"method\": \"eagle3\", \"model\": \"{req.out}\", "
            f"\"num_speculative_tokens\": {req.num_speculative_tokens or eagle3_export.DEFAULT_SPECULATIVE_TOKENS}}}'")


def llamacpp_config(draft_config: dict, target_config: dict, layer_ids: Optional[Sequence[int]] = None) -> dict:
    """EAGLE-3's staged config.json (the layer inputs the converter reads), refusing the flags llama.cpp
    does not implement; ``norm_before_fc`` / ``norm_before_residual`` reach the converter at the top level
    (``eagle3.norm_before_fc`` / ``eagle3.norm_before_residual`` in the GGUF)."""
    refuse_ignored("llama.cpp", draft_config)
    staged = eagle3_export.llamacpp_config(draft_config, target_config, layer_ids)
    return {**staged, **{f: flags_of(draft_config)[f] for f in ("norm_before_fc", "norm_before_residual")}}


def owns_gguf(arch: str, tensor_names: set[str], gguf_architecture: str) -> bool:
    """An EAGLE-3 GGUF with llama.cpp's ``input_norm`` (``norm_before_fc``). A GGUF whose only flag is
    ``norm_before_residual`` (a key, not a tensor) reads as EAGLE-3's: llama.cpp serves both the same way."""
    return arch == gguf_architecture and GGUF_MARKER in tensor_names
