"""EAGLE-3 draft model in the ``LlamaForCausalLMEagle3`` layout (plain PyTorch, no distributed code).

Layout (the names are the SGLang checkpoint keys)::

    embed_tokens  V x H     frozen copy of the target's embedding, NOT saved (see below)
    fc            3*H_target -> H, no bias: fuses the three captured target layers
    midlayer      one Llama decoder layer whose q/k/v read concat(input_layernorm(embeds),
                  hidden_norm(hidden)) (2H wide); residual = hidden
      .input_layernorm, .hidden_norm, .post_attention_layernorm
      .self_attn.{q_proj,k_proj,v_proj,o_proj}, .self_attn.core (TTT attention, no params)
      .mlp.{gate_proj,up_proj,down_proj}
    norm          final RMSNorm
    lm_head       H -> N (draft vocab), no bias
    d2t           int64[N]: target_id = draft_id + d2t[draft_id]
    t2d           bool[V]:  target token is in the draft vocab

The "hidden" fed back between drafting steps is the decoder-layer output *before* ``norm``
(what SGLang calls ``hidden_states_to_aux``); logits are ``lm_head(norm(hidden))``.

Embedding when the draft hidden size differs from the target's: the target embedding cannot be
reused, so ``embed_tokens`` becomes a trainable ``V x H`` table initialised from the target's
embedding times a fixed random projection (``H_target -> H``, scaled to keep the row norms),
and :meth:`Eagle3Draft.export_state_dict` then also returns ``embed_tokens.weight`` (SGLang's
loader maps it to ``model.embed_tokens.weight``). With equal sizes (the normal case) the
embedding is the target's, frozen, and not saved.

Training: :meth:`~Eagle3Draft.forward` IS the training-time-test (TTT) unroll (conventions and
the loss in ``specforge/algorithms/eagle3/loss.py``), so FSDP2's hooks fire around it like around any forward.
Inference uses :meth:`~Eagle3Draft.forward_cached` with a :class:`DraftKVCache`. Both are built
from the same pieces (``project_aux``, ``embed_part``, ``layer_qkv``, ``layer_finish``,
``logits``), so training and drafting agree exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from specforge.algorithms.eagle3.attention import TTTAttentionCore, ttt_attention_fast
from specforge.models.layers import GatedMLP, RMSNorm, apply_rotary, cast_once, rope_cos_sin, rope_inv_freq, rotate_half
from specforge.targets import draft_attention, draft_rope, text_config

__all__ = [
    "Eagle3DraftConfig",
    "draft_config_from_target",
    "Eagle3Draft",
    "DraftKVCache",
    "ChainDrafter",
    "RMSNorm",
    "apply_rotary",
]


# ------------------------------------------------------------------------------ config


def _cfg_get(cfg: Any, name: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def _rope_from(cfg: Any) -> tuple[Optional[float], Optional[dict]]:
    """(rope_theta, rope_scaling) from an HF config (transformers 4 or 5 style) or dict."""
    theta = _cfg_get(cfg, "rope_theta")
    scaling = _cfg_get(cfg, "rope_scaling")
    params = _cfg_get(cfg, "rope_parameters")
    if isinstance(params, Mapping):
        theta = theta if theta is not None else params.get("rope_theta")
        if scaling is None and params.get("rope_type", "default") != "default":
            scaling = dict(params)
    if isinstance(scaling, Mapping):
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
        if scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
    return theta, (dict(scaling) if scaling else None)


@dataclass
class Eagle3DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # target vocab V
    draft_vocab_size: int  # N
    target_hidden_size: Optional[int] = None  # None = hidden_size
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # passthrough; "linear" and "llama3" are implemented
    max_position_embeddings: int = 2048
    aux_layer_ids: list[int] = field(default_factory=list)
    torch_dtype: str = "bfloat16"  # dtype written to config.json / checkpoint
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[Any] = None
    attention: str = "auto"  # TTT attention core impl (not saved)
    # sliding-window attention (tokens, None = full): a query at position p sees keys at positions > p - W
    # (config.json: sliding_window + layer_types ["sliding_attention"], the HF / vLLM convention)
    sliding_window: Optional[int] = None

    def __post_init__(self):
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )

    def to_hf_config(self) -> dict:
        """config.json for SGLang (``--speculative-algorithm EAGLE3``)."""
        d = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "initializer_range": 0.02,
            "pretraining_tp": 1,
            "tie_word_embeddings": False,
            "use_cache": True,
            "torch_dtype": self.torch_dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": None,
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                "use_aux_hidden_state": True,
            },
        }
        if self.target_hidden_size != self.hidden_size:
            d["target_hidden_size"] = self.target_hidden_size
        if self.sliding_window is not None:
            d.update(sliding_window=self.sliding_window, use_sliding_window=True, layer_types=["sliding_attention"])
        return d

    @classmethod
    def from_hf_config(cls, d: Mapping) -> "Eagle3DraftConfig":
        H = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        theta, scaling = _rope_from(d)
        eagle = d.get("eagle_config") or {}
        return cls(
            hidden_size=H,
            intermediate_size=int(d["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or H // heads),
            vocab_size=int(d["vocab_size"]),
            draft_vocab_size=int(d.get("draft_vocab_size") or d["vocab_size"]),
            target_hidden_size=int(d.get("target_hidden_size") or H),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta if theta is not None else 10000.0),
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            aux_layer_ids=list(eagle.get("eagle_aux_hidden_state_layer_ids") or []),
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            sliding_window=window_of(d),
        )


def window_of(hf_config: Mapping) -> Optional[int]:
    """A config.json's sliding window: ``sliding_window`` where its one layer is a sliding one
    (``layer_types`` ["sliding_attention"], or no ``layer_types`` and ``use_sliding_window``)."""
    w = hf_config.get("sliding_window")
    types = hf_config.get("layer_types")
    sliding = types == ["sliding_attention"] if types is not None else bool(hf_config.get("use_sliding_window"))
    return int(w) if w is not None and sliding else None


def draft_config_from_target(target_hf_config: Any, draft_cfg: Any, aux_layer_ids: list[int]) -> Eagle3DraftConfig:
    """Fill the draft's ``None`` fields (``specforge.config.DraftConfig``) from the target's config.

    ``target_hf_config`` may be a transformers config object or its dict. If the draft hidden
    size differs from the target's, heads default to ``hidden_size // target_head_dim``. What
    differs per target family (the text tower of an image-text target, MLA head dims, RoPE
    variants) comes from ``specforge.targets`` (``draft_attention``, ``draft_rope``).
    """
    t = text_config(target_hf_config)  # an image-text target: its text tower
    Ht = int(_cfg_get(t, "hidden_size"))
    t_heads, t_kv, t_hd = draft_attention(target_hf_config)
    theta, scaling = draft_rope(target_hf_config)
    H = draft_cfg.hidden_size or Ht
    if draft_cfg.head_dim is not None:
        head_dim = draft_cfg.head_dim
    else:
        head_dim = t_hd
    if draft_cfg.num_attention_heads is not None:
        heads = draft_cfg.num_attention_heads
    else:
        heads = t_heads if H == Ht else max(1, H // head_dim)
    if draft_cfg.num_key_value_heads is not None:
        kv = draft_cfg.num_key_value_heads
    else:
        kv = t_kv if heads == t_heads else math.gcd(heads, t_kv)
    V = int(_cfg_get(t, "vocab_size"))
    inter = draft_cfg.intermediate_size or int(_cfg_get(t, "intermediate_size"))
    return Eagle3DraftConfig(
        hidden_size=H,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        vocab_size=V,
        draft_vocab_size=min(int(draft_cfg.vocab_size), V),
        target_hidden_size=Ht,
        rms_norm_eps=float(draft_cfg.rms_norm_eps or _cfg_get(t, "rms_norm_eps") or 1e-6),
        rope_theta=float(draft_cfg.rope_theta or theta or 10000.0),
        rope_scaling=scaling,
        max_position_embeddings=int(_cfg_get(t, "max_position_embeddings") or 2048),
        aux_layer_ids=list(aux_layer_ids),
        bos_token_id=_cfg_get(t, "bos_token_id"),
        eos_token_id=_cfg_get(t, "eos_token_id"),
        attention=getattr(draft_cfg, "attention", "auto"),
        sliding_window=getattr(draft_cfg, "sliding_window", None),
    )


# ------------------------------------------------------------------------------ building blocks


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: Eagle3DraftConfig):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.q_proj = nn.Linear(2 * H, self.num_heads * D, bias=False)
        self.k_proj = nn.Linear(2 * H, self.num_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(2 * H, self.num_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=False)
        self.core = TTTAttentionCore(cfg.attention, window=cfg.sliding_window)


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, cfg: Eagle3DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)


# ------------------------------------------------------------------------------ KV cache


class DraftKVCache:
    """Per-sequence KV cache of the draft's single layer (batch rows share one length).

    ``k``/``v``: ``B x Hkv x L x D``, written in place; :meth:`crop` rolls back to the first ``n``
    entries (rejected draft tokens) by moving the length pointer. ``capacity`` preallocates that many
    positions on the first append (a whole decode then never reallocates); past it, capacity doubles.
    """

    def __init__(self, capacity: int = 16):
        self._k: Optional[torch.Tensor] = None
        self._v: Optional[torch.Tensor] = None
        self.length = 0
        self.capacity = capacity

    def __len__(self) -> int:
        return self.length

    @property
    def keys(self) -> Optional[torch.Tensor]:
        return None if self._k is None else self._k[:, :, : self.length]

    @property
    def values(self) -> Optional[torch.Tensor]:
        return None if self._v is None else self._v[:, :, : self.length]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = k.shape[2]
        if self._k is None:
            cap = max(self.capacity, n)
            self._k = k.new_empty(k.shape[0], k.shape[1], cap, k.shape[3])
            self._v = v.new_empty(v.shape[0], v.shape[1], cap, v.shape[3])
        elif self.length + n > self._k.shape[2]:
            cap = max(2 * self._k.shape[2], self.length + n)
            nk = self._k.new_empty(*self._k.shape[:2], cap, self._k.shape[3])
            nv = self._v.new_empty(*self._v.shape[:2], cap, self._v.shape[3])
            nk[:, :, : self.length] = self._k[:, :, : self.length]
            nv[:, :, : self.length] = self._v[:, :, : self.length]
            self._k, self._v = nk, nv
        self._k[:, :, self.length : self.length + n] = k
        self._v[:, :, self.length : self.length + n] = v
        self.length += n
        return self.keys, self.values

    def crop(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"crop({n}) outside 0..{self.length}")
        self.length = n


# ------------------------------------------------------------------------------ the draft


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: Eagle3DraftConfig):
        super().__init__()
        self.config = cfg
        H, V, N = cfg.hidden_size, cfg.vocab_size, cfg.draft_vocab_size
        self.embed_tokens = nn.Embedding(V, H)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, H, bias=False)
        self.midlayer = Eagle3DecoderLayer(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, N, bias=False)
        self.register_buffer("d2t", torch.zeros(N, dtype=torch.int64))  # device: module init (meta in the dry run)
        t2d = torch.zeros(V, dtype=torch.bool)  # device: module init (meta in the dry run)
        t2d[:N] = True
        self.register_buffer("t2d", t2d)
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)  # device: module init
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.reset_parameters()
        self.embed_tokens.weight.requires_grad_(self.embedding_trainable)

    # ---------------------------------------------------------------- init / vocab / io

    @property
    def embedding_trainable(self) -> bool:
        return self.config.hidden_size != self.config.target_hidden_size

    def reset_parameters(self, std: float = 0.02) -> None:
        for mod in self.modules():
            if isinstance(mod, nn.Linear):
                nn.init.normal_(mod.weight, std=std)
            elif isinstance(mod, RMSNorm):
                nn.init.ones_(mod.weight)
        nn.init.normal_(self.embed_tokens.weight, std=std)

    @torch.no_grad()
    def set_vocab(self, d2t: torch.Tensor, t2d: Optional[torch.Tensor] = None) -> None:
        """Install the draft vocab (``d2t`` offsets; ``t2d`` derived from it if not given)."""
        d2t = torch.as_tensor(d2t, dtype=torch.int64, device=self.d2t.device)
        if d2t.shape != self.d2t.shape:
            raise ValueError(f"d2t has shape {tuple(d2t.shape)}, expected {tuple(self.d2t.shape)}")
        if t2d is None:
            t2d = torch.zeros_like(self.t2d)
            t2d[torch.arange(d2t.numel(), device=d2t.device) + d2t] = True
        self.d2t.copy_(d2t)
        self.t2d.copy_(torch.as_tensor(t2d, dtype=torch.bool, device=self.t2d.device))

    @torch.no_grad()
    def init_embeddings_from_target(self, target_embed_VHt: torch.Tensor, seed: int = 0) -> None:
        """Copy the target embedding (frozen); project it if the hidden sizes differ (trainable)."""
        W = target_embed_VHt.detach().to(self.embed_tokens.weight.device, torch.float32)
        if W.shape[0] != self.config.vocab_size:
            raise ValueError(f"target embedding has {W.shape[0]} rows, vocab_size is {self.config.vocab_size}")
        if W.shape[1] == self.config.hidden_size:
            self.embed_tokens.weight.copy_(W)
            self.embed_tokens.weight.requires_grad_(False)
        else:
            g = torch.Generator().manual_seed(seed)
            # the host generator's stream: the same projection whatever the device (moved below)
            P = torch.randn(W.shape[1], self.config.hidden_size, generator=g)  # device: host stream
            P = P / math.sqrt(self.config.hidden_size)
            self.embed_tokens.weight.copy_(W @ P.to(W.device))
            self.embed_tokens.weight.requires_grad_(True)

    @torch.no_grad()
    def init_lm_head_from_target(self, target_lm_head_weight_VH: torch.Tensor,
                                 d2t: Optional[torch.Tensor] = None) -> None:
        """``lm_head.weight[d] = target_lm_head[d + d2t[d]]`` (needs equal hidden sizes)."""
        if d2t is not None:
            self.set_vocab(d2t)
        W = target_lm_head_weight_VH.detach()
        if W.shape[1] != self.config.hidden_size:
            raise ValueError(
                f"target lm_head is {W.shape[1]} wide, draft hidden is {self.config.hidden_size}: cannot copy"
            )
        self.lm_head.weight.copy_(W[self.draft_to_target_ids()].to(self.lm_head.weight))

    @torch.no_grad()
    def init_midlayer_from_target(self, layer: nn.Module, top_aux: int) -> None:
        """Start from the target decoder layer that follows the deepest aux layer.

        ``fc`` starts as the selector of the deepest aux hidden (the ``top_aux``-th of the 3 slots),
        so at step 0 the residual stream is the target's own hidden there; the hidden half of q/k/v,
        o_proj, the MLP and the norms are that next layer's. The embedding half of q/k/v keeps its
        random init: the draft has to learn what the next token adds (the target never saw it).
        """
        H = self.config.hidden_size
        if H != self.config.target_hidden_size:
            raise ValueError("init from a target layer needs draft hidden size == target hidden size")
        self.fc.weight.zero_()
        self.fc.weight[:, top_aux * H:(top_aux + 1) * H].copy_(torch.eye(H, device=self.fc.weight.device))
        mine, theirs = self.midlayer, layer
        mine.hidden_norm.weight.copy_(theirs.input_layernorm.weight)
        mine.post_attention_layernorm.weight.copy_(theirs.post_attention_layernorm.weight)
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(mine.self_attn, name).weight[:, H:].copy_(getattr(theirs.self_attn, name).weight)
        mine.self_attn.o_proj.weight.copy_(theirs.self_attn.o_proj.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(mine.mlp, name).weight.copy_(getattr(theirs.mlp, name).weight)

    def draft_to_target_ids(self, draft_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        if draft_ids is None:
            draft_ids = torch.arange(self.d2t.numel(), device=self.d2t.device)
        return draft_ids + self.d2t[draft_ids]

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The trained weights: fc, midlayer.*, norm, lm_head (+ embed_tokens if trainable)."""
        return {
            k: v
            for k, v in self.state_dict().items()
            if k not in ("d2t", "t2d") and (k != "embed_tokens.weight" or self.embedding_trainable)
        }

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """Exactly the SGLang checkpoint keys: fc.weight, midlayer.*, norm.weight, lm_head.weight,
        d2t, t2d (+ embed_tokens.weight only when the draft has its own trainable embedding)."""
        sd = self.trainable_state_dict()
        sd["d2t"] = self.d2t
        sd["t2d"] = self.t2d
        return {k: v.detach() for k, v in sd.items()}

    def load_export_state_dict(self, sd: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Load what :meth:`export_state_dict` produced (the frozen embedding is left alone)."""
        missing, unexpected = self.load_state_dict(dict(sd), strict=False)
        missing = [k for k in missing if k != "embed_tokens.weight" or self.embedding_trainable]
        if strict and (missing or unexpected):
            raise KeyError(f"draft state dict: missing {missing}, unexpected {unexpected}")

    # ---------------------------------------------------------------- pieces of the forward

    def rope(self, position_ids_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each ``B x T x D``, fp32."""
        return rope_cos_sin(position_ids_BT, self.inv_freq)

    def project_aux(self, aux_hidden_BTKH: torch.Tensor) -> torch.Tensor:
        return self.fc(aux_hidden_BTKH)

    def embed(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids_BT)

    def qkv_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused q/k/v weight split into the embedding half and the hidden half."""
        a = self.midlayer.self_attn
        W = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], dim=0)
        H = self.config.hidden_size
        return W[:, :H], W[:, H:]

    def embed_part(self, embeds_BTH: torch.Tensor, w_emb: Optional[torch.Tensor] = None) -> torch.Tensor:
        """input_layernorm(embeds) @ W_qkv[:, :H].T -- position independent, so the TTT loop
        computes it once for the whole sequence and shifts it per step."""
        if w_emb is None:
            w_emb = self.qkv_weights()[0]
        return F.linear(self.midlayer.input_layernorm(embeds_BTH), w_emb)

    def layer_qkv(
        self,
        embed_part_BTF: torch.Tensor,
        hidden_BTH: torch.Tensor,
        position_ids_BT: torch.Tensor,
        w_hid: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B,Hq,T,D), k, v (B,Hkv,T,D) with RoPE at ``position_ids``."""
        if w_hid is None:
            w_hid = self.qkv_weights()[1]
        a = self.midlayer.self_attn
        B, T = hidden_BTH.shape[:2]
        qkv = embed_part_BTF + F.linear(self.midlayer.hidden_norm(hidden_BTH), w_hid)
        Hq, Hk, D = a.num_heads, a.num_kv_heads, a.head_dim
        q, k, v = qkv.split([Hq * D, Hk * D, Hk * D], dim=-1)
        q = q.view(B, T, Hq, D).transpose(1, 2)
        k = k.view(B, T, Hk, D).transpose(1, 2)
        v = v.view(B, T, Hk, D).transpose(1, 2)
        cos, sin = self.rope(position_ids_BT)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def layer_finish(self, attn_BHTD: torch.Tensor, hidden_BTH: torch.Tensor) -> torch.Tensor:
        """o_proj + residual (= the input hidden) + post-norm MLP + residual: the output hidden."""
        layer = self.midlayer
        B, Hq, T, D = attn_BHTD.shape
        h = hidden_BTH + layer.self_attn.o_proj(attn_BHTD.transpose(1, 2).reshape(B, T, Hq * D))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits ``lm_head(norm(hidden))`` (any leading shape)."""
        return self.lm_head(self.norm(hidden_out))

    # ---------------------------------------------------------------- training: the TTT unroll

    def row_multiple(self, device_type: str) -> int:
        """What a TTT step's query rows are rounded up to (the attention core's ``row_multiple``)."""
        core = self.midlayer.self_attn.core
        return core.row_multiple(device_type) if hasattr(core, "row_multiple") else 1

    def forward(self, input_ids_BT: torch.Tensor, aux_hidden_BTKH: torch.Tensor, position_ids_BT: torch.Tensor,
                t_len: Sequence[int], head: Optional[Callable[[int, torch.Tensor], Any]] = None,
                doc_ids_BT: Optional[torch.Tensor] = None) -> list:
        """The training forward: ``[head(i, hidden_out_B_Ti_H) for TTT steps i]`` (default head: the
        hidden itself). The head runs inside this forward because it reads ``norm``/``lm_head``,
        which FSDP2 unshards only around a forward.

        Step ``i`` computes rows ``t < t_len[i]`` (non-increasing); row ``t`` reads the embedding of
        x_{t+1+i} (zeros past the end), the previous step's hidden, RoPE position ``pos[t] + i``,
        and attends to step-0 keys ``<= t`` and to its own row's keys of steps ``1..i``. The
        embedding half of q/k/v is projected once for the whole sequence and shifted per step.
        ``doc_ids_BT``: packed rows (``data/packing.py``): a query attends only to its own sample's keys.
        """
        core = self.midlayer.self_attn.core
        w_emb, w_hid = self.qkv_weights()
        w_hid = cast_once(w_hid)  # read by every step: cast to the autocast dtype once (bit-identical)
        e_full = self.embed_part(self.embed(input_ids_BT), w_emb)  # (B,T,F) for x_0..x_{T-1}
        hidden = self.project_aux(aux_hidden_BTKH)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        out = []
        # the step-0 keys' rows (one tensor for the unroll: SP cores cache their gather of it by identity)
        kw = {} if doc_ids_BT is None else {"doc_ids_BT": doc_ids_BT[:, : t_len[0]]}
        for i, Ti in enumerate(t_len):
            hidden = hidden[:, :Ti]
            e_i = e_full[:, 1 + i : 1 + i + Ti]
            if e_i.shape[1] < Ti:
                e_i = F.pad(e_i, (0, 0, 0, Ti - e_i.shape[1]))
            q, k, v = self.layer_qkv(e_i, hidden, position_ids_BT[:, :Ti] + i, w_hid())
            keys.append(k)
            values.append(v)
            # step-0 keys stay whole (causal, may be longer than Ti); diagonal keys are cut to Ti
            # (passed as the same tensor objects when not cut: SP cores cache their collectives by identity)
            cut = lambda x: x if x.shape[2] == Ti else x[:, :, :Ti]  # noqa: E731
            attn = core(q, [keys[0]] + [cut(kk) for kk in keys[1:]], [values[0]] + [cut(vv) for vv in values[1:]], **kw)
            hidden = self.layer_finish(attn, hidden)
            out.append(hidden if head is None else head(i, hidden))
        return out

    # ---------------------------------------------------------------- inference

    def _as_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        H = self.config.hidden_size
        if hidden.shape[-1] == H:
            return hidden
        if hidden.shape[-1] == self.fc.in_features:
            return self.fc(hidden)
        raise ValueError(f"hidden has width {hidden.shape[-1]}: expected {H} or {self.fc.in_features}")

    def forward_cached(
        self,
        input_ids_BT: torch.Tensor,
        hidden_BTH: torch.Tensor,
        position_ids_BT: torch.Tensor,
        cache: DraftKVCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Chain-drafting forward with a KV cache: ``(hidden_out_BTH, logits_BTN)``.

        Row ``t`` takes ``hidden_BTH[:, t]`` (``fc``-projected target features -- raw ``3*H_target``
        features are projected automatically -- or the draft's own previous ``hidden_out``) and
        the embedding of ``input_ids_BT[:, t]`` (the *next* token, EAGLE convention), at RoPE
        position ``position_ids_BT[:, t]``. The new keys are appended to ``cache``; queries
        attend causally to everything cached plus the new rows up to themselves.

        Usage: prefill ``forward_cached(x[1:t+2], fc(aux[0:t+1]), arange(t+1))``; the logits of
        the last row predict x_{t+2}. Then decode one token at a time: ``forward_cached(tok,
        hidden_out[:, -1:], [[pos]])`` with pos increasing by one. Reject -> ``cache.crop(n)``.
        """
        hidden = self._as_hidden(hidden_BTH)
        w_emb, w_hid = self.qkv_weights()
        e = self.embed_part(self.embed(input_ids_BT), w_emb)
        q, k, v = self.layer_qkv(e, hidden, position_ids_BT, w_hid)
        offset = len(cache)
        K, V = cache.append(k.detach(), v.detach())
        attn = ttt_attention_fast(q, [K], [V], q_offset=offset, window=self.config.sliding_window)
        out = self.layer_finish(attn, hidden)
        return out, self.logits(out)


