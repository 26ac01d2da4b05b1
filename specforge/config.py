"""Typed run configuration.

One dataclass per concern; a YAML file's keys are the field names, and dotted command-line
overrides (``train.lr=1e-4``) address the same fields. An unknown key or a value of the wrong
type is a ``ValueError`` that names the dotted key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from specforge.registry import NAMES, get_algorithm

EMBEDDED_TARGET = "embedded:smollm2-135m-instruct"
EMBEDDED_DATA = "embedded:sharegpt"
DEFAULT_ALGORITHM = "eagle3"  # draft.algorithm when a config names none (a name of specforge.algorithms.NAMES)


@dataclass
class ModelConfig:
    """The frozen target model."""

    target_path: str = EMBEDDED_TARGET  # local HF folder, hub id, or the embedded default
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Target layer outputs fused by the draft; None = [1, L//2 - 1, L - 4].
    aux_layer_ids: Optional[list[int]] = None
    chat_template: Optional[str] = None  # overrides the tokenizer's own template
    trust_remote_code: bool = False
    cache_dir: str = "~/.cache/specforge"  # converted embedded model, tokenized data
    argmax_chunk_tokens: int = 1024  # tokens per lm_head chunk when taking the target argmax
    # a 16-bit target (transformers, not an engine) keeps its residual stream -- each layer's input and
    # output, the norms' input -- in fp32, its matmuls in its dtype: the teacher's argmax agrees with an
    # fp32 forward more often, for a few elementwise fp32 ops a layer (models/target.py, keep_residual_fp32)
    fp32_residual: bool = True
    # GPUs one copy of the target spans (rollout worker, colocated train worker, capture, regenerate,
    # eval): its decoder layers are split over them by a memory-balanced device map, for a target one
    # GPU cannot hold. 1 = the whole target on one device (the only choice on CPU).
    num_gpus: int = 1


@dataclass
class DataConfig:
    """ShareGPT-style conversations rendered with the target's chat template."""

    path: str = EMBEDDED_DATA  # JSON/JSONL file, folder of them, or the embedded default
    max_length: int = 2048
    max_samples: Optional[int] = None  # first N usable conversations (None = all)
    num_eval: int = 64  # held-out conversations (taken from the end, never trained on)
    num_proc: int = 1
    # Long-context runs: keep only conversations of at least this many tokens (after truncation at
    # max_length); shorter ones are skipped like unusable rows, held-out split included. 0 = all.
    min_length: int = 0
    # Join the consecutive parts of one chat (ShareGPT V3 ids <chat>_<n>) into one conversation.
    join_parts: bool = False

    def __post_init__(self):
        if self.min_length < 0:
            raise ValueError(f"config key 'data.min_length'={self.min_length!r} must be >= 0 (0 keeps every length)")
        if self.min_length > self.max_length:
            raise ValueError(f"config key 'data.min_length'={self.min_length!r} exceeds "
                             f"data.max_length={self.max_length} (rows are cut at max_length, none could be kept); "
                             "lower data.min_length or raise data.max_length")


@dataclass
class DraftConfig:
    """The draft: which algorithm trains it (``specforge.registry``) and the keys every algorithm
    reads. An algorithm's own keys are the fields of its options class, a subclass of this one
    (``DraftAlgorithm.options``): the ``draft`` section is built as that class, so a key of another
    algorithm is refused as unknown. Range checks of an option: its field metadata ``at_least``,
    ``positive`` or ``unit`` (``"(0, 1]"``)."""

    algorithm: str = DEFAULT_ALGORITHM
    intermediate_size: Optional[int] = None  # None = the target's (per algorithm: its default)
    num_attention_heads: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    rope_theta: Optional[float] = None
    rms_norm_eps: Optional[float] = None
    # start a fresh run's draft from a published draft folder of the same target and algorithm (ours,
    # SGLang's EAGLE-3, a speculators/vLLM export, z-lab's DFlash): ``specforge/training/init_from.py``
    init_from: Optional[str] = None


def default_feature_layers(model_cfg: "ModelConfig", num_layers: int) -> list[int]:
    """The layers the default algorithm (``DEFAULT_ALGORITHM``) reads, for ``model_cfg``: what a
    target loaded without a run's config captures."""
    return get_algorithm(DEFAULT_ALGORITHM).bind(Config(model=model_cfg)).feature_layers(num_layers)


def draft_options(algorithm: str) -> type:
    """The options class (a ``DraftConfig``) of ``algorithm``; a ValueError naming the key otherwise."""
    return get_algorithm(algorithm).options


