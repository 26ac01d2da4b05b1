"""XPress behind the draft-algorithm seam: DFlash's hooks (features, anchors, packing, the runtime's
view of a block draft) with the refiner, its loss, its checkpoint.

Features: DFlash's (``draft.num_layers`` target layer outputs by default, ``model.aux_layer_ids``
sets them), the target argmax (the labels: the CE term unless ``ce_from_data``, the metrics) and the
target's last hidden state (the teacher of the TV and KL terms). Anchors are DFlash's (per sample, a
function of train.seed, the step and the sample's tokens). Packing keeps samples apart as DSpark's
does (a block's labels, teacher rows and teacher-forced previous tokens lie in its own sample).
Sequence parallelism is refused. Engines: none serves it, so ``python -m specforge.export`` refuses
each in a line (``NO_ENGINE``): vLLM 0.32 has no XPress model (its speculators parser takes eagle3,
peagle, dflash, dflash2 and dspark; no ``XPressDraftModel`` in its registry), llama.cpp's converter
has no ``XPressDraftModel``, SGLang has no XPress drafting. speculators' XPress format is not written:
no engine reads it, and speculators itself is not a server.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch

from specforge.algorithms.dflash.algorithm import CHUNK_BLOCKS, DFlash, DFlashOptions
from specforge.algorithms.dflash.blocks import ShiftedBlocks, shifted_targets
from specforge.algorithms.dflash.memory import anchors_per_row
from specforge.algorithms.xpress.export import FORMAT
from specforge.algorithms.xpress.loss import LossMix, teacher_prev, xpress_block_loss, xpress_metrics
from specforge.algorithms.xpress.memory import xpress_step
from specforge.algorithms.xpress.model import XPressConfig, XPressDraft
from specforge.algorithms.xpress.propose import XPressProposer


@dataclass
class XPressOptions(DFlashOptions):
    """``draft.*`` keys of an XPress draft: DFlash's (defaults: speculators' XPress, blocks of 16 and
    the decay gamma 4; no sliding window) plus the refiner (``refiner_rank`` r, its SwiGLU MLP
    ``refiner_mlp_ratio`` x r wide; speculators' ``xpress_rank``, ``xpress_mlp_ratio``), drafting's
    ``jacobi_passes`` (``num_jacobi_passes``), the block layout and the loss: per predicted row
    ``ce_weight`` x CE(label) + ``tv_weight`` x TV(teacher) + ``kl_weight`` x KL(teacher || draft) of
    the teacher-forced refined logits, + ``consistency_weight`` x its mean over ``consistency_passes``
    free-running passes, + ``anchor_weight`` x the base logits' (speculators' ``base_anchor_weight``;
    ``anchor_full_weight``: that term undecayed). ``ce_from_data``: the CE's label is the data token,
    not the target's argmax."""

    block_size: int = field(default=16, metadata={"at_least": 2})
    loss_gamma: float = field(default=4.0, metadata={"positive": True})
    refiner_rank: int = field(default=256, metadata={"at_least": 1})
    refiner_mlp_ratio: int = field(default=2, metadata={"at_least": 1})
    jacobi_passes: int = field(default=6, metadata={"at_least": 0})
    sample_from_anchor: bool = False  # block row k predicts the token after a + k: K drafts a block (else K - 1)
    ce_weight: float = field(default=0.1, metadata={"at_least": 0})
    tv_weight: float = field(default=0.9, metadata={"at_least": 0})
    kl_weight: float = field(default=0.0, metadata={"at_least": 0})
    consistency_weight: float = field(default=0.3, metadata={"at_least": 0})
    consistency_passes: int = field(default=3, metadata={"at_least": 0})
    anchor_weight: float = field(default=0.6, metadata={"at_least": 0})
    anchor_full_weight: bool = False
    ce_from_data: bool = False


NO_ENGINE = {  # why each engine cannot serve an XPress draft (checked: vLLM 0.32.0, llama.cpp build 11434)
    "vllm": "vLLM has no XPress model (its speculators config parser takes eagle3, peagle, dflash, dflash2 and dspark, "
            "not xpress; no XPressDraftModel in its model registry)",
    "sglang": "SGLang has no XPress drafting",
    "llama.cpp": "llama.cpp has no XPress drafting (its converter has no XPressDraftModel)",
}