# ------------------------------------------------------------------------------ fast chain drafting


class ChainDrafter:
    """Chain drafting for ONE sequence with the per-call work hoisted out (inference only).

    The math of :meth:`Eagle3Draft.forward_cached` (tests pin the logits within 1e-5) in fewer,
    fused calls, because on a CPU a draft step was mostly per-op overhead: q/k/v and gate/up weights
    fused once, fused RMSNorms, RoPE cos/sin tabulated and applied to q and k in one go, SDPA for the
    1-query attention (no mask), the draft vocab's embedding rows gathered once so a drafted token
    goes back in by its draft id (the draft->target map runs once per round, in :meth:`to_target`),
    the KV cache written in place. Weights are snapshotted (in ``dtype``, default the draft's):
    build a new drafter after the draft changes. Legend: T rows, X = H or 3*H_target, N draft vocab.
    """

    def __init__(self, draft: Eagle3Draft, dtype: Optional[torch.dtype] = None, capacity: int = 1024):
        a, mlp, layer = draft.midlayer.self_attn, draft.midlayer.mlp, draft.midlayer
        self.dtype = dtype or draft.fc.weight.dtype
        w = lambda t: t.detach().to(self.dtype)  # noqa: E731
        self.w_fc, self.w_o, self.w_down, self.w_lm = (w(draft.fc.weight), w(a.o_proj.weight), w(mlp.down_proj.weight),
                                                       w(draft.lm_head.weight))
        self.w_qkv = w(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))  # reads [norm(e) | norm(h)]
        self.w_gate_up = w(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        self.norms = [(w(n.weight), n.eps) for n in (layer.input_layernorm, layer.hidden_norm,
                                                      layer.post_attention_layernorm, draft.norm)]
        self.embed_V, self.d2t = draft.embed_tokens.weight, draft.d2t
        self.embed_N = w(draft.embed_tokens.weight[draft.draft_to_target_ids()])
        self.heads = (a.num_heads, a.num_kv_heads, a.head_dim)
        self.inv_freq = draft.inv_freq
        self.window = draft.config.sliding_window
        self.cache = DraftKVCache(capacity)
        self._rope_table(capacity)

    def _rope_table(self, n: int) -> None:
        # the same fp32 ops as Eagle3Draft.rope, once for positions 0..n-1
        cos, sin = rope_cos_sin(torch.arange(n, device=self.inv_freq.device), self.inv_freq)
        self.cos, self.sin = cos.to(self.dtype), sin.to(self.dtype)

    def prefill(self, ids_T: torch.Tensor, hidden_TX: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows taking target ids (any of V) and target features (raw ``3*H_target`` or projected),
        appended at the cache's end: ``(hidden_out_TH, logits_TN)``."""
        hidden = hidden_TX.to(self.dtype)
        if hidden.shape[-1] == self.w_fc.shape[1]:
            hidden = F.linear(hidden, self.w_fc)
        return self._layer(self.embed_V[ids_T].to(self.dtype), hidden)

    def step(self, draft_id: torch.Tensor, hidden_1H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafted token (a 1-element draft-vocab id tensor) and the previous ``hidden_out`` row."""
        return self._layer(self.embed_N[draft_id.view(1)], hidden_1H)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def _norm(self, i: int, x: torch.Tensor) -> torch.Tensor:
        weight, eps = self.norms[i]
        return F.rms_norm(x, weight.shape, weight, eps)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        """Append the rows' keys to the cache; their attention over it (Hq x T x D)."""
        K, V = self.cache.append(k[None], v[None])
        if q.shape[1] == 1:  # the newest row sees every cached key (the last W with a window): no mask
            if self.window is not None:
                K, V = K[:, :, -self.window:], V[:, :, -self.window:]
            return F.scaled_dot_product_attention(q[None], K, V, enable_gqa=q.shape[0] != K.shape[1])[0]
        return ttt_attention_fast(q[None], [K], [V], q_offset=start, window=self.window)[0]

    def _layer(self, e_TH: torch.Tensor, h_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        Hq, Hk, D = self.heads
        T, start = e_TH.shape[0], len(self.cache)
        if start + T > self.cos.shape[0]:
            self._rope_table(2 * (start + T))
        qkv = F.linear(torch.cat([self._norm(0, e_TH), self._norm(1, h_TH)], dim=-1), self.w_qkv)
        qk, v = qkv.view(T, Hq + 2 * Hk, D).transpose(0, 1).split([Hq + Hk, Hk])
        cos, sin = self.cos[start : start + T], self.sin[start : start + T]
        q, k = (qk * cos + rotate_half(qk) * sin).split([Hq, Hk])
        attn = self._attend(q, k, v, start)
        h = h_TH + F.linear(attn.transpose(0, 1).reshape(T, Hq * D), self.w_o)
        gate, up = F.linear(self._norm(2, h), self.w_gate_up).chunk(2, dim=-1)
        h = h + F.linear(F.silu(gate) * up, self.w_down)
        return h, F.linear(self._norm(3, h), self.w_lm)
