"""P-EAGLE's saved folder, and vLLM's format of it (the one engine that serves P-EAGLE).

Our folder is EAGLE-3's (``algorithms/eagle3/export.py``) with three differences, so that no
EAGLE-3 reader takes it for an EAGLE-3 draft::

    config.json          architectures ["LlamaForCausalLMPEagle"]; peagle_config {mask_token_id,
                         parallel_tokens}; hidden_size == the target's
    model.safetensors    EAGLE-3's tensors + mask_embed [H] + mask_hidden [3H] (no embedding: the
                         target's, whose row mask_token_id is replaced by mask_embed when served)

vLLM reads speculators' format (``speculators_model_type: "peagle"``; vLLM turns it into ``method:
eagle3, parallel_drafting: true`` and reads ``mask_token_id`` as its ``pard_token``). No speculators
converter exists for P-EAGLE, so :func:`export_vllm` writes it with speculators' own config class
(``PEagleSpeculatorConfig``; the decoder-layer config and the verifier entry built by speculators'
EAGLE-3 converter's helpers) and ``safetensors``, then rereads the folder and compares every tensor:

    embed_tokens.weight  [V, H]   the target's embedding with row mask_token_id = mask_embed (vLLM
                                  keeps a draft embedding that differs from the target's)
    mask_hidden          [1,1,3H] vLLM raises without it; speculators would random-init it silently
    fc.weight, layers.0.* (our midlayer.*), norm.weight, lm_head.weight, d2t, t2d

Layer ids are vLLM's "after k layers" (ours + 1), ``norm_before_residual`` false, as for EAGLE-3.
SGLang and llama.cpp have no parallel drafting: both are refused (``engines``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import save_file

from specforge.algorithms.eagle3 import export as eagle3_export
from specforge.algorithms.peagle.model import ARCHITECTURE, PEagleDraft, PEagleDraftConfig
from specforge.engines.vllm import quiet_speculators
from specforge.registry import read_draft_config
from specforge.training.checkpoint import load_draft_folder

__all__ = ["ARCHITECTURE", "ONLY_VLLM", "check_checkpoint", "load_peagle", "export", "export_vllm", "serve_command",
           "parallel_tokens"]

ONLY_VLLM = ("P-EAGLE drafts are served by vLLM only (parallel drafting: one forward drafts every token); "
             "export it with --engine vllm")


def parallel_tokens(hf_config: dict) -> int:
    """K: the tokens the saved draft was trained to draft in one forward."""
    return int((hf_config.get("peagle_config") or {})["parallel_tokens"])


def expected_tensors(hf_config: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) our saved file must hold, from the draft model itself (built on meta)."""
    cfg = PEagleDraftConfig.from_hf_config(hf_config)
    with torch.device("meta"):
        draft = PEagleDraft(cfg)
    dtype = getattr(torch, cfg.torch_dtype)
    return {k: (tuple(v.shape), dtype if v.is_floating_point() else v.dtype)
            for k, v in draft.export_state_dict().items()}


def config_errors(hf_config: dict) -> list[str]:
    """What in config.json is not a P-EAGLE draft of ours (each entry names the key)."""
    errors = []
    if hf_config.get("architectures") != [ARCHITECTURE]:
        errors.append(f"architectures is {hf_config.get('architectures')!r}, expected [{ARCHITECTURE!r}]")
    # the rest of the format is EAGLE-3's: its checks, on the same dict under its architecture
    errors += eagle3_export.config_errors({**hf_config, "architectures": [eagle3_export.ARCHITECTURE]})
    extra = hf_config.get("peagle_config")
    if not isinstance(extra, dict):
        return errors + ["peagle_config is missing, expected {mask_token_id, parallel_tokens}"]
    V, M, K = hf_config.get("vocab_size"), extra.get("mask_token_id"), extra.get("parallel_tokens")
    if not (isinstance(M, int) and isinstance(V, int) and 0 <= M < V):
        errors.append(f"peagle_config.mask_token_id is {M!r}, "
                      f"expected a target token id (0..{V if V is None else V - 1})")
    if not (isinstance(K, int) and K >= 1):
        errors.append(f"peagle_config.parallel_tokens is {K!r}, expected an integer >= 1")
    Ht = hf_config.get("target_hidden_size")
    if Ht is not None and Ht != hf_config.get("hidden_size"):
        errors.append(f"target_hidden_size {Ht} differs from hidden_size {hf_config.get('hidden_size')} "
                      "(a P-EAGLE draft has the target's hidden size)")
    return errors