@dataclass
class TrainConfig:
    """The optimization. Training stops at whichever comes first: ``max_steps`` optimizer steps,
    ``epochs`` passes over the train split (``ceil(epochs * num_train_samples / global_batch)``
    steps, global batch = ``batch_size * grad_accum * data-parallel groups``) and ``max_minutes``
    of wall clock. ``None`` = no such limit (``max_steps`` and ``epochs`` may not both be None).
    The LR schedule spans the steps the first two allow."""

    lr: float = 1e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    adam_eps: float = 1e-8  # AdamW's epsilon: an update is at most lr/adam_eps times its gradient
    # the draft's row loss against the target's distribution (kernels/losses.py): forward KL (the soft
    # cross-entropy), total variation, LK's alpha (nla) and lambda (lk_hybrid) forms, reverse KL, Jensen-Shannon,
    # Draft-OPD (opd: forward KL where the target accepts the draft's token, reverse KL where it rejects it,
    # on the states the draft's own accepted drafts reach)
    loss: Literal["kl_div", "tv", "nla", "lk_hybrid", "rkl", "jsd", "opd"] = "kl_div"
    # adamw, or muon (torch.optim.Muon) for the hidden weight matrices with AdamW for the rest (training/optim.py)
    optimizer: Literal["adamw", "muon"] = "adamw"
    muon_lr: Optional[float] = None  # Muon's learning rate (None = train.lr: its update is scaled to AdamW's RMS)
    muon_weight_decay: float = 0.1  # Muon's decoupled weight decay (torch's and speculators' default)
    max_grad_norm: float = 0.5
    batch_size: int = 1  # sequences per data-parallel rank per micro-step
    grad_accum: int = 1
    max_steps: Optional[int] = 1000
    max_minutes: Optional[float] = None  # wall-clock budget; stops cleanly and saves
    epochs: Optional[float] = None  # passes over the train split
    seed: int = 0
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    # pack this rank's samples of a step end to end in rows of at most this many tokens (no padding;
    # positions, attention and loss stay each sample's own: specforge/data/packing.py); None = pad
    pack_tokens: Optional[int] = None
    # every gated MLP of the draft keeps only its input for backward and recomputes gate, up and their
    # product there (models/layers.py): its three I-wide activations a row for its three matmuls again
    recompute_mlp: bool = False
    num_threads: Optional[int] = None  # torch intra-op threads (None = leave as is)
    num_workers: int = 1  # train workers (Ray); one process (specforge.train) trains their global batch
    # train workers lost (killed, crashed, their node gone) after which the driver restarts the train
    # group from the last complete checkpoint, per run; past it the run ends naming the worker
    max_restarts: int = 3
    log_every: int = 10
    eval_every: int = 100
    output_dir: str = "runs/default"


@dataclass
class RolloutConfig:
    num_workers: int = 1  # target workers in disaggregated mode
    max_restarts: int = 3  # rollout workers that died and were replaced, per run, before it gives up
    # Packed target forwards: a batch's samples go end to end into rows of at most this many tokens
    # (position ids restart at 0 per sample, HF's masks keep samples apart), then come back per sample:
    # no compute on padding. Used wherever the target runs: rollout workers, the single process and
    # python -m specforge.capture. None = right-padded batches. At least data.max_length.
    pack_tokens: Optional[int] = None
    # What computes the target's features wherever the target runs for them (rollout workers,
    # colocated and single-process trainers, python -m specforge.capture, adapt's capture):
    # hf = a transformers forward in this process; vllm = a vLLM engine (its own venv, made by
    # scripts/install_vllm.sh) with vLLM's extract_hidden_states method, tensor/expert parallel inside it
    backend: Literal["hf", "vllm"] = "hf"
    tp_size: int = 1  # vllm: tensor-parallel size inside the engine (GPUs, or CPU ranks, per rollout worker)
    expert_parallel: bool = False  # vllm: experts spread over the tp_size ranks (--enable-expert-parallel)
    # vllm: an engine the user runs (http://host:port), started with the command
    # `python -m specforge.capture --config ... --vllm-command` prints; None = each process starts its own
    vllm_endpoint: Optional[str] = None
    vllm_python: Optional[str] = None  # the vLLM venv's python (None = ~/.cache/specforge/vllm/bin/python)
    vllm_gpu_memory_utilization: float = 0.85  # vllm on a GPU: its share of each GPU (colocated: beside the draft)
    vllm_cpu_kvcache_gib: float = 1.0  # vllm on the CPU: its KV-cache (and hidden-states cache) space
    # the engine's start, weights loaded and compiled; None: parallel.setup_timeout_s, the bound of a worker's
    # whole start, which the engine's is part of (a big target's configs raise that one)
    vllm_startup_timeout_s: Optional[float] = None
    vllm_args: list[str] = field(default_factory=list)  # more `vllm serve` flags, passed as they are
    # vllm: the folder the engine writes hidden states into for us (None: /dev/shm where it holds 64 requests
    # of the longest sample, else the temp folder on disk; models/handoff.py)
    vllm_storage: Optional[str] = None


