"""The tensors the draft trains on, as every side of the runtime hands them over.

``Features`` is what a target forward yields per token (rollout capture, the feature store,
regeneration); ``TrainBatch`` is a batch of them with the token ids and loss mask the train step
reads. Both are plain tensor containers: this module imports torch and nothing of ours, so the
target, the store, the runtime and the trainer may all import it.
Legend: B batch, T tokens, K fused target layers, H target hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

import torch


@dataclass
class Features:
    """What the draft trains on, per token: K fused target layers, the last hidden, the argmax."""

    aux_hidden_BTKH: torch.Tensor
    last_hidden_BTH: torch.Tensor
    target_ids_BT: torch.Tensor


@dataclass
class TrainBatch:
    """Everything one train step needs. Right-padded; padding has loss_mask 0."""

    input_ids_BT: torch.Tensor
    loss_mask_BT: torch.Tensor
    aux_hidden_BTKH: torch.Tensor
    last_hidden_BTH: torch.Tensor
    target_ids_BT: torch.Tensor
    # tokens of each row before its right padding (``train.pack_tokens`` packs by it); None: not recorded.
    # Host metadata: ``to`` leaves it on the host, so reading it never waits for a device
    length_B: Optional[torch.Tensor] = field(default=None, kw_only=True)

    @classmethod
    def from_features(cls, input_ids_BT: torch.Tensor, loss_mask_BT: torch.Tensor, feats: Features) -> "TrainBatch":
        return cls(input_ids_BT, loss_mask_BT, feats.aux_hidden_BTKH, feats.last_hidden_BTH, feats.target_ids_BT)

    def to(self, device: torch.device) -> "TrainBatch":
        return type(self)(**{f.name: getattr(self, f.name) if f.name == "length_B" else
                             getattr(self, f.name).to(device) for f in fields(self)})

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_BT.numel())
