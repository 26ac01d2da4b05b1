"""EAGLE-3 behind the draft-algorithm seam: the draft (``algorithms/eagle3/model.py``, SGLang's
``LlamaForCausalLMEagle3`` layout), the TTT loss (``algorithms/eagle3/loss.py``), its proposer (``propose.py``).

Features: 3 target layer outputs (``model.aux_layer_ids``, default [1, L//2 - 1, L - 4]) fused by
``fc``, and the last hidden state, from which the train side rebuilds the teacher over the draft
vocabulary with the target's lm_head rows and its final logit soft-cap (``train_state``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Optional

import torch

from specforge.algorithms.eagle3 import loss as loss_module
from specforge.algorithms.eagle3.attention import CHOICES, pick_impl
from specforge.algorithms.eagle3.export import (
    DEFAULT_SPECULATIVE_TOKENS,
    check_checkpoint,
    export,
    llamacpp_config,
    load_eagle3,
)
from specforge.algorithms.eagle3.loss import (
    TeacherHead,
    loss_chunk,
    metrics_from_counts,
    num_valid_rows,
    teacher_weight_from_target,
    ttt_loss,
)
from specforge.algorithms.eagle3.memory import Eagle3Dims, attention_chunk, eagle3_step
from specforge.algorithms.eagle3.model import Eagle3Draft, draft_config_from_target
from specforge.algorithms.eagle3.propose import EagleProposer
from specforge.algorithms.eagle3.published import as_ours, is_speculators, read_published
from specforge.config import DraftConfig, aux_layer_errors, layer_ids_or_default
from specforge.kernels.losses import KINDS as LOSS_KINDS
from specforge.kernels.losses import WORKSET as LOSS_WORKSET
from specforge.seam import Binds
from specforge.targets import logit_softcap


@dataclass
class Eagle3Options(DraftConfig):
    """``draft.*`` keys of an EAGLE-3 draft (besides the shared ones of ``DraftConfig``)."""

    # the draft vocabulary: the target tokens the train split's loss positions use most (data/vocab.py)
    vocab_size: int = field(default=32000, metadata={"at_least": 2})
    hidden_size: Optional[int] = field(default=None, metadata={"at_least": 1})  # None = the target's
    init_lm_head_from_target: bool = True
    init_midlayer_from_target: bool = False  # start from the target layer after the deepest aux layer
    ttt_length: int = field(default=7, metadata={"at_least": 1})
    ttt_decay: float = field(default=0.8, metadata={"unit": "(0, 1]"})
    # the first N steps train TTT step 0 only (5x cheaper), then draft.ttt_length
    ttt_warmup_steps: int = field(default=0, metadata={"at_least": 0})
    # TTT attention core, one of attention.CHOICES: auto (fast on a CPU; on CUDA flex, sdpa for packed rows:
    # attention.pick_impl, measured on an H200) or a core by name; flex: compiled flex_attention on CUDA
    attention: Literal[CHOICES] = "auto"
    # sliding-window attention (tokens; None = full): a draft query at position p sees the keys at
    # positions > p - sliding_window, in training and drafting (attention.py); served by vLLM
    sliding_window: Optional[int] = field(default=None, metadata={"at_least": 1})


AUX_LAYERS = 3  # target layer outputs an EAGLE-3 draft fuses (SGLang's eagle_aux_hidden_state_layer_ids)
# keys that do not change what a step computes, left out of a checkpoint's identity (init_from: where a
# fresh run's weights came from; the vocab mapping it brings is in the identity through its hash)
_NOT_IDENTITY = ("algorithm", "attention", "init_from")


def default_layers(num_layers: int) -> list[int]:
    """EAGLE-3's default target layer outputs: [1, L//2 - 1, L - 4]."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def aux_layer_ids(model_cfg, num_layers: int) -> list[int]:
    """The target layer outputs an EAGLE-3 draft fuses (``model.aux_layer_ids`` of ``model_cfg``, a
    ``ModelConfig``, or the default); a ValueError naming the key unless 3 sorted unique ids in 0..L-2."""
    return eagle3_layers(model_cfg.aux_layer_ids, num_layers)


def eagle3_layers(ids, num_layers: int) -> list[int]:
    """``ids`` (``model.aux_layer_ids``) checked, or the default when None."""
    return layer_ids_or_default(ids, num_layers, default_layers(num_layers), AUX_LAYERS, "an EAGLE-3 draft")


