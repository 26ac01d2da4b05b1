"""vLLM's contract, written by vLLM's own tool: ``speculators``' converters.

EAGLE-3: the ``speculators`` format (``speculators_model_type: eagle3``), written by
``speculators.convert.eagle.eagle3_converter.Eagle3Converter`` from our checkpoint (``midlayer.*``
becomes ``layers.0.*``; config.json gets ``transformer_layer_config``, ``speculators_config`` with
the verifier). What we tell the converter, because its defaults are not our conventions:

* Layer ids. vLLM's targets capture ``hidden_states + residual`` at the INPUT of each layer in
  ``eagle_aux_hidden_state_layer_ids`` (``vllm/model_executor/models/llama.py``), i.e. "after k
  layers"; default (2, L // 2, L - 3). Our ids (SGLang's) are layer OUTPUTS: ours k = theirs k + 1.
  The converter reads no ids from our nested ``eagle_config``: we pass them.
* ``norm_before_residual``: vLLM's ``update_eagle3`` (``transformers_utils/configs/speculators/
  algos.py``) defaults it to TRUE when absent; our layer keeps the un-normed hidden as the
  residual, so it is passed False (and the written config is checked to hold it).
* ``speculative_tokens``: the converter writes 3; ``--num-speculative-tokens`` is set through
  speculators' own config class afterwards.

d2t holds offsets (vLLM ``llama_eagle3.py``: target = arange + d2t), as ours; t2d is skipped by
vLLM and read by speculators; the embedding comes from the verifier. tests/test_export.py loads the
export with ``speculators.models.eagle3.Eagle3DraftModel`` and compares logits with ours.

DFlash: vLLM serves z-lab's ``DFlashDraftModel`` folders as they are (``"method": "dflash"``),
which is what our checkpoint is (``specforge/algorithms/dflash/export.py``); see :func:`export_dflash`.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from specforge.engines.sglang import check_checkpoint

DEFAULT_SPECULATIVE_TOKENS = 3  # speculators' converter default; vLLM's --speculative-config overrides it


def speculators_layer_ids(sglang_ids: list[int]) -> list[int]:
    """Our (SGLang) layer-output ids -> speculators/vLLM "after k layers" ids."""
    return [int(k) + 1 for k in sglang_ids]


@contextlib.contextmanager
def quiet_speculators() -> Iterator[None]:
    """speculators logs every step at INFO through loguru; the export prints its own summary."""
    from loguru import logger

    logger.disable("speculators")
    try:
        yield
    finally:
        logger.enable("speculators")


def export(draft_dir: str | Path, out_dir: str | Path, target: str, target_config: Any,
           speculative_tokens: Optional[int] = None) -> Path:
    """Convert the (validated) EAGLE-3 checkpoint into ``out_dir`` (which must exist) with
    speculators' converter. ``target`` is the verifier's HF folder or hub id (recorded as
    ``verifier.name_or_path``; the converter reads its config.json), ``target_config`` its
    transformers config (that it is the draft's target: ``specforge.compat``, checked by the CLI)."""
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    if speculative_tokens is not None and speculative_tokens < 1:
        raise ValueError(f"--num-speculative-tokens is {speculative_tokens}, expected at least 1")
    hf_config, weights = check_checkpoint(draft_dir)
    ids = speculators_layer_ids(hf_config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    out = Path(out_dir)
    with quiet_speculators():
        Eagle3Converter().convert(draft_dir, out, base_model=str(target), validate=False,
                                  norm_before_residual=False, eagle_aux_hidden_state_layer_ids=ids)
        config = Eagle3SpeculatorConfig.from_pretrained(str(out))
        if speculative_tokens is not None:
            config.speculators_config.proposal_methods[0].speculative_tokens = int(speculative_tokens)
            config.save_pretrained(str(out))
    check_converted(weights, out, ids, config)
    return out


def check_converted(ours: dict[str, torch.Tensor], out: Path, ids: list[int], config: Any) -> None:
    """The converter logs, and does not raise on, tensors it could not place: every one of ours must
    be in the written file, equal (in the written dtype), and the conventions we passed must hold."""
    from safetensors.torch import load_file

    written = {}
    for f in sorted(out.glob("*.safetensors")):
        written.update(load_file(f))
    errors = []
    for k, v in ours.items():
        name = "layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k
        if name not in written:
            errors.append(f"{name} missing")
        elif written[name].shape != v.shape or not torch.equal(written[name], v.to(written[name].dtype)):
            errors.append(f"{name} differs from our {k}")
    if list(config.eagle_aux_hidden_state_layer_ids) != ids:
        errors.append(f"eagle_aux_hidden_state_layer_ids {config.eagle_aux_hidden_state_layer_ids}, expected {ids}")
    if config.norm_before_residual is not False:
        errors.append("norm_before_residual is not false")
    if errors:
        raise ValueError(f"speculators' converter wrote {str(out)!r} wrongly: " + "; ".join(errors))


def export_dflash(draft_dir: str | Path, out_dir: str | Path) -> Path:
    """A DFlash draft for vLLM and SGLang: the z-lab folder both load as it is (config.json and
    model.safetensors), copied once our DFlash model loads it with no tensor missing or extra."""
    from specforge.algorithms.dflash.export import load_dflash

    try:
        load_dflash(draft_dir)
    except (ValueError, KeyError) as e:
        raise ValueError(f"{str(draft_dir)!r} is not a valid DFlashDraftModel checkpoint ({e}). Export a checkpoint "
                         "written by specforge training with draft.algorithm=dflash (a step-* folder)") from None
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(Path(draft_dir) / name, Path(out_dir) / name)
    return Path(out_dir)
