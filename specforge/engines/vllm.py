"""vLLM's contract, written by vLLM's own tool: ``speculators``' converters (each algorithm's export
in its package calls them; here: the conventions and what they share).

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
which is what our checkpoint is (``specforge/algorithms/dflash/export.py``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def quiet_speculators() -> Iterator[None]:
    """speculators logs every step at INFO through loguru; the export prints its own summary."""
    from loguru import logger  # lazy: optional (loguru)

    logger.disable("speculators")
    try:
        yield
    finally:
        logger.enable("speculators")


