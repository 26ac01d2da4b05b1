"""FSDP2 (``fully_shard``) for the draft, model-agnostic.

Decisions:

* One FSDP unit = the whole trainable draft (fc, midlayer, norm, lm_head): a one-layer model,
  so per-layer units would only add collectives. The frozen target embedding (``V x H``, the
  largest tensor, no gradient) is NOT sharded: ``ignored_params`` keeps a full replica on every
  rank, so it is never all-gathered per step and never reduce-scattered. A trainable embedding
  (draft hidden != target hidden) is sharded like everything else.
* Gradients are SUMMED over the mesh (``set_gradient_divide_factor(1.0)``): the TTT loss is
  already normalized by the global valid-token count. ``set_force_sum_reduction_for_comms``
  keeps the collectives plain SUMs (with a divide factor FSDP2 would use PREMUL_SUM, which gloo
  lacks).
* The draft's forward is the TTT unroll (the loss's lm_head head runs inside it), so FSDP2's
  hooks unshard and reduce around it like around any model's forward.
* Mixed precision is the caller's choice (``mp_policy``): bf16 params + fp32 reductions on
  GPUs; on CPU the params stay fp32 and autocast does the bf16 compute.
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["apply_fsdp", "full_state_dict", "grads_full", "bf16_mp_policy"]


def bf16_mp_policy():
    """bf16 params/compute, fp32 gradient reduction (GPUs)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def apply_fsdp(draft: nn.Module, dp_mesh, mp_policy=None, sum_gradients: bool = True) -> nn.Module:
    """Shard ``draft`` in place over ``dp_mesh`` (a 1-D DeviceMesh) with FSDP2; returns it."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    frozen = {p for p in draft.parameters() if not p.requires_grad}
    fully_shard(draft, mesh=dp_mesh, mp_policy=mp_policy or MixedPrecisionPolicy(), ignored_params=frozen or None)
    if sum_gradients:
        draft.set_gradient_divide_factor(1.0)
        draft.set_force_sum_reduction_for_comms(True)
    return draft


def full_state_dict(draft: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict on CPU on the FIRST rank of the FSDP mesh, ``{}`` elsewhere.

    Collective: call on every rank of the mesh. Not ``get_model_state_dict(full_state_dict=True,
    cpu_offload=True)``: that keeps the result on GLOBAL rank 0, which may be a rollout rank
    outside the mesh. Gathers one tensor at a time. Unsharded modules: a plain CPU copy.
    """
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    keep = True
    for name, v in draft.state_dict().items():
        if isinstance(v, DTensor):
            keep = v.device_mesh.get_local_rank() == 0
            v = v.full_tensor()
        if keep:
            out[name] = v.detach().cpu().clone()
    return out if keep else {}


def grads_full(draft: nn.Module) -> dict[str, torch.Tensor]:
    """Full gradients of the trainable parameters on every rank (collective; tests, debugging)."""
    out = {}
    for name, p in draft.named_parameters():
        if p.grad is None:
            continue
        g = p.grad
        out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().cpu().clone()
    return out