@dataclass
class PlacementConfig:
    mode: Literal["colocated", "disaggregated", "offline"] = "colocated"
    transport: Literal["p2p", "object_store"] = "p2p"
    # backpressure: features sent but not yet trained on never exceed this; it must hold the largest
    # possible step (a global batch of samples as long as the longest), else the run is refused before step 0
    max_inflight_mb: float = 512.0


@dataclass
class StoreConfig:
    """The offline feature store (python -m specforge.capture / regenerate write it; offline mode reads it)."""

    dir: Optional[str] = None  # None = <train.output_dir>/features
    dtype: Literal["bfloat16", "int8"] = "bfloat16"  # int8 = per-row absmax scales, ~half the bytes
    shard_mb: float = 256.0  # samples are packed into shards of about this size
    # What fills the store before offline training (scripts/train_eagle3.sh runs python -m specforge.<fill>):
    # regenerate = the target writes the answers and its features are kept while it generates;
    # capture = the target reads the dataset's own answers (one forward per sample).
    fill: Literal["regenerate", "capture"] = "capture"
    # Replay (offline only): a reference store (same target, tokenizer, aux layers, max_length) whose
    # training samples make up ``replay_share`` of every step's samples, so a fine-tune on new data
    # keeps what the draft knew. Its last samples (what a run on it holds out) are never replayed.
    replay_dir: Optional[str] = None
    replay_share: float = 0.25  # in [0, 1): over any K steps floor(share * global_batch * K) samples are replayed


@dataclass
class RegenerateConfig:
    """Self-distilled data: every assistant turn rewritten by the target (python -m specforge.regenerate)."""

    backend: Literal["local", "openai"] = "local"  # local = in-process batched generation with a KV cache
    endpoint: Optional[str] = None  # OpenAI-compatible base URL, e.g. http://127.0.0.1:30000/v1
    api_model: Optional[str] = None  # model name sent to the endpoint (None = model.target_path)
    concurrency: int = 8  # requests in flight (openai backend)
    timeout_s: float = 120.0  # per request (openai backend)
    retries: int = 3  # per request, with backoff (openai backend)
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    batch_size: int = 32  # sequences decoded together (local backend)
    num_workers: int = 1  # Ray generation workers, data-parallel (local backend)
    max_samples: Optional[int] = None  # first N conversations of data.path (None = all)
    max_turns: Optional[int] = None  # keep and regenerate only the first K assistant turns
    output: Optional[str] = None  # JSONL; None = <train.output_dir>/regenerated.jsonl
    capture_features: bool = True  # local backend: write the features computed while generating to the store


@dataclass
class ParallelConfig:
    sp_ulysses: int = 1
    sp_ring: int = 1
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    timeout_s: float = 300.0  # one step: every transfer, collective and per-step remote call (NCCL's watchdog too)
    setup_timeout_s: float = 1800.0  # starting the workers: placement, model and checkpoint loading


@dataclass
class RayConfig:
    address: Optional[str] = None  # None = start a local Ray; "auto" or host:port = join
    num_cpus: Optional[int] = None
    temp_dir: Optional[str] = None
    # Custom Ray resources each worker's bundle requests, to pin a worker kind to nodes started with
    # them (ray start --resources='{"rollout_node": 8}'); e.g. {rollout_node: 1}. {} = anywhere.
    rollout_resources: dict[str, float] = field(default_factory=dict)
    train_resources: dict[str, float] = field(default_factory=dict)
    # Memory of one GPU the workers get, in GiB: the driver refuses a run whose predicted peak on a
    # device (specforge/memory.py) exceeds it, before any worker starts. None = this machine's first
    # CUDA device when the run uses GPUs; no check without one (e.g. a driver off the GPU nodes).
    gpu_memory_gib: Optional[float] = None


