"""The target families specforge trains drafts for: ONE table of their traits.

Every piece of per-family knowledge lives in ``FAMILIES`` (one frozen ``Family`` per row); the
target code (``models/target.py``), in-process generation (``models/generate.py``), the draft's
config (``algorithms/eagle3/model.py``) and the run checks (``preflight.check_run``) ask this module instead
of branching on model types. ``tests/test_targets.py`` runs every row's tiny random model
(``targets/tiny.py``) through capture, teacher logits, generation and the draft config, and checks
that the README's supported-targets table is ``python -m specforge.targets --table``.

A target config is matched by its ``model_type`` (the top-level one, or its text tower's).
A family not in the table is refused with one error naming the table (``family_of``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

IN_PROCESS = "in-process"  # models/generate.py runs the decoder layers around its own KV cache
HF_FALLBACK = "hf-generate"  # HF ``generate`` writes the tokens, then one capture pass gives the features

# How the lossless eval (eval.py) takes rejected draft tokens back out of the target's cache after a verify forward.
CROP = "crop"  # crop the KV cache (sliding layers keep every key there: the attention masks apply the window)
RESTORE = "restore"  # a recurrent state no crop can undo: snapshot it before the verify, restore it and re-run
#                      the accepted tokens when a draft token is rejected (one more target forward in such rounds)

# The engines ``python -m specforge.export --engine`` writes an EAGLE-3 draft for (tests/test_targets_export.py
# checks every row with each engine it lists). SGLang's and vLLM's draft formats do not depend on the family.
# llama.cpp (11434) serves a family when the graph its converter gives the target records each layer's input
# (``res->t_layer_inp[il] = inpL`` in src/models/<arch>.cpp: llama, qwen3, qwen3moe, qwen3next, qwen35,
# gemma4, openai-moe among ours; Mistral and Mixtral convert to llama), which its EAGLE-3 drafter reads
# (common/speculative.cpp: llama_get_embeddings_layer_inp); other families are refused (engines/llamacpp.py).
SGLANG, VLLM, LLAMACPP = "sglang", "vllm", "llama.cpp"
_ALL = (SGLANG, VLLM, LLAMACPP)


@dataclass(frozen=True)
class Family:
    """What specforge needs to know about one target family (one README table row)."""

    name: str  # the row's name (also the tiny model's builder in targets/tiny.py)
    model_types: tuple[str, ...]  # config.json ``model_type`` values of this row (top level or text tower)
    hf_class: str  # the transformers class ``load_target`` builds
    example: str  # a real checkpoint of the family
    quirks: str  # what differs from Llama (and what the tiny model keeps)
    image_text: bool = False  # an image-text model: the target is its text tower (``get_decoder()``)
    generation: str = IN_PROCESS  # IN_PROCESS or HF_FALLBACK (why: ``fallback_reason``)
    fallback_reason: str = ""
    norm_offset: float = 0.0  # final norm multiplies by (norm_offset + weight): Gemma-style RMSNorm is 1
    aux_on_linear_layers: bool = True  # engines capture aux states at linear-attention layer outputs
    mla: bool = False  # multi-head latent attention: no per-head K/V of the target to copy into the draft
    final_softcap: bool = False  # the HF class soft-caps its logits by final_logit_softcapping (when set)
    rollback: str = CROP  # CROP or RESTORE: how the eval's verify forward is taken back to the accepted tokens
    engines: tuple[str, ...] = (SGLANG, VLLM)  # engines the export writes an EAGLE-3 draft for (+ LLAMACPP)
    # extra arguments of llama.cpp's converter for the target GGUF. "--no-mtp": leave out the MTP head real
    # checkpoints ship (our draft replaces it; a checkpoint re-saved by transformers has lost its tensors
    # while its config still counts them, and the converter asserts they exist)
    llamacpp_target_args: tuple[str, ...] = ()
    # why a packed target forward (``rollout.pack_tokens``: samples end to end in one row, positions
    # restarting at 0) would let samples see each other; "" = HF's masks keep them apart (tests/test_packing_capture.py)
    no_pack_reason: str = ""

    @property
    def loader(self) -> str:
        """The transformers Auto class that builds ``hf_class`` from the config."""
        return "AutoModelForImageTextToText" if self.image_text else "AutoModelForCausalLM"

    def auto_class(self):
        import transformers  # lazy: heavy (transformers)

        return getattr(transformers, self.loader)


_MOE = "MoE MLP (router top-k)"
FAMILIES: tuple[Family, ...] = (
    Family("llama", ("llama",), "LlamaForCausalLM", "meta-llama/Llama-3.1-8B-Instruct",
           "RoPE llama3 scaling; untied head", engines=_ALL),
    Family("mistral", ("mistral",), "MistralForCausalLM", "mistralai/Mistral-7B-Instruct-v0.3",
           "sliding-window attention (all layers) when sliding_window is set; head_dim set apart from hidden",
           engines=_ALL),
    Family("qwen2", ("qwen2",), "Qwen2ForCausalLM", "Qwen/Qwen2.5-7B-Instruct",
           "q/k/v bias; tied head on small sizes"),
    Family("qwen3", ("qwen3",), "Qwen3ForCausalLM", "Qwen/Qwen3-8B",
           "per-head q/k RMSNorm; head_dim set apart from hidden; tied head on small sizes", engines=_ALL),
    Family("qwen3_moe", ("qwen3_moe",), "Qwen3MoeForCausalLM", "Qwen/Qwen3-30B-A3B",
           f"{_MOE}, dense layers via mlp_only_layers; q/k norm; YaRN RoPE", engines=_ALL),
    Family("qwen3_next", ("qwen3_next",), "Qwen3NextForCausalLM", "Qwen/Qwen3-Next-80B-A3B-Instruct",
           f"linear-attention (gated DeltaNet) layers between gated full-attention ones; {_MOE} + shared expert; "
           "partial rotary; zero-centred RMSNorm (1 + w)",
           generation=HF_FALLBACK, fallback_reason="linear-attention layers keep a recurrent state, not a KV cache",
           norm_offset=1.0, rollback=RESTORE, engines=_ALL, llamacpp_target_args=("--no-mtp",),
           no_pack_reason="its linear-attention layers carry one recurrent state along the whole row"),
    Family("qwen3_5", ("qwen3_5", "qwen3_5_text"), "Qwen3_5ForCausalLM", "Qwen/Qwen3.5-9B",
           "image-text checkpoint, loaded as its text tower; linear-attention layers; M-RoPE (interleaved), "
           "partial rotary; zero-centred RMSNorm (1 + w)",
           generation=HF_FALLBACK, fallback_reason="linear-attention layers keep a recurrent state, not a KV cache",
           norm_offset=1.0, rollback=RESTORE, engines=_ALL, llamacpp_target_args=("--no-mtp",),
           no_pack_reason="its linear-attention layers carry one recurrent state along the whole row"),
    Family("gemma3_text", ("gemma3_text",), "Gemma3ForCausalLM", "google/gemma-3-1b-it",
           "embeddings scaled by sqrt(H); 4 norms per layer, (1 + w) RMSNorm; q/k norm; sliding + full layers "
           "with their own RoPE; query_pre_attn_scalar; final logit soft-cap when set; tied head",
           generation=HF_FALLBACK, fallback_reason="sliding layers with their own RoPE, 4 norms per layer",
           norm_offset=1.0, final_softcap=True),
    Family("gemma3", ("gemma3",), "Gemma3ForConditionalGeneration", "google/gemma-3-27b-it",
           "image-text: the text tower is gemma3_text (its quirks; the HF class applies no final logit soft-cap)",
           image_text=True,
           generation=HF_FALLBACK, fallback_reason="as gemma3_text", norm_offset=1.0),
    Family("gemma4", ("gemma4", "gemma4_text"), "Gemma4ForConditionalGeneration", "google/gemma-4-31B-it",
           "image-text; per-layer input embeddings; KV shared across the last layers; sliding layers + wider "
           "full-attention layers (global_head_dim, proportional partial RoPE); final logit soft-cap; tied head",
           image_text=True,
           generation=HF_FALLBACK, fallback_reason="per-layer inputs and shared KV layers", final_softcap=True,
           engines=_ALL),
    Family("phi3", ("phi3",), "Phi3ForCausalLM", "microsoft/Phi-4-mini-instruct",
           "fused qkv_proj and gate_up_proj; partial rotary (Phi-4-mini 0.75)",
           generation=HF_FALLBACK, fallback_reason="fused projections and partial rotary"),
    Family("gpt_oss", ("gpt_oss",), "GptOssForCausalLM", "openai/gpt-oss-20b",
           f"attention sinks; alternating sliding/full layers; {_MOE} with clamped SwiGLU; YaRN RoPE",
           generation=HF_FALLBACK, fallback_reason="attention sinks", engines=_ALL,
           no_pack_reason="its model builds its masks without the position ids (transformers 5.x)"),
    Family("deepseek_v3", ("deepseek_v3",), "DeepseekV3ForCausalLM", "deepseek-ai/DeepSeek-V3",
           "MLA (low-rank q/kv, qk_nope + qk_rope head dims, v_head_dim); grouped top-k MoE + shared expert "
           "after first_k_dense_replace dense layers; YaRN RoPE with mscale",
           generation=HF_FALLBACK, fallback_reason="MLA attention", mla=True),
    Family("glm4_moe", ("glm4_moe",), "Glm4MoeForCausalLM", "zai-org/GLM-4.5-Air",
           f"partial rotary 0.5; q/k norm; q/k/v bias; {_MOE} + shared expert after a dense layer",
           generation=HF_FALLBACK, fallback_reason="partial rotary"),
    Family("mixtral", ("mixtral",), "MixtralForCausalLM", "mistralai/Mixtral-8x7B-Instruct-v0.1",
           f"{_MOE} in every layer", engines=_ALL),
    Family("qwen2_5_vl", ("qwen2_5_vl", "qwen2_5_vl_text"), "Qwen2_5_VLForConditionalGeneration",
           "Qwen/Qwen2.5-VL-7B-Instruct",
           "image-text: the target is the text tower (model.language_model); M-RoPE (text-only: 1-D positions)",
           image_text=True, generation=HF_FALLBACK, fallback_reason="M-RoPE position ids",
           no_pack_reason="its masks read packed positions only from a 4-row M-RoPE position tensor"),
    Family("qwen3_vl", ("qwen3_vl", "qwen3_vl_text"), "Qwen3VLForConditionalGeneration", "Qwen/Qwen3-VL-8B-Instruct",
           "image-text: the target is the text tower (model.language_model); interleaved M-RoPE; q/k norm",
           image_text=True, generation=HF_FALLBACK, fallback_reason="M-RoPE position ids"),
)

_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def family_of(config: Any) -> Family:
    """The table row of a target config (an HF config or its dict); a ValueError naming the table."""
    kinds = [_get(config, "model_type"), _get(text_config(config), "model_type")]
    for kind in kinds:
        if kind in _BY_TYPE:
            return _BY_TYPE[kind]
    raise ValueError(
        f"target model_type {kinds[0]!r} is not a supported target family (supported: "
        f"{', '.join(sorted(_BY_TYPE))}); pick a target of one of them, or add a Family row for it in "
        "specforge/targets/__init__.py (and its tiny model in specforge/targets/tiny.py) so the tests cover it")


def text_config(config: Any) -> Any:
    """The text tower's config (the config itself for a text-only model)."""
    if isinstance(config, Mapping):
        sub = config.get("text_config")
        return sub if isinstance(sub, Mapping) else config
    get = getattr(config, "get_text_config", None)
    return get() if get is not None else config


