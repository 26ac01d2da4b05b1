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
* Saves gather to ONE rank, the mesh's first (``full_state_dict``, ``full_optimizer_state``):
  each shard is sent there, one tensor at a time, and copied to its host memory once; the
  other ranks keep nothing and copy nothing, and frozen weights can be left out entirely.
"""

from __future__ import annotations

import copy
import sys
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

# torch.distributed.fsdp / .tensor / .checkpoint are imported where they are used (0.6-0.7 s of CPU on
# import, which every Ray actor paid at start): a rollout worker and an unsharded draft never need
# them, and no tensor can be a DTensor before torch.distributed.tensor was imported (``_is_dtensor``).

__all__ = ["apply_fsdp", "full_state_dict", "full_optimizer_state", "gather_to_first", "is_first_rank", "grads_full",
           "bf16_mp_policy"]


def bf16_mp_policy():
    """bf16 params/compute, fp32 gradient reduction (GPUs)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy  # lazy: heavy (torch) distributed.tensor

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def apply_fsdp(draft: nn.Module, dp_mesh, mp_policy=None, sum_gradients: bool = True) -> nn.Module:
    """Shard ``draft`` in place over ``dp_mesh`` (a 1-D DeviceMesh) with FSDP2; returns it."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # lazy: heavy (torch) distributed.tensor

    frozen = {p for p in draft.parameters() if not p.requires_grad}
    fully_shard(draft, mesh=dp_mesh, mp_policy=mp_policy or MixedPrecisionPolicy(), ignored_params=frozen or None)
    if sum_gradients:
        draft.set_gradient_divide_factor(1.0)
        draft.set_force_sum_reduction_for_comms(True)
    return draft


def is_first_rank(module: nn.Module) -> bool:
    """Whether this process is the first rank of ``module``'s FSDP mesh (where a full state lands);
    True for a module that is not sharded (one process)."""
    # state_dict(), not parameters(): after a forward without backward (an eval) FSDP2 leaves the
    # root's parameters unsharded, registered as plain tensors; its state_dict hook shows the shards
    for v in module.state_dict().values():
        if _is_dtensor(v):
            return v.device_mesh.get_local_rank() == 0
    return True


def gather_to_first(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The full value of ``t`` in host memory on the first rank of its mesh, None on the others.

    Collective for a DTensor (call on every rank of its mesh). FSDP2's dim-0 shards over a 1-D
    mesh are GATHERED to that rank: no other rank ever holds the full tensor (an all-gather
    would put it on every rank's device); the first rank's device holds it transiently, one
    tensor at a time, before the single copy to host. A plain (unsharded) tensor is no
    collective: its host copy, made on whichever rank the caller calls it.
    """
    if not _is_dtensor(t):
        return t.detach().to("cpu", copy=True)
    from torch.distributed.tensor import Shard  # lazy: heavy (torch) distributed.tensor

    mesh = t.device_mesh
    first = mesh.get_local_rank() == 0
    if mesh.ndim != 1 or tuple(t.placements) != (Shard(0),):  # not FSDP2's layout: gather everywhere
        full = t.full_tensor()
        return full.detach().to("cpu") if first else None
    world, rows = mesh.size(), t.shape[0]
    chunk = -(-rows // world)  # torch.chunk's split, FSDP2's and DTensor's: the last ranks may hold fewer rows
    local = t.to_local().detach()
    if local.shape[0] < chunk:
        local = torch.cat([local, local.new_zeros(chunk - local.shape[0], *local.shape[1:])])
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(world)] if first else None
    dist.gather(local, parts, group=mesh.get_group(), group_dst=0)
    if not first:
        return None
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    for i, part in enumerate(parts):
        n = max(0, min(chunk, rows - i * chunk))
        out[i * chunk : i * chunk + n].copy_(part[:n])
    return out


def full_state_dict(draft: nn.Module, include_frozen: bool = True) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict in host memory on the FIRST rank of the FSDP mesh, ``{}``
    elsewhere; ``include_frozen=False`` leaves out the frozen parameters (the target's embedding:
    a checkpoint does not save it, so it is never copied).

    Collective: call on every rank of the mesh. Not ``get_model_state_dict(full_state_dict=True,
    cpu_offload=True)``: that keeps the result on GLOBAL rank 0, which may be a rollout rank
    outside the mesh, and all-gathers every tensor onto every rank's device first. One tensor at
    a time (``gather_to_first``); the other ranks copy nothing.
    """
    first = is_first_rank(draft)
    frozen = set() if include_frozen else {n for n, p in draft.named_parameters() if not p.requires_grad}
    out: dict[str, torch.Tensor] = {}
    for name, v in draft.state_dict().items():
        if name in frozen:
            continue
        v = gather_to_first(v) if first or _is_dtensor(v) else None
        if first:
            out[name] = v
    return out


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's full state keyed by parameter name (the layout ``get_optimizer_state_dict``
    with ``full_state_dict=True`` returns, and ``set_optimizer_state_dict`` loads) in host memory on
    the first rank of the mesh, ``{}`` elsewhere. Collective. Reads the sharded state (no copy),
    then gathers each tensor to the first rank (``gather_to_first``)."""
    from torch.distributed.checkpoint.state_dict import (  # lazy: heavy (torch) distributed.tensor
        StateDictOptions,
        get_optimizer_state_dict,
    )

    sharded = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=False))
    first = is_first_rank(model)
    out = _gather_tree(sharded, first)
    return out if first else {}


def _is_dtensor(v: Any) -> bool:
    tensor_mod = sys.modules.get("torch.distributed.tensor")  # not imported yet: there is no DTensor
    return tensor_mod is not None and isinstance(v, tensor_mod.DTensor)


def _gather_tree(obj: Any, first: bool) -> Any:
    """``obj`` (nested dicts/lists of tensors and plain values) with every tensor gathered to the
    first rank; in the same order on every rank, so the collectives match."""
    if isinstance(obj, torch.Tensor):
        return gather_to_first(obj) if first or _is_dtensor(obj) else None
    if isinstance(obj, dict):
        return {k: _gather_tree(v, first) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_gather_tree(v, first) for v in obj)
    return copy.deepcopy(obj) if first else None


def grads_full(draft: nn.Module) -> dict[str, torch.Tensor]:
    """Full gradients of the trainable parameters on every rank (collective; tests, debugging)."""
    out = {}
    for name, p in draft.named_parameters():
        if p.grad is None:
            continue
        g = p.grad
        out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().cpu().clone()
    return out
