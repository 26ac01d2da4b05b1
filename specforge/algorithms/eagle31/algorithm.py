"""EAGLE-3.1 behind the draft-algorithm seam: EAGLE-3 (``algorithms/eagle3``: its features, TTT loss,
metrics, sequence parallelism, checkpoint layout) with speculators' four switches as ``draft.*`` keys
(``model.py`` has the math, ``export.py`` what each engine reads of them).

The defaults are speculators' trainer's for EAGLE-3 (``norm_before_residual``, ``norm_before_fc`` and
``norm_output`` on, ``fc_norm`` off); with all four off the draft is EAGLE-3's and so is its folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from specforge.algorithms.eagle3.algorithm import Eagle3, Eagle3Options
from specforge.algorithms.eagle3.memory import Eagle3Dims
from specforge.algorithms.eagle31.export import (
    check_checkpoint,
    export,
    is_eagle31,
    llamacpp_config,
    load_eagle31,
    owns_gguf,
)
from specforge.algorithms.eagle31.loss import for_loss
from specforge.algorithms.eagle31.memory import eagle31_terms
from specforge.algorithms.eagle31.model import FLAGS, Eagle31Draft, Eagle31DraftConfig, flag_conflict
from specforge.algorithms.eagle31.propose import Eagle31Proposer


@dataclass
class Eagle31Options(Eagle3Options):
    """``draft.*`` keys of an EAGLE-3.1 draft: EAGLE-3's plus the four switches (``model.py``)."""

    norm_before_fc: bool = True  # one RMSNorm over the concatenated target features before fc
    fc_norm: bool = False  # one RMSNorm per target feature before fc (excludes norm_before_fc)
    norm_before_residual: bool = True  # the layer's residual is hidden_norm(hidden)
    norm_output: bool = True  # the final norm ends every step: fed back normed, logits lm_head(hidden)


def flags_of(draft_cfg) -> dict[str, bool]:
    return {f: bool(getattr(draft_cfg, f)) for f in FLAGS}


class Eagle31(Eagle3):
    name = "eagle31"
    options = Eagle31Options
    refines = "eagle3"  # EAGLE-3's folder with a flag set: it owns those, EAGLE-3 the rest

    def config_errors(self, cfg) -> list[str]:
        errors = super().config_errors(cfg)
        if (msg := flag_conflict(flags_of(cfg.draft), "'draft.{}'")) is not None:
            errors.append(f"config keys {msg}")
        return errors

    def build_draft(self, target, vocab):
        """EAGLE-3's draft, initialised as EAGLE-3 initialises it (the same seed, the same numbers),
        made an EAGLE-3.1 draft with the fc-side norms its flags ask for (at 1)."""
        draft = super().build_draft(target, vocab)
        return Eagle31Draft.adopt(draft, Eagle31DraftConfig.of(draft.config, **flags_of(self.opt)))

    def loss(self, draft, batch, state, step: int, normalizer: Optional[torch.Tensor], *, training: bool):
        return super().loss(for_loss(draft), batch, state, step, normalizer, training=training)

    def memory_step(self, draft, shape, precision, gpu: bool) -> dict:
        step = super().memory_step(draft, shape, precision, gpu)
        extra = eagle31_terms(Eagle3Dims.of(draft.config), shape, precision, flags_of(self.opt))
        return {phase: terms + extra for phase, terms in step.items()}

    def owns_checkpoint(self, hf_config: dict) -> bool:
        """EAGLE-3's architecture with a flag set; with none set the folder is EAGLE-3's (same math)."""
        return is_eagle31(hf_config)

    def owns_gguf(self, arch: str, tensor_names: set[str]) -> bool:
        return owns_gguf(arch, tensor_names, self.gguf_architecture)

    def check_checkpoint(self, path):
        return check_checkpoint(path)

    def load(self, path, target):
        return load_eagle31(path, target)

    def proposer(self, draft, dtype: Optional[torch.dtype] = None, as_served: bool = False):
        return Eagle31Proposer(draft, dtype)  # no block to shorten

    def export(self, engine, draft_dir, out_dir, req) -> str:
        return export(engine, draft_dir, out_dir, req)

    def llamacpp_config(self, draft_config: dict, target_config: dict, layer_ids=None) -> dict:
        return llamacpp_config(draft_config, target_config, layer_ids)


ALGORITHM = Eagle31()
