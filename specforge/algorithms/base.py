"""The hooks a draft algorithm gives the runtime (a Protocol: duck-typed, for readers and type checkers).

Legend: B batch, T tokens, K aux layers, H the target's hidden size. ``batch`` is a ``TrainBatch``
(or an ``SPTrainBatch``): the target features of the layers ``feature_layers`` chose
(``aux_hidden_BTKH``: K layer outputs concatenated, K*H wide), the last hidden state, the target
argmax, the input ids and the loss mask, whatever the feature source.

Everything that differs between algorithms is one of these hooks; code outside
``specforge/algorithms/`` asks ``get_algorithm(name)`` and never compares a name
(``tests/test_layering.py`` fails if it does).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol

import torch


@dataclass
class ExportRequest:
    """What ``python -m specforge.export`` hands an algorithm's ``export`` hook."""

    out: Path  # the final folder (the hook writes into a temporary one, renamed into place)
    target: Optional[str]  # the target's HF folder or hub id (None: not given and not needed)
    target_config: Any = None  # its transformers config
    num_speculative_tokens: Optional[int] = None  # vllm: the proposal length asked for


class DraftAlgorithm(Protocol):
    name: str
    options: type  # a ``config.DraftConfig`` subclass: the ``draft.*`` keys this algorithm reads
    architecture: str  # config.json ``architectures`` entry of its saved folder
    dynamic_drafting: bool  # whether the eval also runs it with cost-based early stops (a chain, not a block)
    llamacpp_spec_type: Optional[str]  # ``llama-server --spec-type`` (None: llama.cpp cannot serve it)
    gguf_architecture: Optional[str]  # ``general.architecture`` of its draft GGUF
    engines: tuple[str, ...]  # the engines whose export it writes (``specforge.export.ENGINES``)

    # ---------------------------------------------------------------- configuration

    def config_errors(self, cfg) -> list[str]:
        """Checks of the config alone (before anything loads): one message per problem, naming the key."""

    def feature_layers(self, cfg, num_layers: int) -> list[int]:
        """The target layer outputs the draft reads (``model.aux_layer_ids`` or the default)."""

    def check(self, cfg, target_config) -> None:
        """What the config cannot say alone (against the target's config.json): a ValueError naming the key."""

    def draft_vocab_size(self, cfg, target_vocab_size: int) -> int:
        """Entries of the run's draft-vocab file."""

    def identity(self, cfg) -> dict[str, Any]:
        """The config values a checkpoint must share with the run resuming it (what changes the math)."""

    def sp_halo(self, cfg) -> int:
        """Rows past its own slice a sequence-parallel rank reads (0: the algorithm refuses SP)."""

    def sp_cores(self, draft) -> list[tuple[torch.nn.Module, str]]:
        """``(module, attribute)`` of each attention core sequence parallelism wraps."""

    # ---------------------------------------------------------------- training

    def build_draft(self, cfg, target, vocab) -> torch.nn.Module:
        """A fresh draft shaped for ``target`` (a ``TargetModel``), its init a function of the seed alone."""

    def train_state(self, cfg, target, vocab) -> Any:
        """Frozen tensors the loss needs besides the draft (EAGLE-3: the teacher rows), or None."""

    def normalizer(self, draft, batch, cfg, step: int) -> float:
        """This micro-batch's share of the loss denominator (summed over micro-batches and ranks)."""

    def loss(self, draft, batch, state, cfg, step: int, normalizer: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, counts)`` of one micro-batch: the loss is its share of the global mean when
        ``normalizer`` (the global sum) is given; counts are raw float64 sums, reduced once."""

    def counts_shape(self, cfg) -> tuple[int, int]:
        """The shape of the summed counters."""

    def metrics(self, counts: torch.Tensor, cfg) -> dict[str, float]:
        """Rates from the summed counters (loss, per-position accuracy, simulated acceptance tau)."""

    def memory_step(self, cfg, draft, shape, precision, gpu: bool) -> dict[str, list]:
        """The memory model's terms of one micro-batch's step (``specforge.memory``), by phase."""

    def memory_keys(self, cfg) -> list[str]:
        """Config keys that shrink a train device's step, for the memory refusal's message."""

    # ---------------------------------------------------------------- a saved draft

    def hf_config(self, draft) -> dict:
        """The checkpoint's config.json (the format its servers load)."""

    def owns_checkpoint(self, hf_config: dict) -> bool:
        """Whether a saved folder's config.json is this algorithm's (the registry asks the last
        registered first, so a refinement of an earlier format claims its own folders)."""

    def owns_gguf(self, arch: str, tensor_names: set[str]) -> bool:
        """Whether a draft GGUF (its ``general.architecture`` and tensor names) is this algorithm's."""

    def check_checkpoint(self, path) -> tuple[dict, Any]:
        """``(config.json, weights or None)`` of a valid saved folder; a ValueError naming every problem."""

    def load(self, path, target) -> torch.nn.Module:
        """A saved draft folder, with the frozen parts taken from ``target``."""

    def owns_published(self, hf_config: dict) -> bool:
        """Whether a published draft folder's config.json (ours, or an engine's format this algorithm
        reads: SGLang, speculators/vLLM, z-lab's DFlash) is this algorithm's (``draft.init_from``;
        asked last registered first, as ``owns_checkpoint``)."""

    def read_published(self, path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
        """``(config.json in our saved format, weights named as the draft's export_state_dict)`` of a
        published folder this algorithm owns; only the names are mapped, nothing is checked against a
        run (``specforge/train/init_from.py`` loads them strictly into a fresh draft)."""

    def proposer(self, draft, dtype: Optional[torch.dtype]):
        """The eval's proposer: ``start(ids, aux_TH)``, ``propose(k, costs=None)``, ``accept(new, aux_TH)``."""

    def tokens_per_round(self, hf_config: dict) -> int:
        """Draft tokens a round an engine is told to ask for by default."""

    def max_tokens_per_round(self, hf_config: dict) -> Optional[int]:
        """The most draft tokens one round can propose (None: no bound)."""

    def export(self, engine: str, draft_dir: Path, out_dir: Path, req: ExportRequest) -> str:
        """Write ``engine``'s format (sglang, vllm) into ``out_dir``; returns the serve command."""

    def llamacpp_config(self, draft_config: dict, target_config: dict, layer_ids=None) -> dict:
        """The config.json llama.cpp's converter reads for this draft (a staged copy's)."""
