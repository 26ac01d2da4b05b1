"""``draft.init_from``: a fresh run's draft starts from a published draft folder, then trains as usual.

The folder may be a checkpoint of ours (``checkpoints/step-N`` or ``checkpoints/latest``, any
algorithm), SGLang's EAGLE-3 format (ours, or upstream SpecForge's small variants), a speculators /
vLLM export (``python -m specforge.export --engine vllm``) or z-lab's DFlash folder. Which algorithm
reads it is the registry's question (``owns_published``); the reading (names mapped to ours) is the
algorithm's ``read_published`` hook. This file only checks and places, in three moments:

    check_init_from   config-level facts (folder, config.json, a draft, the run's algorithm), from
                      ``preflight.check_run``, before anything loads
    init_vocab_path   the run's vocab file IS the folder's mapping (d2t/t2d), cached by its content
                      hash, from ``plan.prepare`` / ``prepare_offline``: every placement reads it
                      through ``RunData.vocab_path`` (the lm_head rows are the folder's)
    apply_init_from   the folder's weights copied into the freshly built draft, strictly, before
                      FSDP2 and the optimizer (``TrainWorker.setup``, every placement)

Resuming: a run that resumes its own checkpoint (``checkpoint.resume`` with a checkpoint there) takes
that checkpoint, weights and vocab mapping alike, and never reads ``init_from``. So ``init_from`` is
not part of the run identity (a resume with the key removed or changed still resumes); what it
brought that changes the math, the vocab mapping, is (its hash). The run's config, and so the key,
is recorded with its metrics (``tracking.MetricsLogger``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from specforge.config import Config
from specforge.data.vocab import DraftVocab, save_draft_vocab
from specforge.registry import published_algorithm_name
from specforge.seam import BoundAlgorithm, Format, Training
from specforge.training.checkpoint import latest_checkpoint
from specforge.training.trainer import checkpoint_root

FIX_SHAPES = ("start from a draft of the same target with the same draft.* sizes as its config.json "
              "(draft.vocab_size, draft.hidden_size, draft.intermediate_size, draft.num_attention_heads, "
              "draft.num_key_value_heads, draft.head_dim, ...), or drop draft.init_from to start from scratch")


# config.json facts (any format, read as ours) that change what a draft computes without changing a
# tensor's shape, each with the run's key that sets it: a folder and a run that differ in one would
# load "fine" and draft wrongly. Compared where both configs name the fact.
SAME_CONFIG = {
    "eagle_config.eagle_aux_hidden_state_layer_ids": "model.aux_layer_ids",
    "dflash_config.target_layer_ids": "model.aux_layer_ids",
    "dflash_config.mask_token_id": "draft.mask_token_id",
    "peagle_config.mask_token_id": "draft.mask_token_id",
    "block_size": "draft.block_size",
    "rope_theta": "draft.rope_theta",
    "rms_norm_eps": "draft.rms_norm_eps",
    **{flag: f"draft.{flag}" for flag in ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")},
}


def fact(hf_config: dict, dotted: str):
    head, _, rest = dotted.partition(".")
    value = hf_config.get(head)
    return fact(value, rest) if rest and isinstance(value, dict) else (None if rest else value)


def window(hf_config: dict) -> Optional[int]:
    """The sliding window a config.json's layers use (None: full attention), absent key or not: a
    window is on where ``layer_types`` are sliding or, without them, ``use_sliding_window`` says so."""
    types = hf_config.get("layer_types")
    on = "sliding_attention" in types if types else bool(hf_config.get("use_sliding_window"))
    return hf_config.get("sliding_window") if on else None


def config_differences(published: dict, ours: dict) -> list[str]:
    """``SAME_CONFIG`` facts (where both name one) and the sliding window (always) that the folder's
    config.json and the run's draft disagree on, with the key to set."""
    pairs = [(dotted, key, fact(published, dotted), fact(ours, dotted)) for dotted, key in SAME_CONFIG.items()]
    pairs.append(("sliding window", "draft.sliding_window", window(published), window(ours)))
    out = []
    for dotted, key, theirs, mine in pairs:
        if theirs != mine and (dotted == "sliding window" or (theirs is not None and mine is not None)):
            a, b = json.dumps(theirs), json.dumps(mine)  # as a YAML value / a dotted override reads it
            out.append(f"its {dotted} is {a}, the run's draft has {b} (set {key}={a})")
    return out


def where(cfg: Config) -> str:
    return f"draft.init_from: {cfg.draft.init_from}"


def check_init_from(cfg: Config) -> None:
    """The config-level facts, before anything loads: one ValueError naming the key, the file and the fix."""
    path = cfg.draft.init_from
    if path is None:
        return
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ValueError(f"config key 'draft.init_from'={path!r}: no such folder; give a published draft folder (a "
                         "checkpoints/step-N or checkpoints/latest of ours, an SGLang, speculators/vLLM or z-lab "
                         "DFlash folder), or drop the key")
    root = checkpoint_root(cfg).expanduser().resolve()
    if not cfg.checkpoint.resume and folder.resolve().is_relative_to(root):
        raise ValueError(f"config key 'draft.init_from'={path!r} lies in this run's checkpoint folder {str(root)!r}, "
                         "which a fresh start (checkpoint.resume=false) moves aside before training: copy the folder "
                         "elsewhere, or give the run another train.output_dir / checkpoint.dir")
    f = folder / "config.json"
    if not f.is_file():
        raise ValueError(f"config key 'draft.init_from'={path!r} has no config.json: not a draft folder; "
                         "give the folder that holds the draft's config.json and safetensors")
    try:
        hf_config = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"config key 'draft.init_from': {str(f)!r} is not valid JSON ({e}): a truncated or "
                         "hand-edited draft folder") from None
    name = published_algorithm_name(hf_config, f"config key 'draft.init_from'={path!r}")
    if name != cfg.draft.algorithm:
        raise ValueError(f"config key 'draft.init_from'={path!r} holds a {name} draft, but draft.algorithm is "
                         f"{cfg.draft.algorithm!r}: set draft.algorithm={name} (and its draft.* sizes), or start from "
                         f"a {cfg.draft.algorithm} draft")