def read_config_json(path: str) -> Optional[dict]:
    """A local target folder's config.json as written (None for a hub id): transformers fills a
    missing ``text_config`` with defaults, so only the file shows that it is missing."""
    f = Path(path) / "config.json"
    return json.loads(f.read_text()) if f.is_file() else None


def check_text_tower(config: Any) -> None:
    """An image-text family's config must carry its text tower (``text_config``): the draft is
    shaped from it and the target is its language model."""
    fam = family_of(config)
    if not fam.image_text or _get(config, "model_type") not in fam.model_types[:1]:
        return
    text = text_config(config)
    if text is config or _get(text, "num_hidden_layers") is None:
        raise ValueError(
            f"target is a {fam.name} image-text model but its config.json has no text_config (the language model "
            f"the draft is trained for); point model.target_path at the full {fam.hf_class} checkpoint "
            f"(e.g. {fam.example})")


def linear_attention_layers(config: Any) -> list[int]:
    """Layers without softmax attention (``layer_types`` == "linear_attention")."""
    types = _get(text_config(config), "layer_types") or []
    return [i for i, t in enumerate(types) if t == "linear_attention"]


def sliding_windows(config: Any) -> list[Optional[int]]:
    """Each layer's sliding window (None = full causal attention), as HF's masks apply it."""
    cfg = text_config(config)
    n = int(_get(cfg, "num_hidden_layers"))
    window = _get(cfg, "sliding_window")
    types = _get(cfg, "layer_types")
    if types:
        return [window if t == "sliding_attention" else None for t in types]
    if _get(cfg, "use_sliding_window") is False:
        return [None] * n
    return [window] * n


