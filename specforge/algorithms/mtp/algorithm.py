"""MTP behind the draft-algorithm seam: one MTP layer (``model.py``) trained on the target's last hidden
state over ``draft.num_speculative_steps`` teacher-forced steps (``loss.py``), as speculators 0.9.0 does.

Features: the target's last hidden state (after its final norm; ``last_hidden_BTH``) and the data's
tokens (the labels: speculators trains MTP on the data, not the target's argmax). The one target layer
captured is the last (its output, before the final norm, is what the eval drafts from; ``propose.py``).
Packing keeps samples apart (each step's attention and targets stay inside the row's sample).
Sequence parallelism is refused. Engines: none here serves it, and ``python -m specforge.export``
refuses each in a line (``NO_ENGINE``): our folder is speculators' MTP format, which speculators'
``MTPDraftModel`` loads, but vLLM 0.32 reads no ``mtp`` speculators folder; SGLang and llama.cpp have
no MTP drafting of this format.

Stitching a target's own MTP layers (``draft.stitch_target_mtp``) is refused: the target loader
(transformers' ``from_pretrained``) drops a checkpoint's ``mtp.*`` tensors, and the targets that carry
them (Qwen3-Next, Qwen3.5, DeepSeek-V3, MiMo) build their MTP layer from their own decoder layer
(gated or linear attention, MLA, MoE, biased projections), not the Qwen3 layer this draft is.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from specforge.algorithms.mtp.export import ARCHITECTURE, check_checkpoint, export, load_mtp, to_hf_config
from specforge.algorithms.mtp.export import tokens_per_round as proposal_tokens
from specforge.algorithms.mtp.loss import metrics_from_counts, mtp_loss, step_valid, step_weights
from specforge.algorithms.mtp.memory import MTPDims, mtp_step
from specforge.algorithms.mtp.model import MTPConfig, MTPDraft
from specforge.algorithms.mtp.propose import MTPProposer
from specforge.config import DraftConfig
from specforge.data.vocab import MOST_USED_IDS
from specforge.files import read_safetensors_folder
from specforge.seam import Binds


@dataclass
class MTPOptions(DraftConfig):
    """``draft.*`` keys of an MTP draft (defaults: speculators' trainer): the steps a forward trains
    (``num_speculative_steps``), FastMTP's step-weight decay ``step_weight_beta`` (step k weighs
    ``beta**k``, normalized) and ``stitch_target_mtp`` (start from the target's own MTP layer: refused,
    see the module docstring). The layer is shaped as the target's (the shared shape keys override it)."""

    num_speculative_steps: int = field(default=3, metadata={"at_least": 1})
    step_weight_beta: float = field(default=0.6, metadata={"positive": True})
    stitch_target_mtp: bool = False


NO_ENGINE = {  # why each engine cannot serve an MTP draft folder (checked: vLLM 0.32.0, llama.cpp build 11434)
    "vllm": "vLLM 0.32 reads speculators folders of types eagle3, peagle, dflash, dflash2 and dspark, not mtp; "
            "its own MTP drafting runs a target's built-in MTP layers; the checkpoint folder is speculators' MTP "
            "format (MTPDraftModel.from_pretrained loads it)",
    "sglang": "SGLang has no MTP drafting of speculators' format",
    "llama.cpp": "llama.cpp has no MTP drafting of speculators' format (MTPDraftModel)",
}


