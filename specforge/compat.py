"""Does a draft checkpoint belong with this target? Checked before a draft is run or exported.

A draft is a function of one target's hidden states: run with another target (other weights of the
same shape, or other captured layers) it still produces numbers, and the acceptance it gets is
meaningless. Three checks, cheapest first, each a ``ValueError`` naming the draft, what differs
and the fix:

    check_draft_shape   config.json against the target's config.json (no weights): hidden size,
                        vocabulary, the captured layer ids within the target's layers
    draft_aux_ids       the layer ids the draft was trained on (SGLang's ``eagle_config``), which a
                        caller uses unless the user asked for others (``check_aux_ids``)
    check_target_weights  the target fingerprint ``training_state.pt`` records (``run_identity``)
                        against the loaded target's weights
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from specforge.registry import algorithm_of, read_draft_config
from specforge.seam import recorded_layers
from specforge.targets import text_config

ALLOW_FLAG = "--allow-mismatch"


def _algorithm(hf_config: dict):
    """The algorithm that claims a draft's config.json, or None (a folder none here claims)."""
    try:
        return algorithm_of(hf_config)
    except ValueError:
        return None


def draft_aux_ids(hf_config: dict) -> Optional[list[int]]:
    """The target layer outputs the draft fuses, as its config.json records them (None if absent): its
    algorithm's ``recorded_layers`` (an MTP draft: the target's last layer), or for a folder no
    algorithm here claims, EAGLE-3's or DFlash's key."""
    return _recorded(hf_config, _algorithm(hf_config))


def _recorded(hf_config: dict, algo) -> Optional[list[int]]:
    return recorded_layers(hf_config) if algo is None else algo.recorded_layers(hf_config)


def check_draft_shape(path: str | Path, hf_config: dict, target_config) -> None:
    """The draft's config.json against the target's: what a draft of another target gets wrong first."""
    name = str(path)
    target_config = text_config(target_config)  # an image-text target: its text tower
    sizes = {**(hf_config.get("transformer_layer_config") or {}), **hf_config}  # speculators' format: nested
    want_h = int(sizes.get("target_hidden_size") or sizes["hidden_size"])
    if want_h != target_config.hidden_size:
        raise ValueError(f"draft {name!r} was trained for a target of hidden size {want_h}, this target has "
                         f"{target_config.hidden_size}: evaluate it with the target it was trained for "
                         "(model.target_path / --target)")
    if int(sizes["vocab_size"]) != target_config.vocab_size:
        raise ValueError(f"draft {name!r} maps into a vocabulary of {sizes['vocab_size']} tokens, this target has "
                         f"{target_config.vocab_size}: evaluate it with the target it was trained for")
    algo = _algorithm(hf_config)
    ids = _recorded(hf_config, algo) or []
    # EAGLE-3's numbering ends at L-2 (SGLang feeds layer id's output to layer id+1); an MTP draft reads L-1
    top = target_config.num_hidden_layers - (1 if algo is not None and algo.reads_last_layer else 2)
    if ids and max(ids) > top:
        raise ValueError(f"draft {name!r} fuses target layers {ids}, but this target has only "
                         f"{target_config.num_hidden_layers} layers: evaluate it with the target it was trained for")


def check_aux_ids(path: str | Path, draft_ids: Optional[Sequence[int]], asked: Optional[Sequence[int]],
                  allow: bool) -> Optional[list[int]]:
    """The layer ids to run the draft with: its own; ``asked`` (``model.aux_layer_ids`` set by the
    user) only if equal, or with ``allow`` (then those, on purpose)."""
    if asked is None or draft_ids is None or list(asked) == list(draft_ids):
        return list(draft_ids) if draft_ids is not None else (list(asked) if asked is not None else None)
    if allow:
        return list(asked)
    raise ValueError(f"draft {str(path)!r} was trained on target layers {list(draft_ids)}, but model.aux_layer_ids "
                     f"asks for {list(asked)}: drop that key to use the draft's own layers, or pass {ALLOW_FLAG} to "
                     "run it on other layers anyway")


def recorded_target(path: str | Path) -> Optional[str]:
    """The target fingerprint the draft's training_state.pt records (None without one)."""
    from specforge.training.checkpoint import load_train_state  # lazy: keeps specforge.compat torch-free

    state = load_train_state(path, mmap=True)  # mmap: the optimizer state in the same file is not read
    return None if state is None else (state.get("identity") or {}).get("target")


def target_fingerprints(model) -> set[str]:
    """The model's fingerprint as ``run_identity`` computes it, in the model's own dtype and in
    the other float dtypes a run may have loaded it in (the fingerprint hashes values and dtype)."""
    import torch  # lazy: keeps specforge.compat torch-free

    from specforge.training.checkpoint import tensor_digest  # lazy: keeps specforge.compat torch-free

    named = list(model.state_dict().items())
    return {tensor_digest(named, sample=64, dtype=d) for d in (None, torch.float32, torch.bfloat16, torch.float16)}


def check_target_weights(path: str | Path, model, allow: bool) -> Optional[str]:
    """ValueError (unless ``allow``) when the draft records another target's fingerprint; a note
    to print when nothing can be checked or the mismatch is allowed, else None."""
    recorded = recorded_target(path)
    if recorded is None:
        return f"draft {str(path)!r} has no training_state.pt: its target was not checked"
    if recorded in target_fingerprints(model):
        return None
    msg = (f"draft {str(path)!r} was trained with another target (weights fingerprint {recorded}, this target's "
           "differs): evaluate it with the target it was trained for (model.target_path / --target)")
    if allow:
        return f"warning: {msg}; evaluating anyway ({ALLOW_FLAG})"
    raise ValueError(f"{msg}, or pass {ALLOW_FLAG} to compare anyway")


def check_drafts(drafts: Sequence[str], cfg, allow: bool) -> dict[str, Optional[list[int]]]:
    """Before the target loads: every draft checkpoint against the target's config.json; the
    layer ids each draft runs with (its own, unless model.aux_layer_ids asks otherwise)."""
    from specforge.models.target import load_target_config  # lazy: keeps specforge.compat torch-free

    target_config = load_target_config(cfg.model)
    out = {}
    for name in dict.fromkeys(drafts):
        if name == "prompt-lookup":
            continue
        hf = read_draft_config(name)
        check_draft_shape(name, hf, target_config)
        out[name] = check_aux_ids(name, draft_aux_ids(hf), cfg.model.aux_layer_ids, allow)
    return out
