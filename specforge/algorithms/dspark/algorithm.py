"""DSpark behind the draft-algorithm seam: DFlash's hooks (features, anchors, SP refusal, the
runtime's view of a block draft) with the Markov and confidence heads, their loss, their export.

Features: DFlash's (``draft.num_layers`` target layer outputs by default, ``model.aux_layer_ids``
sets them), the target argmax (greedy labels, the CE term and the accuracy metrics) and the target's
last hidden state (the teacher of the KL term and of the confidence target). Anchors are DFlash's
(per sample, a function of train.seed, the step and the sample's tokens). Packing keeps samples apart
as DFlash's does (a Markov head's previous token and a teacher row of a counted row lie in its own
sample). Sequence parallelism is refused.
Engines: llama.cpp (``--spec-type draft-dspark``); this project writes no SGLang or vLLM export for it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch

from specforge.algorithms.dflash.algorithm import CHUNK_BLOCKS, DFlash, DFlashOptions
from specforge.algorithms.dflash.blocks import ShiftedBlocks
from specforge.algorithms.dflash.memory import anchors_per_row
from specforge.algorithms.dspark.export import FORMAT, export
from specforge.algorithms.dspark.loss import dspark_block_loss, dspark_metrics
from specforge.algorithms.dspark.memory import dspark_step
from specforge.algorithms.dspark.model import DSparkConfig, DSparkDraft
from specforge.algorithms.dspark.propose import DSparkProposer


@dataclass
class DSparkOptions(DFlashOptions):
    """``draft.*`` keys of a DSpark draft: DFlash's (defaults: speculators' DSpark, blocks of 8 and
    the decay gamma 4) plus the Markov head's rank, the confidence head, the block layout and the
    loss weights: ``kl_weight`` x KL(target || draft) + ``ce_weight`` x CE(draft, target argmax),
    plus ``confidence_weight`` x the confidence head's BCE against 1 - TV(draft, target)."""

    block_size: int = field(default=8, metadata={"at_least": 2})
    loss_gamma: float = field(default=4.0, metadata={"positive": True})
    markov_rank: int = field(default=256, metadata={"at_least": 1})
    confidence_head: bool = True
    sample_from_anchor: bool = True  # block row k predicts the token after a + k: K drafts a block (else K - 1)
    kl_weight: float = field(default=1.0, metadata={"at_least": 0})
    ce_weight: float = field(default=0.0, metadata={"at_least": 0})
    confidence_weight: float = field(default=1.0, metadata={"at_least": 0})


class DSpark(ShiftedBlocks, DFlash):
    name = "dspark"
    options = DSparkOptions
    saved = FORMAT  # its own saved folder's functions (DFlash's hooks call them)
    architecture = "DSparkDraftModel"
    dynamic_drafting = False  # a block is drafted whole, in one forward (the chain runs on its logits)
    llamacpp_spec_type = "draft-dspark"
    gguf_architecture = "dflash"  # llama.cpp's converter writes DFlash's architecture; owns_gguf tells them apart
    refines = "dflash"  # its GGUF is DFlash's plus the Markov head: both own it, DSpark wins
    engines = ("llama.cpp", "vllm")
    title = "DSpark"
    ring_sp = False  # its loss (the Markov and confidence heads) has no sequence-parallel path

    # ---------------------------------------------------------------- configuration

    def config_errors(self, cfg) -> list[str]:
        d = cfg.draft
        errors = super().config_errors(cfg)
        if d.sliding_window is not None:  # DFlash's key; the DSpark forward and export have no window
            errors.append(f"config key 'draft.sliding_window'={d.sliding_window} applies to draft.algorithm=dflash, "
                          f"not {self.name}; remove it")
        if d.kl_weight == 0 and d.ce_weight == 0:
            errors.append("config keys 'draft.kl_weight' and 'draft.ce_weight' are both 0: nothing would train the "
                          "draft's tokens; set one of them > 0 (kl_weight=1 is speculators' DSpark loss)")
        if d.confidence_head and d.confidence_weight == 0:
            errors.append("config key 'draft.confidence_weight'=0 with 'draft.confidence_head'=true: the confidence "
                          "head would never train; set draft.confidence_weight > 0 or draft.confidence_head=false")
        return errors

    # ---------------------------------------------------------------- training

    def _draft_config(self, target, vocab):
        base = super()._draft_config(target, vocab)
        d = self.opt
        return DSparkConfig(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
                            markov_rank=d.markov_rank, confidence_head=d.confidence_head,
                            sample_from_anchor=d.sample_from_anchor)

    def _new_draft(self, dcfg):
        return DSparkDraft(dcfg)

    def loss(self, draft, batch, state, step: int, normalizer: Optional[torch.Tensor], *, training: bool):
        d = self.opt
        anchors, keep, labels, valid, prev_pos = self._targets(draft, batch, step, training)

        def head_loss(module, hidden, norm):
            return dspark_block_loss(module, hidden, batch, anchors, labels, valid, prev_pos, gamma=d.loss_gamma,
                                     kl_weight=d.kl_weight, ce_weight=d.ce_weight,
                                     confidence_weight=d.confidence_weight, normalizer=norm, chunk_blocks=CHUNK_BLOCKS,
                                     dpace_alpha=self.dpace_alpha)

        return self._forward_with(draft, batch, anchors, keep, normalizer, head_loss)

    def counts_shape(self) -> tuple[int, int]:
        return (self.opt.block_size + int(self.opt.sample_from_anchor), 7)

    def metrics(self, counts: torch.Tensor) -> dict[str, float]:
        d = self.opt
        return dspark_metrics(counts, self.decay_gamma, d.confidence_weight, d.confidence_head,
                              teacher=bool(d.kl_weight) or d.confidence_head)

    def memory_step(self, draft, shape, precision, gpu: bool) -> dict:
        return dspark_step(draft.config, shape.B, shape.T,
                           anchors_per_row(self.opt.num_anchors, self.run.samples_per_row, shape.T), precision,
                           CHUNK_BLOCKS)

    # ---------------------------------------------------------------- a saved draft

    def owns_gguf(self, arch: str, tensor_names: set[str]) -> bool:
        """llama.cpp's own rule (common/speculative.cpp): a ``dflash`` GGUF with ``markov_w1.weight`` is DSpark."""
        return arch == self.gguf_architecture and "markov_w1.weight" in tensor_names

    def export(self, engine, draft_dir, out_dir, req) -> str:
        return export(engine, draft_dir, out_dir, req)  # vLLM: speculators' DSpark format

    def refusal(self, engine: str) -> Optional[str]:
        return "SGLang has no DSpark drafting" if engine == "sglang" else None

    def proposer(self, draft, dtype: Optional[torch.dtype] = None, as_served: bool = False):
        return DSparkProposer(draft, dtype, as_served=as_served)


ALGORITHM = DSpark()