def logit_softcap(config: Any) -> Optional[float]:
    """``final_logit_softcapping`` of a family whose HF class applies it (logits = cap * tanh(h @ W.T / cap)),
    else None. (transformers' Gemma3ForConditionalGeneration does not apply its text config's cap.)"""
    if not family_of(config).final_softcap:
        return None
    cap = _get(text_config(config), "final_logit_softcapping")
    return float(cap) if cap else None


# RoPE variants algorithms/eagle3/model.py implements; the draft of a target with another variant (YaRN,
# dynamic, ...) gets plain RoPE at the target's theta (as SpecForge's gpt-oss / DeepSeek-V3 drafts):
# what matters is that training and serving use the same, and both read the draft's config.json.
DRAFT_ROPE_TYPES = ("linear", "llama3")
_NOT_ROPE_SCALING = ("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved")


def draft_rope(config: Any) -> tuple[Optional[float], Optional[dict]]:
    """``(rope_theta, rope_scaling)`` for the target's draft. Gemma's per-layer-type RoPE: the
    full-attention layers' (the long-range one). M-RoPE over text is 1-D RoPE (its three position
    rows are equal), and partial rotary is the target's own business: the draft is a Llama layer
    rotating all of its head dims."""
    cfg = text_config(config)
    params = _get(cfg, "rope_parameters") or _get(cfg, "rope_scaling") or {}
    if "full_attention" in params:
        params = params["full_attention"]
    theta = params.get("rope_theta", _get(cfg, "rope_theta"))
    kind = params.get("rope_type", params.get("type", "default"))
    scaling = {k: v for k, v in params.items() if k not in _NOT_ROPE_SCALING} if kind in DRAFT_ROPE_TYPES else None
    return (None if theta is None else float(theta)), scaling