class XPress(ShiftedBlocks, DFlash):
    name = "xpress"
    options = XPressOptions
    saved = FORMAT  # its own saved folder's functions (DFlash's hooks call them)
    architecture = "XPressDraftModel"
    dynamic_drafting = False  # a block is drafted whole, in one forward (the Jacobi passes run on its rows)
    llamacpp_spec_type = None  # llama.cpp has no XPress drafting
    gguf_architecture = None
    engines = ()  # NO_ENGINE
    title = "XPress"
    ring_sp = False  # its loss (the refiner over whole blocks, the teacher rows) has no sequence-parallel path

    # ---------------------------------------------------------------- configuration

    def config_errors(self, cfg) -> list[str]:
        d = cfg.draft
        errors = super().config_errors(cfg)
        if d.sliding_window is not None:  # DFlash's key; the XPress forward and export have no window
            errors.append(f"config key 'draft.sliding_window'={d.sliding_window} applies to draft.algorithm=dflash, "
                          f"not {self.name}; remove it")
        if d.ce_weight == 0 and d.tv_weight == 0 and d.kl_weight == 0:
            errors.append("config keys 'draft.ce_weight', 'draft.tv_weight' and 'draft.kl_weight' are all 0: nothing "
                          "would train the draft; set one of them > 0 (speculators' XPress: ce 0.1, tv 0.9)")
        if d.consistency_weight > 0 and d.consistency_passes == 0:
            errors.append(f"config key 'draft.consistency_passes'=0 with 'draft.consistency_weight'="
                          f"{d.consistency_weight}: the consistency term has no pass to run; set "
                          "draft.consistency_passes >= 1 or draft.consistency_weight=0")
        if d.ce_from_data and d.ce_weight == 0:
            errors.append("config key 'draft.ce_from_data'=true with 'draft.ce_weight'=0: there is no CE term to "
                          "point at the data; set draft.ce_weight > 0 or draft.ce_from_data=false")
        return errors

    # ---------------------------------------------------------------- training

    def _draft_config(self, target, vocab):
        base = super()._draft_config(target, vocab)
        d = self.opt
        return XPressConfig(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
                            refiner_rank=d.refiner_rank, refiner_mlp_ratio=d.refiner_mlp_ratio,
                            jacobi_passes=d.jacobi_passes, sample_from_anchor=d.sample_from_anchor)

    def _new_draft(self, dcfg):
        return XPressDraft(dcfg)

    def loss(self, draft, batch, state, step: int, normalizer: Optional[torch.Tensor], *, training: bool):
        c, d = draft.config, self.opt
        anchors, keep, labels, valid, prev_pos = self._targets(draft, batch, step, training)
        doc_ids_BT = getattr(batch, "doc_ids_BT", None)
        prev = teacher_prev(batch.input_ids_BT, anchors, c.block_size, c.shift, doc_ids_BT)
        ce_labels = None
        if d.ce_from_data:  # the data token of each row (no target argmax)
            ce_labels = shifted_targets(batch.input_ids_BT, None, batch.loss_mask_BT, anchors, keep, c.block_size,
                                        c.shift, doc_ids_BT)[0]

        def head_loss(module, hidden, norm):
            return xpress_block_loss(module, hidden, batch, labels, valid, prev_pos, prev, gamma=d.loss_gamma,
                                     mix=LossMix.of(d), ce_labels_BNR=ce_labels, normalizer=norm,
                                     chunk_blocks=CHUNK_BLOCKS, dpace_alpha=self.dpace_alpha)

        return self._forward_with(draft, batch, anchors, keep, normalizer, head_loss)

    def counts_shape(self) -> tuple[int, int]:
        return (self.opt.block_size + int(self.opt.sample_from_anchor), 8)

    def metrics(self, counts: torch.Tensor) -> dict[str, float]:
        return xpress_metrics(counts, self.decay_gamma)

    def memory_step(self, draft, shape, precision, gpu: bool) -> dict:
        d = self.opt
        passes = d.consistency_passes if d.consistency_weight > 0 else 0
        return xpress_step(draft.config, shape.B, shape.T, anchors_per_row(d.num_anchors, self.run.samples_per_row,
                                                                           shape.T), precision, passes, CHUNK_BLOCKS)

    def memory_keys(self) -> list[str]:
        return ["draft.num_anchors", "draft.consistency_passes"]

    # ---------------------------------------------------------------- a saved draft

    def owns_gguf(self, arch: str, tensor_names: set[str]) -> bool:
        return False  # llama.cpp writes no XPress GGUF

    def export(self, engine, draft_dir, out_dir, req) -> str:
        raise ValueError(f"--engine {engine}: {NO_ENGINE.get(engine, 'no engine serves XPressDraftModel drafts')}; "
                         "evaluate it with python -m specforge.eval")

    def llamacpp_config(self, draft_config: dict, target_config: dict, layer_ids=None) -> dict:
        raise ValueError(NO_ENGINE["llama.cpp"])

    def refusal(self, engine: str) -> Optional[str]:
        return NO_ENGINE.get(engine)

    def proposer(self, draft, dtype: Optional[torch.dtype] = None, as_served: bool = False):
        return XPressProposer(draft, dtype)  # no block to shorten


ALGORITHM = XPress()
