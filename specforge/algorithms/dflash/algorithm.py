"""DFlash behind the draft-algorithm seam: what the runtime calls (``specforge.seam``).

Features: ``draft.num_layers`` target layer outputs by default (``model.aux_layer_ids`` sets them),
concatenated as the aux feature, plus the target argmax (labels = the target's greedy next token,
what greedy verification accepts; the data are not always the target's own answers). The last
hidden state travels but is not used. Anchors are random (``loss.sample_anchors``) but, per sample, a
function of (train.seed, step, the sample's tokens; ``loss.anchor_keys``): a rank and the single
process, a packed row and a padded one, draw the same anchors for the same sample, and the
normalizer pass and the loss pass agree without keeping state.
Packing (``train.pack_tokens``): a packed row's samples keep their positions (RoPE restarts), their
anchors and blocks (a block and its labels stay inside its sample) and their context (a block sees
its own sample's context only: ``model.build_block_mask`` with the doc ids).
Sequence parallelism: ring (``parallel.sp_ring``; ``sp.py``): each ring rank holds a contiguous
share of the context and computes the blocks anchored in it (the same global anchors as one
process); the context's keys/values travel the ring. Ulysses is refused.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import torch

from specforge.algorithms.dflash.blocks import DrawnOnce, drafted_metrics
from specforge.algorithms.dflash.export import FORMAT, export, llamacpp_config
from specforge.algorithms.dflash.loss import (
    anchor_keys,
    block_loss,
    block_targets,
    build_block_ids,
    counted_weight,
    local_anchors,
    next_token_labels,
    sample_anchors,
)
from specforge.algorithms.dflash.memory import DFlashDims, anchors_per_row, dflash_step
from specforge.algorithms.dflash.model import DFlashConfig, DFlashDraft, default_target_layer_ids
from specforge.algorithms.dflash.propose import DFlashProposer
from specforge.algorithms.dflash.sp import RingBlocks, gather_rows, ring_comm
from specforge.config import DraftConfig, aux_layer_errors, layer_ids_or_default
from specforge.data.vocab import MOST_USED_IDS
from specforge.files import read_safetensors_folder
from specforge.seam import Binds

CHUNK_BLOCKS = 16  # blocks whose full-vocab logits exist at once (recomputed in backward)
EVAL_STEP = -1  # held-out metrics draw the same anchors at every periodic eval


def anchor_seed(seed: int, step: int) -> int:
    """The anchors' seed of a step: a function of (``train.seed``, step) alone; each sample's draw adds
    its own tokens (``loss.anchor_keys``), so packed and unpacked rows draw the same anchors per sample."""
    return hash((seed, step)) & 0xFFFFFFFF


@dataclass
class DFlashOptions(DraftConfig):
    """``draft.*`` keys of a DFlash draft: decoder layers, block = anchor + block_size - 1 drafted
    tokens, anchors per sequence and step, the block loss's position weights (``loss_weighting``: the
    decay exp(-(k-1)/loss_gamma), or D-PACE's expected accepted drafts smoothed by ``dpace_alpha``),
    the mask token (None = the highest target id the training data never use as an assistant token)
    and the sliding window (None = full attention over the context)."""

    num_layers: int = field(default=3, metadata={"at_least": 1})
    block_size: int = field(default=16, metadata={"at_least": 2})
    num_anchors: int = field(default=64, metadata={"at_least": 1})
    loss_gamma: float = field(default=7.0, metadata={"positive": True})
    loss_weighting: Literal["decay", "dpace"] = "decay"  # the block rows' loss weights (loss.dpace_weights)
    dpace_alpha: float = field(default=0.5, metadata={"unit": "(0, 1]"})  # D-PACE's confidence smoothing
    mask_token_id: Optional[int] = field(default=None, metadata={"at_least": 0})
    # tokens back from a block row's own position it sees of the context (model.py); None = all of it
    sliding_window: Optional[int] = field(default=None, metadata={"at_least": 1})


class DFlash(Binds):
    name = "dflash"
    options = DFlashOptions
    architecture = "DFlashDraftModel"
    dynamic_drafting = False  # a block is drafted whole, in one forward
    packs = True  # train.pack_tokens: anchors, blocks, labels and block attention stay inside each packed sample
    packs_sp = False  # ... but not with ring SP: its ring kernel takes no sample ids (sp.py)
    llamacpp_spec_type = "draft-dflash"
    gguf_architecture = "dflash"
    engines = ("sglang", "vllm", "llama.cpp")
    title = "DFlash"  # how messages name it
    ring_sp = True  # ring sequence parallelism (sp.py); a subclass whose loss does not take it says False
    saved = FORMAT  # its saved folder's functions (export.BlockFormat): a subclass names its own export's

    def config_errors(self, cfg) -> list[str]:
        errors = [] if cfg.model.aux_layer_ids is None else aux_layer_errors(cfg.model.aux_layer_ids)
        w = getattr(cfg.draft, "sliding_window", None)
        if w is not None and w < cfg.draft.block_size:
            errors.append(f"config key 'draft.sliding_window'={w} is below 'draft.block_size'={cfg.draft.block_size}: "
                          "a block's rows must see each other; use at least the block size, or null (full attention)")
        return errors

    # ---------------------------------------------------------------- bound to a run (bind)

    def feature_layers(self, num_layers: int) -> list[int]:
        return layer_ids_or_default(self.run.aux_layer_ids, num_layers,
                                    default_target_layer_ids(num_layers, self.opt.num_layers))

    def draft_vocab_size(self, target_vocab_size: int) -> int:
        """DFlash predicts the target's whole vocabulary (its public format has no draft vocab): the
        file only marks the ids the data use most, so that the mask token can be one outside them."""
        return min(MOST_USED_IDS, target_vocab_size - 1)

    def identity(self) -> dict:
        """Every draft.* key but init_from (where a fresh run's weights came from, not what a step computes)."""
        return {f"draft.{f.name}": getattr(self.opt, f.name) for f in dataclasses.fields(self.opt)
                if f.name != "init_from"}

    def sp_halo(self) -> int:
        # a block anchored at a ring rank's last row reads labels and loss mask up to block_size - 1 rows past it
        return self.opt.block_size - 1 if self.ring_sp else 0

    def sp_cores(self, draft) -> list:
        # the slot the ring wrapper goes on; the SP path reads its ring (sp.ring_comm), never calls it
        return [(draft, "sp_attention")] if self.ring_sp else []

    def check(self, target_config) -> None:
        p = self.run
        keys = f"config keys 'parallel.sp_ulysses'={p.sp_ulysses} / 'parallel.sp_ring'={p.sp_ring}"
        if p.sp_ring > 1 and not self.ring_sp:
            raise ValueError(f"{keys}: {self.title} has no sequence parallelism; use 1 and data parallelism "
                             "(train.num_workers)")
        if p.sp_ulysses > 1:
            raise ValueError(f"{keys}: {self.title} has no Ulysses sequence parallelism" +
                             (", only ring (parallel.sp_ring)" if self.ring_sp else "") + "; use parallel.sp_ulysses=1")
        m = self.opt.mask_token_id
        if m is not None and m >= target_config.vocab_size:
            raise ValueError(f"config key 'draft.mask_token_id'={m} is not a token of the target "
                             f"({target_config.vocab_size} tokens)")

    def _draft_config(self, target, vocab):
        d = self.opt
        mask = d.mask_token_id
        if mask is None:  # the highest id outside the draft vocab: never a frequent assistant token
            mask = int((~vocab.t2d.bool()).nonzero().max())
        shape = {k: getattr(d, k) for k in ("intermediate_size", "num_attention_heads", "num_key_value_heads",
                                            "head_dim", "rope_theta", "rms_norm_eps") if getattr(d, k) is not None}
        return DFlashConfig.from_target(target.config, mask_token_id=mask, num_hidden_layers=d.num_layers,
                                        target_layer_ids=list(target.aux_layer_ids), block_size=d.block_size,
                                        sliding_window=d.sliding_window, **shape)

    def _new_draft(self, dcfg):
        return DFlashDraft(dcfg)

    def build_draft(self, target, vocab):
        dcfg = self._draft_config(target, vocab)
        with torch.random.fork_rng(devices=[]):  # the init is a function of the seed alone
            torch.manual_seed(self.run.seed)
            draft = self._new_draft(dcfg)
        return draft.set_target_weights(target.embed_weight_VH, target.lm_head_weight_VH)

    def train_state(self, target, vocab):
        return None

    def _anchors(self, draft, batch, step: int, training: bool):
        """``(anchors, keep, ring)``: the micro-batch's anchors, as indices into this rank's rows; ``ring``
        (``sp.RingBlocks``) on a ring rank (the anchors drawn over the whole micro-batch, whose ids and
        loss mask the ranks all-gather, then those in its rows kept), else None."""
        step = step if training else EVAL_STEP
        comm = ring_comm(draft) if hasattr(batch, "num_rows") else None
        if comm is None:
            doc_ids_BT = getattr(batch, "doc_ids_BT", None)  # packed rows (data/packing.py): anchors per sample
            keys = anchor_keys(batch.input_ids_BT, batch.loss_mask_BT, anchor_seed(self.run.seed, step), doc_ids_BT)
            anchors, keep = sample_anchors(batch.loss_mask_BT, self.opt.num_anchors, doc_ids_BT=doc_ids_BT,
                                           keys_BT=keys)
            ring = None
        else:
            C = batch.num_rows
            ids = gather_rows(batch.input_ids_BT[:, :C], comm)
            mask = gather_rows(batch.loss_mask_BT[:, :C], comm)
            keys = anchor_keys(ids, mask, anchor_seed(self.run.seed, step))
            anchors, keep = sample_anchors(mask, self.opt.num_anchors, keys_BT=keys)
            anchors, keep = local_anchors(anchors, keep, batch.start, batch.start + C)
            ring = RingBlocks(comm, batch.start)
        return anchors, keep, ring

    @property
    def drawn(self) -> DrawnOnce:
        """The micro-batches' anchors and targets, drawn once for the normalizer and the loss; each bound
        copy its own (``Binds.bind`` copies the registry's object)."""
        if "_drawn" not in vars(self):
            self._drawn = DrawnOnce()
        return self._drawn

    def _blocks(self, draft, batch, step: int, training: bool):
        def draw():
            c = draft.config
            anchors, keep, ring = self._anchors(draft, batch, step, training)
            labels = next_token_labels(batch.input_ids_BT, batch.target_ids_BT)
            labels_BNK, valid = block_targets(labels, batch.loss_mask_BT, anchors, keep, c.block_size,
                                              getattr(batch, "doc_ids_BT", None))
            return anchors, keep, labels_BNK, valid, ring

        if hasattr(batch, "num_rows"):  # a ring rank: its draw is collective (an all-gather); each call draws
            return draw()
        return self.drawn.get("blocks", batch, step, training, draw)

    def normalizer(self, draft, batch, step: int, *, training: bool) -> torch.Tensor:
        valid = self._blocks(draft, batch, step, training)[3]
        return self.weight_sum(valid)

    @property
    def dpace_alpha(self) -> Optional[float]:
        """D-PACE's smoothing where ``draft.loss_weighting=dpace``, else None (the decay)."""
        return self.opt.dpace_alpha if self.opt.loss_weighting == "dpace" else None

    @property
    def decay_gamma(self) -> Optional[float]:
        """The decay's gamma for the loss and its logged ``loss`` (None under D-PACE: rows weigh alike there)."""
        return None if self.dpace_alpha is not None else self.opt.loss_gamma

    def weight_sum(self, valid: torch.Tensor) -> torch.Tensor:
        """The loss's denominator of a micro-batch's counted rows (``loss.counted_weight``). Under D-PACE block
        row 0 (the anchor, or the shifted layouts' unpredicted row) is left out; the decay weighs it 0."""
        dpace = self.dpace_alpha is not None
        return counted_weight(valid[..., 1:] if dpace else valid, self.opt.loss_gamma, dpace)

    @staticmethod
    def loss_normalizer(normalizer: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
        """The global denominator as the block losses divide by it: fp32 on the device (None: the
        micro-batch's own). DSpark and DFlash2 divide by it too."""
        return None if normalizer is None else torch.as_tensor(normalizer, dtype=torch.float32, device=device)

    def loss(self, draft, batch, state, step: int, normalizer: Optional[torch.Tensor], *, training: bool):
        c = draft.config
        anchors, keep, labels, valid, ring = self._blocks(draft, batch, step, training)
        block_ids = build_block_ids(batch.input_ids_BT, anchors, c.block_size, c.mask_token_id)
        if ring is None:  # packed rows: positions restart per sample, a block sees its own sample only
            hidden = draft(batch.aux_hidden_BTKH, block_ids, anchors, keep, getattr(batch, "position_ids_BT", None),
                           getattr(batch, "doc_ids_BT", None))
        else:
            hidden = draft(batch.aux_hidden_BTKH, block_ids, anchors, keep, batch.position_ids_BT, ring=ring)
        norm = self.loss_normalizer(normalizer, hidden.device)
        return block_loss(draft.logits, hidden, labels, valid, self.opt.loss_gamma, norm, CHUNK_BLOCKS,
                          dpace_alpha=self.dpace_alpha)

    def counts_shape(self) -> tuple[int, int]:
        return (self.opt.block_size, 4)

    def metrics(self, counts: torch.Tensor) -> dict[str, float]:
        # block row k drafts the k-th token after the anchor: logged as position k-1, as EAGLE-3's
        # acc_0 is its first drafted token, so dashboards and the end-of-run line read both alike
        return drafted_metrics(counts, self.decay_gamma)

    def memory_step(self, draft, shape, precision, gpu: bool) -> dict:
        # ring SP: a rank holds R = T / ring context rows, and in the worst case every block of the
        # micro-batch is anchored in its rows; the ring kernel's held/received K/V blocks, per-row
        # visibility and score chunks are counted as the single process's SDPA terms over R rows
        rows = shape.R if shape.sp > 1 else shape.T
        anchors = anchors_per_row(self.opt.num_anchors, self.run.samples_per_row, shape.T)
        return dflash_step(DFlashDims.of(draft.config), shape.B, rows, anchors, precision)

    def memory_keys(self) -> list[str]:
        return ["draft.num_anchors"]

    # ---------------------------------------------------------------- a saved draft (unbound)

    def hf_config(self, draft) -> dict:
        return self.saved.to_hf_config(draft.config)

    def owns_checkpoint(self, hf_config: dict) -> bool:
        return self.architecture in (hf_config.get("architectures") or [])

    def owns_gguf(self, arch: str, tensor_names: set[str]) -> bool:
        return arch == self.gguf_architecture

    def check_checkpoint(self, path):
        return self.saved.check_checkpoint(path)

    def load(self, path, target):
        self.check_checkpoint(path)  # a truncated or misshapen file is named, as for every checkpoint
        return self.saved.load(path, target.embed_weight_VH, target.lm_head_weight_VH).eval()

    def owns_published(self, hf_config: dict) -> bool:
        return self.owns_checkpoint(hf_config)  # our folder IS z-lab's format

    def read_published(self, path):
        """config.json and every safetensors file; the target's embedding and lm_head, which a z-lab
        folder may carry, are the run's target's (frozen), not loaded."""
        weights = read_safetensors_folder(path, "draft weights file", "give a complete draft folder (copy it again)")
        return (json.loads((Path(path) / "config.json").read_text()),
                {k: v for k, v in weights.items() if not k.startswith(("embed_tokens.", "lm_head."))})

    def tokens_per_round(self, hf_config: dict) -> int:
        return self.saved.tokens_per_round(hf_config)

    def max_tokens_per_round(self, hf_config: dict) -> Optional[int]:
        """One block a round (llama-server clamps n_max to it): DFlash's anchor + block_size - 1
        masks, an anchor-first DSpark block's block_size."""
        return self.tokens_per_round(hf_config)

    def export(self, engine, draft_dir, out_dir, req) -> str:
        return export(engine, draft_dir, out_dir, req)

    def llamacpp_config(self, draft_config: dict, target_config: dict, layer_ids=None) -> dict:
        return llamacpp_config(draft_config, target_config, layer_ids)

    def proposer(self, draft, dtype: Optional[torch.dtype] = None, as_served: bool = False):
        return DFlashProposer(draft, dtype, as_served=as_served)


ALGORITHM = DFlash()