def draft_attention(config: Any) -> tuple[int, int, int]:
    """``(heads, kv_heads, head_dim)`` of a draft as wide as the target: the target's own; for MLA
    (no per-head K/V) ``v_head_dim``-wide heads filling the hidden size, KV heads = gcd with the
    target's (DeepSeek-V3: 56 x 128, 8 KV heads, as SpecForge's DeepSeek-V3 draft)."""
    cfg = text_config(config)
    H, heads = int(_get(cfg, "hidden_size")), int(_get(cfg, "num_attention_heads"))
    per_layer = _get(cfg, "per_layer_config")  # Gemma 4: full-attention layers are wider; take layer 0's
    if isinstance(per_layer, Mapping):  # config.json: only the layers that differ, by index
        shape = {**cfg, **per_layer.get("0", {})}
    else:
        shape = per_layer[0] if per_layer else cfg
    kv = int(_get(shape, "num_key_value_heads") or heads)
    head_dim = int(_get(shape, "head_dim") or H // heads)
    fam = _BY_TYPE.get(_get(config, "model_type")) or _BY_TYPE.get(_get(cfg, "model_type"))
    if fam is not None and fam.mla:
        head_dim = int(_get(cfg, "v_head_dim"))
        heads, kv = H // head_dim, math.gcd(H // head_dim, kv)
    return heads, kv, head_dim


def target_head_dim(config: Any) -> Optional[int]:
    """The widest attention head of the target's text tower, or None when it states none. Gemma 4
    states it per layer (``per_layer_config``; its full-attention layers are wider) and transformers
    refuses to read a global ``head_dim`` there."""
    cfg = text_config(config)
    per_layer = _get(cfg, "per_layer_config")
    if isinstance(per_layer, Mapping):  # config.json: only the layers that differ, by index
        dims = [_get(cfg, "head_dim")] + [v.get("head_dim") for v in per_layer.values()]
    elif per_layer:
        dims = [_get(layer, "head_dim") for layer in per_layer]
    else:
        dims = [_get(cfg, "head_dim")]
    dims = [int(d) for d in dims if d]
    return max(dims) if dims else None


def check_packing(config: Any) -> None:
    """``rollout.pack_tokens`` needs a family whose masks keep packed samples apart (``no_pack_reason``)."""
    fam = family_of(config)
    if fam.no_pack_reason:
        raise ValueError(f"config key 'rollout.pack_tokens' is refused for a {fam.name} target: {fam.no_pack_reason}, "
                         "so packed samples would see each other; unset rollout.pack_tokens (padded batches)")


def check_capture_engine(config: Any, tp_size: int = 1) -> None:
    """``rollout.backend=vllm`` needs a family vLLM serves (the table's ``engines``) and attention heads
    that its ``rollout.tp_size`` ranks split evenly: checked from the config alone, before an engine
    starts and fails on either."""
    fam = family_of(config)
    if VLLM not in fam.engines:
        raise ValueError(f"config key 'rollout.backend'='vllm' is refused for a {fam.name} target: vLLM does not "
                         "serve this family; use rollout.backend=hf (the transformers forward in our process)")
    heads = _get(text_config(config), "num_attention_heads")
    if heads and int(heads) % tp_size:
        fits = [d for d in range(1, int(heads) + 1) if int(heads) % d == 0]
        raise ValueError(f"config key 'rollout.tp_size'={tp_size} does not divide the target's {heads} attention "
                         f"heads (vLLM splits them over its tensor-parallel ranks); use one of {fits}")


def check_aux_layers(config: Any, aux_ids: list[int]) -> None:
    """Aux ids that name a linear-attention layer's output, for a family whose engines cannot capture there."""
    fam = family_of(config)
    hit = sorted(set(aux_ids) & set(linear_attention_layers(config)))
    if hit and not fam.aux_on_linear_layers:
        full = [i for i in range(int(_get(text_config(config), "num_hidden_layers")) - 1)
                if i not in linear_attention_layers(config)]
        raise ValueError(
            f"config key 'model.aux_layer_ids'={list(aux_ids)} names linear-attention layer(s) {hit} of this "
            f"{fam.name} target, whose serving engines capture only full-attention layer outputs; choose 3 of {full}")


def check_target(config: Any, aux_ids: list[int], draft_vocab_size: Optional[int] = None) -> None:
    """Every per-family check of a run against the target's config.json (``preflight.check_run``)."""
    family_of(config)
    check_text_tower(config)
    check_aux_layers(config, aux_ids)
    V = int(_get(text_config(config), "vocab_size"))
    if draft_vocab_size is not None and draft_vocab_size > V:
        raise ValueError(f"config key 'draft.vocab_size'={draft_vocab_size} exceeds the target's vocabulary "
                         f"({V} tokens); choose at most {V}")


# ---------------------------------------------------------------- the README table

COLUMNS = ("family", "config model_type", "transformers class", "e.g.", "what the test model keeps",
           "capture = HF", "generation with features", "draft config", "TTT train step",
           "offline training + lossless eval", "EAGLE-3 export")
ENGINE_NAMES = {SGLANG: "SGLang", VLLM: "vLLM", LLAMACPP: "llama.cpp"}
ROLLBACK = {CROP: "yes (rejected tokens cropped from the KV cache)",
            RESTORE: "yes (linear-attention state restored, accepted tokens re-run)"}


def table_markdown() -> str:
    """The README's supported-targets table (tests/test_targets.py asserts the README holds exactly
    this, and runs every row's tiny model through each column; tests/test_targets_train.py the training
    column, tests/test_targets_export.py the export one)."""
    rows = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for f in FAMILIES:
        gen = "in-process" if f.generation == IN_PROCESS else f"HF generate + capture pass ({f.fallback_reason})"
        cells = (f"**{f.name}**", ", ".join(f"`{t}`" for t in f.model_types), f"`{f.hf_class}`", f.example,
                 f.quirks, "yes", gen, "yes", "yes", ROLLBACK[f.rollback], _export_cell(f))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _export_cell(f: Family) -> str:
    served = ", ".join(ENGINE_NAMES[e] for e in _ALL if e in f.engines)
    refused = [ENGINE_NAMES[e] for e in _ALL if e not in f.engines]
    return served + (f" (not {', '.join(refused)}: refused)" if refused else "")
