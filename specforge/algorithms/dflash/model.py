"""The DFlash draft (arXiv 2602.06036): one forward drafts a whole block of tokens.

Legend: B batch, T context positions (target tokens), N blocks, K block size, Q = N*K block rows,
H hidden (= the target's), F = len(target_layer_ids) * H, D head dim, V target vocab.

Layout (z-lab's ``DFlashDraftModel``, the format SGLang, vLLM and llama.cpp load):

* ``fc`` (F -> H, no bias) then ``hidden_norm`` turn the target's features of the context (layer
  outputs ``target_layer_ids``, HF ``hidden_states[i + 1]``) into one H-vector per position.
* ``layers[i]``: Qwen3-style decoder layers (per-head ``q_norm`` / ``k_norm``, SwiGLU MLP). Queries
  come from the block rows only; keys/values from [context ; block rows], through the SAME
  ``k_proj`` / ``v_proj`` / ``k_norm``. The context enters every layer as is (no input_layernorm);
  only the block rows carry a residual stream.
* ``norm``, then the target's ``lm_head`` (frozen, not saved). The block rows enter as the
  target's (frozen) embeddings of ``[anchor, mask, ..., mask]``.

Attention of block row k of a block anchored at position a: the context at positions < a (the
target has not run the anchor yet), and every row of its own block (bidirectional); never
another block. RoPE positions: context p at p, block row k at a + k. With a sliding window W
(``sliding_window``, at least the block size), row k sees only the context ``p > a + k - W``: its
own position minus the key's below W, what SGLang's, vLLM's and llama.cpp's sliding windows (and
z-lab's reference) mean by the same number.

Two forwards over the same weights: :meth:`DFlashDraft.forward` trains many blocks of a batch at
once (one SDPA over [context ; all blocks] with :func:`build_block_mask`); :meth:`forward_block`
drafts one block after the context held in a :class:`ContextCache` (no mask without a window: it
sees all of it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from specforge.models.layers import GatedMLP, RMSNorm, apply_rotary, rope_cos_sin, rope_inv_freq

__all__ = ["DFlashConfig", "DFlashDraft", "ContextCache", "build_block_mask", "default_target_layer_ids"]


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference's default (z-lab's): one captured target layer output per draft layer, spread
    over [1, L-3] (a single draft layer reads the middle one)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    lo, hi = 1, num_target_layers - 3
    return [round(lo + i * (hi - lo) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass
class DFlashConfig:
    """Defaults fit SmolLM2-135M as the target (hidden 576, 9 heads, 3 kv heads, 30 layers)."""

    hidden_size: int = 576
    num_hidden_layers: int = 3  # draft layers (the reference's Qwen3-8B drafts use 5)
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1536
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    max_position_embeddings: int = 8192
    vocab_size: int = 49152  # the target's: logits come from its lm_head
    num_target_layers: int = 30
    target_layer_ids: list[int] = field(default_factory=list)  # empty: the reference default
    block_size: int = 16
    mask_token_id: Optional[int] = None  # a target token id never seen in the data; required
    sliding_window: Optional[int] = None  # None: a block row sees the whole context before its anchor

    def __post_init__(self):
        if not self.target_layer_ids:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.block_size < 2:
            raise ValueError(f"block_size={self.block_size}: a block is the anchor plus at least one draft token")
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < self.block_size):
            raise ValueError(f"sliding_window={w!r}: expected an integer >= block_size={self.block_size} (the rows of "
                             "a block see each other) or None")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} outside the target's {self.num_target_layers} layers")

    @classmethod
    def from_target(cls, target_hf_config: Any, mask_token_id: int, **overrides) -> "DFlashConfig":
        """Shape the draft after a HF target config (hidden size, heads, vocab, RoPE theta)."""
        c = target_hf_config
        get = (lambda k, d=None: c.get(k, d)) if isinstance(c, dict) else (lambda k, d=None: getattr(c, k, d))
        heads = get("num_attention_heads")
        kw = dict(hidden_size=get("hidden_size"), num_attention_heads=heads,
                  num_key_value_heads=get("num_key_value_heads", heads),
                  head_dim=get("head_dim") or get("hidden_size") // heads,
                  intermediate_size=get("intermediate_size"), rms_norm_eps=get("rms_norm_eps", 1e-6),
                  rope_theta=get("rope_theta") or (get("rope_parameters") or {}).get("rope_theta", 10000.0),
                  max_position_embeddings=get("max_position_embeddings", 8192),
                  vocab_size=get("vocab_size"), num_target_layers=get("num_hidden_layers"),
                  mask_token_id=mask_token_id)
        kw.update(overrides)
        return cls(**kw)

    @property
    def context_width(self) -> int:
        return len(self.target_layer_ids) * self.hidden_size


def build_block_mask(anchors_BN: torch.Tensor, keep_BN: Optional[torch.Tensor], T: int, K: int,
                     doc_ids_BT: Optional[torch.Tensor] = None, window: Optional[int] = None) -> torch.Tensor:
    """Boolean SDPA mask ``[B, 1, N*K, T + N*K]`` (True = may attend) for blocks packed after a context.

    Row ``n*K + k`` (block n, anchored at ``a = anchors[b, n]``) sees context keys ``p < a`` (of the
    anchor's document, if ``doc_ids_BT`` is given; with a ``window``, only ``(a + k) - p <
    window``: the row's own position minus the key's, as every engine's sliding window counts it)
    and the K keys of block n. A dropped block
    (``keep`` False) sees only its own block: never a fully masked row (SDPA would give NaN);
    the loss gives it weight 0.
    """
    B, N = anchors_BN.shape
    dev = anchors_BN.device
    q = torch.arange(N * K, device=dev)
    anchor_BQ = anchors_BN.repeat_interleave(K, dim=1)
    p = torch.arange(T, device=dev)
    ctx_BQT = p.view(1, 1, T) < anchor_BQ.unsqueeze(-1)
    if window is not None:
        ctx_BQT = ctx_BQT & (p.view(1, 1, T) > (anchor_BQ + q % K - window).unsqueeze(-1))
    if doc_ids_BT is not None:
        anchor_doc_BQ = doc_ids_BT.gather(1, anchor_BQ)
        ctx_BQT = ctx_BQT & (doc_ids_BT.unsqueeze(1) == anchor_doc_BQ.unsqueeze(-1))
    if keep_BN is not None:
        ctx_BQT = ctx_BQT & keep_BN.repeat_interleave(K, dim=1).unsqueeze(-1)
    own_QQ = (q.view(-1, 1) // K) == (q.view(1, -1) // K)
    mask = torch.cat([ctx_BQT, own_QQ.expand(B, -1, -1)], dim=-1)
    return mask.unsqueeze(1)


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.q_proj = nn.Linear(H, self.num_heads * D, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=False)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)

    def _heads(self, x_BTX: torch.Tensor, n: int) -> torch.Tensor:
        B, T, _ = x_BTX.shape
        return x_BTX.view(B, T, n, self.head_dim)

    def keys_values(self, x_BTH: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotated keys and values ``[B, Hkv, T, D]`` of rows (context or block alike)."""
        k = self.k_norm(self._heads(self.k_proj(x_BTH), self.num_kv_heads)).transpose(1, 2)
        v = self._heads(self.v_proj(x_BTH), self.num_kv_heads).transpose(1, 2)
        return apply_rotary(k, cos, sin), v

    def forward(self, x_BQH, ctx_kv, cos_BQD, sin_BQD, mask=None, attend=None):
        """``attend(q, k_blk, v_blk, ctx_kv)``, if given, replaces the masked SDPA over
        [context ; block rows] (sequence parallelism: ``sp.RingBlocks.attention``)."""
        B, Q, _ = x_BQH.shape
        q = self.q_norm(self._heads(self.q_proj(x_BQH), self.num_heads)).transpose(1, 2)
        q = apply_rotary(q, cos_BQD, sin_BQD)
        k_blk, v_blk = self.keys_values(x_BQH, cos_BQD, sin_BQD)
        if attend is not None:
            out = attend(q, k_blk, v_blk, ctx_kv)
        else:
            k = torch.cat([ctx_kv[0], k_blk], dim=2)
            v = torch.cat([ctx_kv[1], v_blk], dim=2)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, -1))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.self_attn = DFlashAttention(cfg)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x_BQH, ctx_kv, cos, sin, mask=None, attend=None):
        x_BQH = x_BQH + self.self_attn(self.input_layernorm(x_BQH), ctx_kv, cos, sin, mask, attend)
        return x_BQH + self.mlp(self.post_attention_layernorm(x_BQH))


