"""EAGLE-3 behind the draft-algorithm seam: the draft (``models/draft.py``, SGLang's
``LlamaForCausalLMEagle3`` layout), the TTT loss (``train/ttt.py``), its proposer (``propose.py``).

Features: 3 target layer outputs (``model.aux_layer_ids``, default [1, L//2 - 1, L - 4]) fused by
``fc``, and the last hidden state, from which the train side rebuilds the teacher over the draft
vocabulary with the target's lm_head rows and its final logit soft-cap (``train_state``).
"""

from __future__ import annotations

from typing import Optional

import torch

from specforge.config import aux_layer_ids


class Eagle3:
    name = "eagle3"
    dynamic_drafting = True  # the eval also runs its chain with cost-based early stops

    def feature_layers(self, cfg, num_layers: int) -> list[int]:
        return aux_layer_ids(cfg.model, num_layers)

    def check(self, cfg, target_config) -> None:
        if cfg.draft.vocab_size > target_config.vocab_size:
            raise ValueError(f"config key 'draft.vocab_size'={cfg.draft.vocab_size} exceeds the target's vocabulary "
                             f"({target_config.vocab_size} tokens); choose at most {target_config.vocab_size}")

    def build_draft(self, cfg, target, vocab):
        """A fresh draft shaped from the target, embedding copied (frozen), lm_head warm-started."""
        from specforge.models.draft import Eagle3Draft, draft_config_from_target
        from specforge.models.target import _decoder_layers

        dcfg = draft_config_from_target(target.config, cfg.draft, target.aux_layer_ids)
        with torch.random.fork_rng(devices=[]):  # the init is a function of the seed alone, whatever ran before
            torch.manual_seed(cfg.train.seed)
            draft = Eagle3Draft(dcfg)
        draft.set_vocab(vocab.d2t, vocab.t2d)
        draft.init_embeddings_from_target(target.embed_weight_VH)
        if cfg.draft.init_lm_head_from_target and dcfg.hidden_size == dcfg.target_hidden_size:
            draft.init_lm_head_from_target(target.lm_head_weight_VH)
            with torch.no_grad():  # lm_head rows were trained against this norm's scale (Gemma-style: 1 + w)
                draft.norm.weight.copy_(target.final_norm_scale_H.to(draft.norm.weight))
        if cfg.draft.init_midlayer_from_target:
            layers = _decoder_layers(target.model)
            draft.init_midlayer_from_target(layers[min(max(target.aux_layer_ids) + 1, len(layers) - 1)],
                                            target.aux_layer_ids.index(max(target.aux_layer_ids)))
        return draft

    def train_state(self, cfg, target, vocab):
        """The teacher over the draft vocab (a ``TeacherHead``): the target's lm_head rows of the
        draft vocab (N x H) and its family's final logit soft-cap, if its HF class applies one."""
        from specforge.targets import logit_softcap
        from specforge.train.ttt import TeacherHead, teacher_weight_from_target

        return TeacherHead(teacher_weight_from_target(target.lm_head_weight_VH, vocab.d2t).clone(),
                           logit_softcap(target.model.config))

    def unroll_length(self, cfg, step: int, training: bool) -> int:
        """TTT steps a step trains: 1 during ``train.ttt_warmup_steps``, then ``draft.ttt_length``
        (evaluation: always all). A function of the step alone, so every rank agrees without talking."""
        return 1 if training and step < cfg.train.ttt_warmup_steps else cfg.draft.ttt_length

    def normalizer(self, draft, batch, cfg, step: int) -> float:
        from specforge.train.ttt import num_valid_rows

        return float(num_valid_rows(batch, draft.t2d, cfg.draft.ttt_length))

    def loss(self, draft, batch, state, cfg, step: int, normalizer: Optional[float]):
        from specforge.train.ttt import TeacherHead, ttt_loss

        steps = self.unroll_length(cfg, step, torch.is_grad_enabled())
        total = None if normalizer is None else max(normalizer, 1.0)  # no valid row anywhere: a zero loss
        head = state if isinstance(state, TeacherHead) else TeacherHead(state)  # a bare N x H tensor: no soft-cap
        return ttt_loss(draft, batch, head.weight_NH, steps, cfg.draft.ttt_decay, num_valid_global=total,
                        softcap=head.softcap)

    def counts_shape(self, cfg) -> tuple[int, int]:
        return (cfg.draft.ttt_length, 4)

    def metrics(self, counts: torch.Tensor, cfg) -> dict[str, float]:
        from specforge.train.ttt import metrics_from_counts

        return metrics_from_counts(counts, cfg.draft.ttt_decay)

    def hf_config(self, draft) -> dict:
        return draft.config.to_hf_config()

    def load(self, path, target):
        from specforge.train.checkpoint import load_draft

        return load_draft(path, target)

    def proposer(self, draft, dtype: Optional[torch.dtype] = None):
        from specforge.algorithms.eagle3.propose import EagleProposer

        return EagleProposer(draft, dtype)


ALGORITHM = Eagle3()