def tensor_errors(hf_config: dict, weights: dict[str, torch.Tensor]) -> list[str]:
    """EAGLE-3's tensor checks (missing / unexpected keys, shapes, dtypes, vocab mapping) on P-EAGLE's set."""
    return eagle3_export.tensor_errors(hf_config, weights, want=expected_tensors(hf_config), unexpected="")


def check_checkpoint(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, weights) of a valid P-EAGLE checkpoint; a ValueError naming every problem."""
    hf_config, weights = load_draft_folder(path)
    errors = config_errors(hf_config)
    if not errors:
        errors = tensor_errors(hf_config, weights)
    if errors:
        raise ValueError(f"{str(path)!r} is not a valid P-EAGLE ({ARCHITECTURE}) checkpoint: " + "; ".join(errors)
                         + ". Export a checkpoint written by specforge training with draft.algorithm=peagle "
                           "(a step-* folder)")
    return hf_config, weights


def load_peagle(path: str | Path, target) -> PEagleDraft:
    """A ``PEagleDraft`` from a saved folder; the frozen embedding comes from ``target`` (a ``TargetModel``)."""
    hf_config, weights = check_checkpoint(path)
    if target is None:
        raise ValueError(f"{str(path)!r}: a P-EAGLE folder holds no embedding; pass the target to take it from")
    draft = PEagleDraft(PEagleDraftConfig.from_hf_config(hf_config))
    draft.init_embeddings_from_target(target.embed_weight_VH)
    draft.load_export_state_dict(weights)
    return draft.eval()


# ---------------------------------------------------------------- vLLM (speculators' format)


def target_embedding(target: str, V: int, H: int) -> torch.Tensor:
    """The target's input embedding (``V x H``), read from its safetensors alone (no model load)."""
    from speculators.utils.loading import load_model_layers  # lazy: optional (speculators)

    try:
        with quiet_speculators():
            W = load_model_layers(["embed_tokens.weight"], str(target))["embed_tokens.weight"]
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"--target {str(target)!r}: its embedding (embed_tokens.weight) cannot be read ({e}); "
                         "pass the target's HF folder") from None
    if tuple(W.shape) != (V, H):
        raise ValueError(f"--target {str(target)!r}: its embedding is {list(W.shape)}, the draft needs [{V}, {H}]; "
                         "pass the target the draft was trained for")
    return W


def served_tensors(hf_config: dict, weights: dict[str, torch.Tensor],
                   embed_VH: torch.Tensor) -> dict[str, torch.Tensor]:
    """Our checkpoint's tensors under speculators' names, in the checkpoint's dtype."""
    M = int(hf_config["peagle_config"]["mask_token_id"])
    dtype = getattr(torch, hf_config["torch_dtype"])
    out = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
           for k, v in weights.items() if k not in ("mask_embed", "mask_hidden")}
    table = embed_VH.to(dtype, copy=True)
    table[M] = weights["mask_embed"].to(dtype)
    out["embed_tokens.weight"] = table
    out["mask_hidden"] = weights["mask_hidden"].to(dtype).view(1, 1, -1)
    return {k: v.contiguous() for k, v in out.items()}


def speculators_config(hf_config: dict, target: str, speculative_tokens: int):
    """speculators' ``PEagleSpeculatorConfig`` of our checkpoint (decoder-layer config and verifier
    entry built by speculators' EAGLE-3 converter, as the EAGLE-3 export's are)."""
    from speculators.config import SpeculatorsConfig  # lazy: optional (speculators)
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter  # lazy: optional (speculators)
    from speculators.models.peagle import PEagleSpeculatorConfig  # lazy: optional (speculators)
    from speculators.proposals.greedy import GreedyTokenProposalConfig  # lazy: optional (speculators)

    conv = Eagle3Converter()
    with quiet_speculators():
        layer = conv._create_transformer_config_from_eagle({**hf_config, "target_vocab_size": hf_config["vocab_size"]},
                                                           str(target))
        verifier = conv._create_verifier_config(str(target))
    ids = eagle3_export.speculators_layer_ids(hf_config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    return PEagleSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=int(hf_config["draft_vocab_size"]),
        norm_before_residual=False, norm_before_fc=False, fc_norm=False, norm_output=False, target_hidden_size=None,
        eagle_aux_hidden_state_layer_ids=ids, mask_token_id=int(hf_config["peagle_config"]["mask_token_id"]),
        speculators_config=SpeculatorsConfig(
            algorithm="peagle", default_proposal_method="greedy", verifier=verifier,
            proposal_methods=[GreedyTokenProposalConfig(proposal_type="greedy",
                                                        speculative_tokens=int(speculative_tokens))]))


