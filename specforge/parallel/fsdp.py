"""FSDP2 (``fully_shard``) for the draft, model-agnostic except for the TTT entry point.

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
* The TTT loss reads weights directly instead of calling ``draft.forward``, and FSDP2 only
  unshards around a registered forward: :func:`apply_fsdp` installs ``draft.ttt_loss`` and
  registers it with ``register_fsdp_forward_method``. Call the loss through
  :func:`ttt_loss_fn` (works with and without FSDP).
* Mixed precision is the caller's choice (``mp_policy``): bf16 params + fp32 reductions on
  GPUs; on CPU the params stay fp32 and autocast does the bf16 compute.
"""

from __future__ import annotations

import types
from typing import Callable

import torch
import torch.nn as nn

from specforge.train.ttt import ttt_loss

__all__ = ["apply_fsdp", "full_state_dict", "grads_full", "ttt_loss_fn", "bf16_mp_policy"]


def _ttt_loss_method(self, batch, teacher_NH, ttt_length, decay, num_valid_global=None):
    return ttt_loss(self, batch, teacher_NH, ttt_length, decay, num_valid_global=num_valid_global)


def bf16_mp_policy():
    """bf16 params/compute, fp32 gradient reduction (GPUs)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def apply_fsdp(draft: nn.Module, dp_mesh, mp_policy=None, sum_gradients: bool = True) -> nn.Module:
    """Shard ``draft`` in place over ``dp_mesh`` (a 1-D DeviceMesh) with FSDP2; returns it."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    frozen = {p for p in draft.parameters() if not p.requires_grad}
    fully_shard(draft, mesh=dp_mesh, mp_policy=mp_policy or MixedPrecisionPolicy(), ignored_params=frozen or None)
    if sum_gradients:
        draft.set_gradient_divide_factor(1.0)
        draft.set_force_sum_reduction_for_comms(True)
    draft.ttt_loss = types.MethodType(_ttt_loss_method, draft)
    register_fsdp_forward_method(draft, "ttt_loss")
    return draft


def ttt_loss_fn(draft: nn.Module) -> Callable:
    """``loss_fn(draft, batch, teacher, ttt_length, decay, num_valid_global=None)`` for
    :class:`~specforge.train.trainer.DraftTrainer`: through FSDP's hooks when sharded."""
    if hasattr(draft, "ttt_loss"):
        return lambda d, *args, **kw: d.ttt_loss(*args, **kw)
    return ttt_loss


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
