"""The MTP draft: one multi-token-prediction layer applied recursively (speculators 0.9.0 ``models/mtp``,
the layout of Qwen3-Next's and Qwen3.5's own MTP heads).

Legend: B batch, T tokens, H hidden (= the target's), D head dim, V the target's vocabulary, S steps.

One step, at row ``t``: ``x = input_proj([token_layernorm(embed(tok)) ; hidden_layernorm(h)])``
(``2H -> H``, no bias; the embedding half first), then a Qwen3 decoder layer (per-head ``q_norm`` /
``k_norm``, causal attention, SwiGLU MLP, pre-norm residuals) and ``final_layernorm``; the logits are
the target's ``lm_head`` of that output. The embedding and the lm_head are the target's (frozen,
never saved).

Training (``MTPDraft.forward``, teacher-forced): step 0 reads the target's last hidden state (after
its final norm) ``h[t]`` and the token ``x[t+1]``, and predicts ``x[t+2]``; step ``k`` reads step
``k-1``'s output at the same row and ``x[t+k+1]``, and predicts ``x[t+k+2]``. Every step keeps the
RoPE position of row ``t`` and attends causally over its own step's rows (of the row's sample, in a
packed row). Step ``k`` has ``T - k - 1`` rows (those whose input token exists).

Drafting (``MTPDraft.draft_step``): the rows of accepted tokens enter a key/value cache as step 0
sees them (``MTPCache``); every step of a round runs one row at the last target position, which
attends the cache and itself.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from specforge.models.layers import GatedMLP, RMSNorm, apply_rotary, rope_cos_sin, rope_inv_freq

__all__ = ["MTPConfig", "MTPDraft", "MTPCache", "step_mask"]


@dataclass
class MTPConfig:
    """The draft's shape: the target's decoder layer (a Qwen3 layer of its sizes) and the number of
    steps a forward trains (``num_speculative_steps``)."""

    hidden_size: int = 576
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1536
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 8192
    vocab_size: int = 49152
    num_speculative_steps: int = 3
    num_target_layers: int = 30  # the target's layers: the draft reads the last one's output
    target_norm_eps: Optional[float] = None  # the target's final norm (drafting from its last layer's output)

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.num_speculative_steps < 1:
            raise ValueError(f"num_speculative_steps={self.num_speculative_steps}: at least 1")

    @classmethod
    def from_target(cls, target_config: Any, **overrides) -> "MTPConfig":
        """Shaped as the target's decoder layer (a config object or its config.json dict)."""
        c = target_config
        get = (lambda k, d=None: c.get(k, d)) if isinstance(c, dict) else (lambda k, d=None: getattr(c, k, d))
        heads = get("num_attention_heads")
        rope = get("rope_parameters") or {}
        scaling = get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        kw = dict(hidden_size=get("hidden_size"), num_attention_heads=heads,
                  num_key_value_heads=get("num_key_value_heads") or heads,
                  head_dim=get("head_dim") or get("hidden_size") // heads,
                  intermediate_size=get("intermediate_size"), rms_norm_eps=get("rms_norm_eps", 1e-6),
                  rope_theta=get("rope_theta") or rope.get("rope_theta", 10000.0), rope_scaling=scaling,
                  max_position_embeddings=get("max_position_embeddings", 8192), vocab_size=get("vocab_size"),
                  num_target_layers=get("num_hidden_layers"), target_norm_eps=get("rms_norm_eps", 1e-6))
        kw.update(overrides)
        return cls(**kw)

    def to_dict(self) -> dict:
        return asdict(self)


def step_mask(T: int, doc_ids_BT: Optional[torch.Tensor], device) -> Optional[torch.Tensor]:
    """The attention mask of a step's ``T`` rows: None (plain causal) without sample ids, else a
    boolean ``[B, 1, T, T]``: causal and inside the row's sample (a packed row)."""
    if doc_ids_BT is None:
        return None
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    docs = doc_ids_BT[:, :T]
    return (causal & (docs.unsqueeze(-1) == docs.unsqueeze(1))).unsqueeze(1)


