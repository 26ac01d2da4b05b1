"""DFlash2 behind the draft-algorithm seam: DFlash's hooks (features, anchors, packing, the runtime's
view of a block draft) with the convolutions, the selector, their loss, their checkpoint.

Features: DFlash's (``draft.num_layers`` target layer outputs by default, ``model.aux_layer_ids``
sets them), the target argmax (the labels: the unary CE term, the selector's target, the metrics)
and the target's last hidden state (the teacher of the KL term). Anchors are DFlash's (per sample, a
function of train.seed, the step and the sample's tokens). Packing keeps samples apart as DSpark's
does (a row's previous token and teacher row lie in its own sample). Sequence parallelism is refused.
Engines: vLLM (speculators' DFlash2 format, :func:`.export.export_vllm`). ``python -m specforge.export``
refuses SGLang (no DFlash2 drafting) and llama.cpp (not exported here yet: see the export module) in a line.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch

from specforge.algorithms.dflash.algorithm import CHUNK_BLOCKS, DFlash, DFlashOptions
from specforge.algorithms.dflash.blocks import ShiftedBlocks
from specforge.algorithms.dflash.memory import anchors_per_row
from specforge.algorithms.dflash2.export import FORMAT, NO_LLAMACPP, NO_SGLANG, export
from specforge.algorithms.dflash2.loss import dflash2_block_loss, dflash2_metrics
from specforge.algorithms.dflash2.memory import dflash2_step
from specforge.algorithms.dflash2.model import DFlash2Config, DFlash2Draft
from specforge.algorithms.dflash2.propose import DFlash2Proposer


@dataclass
class DFlash2Options(DFlashOptions):
    """``draft.*`` keys of a DFlash2 draft: DFlash's (defaults: speculators' DFlash2, blocks of 8 and
    the decay gamma 4) plus the convolutions (``conv_kernel_size`` taps, ``conv_group_size`` channels
    sharing a kernel: must divide the target's hidden size), the selector (``selector_rank``, rerank
    the unary ``selector_top_k``), the block layout and the loss weights: ``kl_weight`` x
    KL(target || unary) + ``ce_weight`` x CE(unary, target argmax) + ``selector_weight`` x the
    selector's K-way CE (speculators' ``selector_loss_alpha``). ``sliding_window_non_causal``: rows
    of a block see each other both ways under ``sliding_window`` (false, causal, is not implemented)."""

    block_size: int = field(default=8, metadata={"at_least": 2})
    loss_gamma: float = field(default=4.0, metadata={"positive": True})
    conv_kernel_size: int = field(default=2, metadata={"at_least": 1})
    conv_group_size: int = field(default=16, metadata={"at_least": 1})
    selector_rank: int = field(default=256, metadata={"at_least": 1})
    selector_top_k: int = field(default=16, metadata={"at_least": 1})
    sliding_window_non_causal: bool = True
    sample_from_anchor: bool = False  # block row k predicts the token after a + k: K drafts a block (else K - 1)
    kl_weight: float = field(default=1.0, metadata={"at_least": 0})
    ce_weight: float = field(default=0.0, metadata={"at_least": 0})
    selector_weight: float = field(default=1.0, metadata={"at_least": 0})


class DFlash2(ShiftedBlocks, DFlash):
    name = "dflash2"
    options = DFlash2Options
    saved = FORMAT  # its own saved folder's functions (DFlash's hooks call them)
    architecture = "DFlash2DraftModel"
    dynamic_drafting = False  # a block is drafted whole, in one forward (the selector's chain runs on its rows)
    llamacpp_spec_type = None  # not exported for llama.cpp yet (export.NO_LLAMACPP)
    gguf_architecture = None
    engines = ("vllm",)  # vLLM's qwen3_dflash2.py; SGLang has no DFlash2 drafting; llama.cpp: export.NO_LLAMACPP
    title = "DFlash2"
    ring_sp = False  # its loss (the selector, the teacher rows) has no sequence-parallel path

    # ---------------------------------------------------------------- configuration

    def config_errors(self, cfg) -> list[str]:
        d = cfg.draft
        errors = super().config_errors(cfg)
        if d.conv_kernel_size > d.block_size:
            errors.append(f"config key 'draft.conv_kernel_size'={d.conv_kernel_size} exceeds 'draft.block_size'="
                          f"{d.block_size}: the convolution runs inside a block; use at most the block size")
        if d.sliding_window is not None and not d.sliding_window_non_causal:
            errors.append("config key 'draft.sliding_window_non_causal'=false with 'draft.sliding_window': causal "
                          "in-block attention is not implemented; use true (speculators' DFlash2 default)")
        if d.kl_weight == 0 and d.ce_weight == 0:
            errors.append("config keys 'draft.kl_weight' and 'draft.ce_weight' are both 0: nothing would train the "
                          "unary logits; set one of them > 0 (kl_weight=1 is speculators' DFlash2 loss)")
        return errors

    def check(self, target_config) -> None:
        super().check(target_config)
        d = self.opt
        get = (lambda k: target_config.get(k)) if isinstance(target_config, dict) else (
            lambda k: getattr(target_config, k, None))
        hidden, vocab = get("hidden_size"), get("vocab_size")
        if hidden and hidden % d.conv_group_size:
            raise ValueError(f"config key 'draft.conv_group_size'={d.conv_group_size} does not divide the target's "
                             f"hidden size {hidden}; use a divisor of it")
        if vocab and d.selector_top_k > vocab:
            raise ValueError(f"config key 'draft.selector_top_k'={d.selector_top_k} exceeds the target's "
                             f"{vocab} tokens")

    # ---------------------------------------------------------------- training

    def _draft_config(self, target, vocab):
        base = super()._draft_config(target, vocab)
        d = self.opt
        return DFlash2Config(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
                             conv_kernel_size=d.conv_kernel_size, conv_group_size=d.conv_group_size,
                             selector_rank=d.selector_rank, selector_top_k=d.selector_top_k,
                             sample_from_anchor=d.sample_from_anchor,
                             sliding_window_non_causal=d.sliding_window_non_causal)

    def _new_draft(self, dcfg):
        return DFlash2Draft(dcfg)

    def loss(self, draft, batch, state, step: int, normalizer: Optional[torch.Tensor], *, training: bool):
        d = self.opt
        anchors, keep, labels, valid, prev_pos = self._targets(draft, batch, step, training)

        def head_loss(module, hidden, norm):
            return dflash2_block_loss(module, hidden, batch, labels, valid, prev_pos, gamma=d.loss_gamma,
                                      kl_weight=d.kl_weight, ce_weight=d.ce_weight, selector_weight=d.selector_weight,
                                      normalizer=norm, chunk_blocks=CHUNK_BLOCKS, dpace_alpha=self.dpace_alpha)

        return self._forward_with(draft, batch, anchors, keep, normalizer, head_loss)

    def counts_shape(self) -> tuple[int, int]:
        return (self.opt.block_size + int(self.opt.sample_from_anchor), 8)

    def metrics(self, counts: torch.Tensor) -> dict[str, float]:
        return dflash2_metrics(counts, self.decay_gamma, self.opt.selector_top_k)

    def memory_step(self, draft, shape, precision, gpu: bool) -> dict:
        return dflash2_step(draft.config, shape.B, shape.T,
                            anchors_per_row(self.opt.num_anchors, self.run.samples_per_row, shape.T), precision,
                            CHUNK_BLOCKS)

    # ---------------------------------------------------------------- a saved draft

    def owns_gguf(self, arch: str, tensor_names: set[str]) -> bool:
        return False  # we write no DFlash2 GGUF (llama.cpp's converter would write a "dflash" one, DFlash's spec type)

    def export(self, engine, draft_dir, out_dir, req) -> str:
        return export(engine, draft_dir, out_dir, req)

    def refusal(self, engine: str) -> Optional[str]:
        return {"sglang": NO_SGLANG, "llama.cpp": NO_LLAMACPP}.get(engine)

    def llamacpp_config(self, draft_config: dict, target_config: dict, layer_ids=None) -> dict:
        raise ValueError(NO_LLAMACPP)

    def proposer(self, draft, dtype: Optional[torch.dtype] = None, as_served: bool = False):
        return DFlash2Proposer(draft, dtype, as_served=as_served)


ALGORITHM = DFlash2()