class MTP(Binds):
    name = "mtp"
    options = MTPOptions
    architecture = ARCHITECTURE
    dynamic_drafting = False
    packs = True  # train.pack_tokens: attention and targets stay inside each packed sample
    packs_sp = False
    llamacpp_spec_type = None  # llama.cpp has no MTP drafting of speculators' format
    gguf_architecture = None
    engines = ()  # NO_ENGINE: vLLM 0.32 reads no speculators MTP folder
    reads_last_layer = True  # its one feature layer is the target's last (L-1), past EAGLE-3's range (L-2)

    # ---------------------------------------------------------------- configuration (unbound)

    def config_errors(self, cfg) -> list[str]:
        d, errors = cfg.draft, []
        ids = cfg.model.aux_layer_ids
        if ids is not None and len(ids) != 1:
            errors.append(f"config key 'model.aux_layer_ids'={ids}: an MTP draft reads the target's last layer "
                          "alone; remove it (null)")
        if d.stitch_target_mtp:
            errors.append("config key 'draft.stitch_target_mtp'=true: the target loader drops a checkpoint's mtp.* "
                          "tensors and no target's own MTP layer is this draft's Qwen3 layer; use false")
        if cfg.parallel.sp_ulysses > 1 or cfg.parallel.sp_ring > 1:
            errors.append(f"config keys 'parallel.sp_ulysses'={cfg.parallel.sp_ulysses} / 'parallel.sp_ring'="
                          f"{cfg.parallel.sp_ring}: MTP has no sequence parallelism; use 1 and data parallelism "
                          "(train.num_workers)")
        return errors

    # ---------------------------------------------------------------- bound to a run

    def feature_layers(self, num_layers: int) -> list[int]:
        ids = self.run.aux_layer_ids
        if ids is not None and list(ids) != [num_layers - 1]:
            raise ValueError(f"config key 'model.aux_layer_ids'={list(ids)}: an MTP draft reads the target's last "
                             f"layer alone ([{num_layers - 1}]); remove it (null)")
        return [num_layers - 1]

    def check(self, target_config) -> None:
        get = (lambda k: target_config.get(k)) if isinstance(target_config, dict) else (
            lambda k: getattr(target_config, k, None))
        heads, kv = self.opt.num_attention_heads or get("num_attention_heads"), self.opt.num_key_value_heads
        kv = kv or get("num_key_value_heads") or heads
        if heads and kv and heads % kv:
            raise ValueError(f"config key 'draft.num_key_value_heads'={kv} does not divide the {heads} attention "
                             "heads; use a divisor of them")

    def draft_vocab_size(self, target_vocab_size: int) -> int:
        return min(MOST_USED_IDS, target_vocab_size)  # the file only; the draft predicts every token

    def identity(self) -> dict:
        return {f"draft.{f.name}": getattr(self.opt, f.name) for f in dataclasses.fields(self.opt)
                if f.name != "init_from"}

    def sp_halo(self) -> int:
        return 0

    def sp_cores(self, draft) -> list:
        return []

    def weights(self) -> list[float]:
        return step_weights(self.opt.step_weight_beta, self.opt.num_speculative_steps)

    def build_draft(self, target, vocab):
        d = self.opt
        shape = {k: getattr(d, k) for k in ("intermediate_size", "num_attention_heads", "num_key_value_heads",
                                            "head_dim", "rope_theta", "rms_norm_eps") if getattr(d, k) is not None}
        dcfg = MTPConfig.from_target(target.config, num_speculative_steps=d.num_speculative_steps, **shape)
        with torch.random.fork_rng(devices=[]):  # the init is a function of the seed alone
            torch.manual_seed(self.run.seed)
            draft = MTPDraft(dcfg)
        return draft.set_target_weights(target.embed_weight_VH, target.lm_head_weight_VH, target.final_norm_scale_H)

    def train_state(self, target, vocab):
        return None

    def normalizer(self, draft, batch, step: int, *, training: bool) -> torch.Tensor:
        """Each step's counted rows (the loss averages every step over its own, as speculators does):
        a vector on the batch's device, one entry per step."""
        docs = getattr(batch, "doc_ids_BT", None)
        mask = batch.loss_mask_BT
        zero = torch.zeros((), dtype=torch.int64, device=mask.device)
        return torch.stack([step_valid(mask, k, docs).sum() if k < mask.shape[1] - 1 else zero
                            for k in range(self.opt.num_speculative_steps)])

    def loss(self, draft, batch, state, step: int, normalizer, *, training: bool):
        return mtp_loss(draft, batch.last_hidden_BTH, batch.input_ids_BT, batch.loss_mask_BT, self.weights(),
                        normalizer, getattr(batch, "position_ids_BT", None), getattr(batch, "doc_ids_BT", None))

    def counts_shape(self) -> tuple[int, int]:
        return (self.opt.num_speculative_steps, 4)

    def metrics(self, counts: torch.Tensor) -> dict[str, float]:
        return metrics_from_counts(counts, self.weights())

    def memory_step(self, draft, shape, precision, gpu: bool) -> dict:
        return mtp_step(MTPDims.of(draft.config), shape.B, shape.T, precision, packed=self.run.samples_per_row > 1)

    def memory_keys(self) -> list[str]:
        return ["draft.num_speculative_steps (each step keeps its activations and fp32 log-softmax)"]

    # ---------------------------------------------------------------- a saved draft (unbound)

    def hf_config(self, draft) -> dict:
        return to_hf_config(draft.config)

    def owns_checkpoint(self, hf_config: dict) -> bool:
        return (self.architecture in (hf_config.get("architectures") or [])
                and hf_config.get("speculators_model_type") == "mtp")

    def owns_gguf(self, arch: str, tensor_names: set[str]) -> bool:
        return False

    def check_checkpoint(self, path):
        return check_checkpoint(path)

    def load(self, path, target):
        self.check_checkpoint(path)
        return load_mtp(path, target).eval()

    def owns_published(self, hf_config: dict) -> bool:
        return self.owns_checkpoint(hf_config)  # our folder IS speculators' format

    def read_published(self, path):
        weights = read_safetensors_folder(path, "draft weights file", "give a complete draft folder (copy it again)")
        return (json.loads((Path(path) / "config.json").read_text()),
                {k: v for k, v in weights.items() if k.startswith("mtp_layers.")})

    def recorded_layers(self, hf_config: dict) -> Optional[list[int]]:
        """The target's last layer: an MTP draft reads nothing else (its folder records the target's
        layer count, ``transformer_layer_config.num_hidden_layers``)."""
        layers = (hf_config.get("transformer_layer_config") or {}).get("num_hidden_layers")
        return None if layers is None else [int(layers) - 1]

    def tokens_per_round(self, hf_config: dict) -> int:
        return proposal_tokens(hf_config)

    def max_tokens_per_round(self, hf_config: dict) -> Optional[int]:
        return None  # a chain: one step a token, as many as asked

    def export(self, engine, draft_dir, out_dir, req) -> str:
        return export(engine, draft_dir, out_dir, req)

    def llamacpp_config(self, draft_config: dict, target_config: dict, layer_ids=None) -> dict:
        raise ValueError(NO_ENGINE["llama.cpp"])

    def refusal(self, engine: str) -> Optional[str]:
        return NO_ENGINE.get(engine)

    def proposer(self, draft, dtype: Optional[torch.dtype] = None, as_served: bool = False):
        return MTPProposer(draft, dtype)  # no block to shorten


ALGORITHM = MTP()