class MTPAttention(nn.Module):
    """Qwen3 attention: q/k/v/o without bias, RMSNorm over each head's q and k before RoPE."""

    def __init__(self, cfg: MTPConfig):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.q_proj = nn.Linear(H, self.num_heads * D, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=False)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int, norm: RMSNorm, cos, sin) -> torch.Tensor:
        B, T, _ = x.shape
        return apply_rotary(norm(x.view(B, T, n, self.head_dim)).transpose(1, 2), cos, sin)

    def keys_values(self, x_BTH: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, _ = x_BTH.shape
        k = self._heads(self.k_proj(x_BTH), self.num_kv_heads, self.k_norm, cos, sin)
        v = self.v_proj(x_BTH).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return k, v

    def forward(self, x_BTH: torch.Tensor, cos, sin, mask=None, past=None) -> torch.Tensor:
        """Causal self-attention over the rows (``mask`` given: that mask); ``past``: cached keys and
        values the rows see besides themselves (drafting: the rows then see every cached key)."""
        B, T, _ = x_BTH.shape
        q = self._heads(self.q_proj(x_BTH), self.num_heads, self.q_norm, cos, sin)
        k, v = self.keys_values(x_BTH, cos, sin)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
            seen = torch.ones(T, k.shape[2] - T, dtype=torch.bool, device=x_BTH.device)
            own = torch.ones(T, T, dtype=torch.bool, device=x_BTH.device).tril()
            mask = torch.cat([seen, own], 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MTPLayer(nn.Module):
    """One MTP step's weights, named as speculators' ``mtp_layers.0`` (and Qwen3-Next's ``mtp.layers.0``)."""

    def __init__(self, cfg: MTPConfig):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.hidden_layernorm = RMSNorm(H, eps)
        self.token_layernorm = RMSNorm(H, eps)
        self.input_proj = nn.Linear(2 * H, H, bias=False)
        self.input_layernorm = RMSNorm(H, eps)
        self.self_attn = MTPAttention(cfg)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = GatedMLP(H, cfg.intermediate_size)
        self.final_layernorm = RMSNorm(H, eps)

    def fuse(self, hidden_BTH: torch.Tensor, embeds_BTH: torch.Tensor) -> torch.Tensor:
        """``input_layernorm(input_proj([token_layernorm(embeds) ; hidden_layernorm(hidden)]))``'s input."""
        return self.input_proj(torch.cat([self.token_layernorm(embeds_BTH), self.hidden_layernorm(hidden_BTH)], -1))

    def forward(self, hidden_BTH, embeds_BTH, cos, sin, mask=None, past=None) -> torch.Tensor:
        x = self.fuse(hidden_BTH, embeds_BTH)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, past)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return self.final_layernorm(x)


class MTPDraft(nn.Module):
    """Trainable: ``mtp_layers[0]`` (speculators' names, so a saved folder is its format). Frozen, from
    the target, never saved: ``embed_tokens``, ``lm_head`` and ``target_norm`` (its final norm)."""

    def __init__(self, cfg: MTPConfig):
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.mtp_layers = nn.ModuleList([MTPLayer(cfg)])
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H).requires_grad_(False)
        self.lm_head = nn.Linear(H, cfg.vocab_size, bias=False).requires_grad_(False)
        self.target_norm = RMSNorm(H, cfg.target_norm_eps or cfg.rms_norm_eps).requires_grad_(False)

    FROZEN = ("embed_tokens.", "lm_head.", "target_norm.")

    def set_target_weights(self, embed_VH: torch.Tensor, lm_head_VH: torch.Tensor,
                           final_norm_scale_H: Optional[torch.Tensor] = None) -> "MTPDraft":
        """Copy the target's token embedding, output head and final norm scale (frozen)."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed_VH)
            self.lm_head.weight.copy_(lm_head_VH)
            if final_norm_scale_H is not None:
                self.target_norm.weight.copy_(final_norm_scale_H)
        return self

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """The trained weights (no embedding, lm_head or target norm), under this module's names."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(self.FROZEN)}

    def rope(self, position_ids_BT: torch.Tensor, dtype: torch.dtype):
        c = self.config
        inv = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling, device=position_ids_BT.device)
        cos, sin = rope_cos_sin(position_ids_BT, inv)
        return cos.to(dtype), sin.to(dtype)

    def step(self, hidden_BTH, tokens_BT, cos, sin, mask=None, past=None) -> torch.Tensor:
        """One MTP step over rows: the output hidden (after ``final_layernorm``)."""
        return self.mtp_layers[0](hidden_BTH, self.embed_tokens(tokens_BT), cos, sin, mask, past)

    def forward(self, hidden_BTH: torch.Tensor, input_ids_BT: torch.Tensor,
                position_ids_BT: Optional[torch.Tensor] = None, doc_ids_BT: Optional[torch.Tensor] = None,
                steps: Optional[int] = None) -> list[torch.Tensor]:
        """Teacher-forced training: step k's output hidden ``[B, T - k - 1, H]`` for k < ``steps``
        (default ``num_speculative_steps``; fewer when the row is too short)."""
        B, T, _ = hidden_BTH.shape
        if position_ids_BT is None:
            position_ids_BT = torch.arange(T, device=hidden_BTH.device).expand(B, T)
        steps = min(steps or self.config.num_speculative_steps, T - 1)
        cos, sin = self.rope(position_ids_BT, hidden_BTH.dtype)
        outs, h = [], hidden_BTH
        for k in range(steps):
            n = T - k - 1
            h = self.step(h[:, :n], input_ids_BT[:, k + 1:k + 1 + n], cos[:, :n], sin[:, :n],
                          step_mask(n, doc_ids_BT, hidden_BTH.device))
            outs.append(h)
        return outs

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    # ---------------------------------------------------------------- drafting

    def cache_rows(self, cache: "MTPCache", hidden_BTH: torch.Tensor, tokens_BT: torch.Tensor) -> "MTPCache":
        """Append step 0's keys/values of rows at positions ``cache.length ..`` (hidden h[t], token x[t+1])."""
        B, T, _ = hidden_BTH.shape
        pos = torch.arange(cache.length, cache.length + T, device=hidden_BTH.device).expand(B, T)
        cos, sin = self.rope(pos, hidden_BTH.dtype)
        layer = self.mtp_layers[0]
        x = layer.input_layernorm(layer.fuse(hidden_BTH, self.embed_tokens(tokens_BT)))
        k, v = layer.self_attn.keys_values(x, cos, sin)
        cache.kv = (k, v) if cache.kv is None else (torch.cat([cache.kv[0], k], 2), torch.cat([cache.kv[1], v], 2))
        cache.length += T
        return cache

    def draft_step(self, cache: "MTPCache", hidden_B1H: torch.Tensor, token_B1: torch.Tensor) -> torch.Tensor:
        """One step at the row after the cache (position ``cache.length``): its output hidden ``[B, 1, H]``."""
        B = hidden_B1H.shape[0]
        pos = torch.full((B, 1), cache.length, device=hidden_B1H.device)
        cos, sin = self.rope(pos, hidden_B1H.dtype)
        return self.step(hidden_B1H, token_B1, cos, sin, past=cache.kv)


class MTPCache:
    """Step 0's keys/values of the rows ``0 .. length - 1`` (target hidden and next token both known)."""

    def __init__(self):
        self.kv: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self.length = 0
