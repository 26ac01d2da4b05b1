"""P-EAGLE behind the draft-algorithm seam: EAGLE-3's hooks (``algorithms/eagle3/algorithm.py``) where
nothing differs (features, teacher, vocab, TTT loss and metrics, SP halo and cores, memory terms),
its own where something does:

* the draft (``model.py``): EAGLE-3's plus the trained mask embedding and ``mask_hidden``; its
  forward trains all ``draft.parallel_tokens`` depths in one pass (EAGLE-3's TTT loss, depth = step);
* the mask token: ``draft.mask_token_id``, else the tokenizer's mask token, else the first id past the
  tokenizer's (a slot no text produces), else the highest id outside the draft vocab;
* the proposer drafts a block in one forward (no dynamic drafting);
* only vLLM serves it (``parallel_drafting``); SGLang and llama.cpp are refused.

Differences from speculators' trainer, on purpose: every (anchor, depth) row is trained (speculators
subsamples depth d to about max(0.7^d, 0.2) of the rows, COD: the same expected gradient with more
variance), weighted ``draft.ttt_decay**d``; the loss mask is EAGLE-3's shifted one; only the mask row
of the embedding is trained (speculators trains the whole table).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from specforge.algorithms.eagle3.algorithm import Eagle3, Eagle3Options
from specforge.algorithms.eagle3.loss import num_valid_rows
from specforge.algorithms.peagle.export import ONLY_VLLM, check_checkpoint, export, load_peagle, parallel_tokens
from specforge.algorithms.peagle.model import PEagleDraft
from specforge.algorithms.peagle.propose import PEagleProposer
from specforge.algorithms.peagle.published import is_speculators, read_published

__all__ = ["PEagleOptions", "PEagle", "ALGORITHM", "resolve_mask_token_id"]


@dataclass
class PEagleOptions(Eagle3Options):
    """``draft.*`` keys of a P-EAGLE draft: EAGLE-3's, less its chain's (``ttt_length``,
    ``ttt_warmup_steps``: refused), plus the block length and the mask token."""

    parallel_tokens: int = field(default=8, metadata={"at_least": 1})  # K: tokens one forward drafts
    mask_token_id: Optional[int] = field(default=None, metadata={"at_least": 0})  # None: resolve_mask_token_id
    ttt_decay: float = field(default=0.7, metadata={"unit": "(0, 1]"})  # depth d's loss weight: ttt_decay**d


def resolve_mask_token_id(options, tokenizer, vocab_size: int, t2d: torch.Tensor) -> int:
    """``draft.mask_token_id``, else the tokenizer's mask token, else ``len(tokenizer)`` (an id the
    tokenizer never produces) when the target has such a slot, else the highest id outside the draft
    vocab (never one of the frequent assistant tokens). Its embedding row is trained either way."""
    if options.mask_token_id is not None:
        return int(options.mask_token_id)
    if tokenizer is not None:
        m = getattr(tokenizer, "mask_token_id", None)
        if m is not None and 0 <= int(m) < vocab_size:
            return int(m)
        if len(tokenizer) < vocab_size:
            return len(tokenizer)
    outside = (~t2d.bool()).nonzero()
    return int(outside.max()) if outside.numel() else vocab_size - 1


class PEagle(Eagle3):
    name = "peagle"
    options = PEagleOptions
    architecture = "LlamaForCausalLMPEagle"
    dynamic_drafting = False  # a block is drafted whole, in one forward
    packs = True  # train.pack_tokens: EAGLE-3's loss and cores keep packed samples apart (its forward passes doc ids)
    packs_sp = False  # ... but not with sequence parallelism: not checked against the single process yet
    llamacpp_spec_type = None  # llama.cpp has no parallel drafting
    gguf_architecture = None
    engines = ("vllm",)

    def config_errors(self, cfg) -> list[str]:
        errors = super().config_errors(cfg)
        for key, fix in (("ttt_length", "draft.parallel_tokens sets the depths it trains"),
                         ("ttt_warmup_steps", "it has no chain to warm up"),
                         ("sliding_window", "a P-EAGLE draft attends the whole context here")):
            if getattr(cfg.draft, key) != getattr(Eagle3Options, key):
                errors.append(f"config key 'draft.{key}'={getattr(cfg.draft, key)!r} applies to "
                              f"draft.algorithm=eagle3, not peagle ({fix}); remove it")
        return errors

    def identity(self) -> dict:
        out = super().identity()
        for key in ("draft.ttt_length", "train.ttt_warmup_steps"):  # refused: never differ
            out.pop(key, None)
        return out

    def sp_halo(self) -> int:
        """Depth d of row t reads x_{t+1} (depth 0), the teacher/argmax at t+1+d, the loss mask at t+2+d."""
        return self.opt.parallel_tokens + 1

    def check(self, target_config) -> None:
        super().check(target_config)
        H = self.opt.hidden_size
        if H is not None and H != target_config.hidden_size:
            raise ValueError(f"config key 'draft.hidden_size'={H}: a P-EAGLE draft has the target's hidden size "
                             f"({target_config.hidden_size}; speculators' and vLLM's loaders refuse another); "
                             "remove it")
        m = self.opt.mask_token_id
        if m is not None and m >= target_config.vocab_size:
            raise ValueError(f"config key 'draft.mask_token_id'={m} is not a token of the target "
                             f"({target_config.vocab_size} tokens)")

    def build_draft(self, target, vocab):
        """EAGLE-3's draft as EAGLE-3 builds it (the same tensors), with the mask: its embedding the
        target's row of the mask token, ``mask_hidden`` random (a function of the seed alone)."""
        base = super().build_draft(target, vocab)
        if base.config.hidden_size != base.config.target_hidden_size:  # check() names the key first
            raise ValueError(f"config key 'draft.hidden_size'={self.opt.hidden_size}: a P-EAGLE draft has the "
                             f"target's hidden size ({base.config.target_hidden_size}); remove it")
        mask = resolve_mask_token_id(self.opt, target.tokenizer, base.config.vocab_size, vocab.t2d)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.run.seed + 1)
            draft = PEagleDraft.from_eagle3(base, mask, self.opt.parallel_tokens)
        draft.init_mask_from_target(target.embed_weight_VH)
        return draft

    def unroll_length(self, step: int, training: bool) -> int:
        return self.opt.parallel_tokens  # no chain, no warmup: every depth from the first step

    def normalizer(self, draft, batch, step: int, *, training: bool) -> torch.Tensor:
        return num_valid_rows(batch, draft.t2d, self.opt.parallel_tokens)

    def counts_shape(self) -> tuple[int, int]:
        return (self.opt.parallel_tokens, 4)

    def memory_keys(self) -> list[str]:
        return ["draft.parallel_tokens", *super().memory_keys()]

    # memory_step: EAGLE-3's TTT unroll with L = parallel_tokens (the shape's ttt = sp_halo - 1). A rough
    # but honest bound: the same rows, keys and loss per depth; a depth >= 1 reads one expanded
    # input row instead of the previous step's output, which saves nothing autograd keeps.

    def owns_checkpoint(self, hf_config: dict) -> bool:
        return self.architecture in (hf_config.get("architectures") or [])

    def owns_gguf(self, arch: str, tensor_names: set[str]) -> bool:
        return False  # never converted to GGUF

    def owns_published(self, hf_config: dict) -> bool:
        """Its own folders and speculators' P-EAGLE format (what its vLLM export writes)."""
        return self.owns_checkpoint(hf_config) or is_speculators(hf_config)

    def read_published(self, path):
        return read_published(path)

    def check_checkpoint(self, path):
        return check_checkpoint(path)

    def load(self, path, target):
        return load_peagle(path, target)

    def proposer(self, draft, dtype: Optional[torch.dtype] = None, as_served: bool = False):
        return PEagleProposer(draft, dtype)  # no block to shorten

    def tokens_per_round(self, hf_config: dict) -> int:
        return parallel_tokens(hf_config)

    def max_tokens_per_round(self, hf_config: dict) -> Optional[int]:
        return self.tokens_per_round(hf_config)  # one block a round

    def export(self, engine, draft_dir, out_dir, req) -> str:
        return export(engine, draft_dir, out_dir, req)

    def llamacpp_config(self, draft_config: dict, target_config: dict, layer_ids=None) -> dict:
        raise ValueError(ONLY_VLLM)


ALGORITHM = PEagle()
