"""The tensors the draft trains on, as every side of the runtime hands them over.

``Features`` is what a target forward yields per token (rollout capture, the feature store,
regeneration); ``TrainBatch`` is a batch of them with the token ids and loss mask the train step
reads. Both are plain tensor containers: this module imports torch and nothing of ours, so the
target, the store, the runtime and the trainer may all import it.
Legend: B batch, T tokens, K fused target layers, H target hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional, Sequence

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


# ---------------------------------------------------------------- the feature check


def feature_flags(aux_BTKH: torch.Tensor, real_BT: Optional[torch.Tensor], num_layers: int) -> torch.Tensor:
    """Counts that tell hidden states an engine can produce silently on some targets (hybrid ones),
    on the features' device with no host read: ``[bad_0..bad_K-1, live_0..live_K-1, real]``, float64,
    the tokens whose captured layer k holds NaN or inf, those whose layer k is not all zeros, and the
    tokens counted (``real_BT``: the samples' tokens, not the padding; None: all). Counts of several
    batches or ranks add up (``refuse_bad_features`` reads the sum). Per token and layer only its max
    and min are kept (NaN and inf reach them; all zeros = both 0): no temporary the size of the features."""
    B, T = aux_BTKH.shape[:2]
    x = aux_BTKH.unflatten(-1, (num_layers, aux_BTKH.shape[-1] // num_layers))
    hi, lo = x.amax(dim=-1).float(), x.amin(dim=-1).float()  # [B, T, K]
    real = (torch.ones(B, T, dtype=torch.bool, device=x.device) if real_BT is None
            else real_BT.to(x.device).bool())[..., None]
    bad = (~(torch.isfinite(hi) & torch.isfinite(lo)) & real).sum(dim=(0, 1))
    live = (((hi != 0) | (lo != 0)) & real).sum(dim=(0, 1))
    return torch.cat([bad, live, real.sum().view(1)]).double()


def refuse_bad_features(flags: Sequence[float], layer_ids: Sequence[int], where: str = "") -> None:
    """ValueError naming the first captured layer ``feature_flags``' counts (host numbers, summed over
    whatever was checked together) find holding NaN or inf, or all zeros over real tokens."""
    K = len(layer_ids)
    for k, layer in enumerate(layer_ids):
        if flags[k] > 0:
            raise ValueError(f"{where}captured target layer {layer} (model.aux_layer_ids) holds NaN or inf hidden "
                             "states: the target computes garbage there (its dtype, or the engine's kernels for this "
                             "family)")
        if flags[K + k] == 0 and flags[2 * K] > 0:
            raise ValueError(f"{where}captured target layer {layer} (model.aux_layer_ids) is all zeros: the engine "
                             "returned no hidden states for it (a hybrid target's layer it does not capture); pick "
                             "other layers")