@dataclass
class TrackingConfig:
    wandb: bool = True
    wandb_mode: Literal["auto", "offline", "online", "disabled"] = "auto"
    project: str = "specforge"
    run_name: Optional[str] = None
    jsonl: bool = True
    tensorboard: bool = False


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None  # None = <train.output_dir>/checkpoints
    every_steps: int = 200
    keep_last: int = 2
    resume: bool = True  # resume from the newest checkpoint in dir if one exists


@dataclass
class AdaptConfig:
    """``python -m specforge.adapt``: rounds that fine-tune the live draft on served traffic."""

    dir: Optional[str] = None  # None = <train.output_dir>/adapt (state, traffic, store, rounds, metrics)
    draft: Optional[str] = None  # the live draft at the start (None = <checkpoint.dir>/latest of this config's run)
    traffic: Optional[str] = None  # JSONL of served traffic to read; None = the logging proxy's own log
    serve: bool = True  # run llama-server with the live draft behind the logging proxy (swapped on a passed gate)
    host: str = "127.0.0.1"
    port: int = 8090  # the proxy clients talk to (0: a free port, printed)
    # stop after this many rounds (None: until interrupted; without serve: till the traffic runs dry)
    rounds: Optional[int] = None
    min_rows: int = 32  # new training rows that start a round
    holdout_share: float = 0.2  # share of traffic rows (by content hash) kept for the gate, never trained on
    steps: int = 60  # fine-tune steps per round (train.max_minutes also bounds it)
    lr: float = 5e-5
    replay_share: float = 0.25  # share of each step from the reference store (store.replay_share)
    reference_store: Optional[str] = None  # None = this config's store (store.dir or <train.output_dir>/features)
    gate_prompts: int = 16  # most recent held-out traffic prompts the gate decodes
    general_prompts: int = 16  # held-out general prompts (data.path's eval split)
    gate_margin: float = 0.02  # general acceptance may fall at most this much
    min_gain: float = 0.0  # domain acceptance must rise by more than this
    max_new_tokens: int = 64  # per gate prompt
    chain: int = 7  # draft tokens per round in the gate's decode
    n_max: int = 3  # llama-server --spec-draft-n-max
    threads: Optional[int] = None  # llama-server threads (None: all cores)
    drain_timeout_s: float = 120.0  # a swap waits at most this long for the old server's requests
    server_restarts: int = 3  # live servers that died and were restarted, per adapt run, before it stops
    poll_s: float = 1.0


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    draft: DraftConfig = field(default_factory=lambda: draft_options(DEFAULT_ALGORITHM)())
    train: TrainConfig = field(default_factory=TrainConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    adapt: AdaptConfig = field(default_factory=AdaptConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- building from plain data


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is list:
        (item,) = typing.get_args(tp)
        return f"a list of {_describe(item)}"
    if origin is dict:
        k_tp, v_tp = typing.get_args(tp)
        return f"a mapping of {_describe(k_tp)} to {_describe(v_tp)}"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted where floats are."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        errors = []
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key)
            except ValueError as e:
                errors.append((arg, e))
        inner = [e for arg, e in errors if arg is not type(None) and typing.get_origin(arg) is list]
        if value is not None and isinstance(value, (list, tuple)) and inner:
            raise inner[0]  # the list element that was wrong, e.g. 'model.aux_layer_ids[1]'
    elif origin is Literal:
        if value in typing.get_args(tp):
            return value
    elif origin is list:
        if isinstance(value, (list, tuple)):
            (item,) = typing.get_args(tp)
            return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    elif origin is dict:
        if isinstance(value, dict):
            k_tp, v_tp = typing.get_args(tp)
            return {_coerce(k, k_tp, key): _coerce(v, v_tp, f"{key}.{k}") for k, v in value.items()}
    elif tp is type(None):
        if value is None:
            return None
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(value, tp):
        return value
    raise ValueError(f"config key {key!r}: got {value!r} ({type(value).__name__}), expected {_describe(tp)}")


# Keys a config may still carry from an older specforge: what to write instead.
_REPLACED = {
    "train.ttt_warmup_steps": "it is an EAGLE-3 key: write draft.ttt_warmup_steps",
}


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        where = prefix.rstrip(".") or "<root>"
        raise ValueError(f"config key {where!r}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}{name}"
        if key in _REPLACED:
            raise ValueError(f"config key {key!r} was replaced: {_REPLACED[key]}")
        if name not in fields:
            if prefix == "draft." and (owner := _draft_key_owner(name)):
                raise ValueError(f"config key {key!r}={value!r} applies to draft.algorithm={owner}, "
                                 f"not {data.get('algorithm', DEFAULT_ALGORITHM)}; "
                                 f"remove it (or set draft.algorithm={owner})")
            raise ValueError(f"unknown config key {key!r}; allowed here: {', '.join(sorted(fields))}")
        tp = hints[name]
        if key == "draft":  # built as the options class of its algorithm
            tp = _draft_class(value)
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value, f"{key}.")
        else:
            kwargs[name] = _coerce(value, tp, key)
    return cls(**kwargs)


def _draft_class(data: Any) -> type:
    name = data.get("algorithm", DEFAULT_ALGORITHM) if isinstance(data, dict) else DEFAULT_ALGORITHM
    if name not in NAMES:
        raise ValueError(f"config key 'draft.algorithm': got {name!r}, expected one of {', '.join(map(repr, NAMES))}")
    return draft_options(name)


def _draft_key_owner(name: str) -> Optional[str]:
    """The algorithm whose options have the key ``name`` (the first in the registry), or None."""
    return next((a for a in NAMES if name in {f.name for f in dataclasses.fields(draft_options(a))}), None)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"config key {dotted!r}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


class _Loader(yaml.SafeLoader):
    """PyYAML reads YAML 1.1, where ``1e-4`` is a string; YAML 1.2 floats are resolved too, so a
    value means the same in a config file and on the command line."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$"),
    list("-+.0123456789"))


def _yaml_error(err: yaml.YAMLError, where: str) -> ValueError:
    """One line naming ``where`` (a file or an override) and the line/column, not ``<unicode string>``."""
    mark = getattr(err, "problem_mark", None)
    at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    return ValueError(f"{where} is not valid YAML: {problem}{at}")


def parse_override(text: str) -> tuple[str, Any]:
    """``"train.lr=1e-4"`` -> ``("train.lr", 1e-4)``; the value is parsed as YAML."""
    if "=" not in text:
        raise ValueError(f"override {text!r} is not of the form section.key=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.load(raw, Loader=_Loader) if raw != "" else None
    except yaml.YAMLError as e:
        raise _yaml_error(e, f"override {text!r}") from None
    if isinstance(value, str) and value.lower() in ("none", "null"):
        value = None
    return key.strip(), value


def load_config(path: Optional[str | Path] = None, overrides: Optional[list[str]] = None) -> Config:
    """Read ``path`` (YAML, may be None for all defaults) and apply dotted overrides."""
    tree: dict = {}
    if path is not None:
        path = Path(path)
        if path.is_dir():
            inside = sorted(str(p) for p in path.glob("*.yaml"))
            raise ValueError(f"config file {str(path)!r} is a directory; pass a YAML file"
                             + (f", one of: {', '.join(inside)}" if inside else ""))
        if not path.is_file():
            raise ValueError(f"config file {str(path)!r} does not exist")
        try:
            tree = yaml.load(path.read_text(), Loader=_Loader) or {}
        except yaml.YAMLError as e:
            raise _yaml_error(e, f"config file {str(path)!r}") from None
        if not isinstance(tree, dict):
            raise ValueError(f"config file {str(path)!r} must hold a mapping at the top level")
    for item in overrides or []:
        key, value = parse_override(item)
        _set_dotted(tree, key, value)
    cfg = _build(Config, tree, "")
    validate(cfg)
    return cfg


# Numeric ranges a type cannot say: key -> (lowest, inclusive). A null Optional passes.
_AT_LEAST = {
    "model.argmax_chunk_tokens": 1, "model.num_gpus": 1, "data.max_length": 8, "data.max_samples": 1,
    "data.num_eval": 0, "data.num_proc": 1, "draft.intermediate_size": 1,
    "draft.num_attention_heads": 1, "draft.num_key_value_heads": 1, "draft.head_dim": 1,
    "train.warmup_steps": 0, "train.weight_decay": 0, "train.muon_weight_decay": 0, "train.batch_size": 1,
    "train.grad_accum": 1,
    "train.max_steps": 1, "train.num_threads": 1, "train.num_workers": 1, "train.max_restarts": 0, "train.log_every": 1,
    "train.eval_every": 0, "rollout.num_workers": 1, "rollout.max_restarts": 0, "parallel.sp_ulysses": 1,
    "parallel.sp_ring": 1, "ray.num_cpus": 1, "checkpoint.every_steps": 0, "checkpoint.keep_last": 0,
    "regenerate.concurrency": 1, "regenerate.retries": 0, "regenerate.max_new_tokens": 1,
    "regenerate.temperature": 0, "regenerate.batch_size": 1, "regenerate.num_workers": 1,
    "regenerate.max_samples": 1, "regenerate.max_turns": 1,
}
_POSITIVE = ("draft.rope_theta", "draft.rms_norm_eps", "train.lr", "train.adam_eps", "train.muon_lr",
             "train.max_grad_norm", "train.max_minutes", "train.epochs", "parallel.timeout_s",
             "parallel.setup_timeout_s", "placement.max_inflight_mb", "store.shard_mb", "regenerate.timeout_s")
_UNIT = {"train.min_lr_ratio": "[0, 1]", "regenerate.top_p": "(0, 1]"}


def _get(cfg: Config, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _or_null(cfg: Config, key: str) -> str:
    """' or null' where the key's type admits null (the range message must not offer what is refused)."""
    section, name = key.split(".")
    tp = typing.get_type_hints(type(getattr(cfg, section)))[name]
    return " or null" if type(None) in typing.get_args(tp) else ""


def _option_ranges(cfg: Config) -> tuple[dict, tuple, dict]:
    """The ranges of the draft algorithm's own keys (their field metadata)."""
    fields = dataclasses.fields(cfg.draft)
    return ({f"draft.{f.name}": f.metadata["at_least"] for f in fields if "at_least" in f.metadata},
            tuple(f"draft.{f.name}" for f in fields if f.metadata.get("positive")),
            {f"draft.{f.name}": f.metadata["unit"] for f in fields if "unit" in f.metadata})


def _range_errors(cfg: Config) -> list[str]:
    at_least, positive, unit = _option_ranges(cfg)
    at_least, positive, unit = {**_AT_LEAST, **at_least}, (*_POSITIVE, *positive), {**_UNIT, **unit}
    out = [f"config key {k!r}={_get(cfg, k)!r} must be >= {lo}{_or_null(cfg, k)}" for k, lo in at_least.items()
           if _get(cfg, k) is not None and _get(cfg, k) < lo]
    out += [f"config key {k!r}={_get(cfg, k)!r} must be > 0{_or_null(cfg, k)}" for k in positive
            if _get(cfg, k) is not None and _get(cfg, k) <= 0]
    for k, interval in unit.items():
        v = _get(cfg, k)
        if not ((0 < v if interval[0] == "(" else 0 <= v) and v <= 1):
            out.append(f"config key {k!r}={v!r} must be in {interval}")
    return out


def validate(cfg: Config) -> None:
    """Cross-field checks that a type annotation cannot express; the first problem is raised,
    naming the dotted key, its value and what is allowed."""
    errors = _range_errors(cfg)
    if cfg.train.max_steps is None and cfg.train.epochs is None:
        errors.append("config keys 'train.max_steps' and 'train.epochs' may not both be null "
                      "(nothing would stop training)")
    if len(cfg.train.betas) != 2 or not all(0 <= b < 1 for b in cfg.train.betas):
        errors.append(f"config key 'train.betas'={cfg.train.betas!r} must be two values in [0, 1)")
    if cfg.train.precision == "fp16":  # before any worker starts; "auto" never trains in fp16 (DraftTrainer)
        errors.append("config key 'train.precision'='fp16' is refused: fp16 training needs loss scaling, which the "
                      "trainer does not do (small gradients would flush to zero); use 'bf16' (fp32's exponent range, "
                      "no scaling needed), or 'fp32' on a GPU without bf16")
    errors += get_algorithm(cfg.draft.algorithm).config_errors(cfg)
    errors += loss_errors(cfg)
    errors += replay_errors(cfg)
    errors += packing_errors(cfg)
    errors += capture_packing_errors(cfg)
    errors += backend_errors(cfg)
    endpoint = cfg.regenerate.endpoint
    if endpoint is not None and not re.match(r"^https?://[^/\s]+", endpoint):
        errors.append(f"config key 'regenerate.endpoint'={endpoint!r} must be an http(s) URL, e.g. "
                      f"'http://{endpoint.split('://')[-1].lstrip('/') or '127.0.0.1:30000'}/v1'")
    if errors:
        raise ValueError(errors[0])


def loss_errors(cfg: Config) -> list[str]:
    """``train.loss``: a kind other than ``kl_div`` only where the algorithm's loss computes it."""
    kinds = getattr(get_algorithm(cfg.draft.algorithm), "losses", ("kl_div",))
    if cfg.train.loss in kinds:
        return []
    return [f"config key 'train.loss'={cfg.train.loss!r} is refused for draft.algorithm={cfg.draft.algorithm}: its "
            "loss trains against the target's tokens, not its distribution (EAGLE-3, EAGLE-3.1 and P-EAGLE take "
            "every train.loss); use kl_div"]


def packing_errors(cfg: Config) -> list[str]:
    """``train.pack_tokens``: a sample must fit one row; what cannot pack yet is refused."""
    n = cfg.train.pack_tokens
    if n is None:
        return []
    if n < cfg.data.max_length:
        return [f"config key 'train.pack_tokens'={n} is below data.max_length={cfg.data.max_length}: the longest "
                f"sample must fit one row; set train.pack_tokens to at least {cfg.data.max_length}"]
    if not getattr(get_algorithm(cfg.draft.algorithm), "packs", False):
        return [f"config key 'train.pack_tokens' is refused for draft.algorithm={cfg.draft.algorithm}: its loss "
                "cannot keep packed samples apart yet (EAGLE-3, EAGLE-3.1, P-EAGLE, DFlash and DSpark can); unset "
                "train.pack_tokens"]
    if cfg.parallel.sp_ulysses * cfg.parallel.sp_ring > 1 and not getattr(get_algorithm(cfg.draft.algorithm),
                                                                           "packs_sp", False):
        return [f"config key 'train.pack_tokens' is refused for draft.algorithm={cfg.draft.algorithm} with sequence "
                f"parallelism (parallel.sp_ulysses={cfg.parallel.sp_ulysses}, "
                f"parallel.sp_ring={cfg.parallel.sp_ring}): "
                "its SP cores do not keep packed samples apart yet (EAGLE-3 and EAGLE-3.1 do); unset "
                "train.pack_tokens or set both to 1"]
    return []


def capture_packing_errors(cfg: Config) -> list[str]:
    """``rollout.pack_tokens``: a sample must fit one packed target row (the family is checked by
    ``targets.check_packing`` where the target config is read)."""
    n = cfg.rollout.pack_tokens
    if n is None or n >= cfg.data.max_length:
        return []
    return [f"config key 'rollout.pack_tokens'={n} is below data.max_length={cfg.data.max_length}: the longest "
            f"sample must fit one packed target row; set rollout.pack_tokens to at least {cfg.data.max_length}"]


def backend_errors(cfg: Config) -> list[str]:
    """``rollout.backend`` and the keys only one backend reads."""
    r = cfg.rollout
    if r.backend == "hf":
        if r.tp_size != 1 or r.expert_parallel:
            key = "rollout.tp_size" if r.tp_size != 1 else "rollout.expert_parallel"
            return [f"config key {key!r} needs rollout.backend=vllm (tensor and expert parallelism run inside vLLM); "
                    "with the hf backend a target one GPU cannot hold is split by layers over model.num_gpus"]
        return []
    if r.tp_size < 1:
        return [f"config key 'rollout.tp_size'={r.tp_size} must be at least 1"]
    if cfg.model.num_gpus > 1:
        return [f"config key 'model.num_gpus'={cfg.model.num_gpus} splits a transformers target by layers; with "
                "rollout.backend=vllm set rollout.tp_size instead (the engine's tensor parallelism) and "
                "model.num_gpus=1"]
    if r.tp_size > 1 and cfg.placement.mode == "colocated":
        return [f"config key 'rollout.tp_size'={r.tp_size}: a colocated engine shares its train worker's one GPU; "
                "use placement.mode=disaggregated for a tensor-parallel engine (its rollout worker gets tp_size GPUs)"]
    if r.pack_tokens is not None:
        return ["config key 'rollout.pack_tokens' is for rollout.backend=hf: vLLM batches the samples its own way "
                "(no padding is computed); unset rollout.pack_tokens"]
    if r.vllm_endpoint is not None and not re.match(r"^https?://[^/\s]+$", r.vllm_endpoint.rstrip("/")):
        return [f"config key 'rollout.vllm_endpoint'={r.vllm_endpoint!r} must be the engine's http(s) address, "
                "e.g. 'http://127.0.0.1:8000'"]
    if not 0 < r.vllm_gpu_memory_utilization <= 1:
        return [f"config key 'rollout.vllm_gpu_memory_utilization'={r.vllm_gpu_memory_utilization} must be in (0, 1]"]
    start = r.vllm_startup_timeout_s
    if r.vllm_cpu_kvcache_gib <= 0 or (start is not None and start <= 0):
        key = "rollout.vllm_cpu_kvcache_gib" if r.vllm_cpu_kvcache_gib <= 0 else "rollout.vllm_startup_timeout_s"
        return [f"config key {key!r} must be positive"]
    bound = setup_timeout(cfg)
    if start is not None and start > bound:
        return [f"config key 'rollout.vllm_startup_timeout_s'={start:g} exceeds parallel.setup_timeout_s={bound:g}, "
                "which bounds a worker's whole start (the engine's included): raise parallel.setup_timeout_s too, "
                "or unset rollout.vllm_startup_timeout_s (it then follows parallel.setup_timeout_s)"]
    return []


def setup_timeout(cfg: Config) -> float:
    """Seconds a worker's start (placement, target and engine, checkpoint) may take: ``parallel.setup_timeout_s``,
    never less than one step's bound (``parallel.timeout_s``); ``ray_train.spawn_cluster`` waits as long (it
    reads the keys itself, as the run's reader of them)."""
    return max(cfg.parallel.setup_timeout_s, cfg.parallel.timeout_s)


def engine_start_timeout(cfg: Config) -> float:
    """Seconds an engine may take to start: ``rollout.vllm_startup_timeout_s``, else the worker's whole start
    (``setup_timeout``), which the engine's is part of."""
    r = cfg.rollout
    return r.vllm_startup_timeout_s if r.vllm_startup_timeout_s is not None else setup_timeout(cfg)


def replay_errors(cfg: Config) -> list[str]:
    """``store.replay_*``: the share in [0, 1), and a reference store only where the run reads a store
    (offline); the folder itself is checked by ``preflight.check_replay``."""
    out = []
    share = cfg.store.replay_share
    if not 0 <= share < 1:
        out.append(f"config key 'store.replay_share'={share!r} must be in [0, 1) (the share of each step's samples "
                   "drawn from store.replay_dir; 0.25 replays one sample in four)")
    if cfg.store.replay_dir is not None and cfg.placement.mode != "offline":
        out.append(f"config key 'store.replay_dir'={cfg.store.replay_dir!r} needs placement.mode=offline (replayed "
                   f"samples are read from a feature store), this run has placement.mode={cfg.placement.mode}; set "
                   "placement.mode=offline or unset store.replay_dir")
    return out


def aux_layer_errors(ids: list[int], num_layers: Optional[int] = None, count: Optional[int] = None,
                     who: str = "the draft") -> list[str]:
    """Target layer outputs a draft reads (``count`` of them if the algorithm fixes it): SGLang
    concatenates them in ascending layer order and captures layer ``id``'s output as the input of
    layer ``id + 1``, so anything but sorted unique ids in 0..L-2 trains a draft SGLang cannot serve
    as trained."""
    key = f"config key 'model.aux_layer_ids'={list(ids)!r}"
    if count is not None and len(ids) != count:
        return [f"{key}: {who} fuses exactly {count} target layers, got {len(ids)}"]
    if not ids:
        return [f"{key}: name at least one target layer"]
    if list(ids) != sorted(set(ids)):
        return [f"{key}: must be in ascending order without repeats (SGLang concatenates them in layer order)"
                + (f", e.g. {sorted(set(ids))}" if count is None or len(set(ids)) == count
                   else ", e.g. the default: leave the key unset")]
    top = "L-2" if num_layers is None else num_layers - 2
    if ids[0] < 0 or (num_layers is not None and ids[-1] > num_layers - 2):
        where = "" if num_layers is None else f" (the target has {num_layers} layers)"
        return [f"{key}: ids must be in 0..{top}{where}: SGLang captures layer id's output as layer id+1's input"]
    return []


def layer_ids_or_default(ids, num_layers: int, default: list[int], count: Optional[int] = None,
                         who: str = "the draft") -> list[int]:
    """``ids`` (a run's ``model.aux_layer_ids``) checked against a target of ``num_layers`` layers, or
    ``default`` when None (an algorithm's, which may repeat a layer only on the toy targets of the tests)."""
    if ids is None:
        if min(default) < 0:
            raise ValueError(f"the target has {num_layers} layers, too few for the default model.aux_layer_ids "
                             f"{default}; set {count or 'some'} sorted ids in 0..{num_layers - 2}")
        return list(default)
    if errors := aux_layer_errors(ids, num_layers, count, who):
        raise ValueError(errors[0])
    return list(ids)
