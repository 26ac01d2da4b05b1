"""The hooks a draft algorithm gives the runtime (a Protocol: duck-typed, for readers and type checkers).

Legend: B batch, T tokens. ``batch`` is a ``TrainBatch`` (or an ``SPTrainBatch``): the target
features of the layers ``feature_layers`` chose (``aux_hidden_BT3H``, K layers x H wide), the last
hidden state, the target argmax, the input ids and the loss mask, whatever the feature source.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import torch


class DraftAlgorithm(Protocol):
    name: str
    dynamic_drafting: bool  # whether the eval also runs it with cost-based early stops (a chain, not a block)

    def feature_layers(self, cfg, num_layers: int) -> list[int]:
        """The target layer outputs the draft reads (``model.aux_layer_ids`` or the default)."""

    def check(self, cfg, target_config) -> None:
        """What the config cannot say alone (against the target's config.json): a ValueError naming the key."""

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

    def hf_config(self, draft) -> dict:
        """The checkpoint's config.json (the format its servers load)."""

    def load(self, path, target) -> torch.nn.Module:
        """A saved draft folder, with the frozen parts taken from ``target``."""

    def proposer(self, draft, dtype: Optional[torch.dtype]):
        """The eval's proposer: ``start(ids, aux_TH)``, ``propose(k, costs=None)``, ``accept(new, aux_TH)``."""