class ContextCache:
    """Per-layer keys/values of the context, positions ``0 .. length-1``.

    They depend on the target's features only, never on a drafted block, so drafting never writes
    here: append the features of the tokens the target has accepted, and that is all.
    """

    def __init__(self):
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.length = 0

    def extend(self, draft: "DFlashDraft", ctx_BTF: torch.Tensor) -> "ContextCache":
        B, T, _ = ctx_BTF.shape
        pos = torch.arange(self.length, self.length + T, device=ctx_BTF.device).expand(B, T)
        new = draft.context_kv(ctx_BTF, pos)
        self.kv = new if not self.kv else [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2))
                                           for (k0, v0), (k1, v1) in zip(self.kv, new)]
        self.length += T
        return self


class SPSlot(nn.Module):
    """Where sequence parallelism is applied (``DFlash.sp_cores`` names it): ``parallelize_draft``
    wraps it in its ring wrapper, whose ring (``RingComm``) the SP path reads (``sp.ring_comm``).
    Never called; no parameters, so no checkpoint key."""


class DFlashDraft(nn.Module):
    """Trainable: fc, hidden_norm, layers, norm. Frozen, from the target, never saved: embed_tokens, lm_head."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        if cfg.mask_token_id is None:
            raise ValueError("DFlashConfig.mask_token_id is required (a target token id used as the mask)")
        self.config = cfg
        self.fc = nn.Linear(cfg.context_width, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size).requires_grad_(False)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False).requires_grad_(False)
        self.sp_attention = SPSlot()

    def set_target_weights(self, embed_VH: torch.Tensor, lm_head_VH: torch.Tensor) -> "DFlashDraft":
        """Copy the target's token embedding and output head (frozen)."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed_VH)
            self.lm_head.weight.copy_(lm_head_VH)
        return self

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """The saved weights, named as in the reference checkpoint (no embedding, no lm_head)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(("embed_tokens.", "lm_head."))}

    def rope(self, position_ids_BT: torch.Tensor, dtype: torch.dtype):
        """cos/sin ``[B, T, D]``, computed in fp32 then cast, as HF's Qwen3/Llama rotary embedding does."""
        inv = rope_inv_freq(self.config.head_dim, self.config.rope_theta, device=position_ids_BT.device)
        cos, sin = rope_cos_sin(position_ids_BT, inv)
        return cos.to(dtype), sin.to(dtype)

    def context_kv(self, ctx_BTF: torch.Tensor, position_ids_BT: torch.Tensor):
        """Fuse the target features and project them to every layer's keys/values."""
        c = self.hidden_norm(self.fc(ctx_BTF))
        cos, sin = self.rope(position_ids_BT, c.dtype)
        return [layer.self_attn.keys_values(c, cos, sin) for layer in self.layers]

    def run_blocks(self, block_ids_BQ, block_pos_BQ, ctx_kv, mask=None, attend=None) -> torch.Tensor:
        assert len(ctx_kv) == len(self.layers)
        x = self.embed_tokens(block_ids_BQ)
        cos, sin = self.rope(block_pos_BQ, x.dtype)
        for layer, kv in zip(self.layers, ctx_kv):
            x = layer(x, kv, cos, sin, mask, attend)
        return self.norm(x)

    def forward(self, ctx_BTF: torch.Tensor, block_ids_BNK: torch.Tensor, anchors_BN: torch.Tensor,
                keep_BN: Optional[torch.Tensor] = None, position_ids_BT: Optional[torch.Tensor] = None,
                doc_ids_BT: Optional[torch.Tensor] = None, ring=None) -> torch.Tensor:
        """Training: all blocks of a batch in one pass -> hidden ``[B, N, K, H]`` (after ``norm``).

        ``block_ids_BNK`` is ``[anchor token, mask, ...]`` per block (``loss.build_block_ids``);
        block n sits at RoPE positions ``position_ids[anchor] + k``. ``ring`` (``sp.RingBlocks``):
        this is one ring rank's share (its context rows at ``position_ids_BT``, the blocks anchored
        in them); the context attention runs over the ring.
        """
        B, T, _ = ctx_BTF.shape
        _, N, K = block_ids_BNK.shape
        if position_ids_BT is None:
            position_ids_BT = torch.arange(T, device=ctx_BTF.device).expand(B, T)
        block_pos = position_ids_BT.gather(1, anchors_BN).unsqueeze(-1) + torch.arange(K, device=ctx_BTF.device)
        mask = attend = None
        window = self.config.sliding_window
        if ring is None:
            mask = build_block_mask(anchors_BN, keep_BN, T, K, doc_ids_BT, window)
        else:
            if doc_ids_BT is not None:
                raise ValueError("DFlash ring attention takes no document ids (packed samples)")
            keep = torch.ones_like(anchors_BN, dtype=torch.bool) if keep_BN is None else keep_BN
            attend = ring.attention(anchors_BN, keep, K, window)
        ctx_kv = self.context_kv(ctx_BTF, position_ids_BT)
        hidden = self.run_blocks(block_ids_BNK.reshape(B, N * K), block_pos.reshape(B, N * K), ctx_kv, mask, attend)
        return hidden.view(B, N, K, -1)

    def forward_block(self, cache: ContextCache, block_ids_BK: torch.Tensor) -> torch.Tensor:
        """Inference: one block right after the cached context -> hidden ``[B, K, H]`` (after ``norm``).
        With a sliding window W, row k (position L + k, L = the cached length) sees the cached
        positions p > L + k - W only, as in training."""
        B, K = block_ids_BK.shape
        L, W, dev = cache.length, self.config.sliding_window, block_ids_BK.device
        pos = torch.arange(L, L + K, device=dev).expand(B, K)
        kv, mask = cache.kv, None
        if kv and W is not None:
            first = max(0, L - W + 1)  # no row sees further back
            kv = [(k[:, :, first:], v[:, :, first:]) for k, v in kv]
            p = torch.arange(first, L, device=dev)
            ctx = p.view(1, -1) > (L + torch.arange(K, device=dev) - W).view(-1, 1)  # [K, L - first]
            mask = torch.cat([ctx, ctx.new_ones(K, K)], dim=1).view(1, 1, K, -1)
        if not kv:  # no context yet: the block sees only itself
            c = self.config
            empty = self.fc.weight.new_zeros(B, c.num_key_value_heads, 0, c.head_dim)
            kv = [(empty, empty)] * len(self.layers)
        return self.run_blocks(block_ids_BK, pos, kv, mask)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
