"""A tiny draft algorithm written as docs/ARCHITECTURE.md's "Add an algorithm" says, for
tests/test_add_an_algorithm.py to register and run end to end: a bigram draft (the next token from the
current one, an embedding and a linear head) trained on the target's greedy tokens, drafting a chain by
feeding itself. It plays every role of ``specforge/seam.py`` with the least each role allows: no engine
serves it, it reads no target layer, it keeps no memory terms."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from specforge.config import DraftConfig, layer_ids_or_default
from specforge.seam import Binds
from specforge.training.checkpoint import load_draft_folder

NAME, ARCHITECTURE = "example", "ExampleBigramDraft"


@dataclass
class ExampleOptions(DraftConfig):
    """The ``draft.*`` keys it reads besides every algorithm's."""

    hidden: int = 16


class BigramDraft(nn.Module):
    def __init__(self, vocab_size: int, hidden: int):
        super().__init__()
        self.vocab_size, self.hidden = vocab_size, hidden
        self.embed = nn.Embedding(vocab_size, hidden)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))

    def export_state_dict(self) -> dict[str, torch.Tensor]:  # what a checkpoint saves
        return self.state_dict()


class BigramProposer:
    """The eval's proposer: the anchor's bigram, then its own drafts', one token a forward."""

    def __init__(self, draft: BigramDraft, dtype: Optional[torch.dtype] = None):
        self.draft, self.anchor = draft if dtype is None else draft.to(dtype), 0

    def start(self, ids: list[int], aux_TH: torch.Tensor) -> None:
        self.anchor = ids[-1]

    @torch.no_grad()
    def propose(self, k: int, costs=None) -> list[int]:
        out, prev = [], self.anchor
        for _ in range(k):
            prev = int(self.draft(torch.tensor([prev])).argmax(-1))
            out.append(prev)
        return out

    def accept(self, new_tokens: list[int], aux_TH: torch.Tensor) -> None:
        self.anchor = new_tokens[-1]


class Example(Binds):
    # Configured
    name, options, reads_last_layer = NAME, ExampleOptions, False
    # Format
    architecture, refines, engines, llamacpp_spec_type, gguf_architecture = ARCHITECTURE, None, (), None, None
    # Drafting
    dynamic_drafting = False
    # Training
    packs = packs_sp = False

    def config_errors(self, cfg) -> list[str]:
        return [] if cfg.draft.hidden > 0 else [f"config key 'draft.hidden'={cfg.draft.hidden}: expected > 0"]

    # ---------------------------------------------------------------- bound to a run
    def feature_layers(self, num_layers: int) -> list[int]:
        return layer_ids_or_default(self.run.aux_layer_ids, num_layers, [num_layers // 2])

    def check(self, target_config) -> None:
        return None

    def draft_vocab_size(self, target_vocab_size: int) -> int:
        return target_vocab_size

    def identity(self) -> dict:
        return {"draft.hidden": self.opt.hidden}

    def sp_halo(self) -> int:
        return 0  # sequence parallelism refused

    def sp_cores(self, draft) -> list:
        return []

    def build_draft(self, target, vocab) -> BigramDraft:
        with torch.random.fork_rng(devices=[]):  # the init is a function of the seed alone
            torch.manual_seed(self.run.seed)
            return BigramDraft(target.config.vocab_size, self.opt.hidden)

    def train_state(self, target, vocab):
        return None

    def normalizer(self, draft, batch, step: int, *, training: bool) -> torch.Tensor:
        return batch.loss_mask_BT.sum()

    def loss(self, draft, batch, state, step: int, normalizer, *, training: bool):
        mask = batch.loss_mask_BT.float()
        logits = draft(batch.input_ids_BT).float()
        ce = F.cross_entropy(logits.flatten(0, 1), batch.target_ids_BT.flatten(), reduction="none").view_as(mask)
        total = mask.sum() if normalizer is None else normalizer
        correct = (logits.argmax(-1) == batch.target_ids_BT).float() * mask
        counts = torch.stack([(ce * mask).sum().detach(), mask.sum(), correct.sum()]).double()[None]
        return (ce * mask).sum() / total.clamp_min(1), counts

    def counts_shape(self) -> tuple[int, int]:
        return (1, 3)

    def metrics(self, counts: torch.Tensor) -> dict[str, float]:
        c = counts.double().cpu()[0]
        n = c[1].item()
        return {"loss": c[0].item() / n if n else float("nan"), "acc_0": c[2].item() / n if n else float("nan")}

    def memory_step(self, draft, shape, precision, gpu: bool) -> dict:
        return {}

    def memory_keys(self) -> list[str]:
        return []

    # ---------------------------------------------------------------- a saved draft
    def hf_config(self, draft) -> dict:
        return {"architectures": [ARCHITECTURE], "vocab_size": draft.vocab_size, "hidden": draft.hidden}

    def owns_checkpoint(self, hf_config: dict) -> bool:
        return ARCHITECTURE in (hf_config.get("architectures") or [])

    def owns_gguf(self, arch: str, tensor_names: set[str]) -> bool:
        return False

    def check_checkpoint(self, path):
        config, weights = load_draft_folder(path)
        want = {k: tuple(v.shape) for k, v in BigramDraft(config["vocab_size"], config["hidden"]).state_dict().items()}
        if {k: tuple(v.shape) for k, v in weights.items()} != want:
            raise ValueError(f"{path}: not the tensors of a {ARCHITECTURE} of its config.json")
        return config, weights

    def load(self, path, target) -> BigramDraft:
        config, weights = self.check_checkpoint(path)
        draft = BigramDraft(config["vocab_size"], config["hidden"])
        draft.load_state_dict(weights)
        return draft.eval()

    def owns_published(self, hf_config: dict) -> bool:
        return self.owns_checkpoint(hf_config)

    def read_published(self, path: Path):
        config, weights = self.check_checkpoint(path)
        return json.loads((Path(path) / "config.json").read_text()), weights

    def tokens_per_round(self, hf_config: dict) -> int:
        return 3

    def max_tokens_per_round(self, hf_config: dict) -> Optional[int]:
        return None

    def refusal(self, engine: str) -> Optional[str]:
        return "no engine serves a bigram draft; evaluate it with python -m specforge.eval"

    def export(self, engine, draft_dir, out_dir, req) -> str:
        raise ValueError(self.refusal(engine))

    def llamacpp_config(self, draft_config: dict, target_config: dict, layer_ids=None) -> dict:
        raise ValueError(self.refusal("llama.cpp"))

    # ---------------------------------------------------------------- the eval
    def proposer(self, draft, dtype: Optional[torch.dtype] = None, as_served: bool = False):
        return BigramProposer(draft, dtype)


ALGORITHM = Example()
