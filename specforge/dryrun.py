"""``--dry-run`` of ``python -m specforge.ray_train`` and ``python -m specforge.train``: does a config fit?

Builds the target and the draft on the meta device from the target's config.json (no weights read,
no data tokenized, Ray not started), prints their parameters, the bytes each worker of the
placement holds, and the plan (workers, global batch, feature bytes per step), then exits.

The target's config.json comes from ``--target-config FILE`` if given, else from the target folder
(``model.target_path``), else, for a hub id, from the published copy shipped in ``configs/targets/``
(``<org>--<name>.json``, see its README) before trying the hub, so a GPU config can be checked on a
machine without network.

Counted per device at its peak (``specforge/memory.py``, term by term): weights as FSDP2 places
them (the draft's trainable params, fp32 master weights and AdamW state sharded over the train
workers; its frozen copy of the target's embedding whole on every rank), the frozen train state,
FSDP2's unsharded params/grads and reduce-scatter buffer, one micro-batch's activations, the step's
features and receive buffers, the in-flight budget, the target's capture forward, a save, and
allowances for the CUDA context, NCCL and allocator fragmentation. Held against the GPU's memory
(``ray.gpu_memory_gib``, or this machine's GPU, or an 80 GB H100 when there is neither).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Optional

import torch

from specforge import memory
from specforge.config import EMBEDDED_TARGET, Config, engine_start_timeout
from specforge.contracts import FeatureSpec
from specforge.data.vocab import DraftVocab
from specforge.device import pick_device, pick_dtype, torch_dtype, wants_gpu
from specforge.models.target import (  # noqa: F401 (the dry run's names for them)
    SHIPPED,
    TargetModel,
    config_from_file,
    load_target_config,
    shipped_config,
    split_plan,
)
from specforge.parallel.dims import ParallelDims
from specforge.registry import bound_algorithm, feature_layers
from specforge.runtime.loop import check
from specforge.runtime.loop import single_process as one_rank
from specforge.runtime.plan import wire_dtype
from specforge.targets import check_target, family_of, text_config
from specforge.training.optim import muon_params

# Bits per converted weight of a quantized checkpoint as shipped (mxfp4: 4-bit values + an 8-bit scale
# per 32; fp8: one byte, its per-block scales negligible). Embeddings, the lm_head, biases, norms and
# the checkpoint's modules_to_not_convert stay in model.dtype.
SHIPPED_BITS = {"mxfp4": 4.25, "fp8": 8.0, "fbgemm_fp8": 8.0}
OPTIMIZER_BYTES = 12  # per trainable parameter: fp32 gradient + AdamW's two fp32 moments
MUON_SAVING = 4  # per parameter Muon takes (train.optimizer=muon): one fp32 momentum, not AdamW's two
MASTER_BYTES = 4  # per draft parameter: fp32 weights
H100_80GB = memory.H100_80GB  # the verdict without a GPU or key


@dataclass
class DryRun:
    """What ``dry_run`` printed, as numbers (bytes are exact integers)."""

    target_source: str
    target_params: int
    target_dtype: str
    target_bytes: int
    draft_params: int
    draft_trainable: int
    state_bytes: int
    draft_frozen: list[str]  # the draft's frozen parameters (copies of target weights), by name
    placement: str
    workers: dict[str, int]  # role -> how many
    per_device: dict[str, int] = field(default_factory=dict)  # role -> weights + optimizer on its fullest device
    memory: list = field(default_factory=list)  # memory.DeviceMemory per kind of device: every term, the peak
    available: Optional[int] = None  # bytes one GPU has (ray.gpu_memory_gib / this machine's GPU), if known
    target_split: list[int] = field(default_factory=list)  # model.num_gpus > 1: the target's bytes on each GPU
    quantized: Optional[str] = None  # the checkpoint's quant_method, if it ships quantized weights
    shipped_bytes: Optional[int] = None  # its weights as shipped (SHIPPED_BITS), where the GPU keeps them so
    global_batch: int = 0
    max_tokens: int = 0
    feature_bytes_per_token: int = 0
    feature_bytes_per_step: int = 0


def read_target_config(cfg: Config, target_config: Optional[str] = None):
    """``(hf_config, where it came from)``, without weights (see the module docstring)."""
    path = Path(target_config) if target_config else None
    if (path is None and cfg.model.target_path != EMBEDDED_TARGET
            and not Path(cfg.model.target_path).expanduser().exists()):
        path = shipped_config(cfg.model.target_path)
    if path is None:
        return load_target_config(cfg.model), f"{cfg.model.target_path} (its config.json)"
    if not path.is_file():
        raise ValueError(f"--target-config {str(path)!r} is not a file (a target's config.json)")
    return config_from_file(path), str(path)


def _target_dtype(cfg: Config) -> torch.dtype:
    """The dtype the workers load the target in (``model.dtype``; auto: bf16 on GPUs, as ``pick_dtype``
    on a bf16-capable GPU, else this machine's choice)."""
    if cfg.model.dtype != "auto":
        return torch_dtype(cfg.model.dtype)
    if cfg.model.device == "cuda":
        return torch.bfloat16
    return pick_dtype("auto", pick_device(cfg.model.device))


def meta_models(cfg: Config, hf_config, dtype: torch.dtype):
    """``(target, draft, train_state)`` on the meta device: the target's class from the family table
    in ``dtype``, the draft and its train state from the run's algorithm, as the workers build them
    (a draft vocab of the algorithm's ``draft_vocab_size`` placeholder ids)."""
    text = text_config(hf_config)
    family = family_of(hf_config)
    meta = torch.device("meta")
    algo = bound_algorithm(cfg)
    n = min(algo.draft_vocab_size(text.vocab_size), text.vocab_size)  # real (small) tensors: an algorithm reads ids
    vocab = DraftVocab(torch.zeros(n, dtype=torch.long), torch.zeros(text.vocab_size, dtype=torch.bool))  # device: host
    with meta:
        model = family.auto_class().from_config(hf_config, dtype=dtype)
        target = TargetModel(model, None, feature_layers(cfg, text.num_hidden_layers), meta)
        draft = algo.build_draft(target, vocab)
        state = algo.train_state(target, vocab)
    return target, draft, state


def quantized_as_shipped(model, hf_config) -> tuple[Optional[str], Optional[int]]:
    """``(quant_method, bytes of the weights as the checkpoint ships them)``; ``(None, None)`` for an
    unquantized checkpoint, ``(method, None)`` for a method ``SHIPPED_BITS`` does not know."""
    quant = getattr(hf_config, "quantization_config", None)
    if not quant:
        return None, None
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    method = str(quant.get("quant_method"))
    bits = SHIPPED_BITS.get(method)
    if bits is None:
        return method, None
    kept = list(quant.get("modules_to_not_convert") or []) + ["*embed_tokens", "lm_head"]
    total = 0.0
    for name, p in model.named_parameters():
        module = name.rsplit(".", 1)[0]
        whole = p.dim() < 2 or name.endswith("bias") or any(fnmatch(module, k) or fnmatch(module, k + ".*")
                                                             for k in kept)
        total += p.numel() * (p.element_size() if whole else bits / 8)
    return method, int(total)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _state_tensors(state) -> list[torch.Tensor]:
    if state is None:
        return []
    if isinstance(state, torch.Tensor):
        return [state]
    return [v for v in vars(state).values() if isinstance(v, torch.Tensor)]


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


def dry_run(cfg: Config, target_config: Optional[str] = None, single_process: bool = False) -> DryRun:
    """Check ``cfg`` as a run would (no weights, no data, no Ray), print what it would hold where."""
    check(cfg)
    if single_process:
        cfg = one_rank(cfg)
    hf_config, source = read_target_config(cfg, target_config)
    text = text_config(hf_config)
    layers = feature_layers(cfg, text.num_hidden_layers)
    check_target(hf_config, layers)
    bound_algorithm(cfg).check(text)
    dims = ParallelDims.from_config(cfg)
    dims.check_heads(cfg.draft.num_attention_heads or text.num_attention_heads)

    dtype = _target_dtype(cfg)
    target, draft, state = meta_models(cfg, hf_config, dtype)
    t_params = sum(p.numel() for p in target.model.parameters())
    t_bytes = _nbytes(target.model.parameters())
    quantized, shipped = quantized_as_shipped(target.model, hf_config)
    d_params = sum(p.numel() for p in draft.parameters())
    d_train = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    frozen = [name for name, p in draft.named_parameters() if not p.requires_grad]
    s_bytes = sum(t.numel() * 4 for t in _state_tensors(state))  # DraftTrainer holds it in fp32
    shards = cfg.train.num_workers  # FSDP2 shards the trainable draft over every dp x sp train rank
    frozen_bytes = sum(p.numel() * p.element_size() for p in draft.parameters() if not p.requires_grad)
    # the frozen params (the target's embedding) are FSDP2's ignored_params: a full replica on every rank
    d_muon = 0
    if cfg.train.optimizer == "muon":
        d_muon = sum(p.numel() for p in muon_params(draft.named_parameters())[0])
    draft_per_rank = (-(-((MASTER_BYTES + OPTIMIZER_BYTES) * d_train - MUON_SAVING * d_muon) // shards)
                      + frozen_bytes + s_bytes)

    mode = cfg.placement.mode  # single process: colocated or offline (runtime.loop.single_process)
    split = _target_split(cfg, hf_config, dtype, target)
    on_gpus = split or [_engine_bytes(cfg, t_bytes, shipped)]  # the target's bytes on each GPU of a worker that runs it
    workers = {"train": cfg.train.num_workers}
    per_device = {"train": draft_per_rank}
    if mode == "colocated":  # target and draft in one process: the draft on the target's first GPU
        per_device["train"] = max([on_gpus[0] + draft_per_rank, *on_gpus[1:]])
    if mode == "disaggregated":
        workers = {"rollout": cfg.rollout.num_workers, **workers}
        per_device = {"rollout": -(-max(on_gpus) // cfg.rollout.tp_size), **per_device}

    global_batch = cfg.train.batch_size * cfg.train.grad_accum * dims.dp
    use_gpu = wants_gpu(cfg.model.device)
    devices = memory.plan(cfg, bound_algorithm(cfg), target, draft, s_bytes, on_gpus, _on_gpus(cfg))
    available = memory.available_bytes(cfg)[0]
    spec = FeatureSpec.hidden_states(int(text.hidden_size), wire_dtype(cfg.model.dtype, use_gpu), len(layers))
    per_token = spec.bytes_per_token()
    report = DryRun(
        target_source=source, target_params=t_params, target_dtype=str(dtype).replace("torch.", ""),
        target_bytes=t_bytes, draft_params=d_params, draft_trainable=d_train, state_bytes=s_bytes,
        draft_frozen=frozen,
        placement=f"single process ({mode})" if single_process else mode, workers=workers, per_device=per_device,
        target_split=split, quantized=quantized, shipped_bytes=shipped, global_batch=global_batch,
        memory=devices, available=available,
        max_tokens=cfg.data.max_length, feature_bytes_per_token=per_token,
        feature_bytes_per_step=global_batch * cfg.data.max_length * per_token)
    _print(cfg, report, family_of(hf_config), dims)
    return report


def _target_split(cfg: Config, hf_config, dtype: torch.dtype, target) -> list[int]:
    """The target's bytes on each of ``model.num_gpus`` GPUs (the plan load_target uses; [] for one
    GPU, and offline, where no target runs a forward)."""
    if cfg.model.num_gpus <= 1 or cfg.placement.mode == "offline":
        return []

    return list(split_plan(hf_config, cfg.model.num_gpus, dtype, target.model)[1].values())


def _engine_bytes(cfg: Config, t_bytes: int, shipped: Optional[int]) -> int:
    """The target's bytes where it runs: vLLM loads a quantized checkpoint as shipped (FP8, MXFP4), the
    transformers forward as ``model.dtype``."""
    return shipped if cfg.rollout.backend == "vllm" and shipped else t_bytes


def _on_gpus(cfg: Config) -> bool:
    """Whether the workers run on GPUs (``ray.gpu_memory_gib`` set says they do)."""
    return wants_gpu(cfg.model.device) or cfg.ray.gpu_memory_gib is not None


def memory_plan(cfg: Config, target_config: Optional[str] = None) -> list:
    """``memory.plan`` of ``cfg`` from the target's config.json alone (the meta models the dry run
    builds): each kind of device at its peak, for the driver's check before any worker starts."""
    hf_config, _ = read_target_config(cfg, target_config)
    dtype = _target_dtype(cfg)
    target, draft, state = meta_models(cfg, hf_config, dtype)
    shares = _target_split(cfg, hf_config, dtype, target) or [
        _engine_bytes(cfg, _nbytes(target.model.parameters()), quantized_as_shipped(target.model, hf_config)[1])]
    s_bytes = sum(t.numel() * 4 for t in _state_tensors(state))
    return memory.plan(cfg, bound_algorithm(cfg), target, draft, s_bytes, shares, _on_gpus(cfg))


def _print(cfg: Config, r: DryRun, family, dims) -> None:
    size = r.target_bytes // max(r.target_params, 1)
    print(f"dry run of {cfg.model.target_path}: nothing loaded, no data read, Ray not started")
    print(f"target  {family.name} ({family.hf_class}); config.json: {r.target_source}")
    print(f"        {r.target_params:,} parameters x {size} B ({r.target_dtype}) = {r.target_bytes:,} bytes "
          f"({_gib(r.target_bytes)})")
    if r.quantized:
        as_shipped = "" if r.shipped_bytes is None else \
            f": {r.shipped_bytes:,} bytes ({_gib(r.shipped_bytes)}) as shipped, where the GPU's kernels keep it so"
        print(f"        its checkpoint is quantized ({r.quantized}){as_shipped}; counted below as loaded in "
              f"{r.target_dtype} (model.dtype), as transformers dequantizes it where they do not")
    frozen = f"; the rest are frozen copies of target weights: {', '.join(r.draft_frozen)}" if r.draft_frozen else ""
    print(f"draft   {cfg.draft.algorithm}: {r.draft_params:,} parameters ({r.draft_trainable:,} trainable{frozen}); "
          f"trainable: fp32 weights + grad + AdamW = {(MASTER_BYTES + OPTIMIZER_BYTES) * r.draft_trainable:,} bytes, "
          f"sharded over {cfg.train.num_workers} train worker(s); frozen: "
          f"{MASTER_BYTES * (r.draft_params - r.draft_trainable):,} bytes (fp32) whole on each; "
          f"train state {r.state_bytes:,} bytes")
    roles = " + ".join(f"{n} {role}" for role, n in r.workers.items())
    print(f"placement {r.placement}: {roles} worker(s) (dp {dims.dp} x sp {dims.sp})")
    target = "the target" if not r.target_split else "its share of the target"
    if cfg.rollout.backend == "vllm" and cfg.placement.mode != "offline":
        r_ = cfg.rollout
        loaded = r.shipped_bytes if r.shipped_bytes else r.target_bytes
        target = f"its 1/{r_.tp_size} of the target in the vLLM engine"
        print(f"  the target runs in vLLM (rollout.backend=vllm): tensor parallel over rollout.tp_size={r_.tp_size} "
              f"{'GPUs' if _on_gpus(cfg) else 'CPU ranks'} per "
              f"{'rollout' if cfg.placement.mode == 'disaggregated' else 'train'} "
              f"worker{', experts spread over them' if r_.expert_parallel else ''}; weights as vLLM loads them "
              f"{_gib(loaded)} = {_gib(-(-loaded // r_.tp_size))} per GPU; the engine takes "
              f"rollout.vllm_gpu_memory_utilization={r_.vllm_gpu_memory_utilization} of each GPU (weights, KV and "
              "hidden-states cache, activations) and this process keeps only the final norm and lm_head")
        if r_.vllm_endpoint is None:
            key = ("rollout.vllm_startup_timeout_s" if r_.vllm_startup_timeout_s is not None
                   else "parallel.setup_timeout_s, which rollout.vllm_startup_timeout_s follows unless set")
            print(f"  the engine's start (weights loaded, compiled) may take {engine_start_timeout(cfg):g} s ({key})")
    holds = {"rollout": target, "train": "its draft shard + the frozen draft params + the train state"
             + (f" + {target}" if cfg.placement.mode == "colocated" else "")}
    if r.target_split:
        who = "rollout" if "rollout" in r.per_device else "train"
        shares = " / ".join(_gib(n) for n in r.target_split)
        print(f"  the target over model.num_gpus={len(r.target_split)} GPUs of each {who} worker (device map, "
              f"decoder layers whole): {shares}")
    for role, n in r.per_device.items():
        fullest = "device (fullest)" if r.target_split and (role == "rollout" or cfg.placement.mode == "colocated") \
            else "device"
        print(f"  per {role} {fullest}: {n:,} bytes ({_gib(n)}) = {holds[role]}")
    if cfg.placement.mode in ("disaggregated", "offline"):
        print(f"  (a train worker opens the target in host memory while it starts, memory-mapped when model.dtype is "
              f"the checkpoint's, and copies only its embedding and lm_head rows to its device: no train GPU holds "
              f"the target's {_gib(r.target_bytes)})")
    print(f"plan    global batch {r.global_batch} sequences (train.batch_size {cfg.train.batch_size} x grad_accum "
          f"{cfg.train.grad_accum} x dp {dims.dp}) of up to {r.max_tokens:,} tokens; features "
          f"{r.feature_bytes_per_token:,} B/token = up to {r.feature_bytes_per_step:,} bytes "
          f"({_gib(r.feature_bytes_per_step)}) per step")
    if cfg.train.pack_tokens is not None:
        print(f"        packed (train.pack_tokens): each train rank's samples of a step end to end in rows of up to "
              f"{cfg.train.pack_tokens:,} tokens, one row per micro-batch, no padding (memory below: one such row"
              + ("; each row sliced over the SP group" if dims.sp > 1 else "") + ")")
    if cfg.rollout.pack_tokens is not None:
        print(f"        packed target forwards (rollout.pack_tokens): a capture's samples end to end in rows of up "
              f"to {cfg.rollout.pack_tokens:,} tokens, one forward per row (memory below: one such row)")
    _print_memory(cfg, r)


def _print_memory(cfg: Config, r: DryRun) -> None:
    """Each kind of device at its peak: held terms, the peak phase's terms, the other phases' totals,
    and whether it fits the GPU (``ray.gpu_memory_gib``, this machine's, or an 80 GB H100)."""
    available, where = memory.available_bytes(cfg)
    if available is None and _on_gpus(cfg):
        available, where = H100_80GB, "an 80 GB H100 (no GPU here and ray.gpu_memory_gib unset)"
    print("memory per device at its peak (specforge/memory.py: held through the run + the largest phase):")
    for dev in r.memory:
        verdict = "" if available is None else \
            f": {'fits' if dev.peak <= available else 'DOES NOT FIT'} in {available / memory.GiB:,.1f} GiB of {where}"
        print(f"  {dev.device} (x{dev.count}): peak {dev.peak / memory.GiB:,.2f} GiB at '{dev.peak_phase}'{verdict}")
        for label, terms in (("held", dev.held), (dev.peak_phase, dev.phases.get(dev.peak_phase, []))):
            print(f"    {label}: {sum(t.nbytes for t in terms) / memory.GiB:,.2f} GiB")
            for t in terms:
                print(f"      {t.nbytes / memory.GiB:9.2f}  {t.name}")
        others = [f"{name} {dev.held_bytes / memory.GiB + dev.phase_bytes(name) / memory.GiB:,.1f}"
                  for name in dev.phases if name != dev.peak_phase]
        if others:
            print(f"    other phases (peak GiB): {', '.join(others)}")
    print("not counted: the KV cache of generation (regenerate/eval, other commands); allowances as stated above")