class Eagle3(Binds):
    name = "eagle3"
    options = Eagle3Options
    architecture = "LlamaForCausalLMEagle3"
    dynamic_drafting = True  # the eval also runs its chain with cost-based early stops
    losses = LOSS_KINDS  # train.loss: every row loss of kernels/losses.py (its teacher is the target's distribution)
    packs = True  # train.pack_tokens: its loss keeps packed samples apart (doc_ids_BT, position_ids_BT)
    packs_sp = True  # ... with SP too: the Ulysses and ring wrappers gather the rows' sample ids (parallel/sp.py)
    llamacpp_spec_type = "draft-eagle3"
    gguf_architecture = "eagle3"
    engines = ("sglang", "vllm", "llama.cpp")

    def config_errors(self, cfg) -> list[str]:
        ids = cfg.model.aux_layer_ids
        errors = [] if ids is None else aux_layer_errors(ids, count=AUX_LAYERS, who="an EAGLE-3 draft")
        w, seen = cfg.draft.sliding_window, self.diagonal_keys(cfg.draft)
        if w is not None and w <= seen:
            errors.append(f"config key 'draft.sliding_window'={w} must exceed {seen} (a drafted token must see "
                          f"the {seen} drafted before it); choose at least {seen + 1}, typically 1024 or more")
        if cfg.draft.attention == "flex" and cfg.parallel.sp_ring > 1:
            errors.append(f"config key 'draft.attention'='flex' does not apply with parallel.sp_ring="
                          f"{cfg.parallel.sp_ring}: ring attention runs its own block kernels (parallel/ring.py); "
                          "use draft.attention=auto, or parallel.sp_ulysses instead of the ring")
        return errors

    def diagonal_keys(self, options) -> int:
        """The most draft-token keys one query attends besides the step-0 ones (TTT steps - 1)."""
        return options.ttt_length - 1

    # ---------------------------------------------------------------- bound to a run (bind)

    def feature_layers(self, num_layers: int) -> list[int]:
        return eagle3_layers(self.run.aux_layer_ids, num_layers)

    def draft_vocab_size(self, target_vocab_size: int) -> int:
        return self.opt.vocab_size

    def identity(self) -> dict:
        """Every draft.* key but the attention impl and init_from, under the names every EAGLE-3
        checkpoint's identity holds (so each resumes): without the algorithm's name, ttt_warmup_steps
        as train.ttt_warmup_steps, sliding_window only when set."""
        out = {f"draft.{f.name}": getattr(self.opt, f.name) for f in dataclasses.fields(self.opt)
               if f.name not in _NOT_IDENTITY}
        out["train.ttt_warmup_steps"] = out.pop("draft.ttt_warmup_steps")
        if out["draft.sliding_window"] is None:  # full attention: no key, as identities without a window hold
            del out["draft.sliding_window"]
        return out

    def sp_halo(self) -> int:
        """Step i of row t reads x_{t+1+i}, the teacher/argmax at t+1+i and the loss mask at t+2+i."""
        return self.opt.ttt_length + 1

    def sp_cores(self, draft) -> list:
        return [(draft.midlayer.self_attn, "core")]

    def check(self, target_config) -> None:
        if self.opt.vocab_size > target_config.vocab_size:
            raise ValueError(f"config key 'draft.vocab_size'={self.opt.vocab_size} exceeds the target's vocabulary "
                             f"({target_config.vocab_size} tokens); choose at most {target_config.vocab_size}")

    def build_draft(self, target, vocab):
        """A fresh draft shaped from the target, embedding copied (frozen), lm_head warm-started."""
        dcfg = draft_config_from_target(target.config, self.opt, target.aux_layer_ids)
        with torch.random.fork_rng(devices=[]):  # the init is a function of the seed alone, whatever ran before
            torch.manual_seed(self.run.seed)
            draft = Eagle3Draft(dcfg)
        draft.set_vocab(vocab.d2t, vocab.t2d)
        draft.init_embeddings_from_target(target.embed_weight_VH)
        if self.opt.init_lm_head_from_target and dcfg.hidden_size == dcfg.target_hidden_size:
            draft.init_lm_head_from_target(target.lm_head_weight_VH)
            with torch.no_grad():  # lm_head rows were trained against this norm's scale (Gemma-style: 1 + w)
                draft.norm.weight.copy_(target.final_norm_scale_H.to(draft.norm.weight))
        if self.opt.init_midlayer_from_target:
            layers = target.decoder_layers
            draft.init_midlayer_from_target(layers[min(max(target.aux_layer_ids) + 1, len(layers) - 1)],
                                            target.aux_layer_ids.index(max(target.aux_layer_ids)))
        return draft

    def train_state(self, target, vocab):
        """The teacher over the draft vocab (a ``TeacherHead``): the target's lm_head rows of the
        draft vocab (N x H) and its family's final logit soft-cap, if its HF class applies one."""
        return TeacherHead(teacher_weight_from_target(target.lm_head_weight_VH, vocab.d2t).clone(),
                           logit_softcap(target.model.config))

    def unroll_length(self, step: int, training: bool) -> int:
        """TTT steps a step trains: 1 during ``draft.ttt_warmup_steps``, then ``draft.ttt_length``
        (evaluation: always all). A function of the step alone, so every rank agrees without talking."""
        return 1 if training and step < self.opt.ttt_warmup_steps else self.opt.ttt_length

    def normalizer(self, draft, batch, step: int, *, training: bool) -> torch.Tensor:
        return num_valid_rows(batch, draft.t2d, self.opt.ttt_length)

    def loss(self, draft, batch, state, step: int, normalizer: Optional[torch.Tensor], *, training: bool):
        steps = self.unroll_length(step, training)
        total = None if normalizer is None else normalizer.clamp(min=1.0)  # no valid row anywhere: a zero loss
        head = state if isinstance(state, TeacherHead) else TeacherHead(state)  # a bare N x H tensor: no soft-cap
        return ttt_loss(draft, batch, head.weight_NH, steps, self.opt.ttt_decay, num_valid_global=total,
                        softcap=head.softcap, loss_kind=self.run.loss)

    def counts_shape(self) -> tuple[int, int]:
        return (self.opt.ttt_length, 4)

    def metrics(self, counts: torch.Tensor) -> dict[str, float]:
        return metrics_from_counts(counts, self.opt.ttt_decay)

    def memory_step(self, draft, shape, precision, gpu: bool) -> dict:
        d = Eagle3Dims.of(draft.config)
        # a GPU's SDPA (fused) computes step 0's causal attention without keeping its probabilities;
        # flex (every step fused, no probabilities) is counted by its own terms
        core = pick_impl(self.opt.attention, "cuda" if gpu else "cpu")  # auto on a GPU: flex (unpacked rows)
        precision = dataclasses.replace(precision, step0_fused=core == "sdpa"
                                        and self.opt.sliding_window is None)  # a window: the fast core
        rows = int(loss_chunk(torch.device("cuda" if gpu else "cpu"), d.N))  # the fused loss's rows per chunk
        core = "flex" if core == "flex" else "fast"
        # on a GPU every kind's chunk runs the fused kernel (loss.kernel_default), which holds no more than
        # kl_div's torch rows (H200: 1.0 GiB at 8,192 rows for every kind, kl_div's torch rows 1.4)
        kernel = gpu and loss_module.SOFT_CE_KERNEL is not False
        return eagle3_step(d, shape, precision, attention_chunk(gpu), rows, self.opt.sliding_window, core,
                           LOSS_WORKSET["kl_div" if kernel else self.run.loss])

    def memory_keys(self) -> list[str]:
        return ["parallel.sp_ulysses / parallel.sp_ring (split T)",
                "draft.sliding_window (bounds the keys a row scores)"]

    # ---------------------------------------------------------------- a saved draft (unbound)

    def hf_config(self, draft) -> dict:
        return draft.config.to_hf_config()

    def owns_checkpoint(self, hf_config: dict) -> bool:
        return self.architecture in (hf_config.get("architectures") or [])

    def owns_gguf(self, arch: str, tensor_names: set[str]) -> bool:
        return arch == self.gguf_architecture

    def check_checkpoint(self, path):
        return check_checkpoint(path)

    def load(self, path, target):
        return load_eagle3(path, target)

    def owns_published(self, hf_config: dict) -> bool:
        """Its own folders (SGLang's format), and a speculators EAGLE-3 export whose flags make it
        this algorithm's (``owns_checkpoint`` of those fields named as ours)."""
        return self.owns_checkpoint(hf_config) or (is_speculators(hf_config)
                                                   and self.owns_checkpoint(as_ours(hf_config)))

    def read_published(self, path):
        return read_published(path)

    def proposer(self, draft, dtype: Optional[torch.dtype] = None, as_served: bool = False):
        return EagleProposer(draft, dtype)  # no block to shorten

    def tokens_per_round(self, hf_config: dict) -> int:
        return DEFAULT_SPECULATIVE_TOKENS

    def max_tokens_per_round(self, hf_config: dict) -> Optional[int]:
        return None  # a chain: one forward a token, as many as asked

    def export(self, engine, draft_dir, out_dir, req) -> str:
        return export(engine, draft_dir, out_dir, req)

    def llamacpp_config(self, draft_config: dict, target_config: dict, layer_ids=None) -> dict:
        return llamacpp_config(draft_config, target_config, layer_ids)


ALGORITHM = Eagle3()