def export_vllm(draft_dir: str | Path, out_dir: str | Path, target: str,
                speculative_tokens: Optional[int] = None) -> Path:
    """Write speculators' P-EAGLE folder into ``out_dir`` (which must exist) from the (validated)
    checkpoint; ``target`` is the verifier's HF folder or hub id (its embedding is read from it)."""
    hf_config, weights = check_checkpoint(draft_dir)
    K = parallel_tokens(hf_config)
    n = K if speculative_tokens is None else int(speculative_tokens)
    if not 1 <= n <= K:
        raise ValueError(f"--num-speculative-tokens is {n}: this P-EAGLE draft was trained for at most {K} "
                         f"(draft.parallel_tokens); choose 1..{K}")
    out = Path(out_dir)
    embed = target_embedding(target, int(hf_config["vocab_size"]), int(hf_config["hidden_size"]))
    tensors = served_tensors(hf_config, weights, embed)
    config = speculators_config(hf_config, target, n)
    config.save_pretrained(str(out))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    check_written(tensors, out, hf_config, n)
    return out


def check_written(want: dict[str, torch.Tensor], out: Path, hf_config: dict, speculative_tokens: int) -> None:
    """Reread ``out`` with speculators' config class and safetensors: every tensor present and equal,
    no other tensor, and the conventions vLLM reads as written."""
    from speculators.models.peagle import PEagleSpeculatorConfig  # lazy: optional (speculators)

    written = eagle3_export.read_written(out)
    errors = [f"{k} missing" for k in sorted(set(want) - set(written))]
    errors += [f"{k} unexpected" for k in sorted(set(written) - set(want))]
    errors += [f"{k} differs" for k in sorted(set(want) & set(written))
               if written[k].dtype != want[k].dtype or not torch.equal(written[k], want[k])]
    cfg = PEagleSpeculatorConfig.from_pretrained(str(out))
    M = hf_config["peagle_config"]["mask_token_id"]
    ids = eagle3_export.speculators_layer_ids(hf_config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    if cfg.speculators_model_type != "peagle" or cfg.speculators_config.algorithm != "peagle":
        errors.append("speculators_model_type / speculators_config.algorithm is not 'peagle'")
    if cfg.mask_token_id != M:
        errors.append(f"mask_token_id is {cfg.mask_token_id!r}, expected {M}")
    if cfg.norm_before_residual is not False:
        errors.append("norm_before_residual is not false")
    if list(cfg.eagle_aux_hidden_state_layer_ids or []) != ids:
        errors.append(f"eagle_aux_hidden_state_layer_ids {cfg.eagle_aux_hidden_state_layer_ids}, expected {ids}")
    if cfg.speculators_config.proposal_methods[0].speculative_tokens != speculative_tokens:
        errors.append(f"speculative_tokens is not {speculative_tokens}")
    if (cfg.transformer_layer_config.vocab_size != hf_config["vocab_size"]
            or cfg.draft_vocab_size != hf_config["draft_vocab_size"]):
        errors.append("vocab_size / draft_vocab_size differ from the checkpoint's")
    if errors:
        raise ValueError(f"the P-EAGLE export {str(out)!r} was written wrongly: " + "; ".join(errors))


def serve_command(target: Any, out: Path, n: int) -> str:
    return (f"vllm serve {target} --speculative-config '{{\"method\": \"eagle3\", \"model\": \"{out}\", "
            f"\"num_speculative_tokens\": {n}, \"parallel_drafting\": true}}'")


def export(engine: str, draft_dir: Path, out_dir: Path, req) -> str:
    """vLLM: speculators' P-EAGLE folder (:func:`export_vllm`); returns the serve command. Any
    other engine: one ValueError (the CLI refuses them first, from ``engines``)."""
    if engine != "vllm":
        raise ValueError(f"--engine {engine}: {ONLY_VLLM}")
    if req.target is None:
        raise ValueError("--target: the vLLM export of a P-EAGLE draft reads the target's embedding; "
                         "pass its HF folder")

    export_vllm(draft_dir, out_dir, req.target, req.num_speculative_tokens)
    return serve_command(req.target, req.out,
                         req.num_speculative_tokens or parallel_tokens(read_draft_config(draft_dir)))