def read_published(algo: Format, cfg: Config) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json as ours, weights named as the draft's saved keys) of the run's ``init_from``;
    ``algo``: the run's algorithm (``registry.bound_algorithm(cfg)``, looked up by the caller)."""
    check_init_from(cfg)
    return algo.read_published(Path(cfg.draft.init_from).expanduser())


def resumed_checkpoint(cfg: Config) -> Optional[Path]:
    """The checkpoint the run resumes (None: a fresh start, where ``init_from`` applies)."""
    return latest_checkpoint(checkpoint_root(cfg)) if cfg.checkpoint.resume else None


def published_vocab(algo: Training, cfg: Config, weights: dict[str, torch.Tensor], target_vocab_size: int,
                    what: str) -> Optional[DraftVocab]:
    """The mapping (d2t, t2d) of ``weights`` checked against the run; None: the draft has none (DFlash
    predicts the target's whole vocabulary)."""
    if "d2t" not in weights or "t2d" not in weights:
        return None
    vocab = DraftVocab(weights["d2t"].to(torch.int64), weights["t2d"].to(torch.bool))
    n, want = vocab.draft_vocab_size, algo.draft_vocab_size(target_vocab_size)
    if vocab.target_vocab_size != target_vocab_size:
        raise ValueError(f"{what}: its vocab mapping is over a target vocabulary of {vocab.target_vocab_size} tokens, "
                         f"the target has {target_vocab_size}: start from a draft of this target (model.target_path)")
    if n != want:
        raise ValueError(f"{what}: its draft vocab has {n} tokens, draft.vocab_size is {want}: "
                         f"set draft.vocab_size={n}")
    ids = vocab.target_ids
    if n and (int(ids.min()) < 0 or int(ids.max()) >= target_vocab_size or ids.unique().numel() != n):
        raise ValueError(f"{what}: its d2t maps draft ids outside the target vocabulary 0..{target_vocab_size - 1} "
                         "(or two onto one): a corrupt mapping or a draft of another target; start from a draft of "
                         "this target")
    return vocab


def init_vocab_path(algo: BoundAlgorithm, cfg: Config, target_vocab_size: int) -> Optional[Path]:
    """The run's vocab file when ``draft.init_from`` is set: the folder's mapping (or, resuming, the
    resumed checkpoint's), written under ``model.cache_dir``/vocab keyed by its content hash. None: the
    run builds its own (no ``init_from``, or a draft without a mapping)."""
    if cfg.draft.init_from is None:
        return None
    resumed = resumed_checkpoint(cfg)
    if resumed is not None:
        weights = algo.read_published(resumed)[1]
        vocab = published_vocab(algo, cfg, weights, target_vocab_size, f"checkpoint {str(resumed)!r}")
    else:
        vocab = published_vocab(algo, cfg, read_published(algo, cfg)[1], target_vocab_size, where(cfg))
    if vocab is None:
        return None
    path = (Path(cfg.model.cache_dir).expanduser() / "vocab"
            / f"init-{vocab.content_hash()[:16]}-n{vocab.draft_vocab_size}.safetensors")
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        save_draft_vocab(vocab, path)
    return path


def apply_init_from(algo: Format, cfg: Config, draft: torch.nn.Module) -> None:
    """Copy the folder's weights into ``draft`` (freshly built, before FSDP2 and the optimizer): every
    saved tensor of the draft (``export_state_dict``) from the folder, nothing left over; otherwise one
    ValueError naming what is missing, what is extra and which shapes differ, and the fix. Then the
    configs must agree on what changes the math without a shape (``SAME_CONFIG``)."""
    hf_config, weights = read_published(algo, cfg)
    want = draft.export_state_dict()
    problems = [f"missing {k}" for k in sorted(set(want) - set(weights))]
    problems += [f"extra {k}" for k in sorted(set(weights) - set(want))]
    problems += [f"{k} is {list(weights[k].shape)}, the draft needs {list(want[k].shape)}"
                 for k in sorted(set(want) & set(weights)) if weights[k].shape != want[k].shape]
    if problems:
        raise ValueError(f"{where(cfg)}: " + "; ".join(problems) + f". To fix: {FIX_SHAPES}")
    for k in ("d2t", "t2d"):  # the run's vocab file is the folder's mapping (init_vocab_path)
        if k in want and not torch.equal(want[k].cpu(), weights[k].to(want[k].dtype)):
            raise ValueError(f"{where(cfg)}: its {k} differs from the run's vocab file: prepare the run with "
                             "specforge's entry points (plan.prepare writes the folder's mapping as the vocab file)")
    if differences := config_differences(hf_config, algo.hf_config(draft)):
        raise ValueError(f"{where(cfg)}: " + "; ".join(differences) + ": the draft would load and compute "
                         "otherwise than it was trained to")
    with torch.no_grad():
        for k, v in want.items():
            v.copy_(weights[k].to(v.dtype))
