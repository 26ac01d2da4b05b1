"""Batched generation with the frozen target that keeps, for free, the features the draft trains on.

    gens = generate(target, prompts, SamplingParams(max_new_tokens=256), stop_ids={eos}, capture=True)

While the target writes an answer it computes, at every position, exactly what teacher-forced
``capture`` would compute for the finished sequence: the aux layer outputs, the last hidden
state and the argmax. ``capture=True`` keeps them, so self-distilled data costs no second
target pass (``Generation.features`` equals ``capture(target, prompt + output)`` within dtype
tolerance; tests/test_generate.py pins it).

Why not HF ``generate``: on a small model it is mostly per-call overhead, and its growing KV
cache re-copies every layer's keys each step. Here a Llama-family decoder layer is run with the
HF modules' own weights (norms, projections, MLP: dense or MoE; per-layer sliding windows)
around a preallocated KV cache written in place; prompts of a batch are left-padded so all rows
decode at the same cache index, and rows that finish are compacted out of the batch. Families
whose layers do not fit that mold (``specforge.targets``: ``generation="hf-generate"``, e.g.
linear attention, attention sinks, MLA, Gemma's norms) use HF ``generate`` for the tokens and one
``capture`` pass over prompt + output for the features: slower, same results.
Legend: B batch, T tokens, L cache length, H hidden, K kv heads, D head dim, V target vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from specforge.models.layers import apply_rotary
from specforge.models.target import Features, TargetModel, _decoder_layers, text_tower
from specforge.models.target import capture as capture_features
from specforge.targets import IN_PROCESS, sliding_windows


@dataclass
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0


@dataclass
class Generation:
    prompt_ids: list[int]
    output_ids: list[int]  # generated tokens, the stop token included when one was produced
    finish_reason: str  # "stop" | "length"
    features: Optional[Features] = None  # of prompt_ids + output_ids (B = 1); only with capture=True


# ---------------------------------------------------------------- one decoder layer, cached


def _heads(x_BTX: torch.Tensor, n: int) -> torch.Tensor:
    B, T, _ = x_BTX.shape
    return x_BTX.view(B, T, n, -1).transpose(1, 2)


def _layer(layer, x_BTH, cos_BTD, sin_BTD, kv: tuple[torch.Tensor, torch.Tensor], start: int, mask_BTL):
    """HF decoder layer math (pre-norm attention + MLP) with keys/values written into ``kv`` at ``start``."""
    attn, cfg = layer.self_attn, layer.self_attn.config
    h = layer.input_layernorm(x_BTH)
    q = _heads(attn.q_proj(h), cfg.num_attention_heads)
    k = _heads(attn.k_proj(h), cfg.num_key_value_heads)
    v = _heads(attn.v_proj(h), cfg.num_key_value_heads)
    if hasattr(attn, "q_norm"):  # qwen3 normalizes each head before RoPE
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rotary(q, cos_BTD, sin_BTD), apply_rotary(k, cos_BTD, sin_BTD)
    end = start + x_BTH.shape[1]
    kv[0][:, :, start:end] = k
    kv[1][:, :, start:end] = v
    o = F.scaled_dot_product_attention(
        q, kv[0][:, :, :end], kv[1][:, :, :end], attn_mask=mask_BTL.unsqueeze(1),
        scale=attn.scaling, enable_gqa=q.shape[1] != k.shape[1],
    )
    x_BTH = x_BTH + attn.o_proj(o.transpose(1, 2).reshape(*x_BTH.shape[:2], -1))
    return x_BTH + layer.mlp(layer.post_attention_layernorm(x_BTH))


class _Batch:
    """The rows decoding together: left-padded prompts, a KV cache and the captured features."""

    def __init__(self, target: TargetModel, prompts: list[list[int]], max_new: int, capture: bool):
        model = target.model
        self.base = text_tower(model)
        self.layers = _decoder_layers(model)
        self.windows = sliding_windows(target.config)
        cfg, dev = target.config, target.device
        dtype = target.embed_weight_VH.dtype
        self.aux_ids = list(target.aux_layer_ids)
        self.lm_head_VH = target.lm_head_weight_VH
        B, P = len(prompts), max(len(p) for p in prompts)
        self.L = P + max_new + 1
        self.pad = torch.tensor([P - len(p) for p in prompts], device=dev)
        self.ids = torch.zeros(B, self.L, dtype=torch.long, device=dev)
        for b, p in enumerate(prompts):
            self.ids[b, P - len(p) : P] = torch.as_tensor(p, dtype=torch.long, device=dev)
        K, D = cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.kv = [(torch.zeros(B, K, self.L, D, dtype=dtype, device=dev),
                    torch.zeros(B, K, self.L, D, dtype=dtype, device=dev)) for _ in self.layers]
        H = cfg.hidden_size
        self.aux = torch.zeros(B, self.L, len(self.aux_ids) * H, dtype=dtype, device=dev) if capture else None
        self.last = torch.zeros(B, self.L, H, dtype=dtype, device=dev) if capture else None
        self.argmax = torch.zeros(B, self.L, dtype=torch.long, device=dev)
        self.row = torch.arange(B, device=dev)  # index into the caller's prompt list
        self.P = P  # longest prompt: where decoding starts
        self.len = 0  # cache positions filled so far (the same for every row)

    def forward(self, n: int) -> torch.Tensor:
        """Run cache positions [len, len + n) of every row; returns the last hidden state [B,n,H]."""
        s, e = self.len, self.len + n
        j = torch.arange(e, device=self.ids.device)
        allowed = (j[None, :] >= self.pad[:, None])[:, None, :] & (j[None, None, :] <= j[s:e, None][None])
        allowed |= j[None, None, :] == j[s:e, None][None]  # a padded query sees itself: no empty rows
        pos = (j[s:e][None, :] - self.pad[:, None]).clamp(min=0)
        x = self.base.embed_tokens(self.ids[:, s:e])
        cos, sin = self.base.rotary_emb(x, pos)
        near = {w: allowed & (j[None, None, :] > j[s:e, None][None] - w) for w in set(self.windows) if w}
        grabbed = []
        for i, layer in enumerate(self.layers):
            w = self.windows[i]
            x = _layer(layer, x, cos, sin, self.kv[i], s, near[w] if w else allowed)
            if self.aux is not None and i in self.aux_ids:
                grabbed.append(x)
        x = self.base.norm(x)
        if self.aux is not None:
            by_id = dict(zip(sorted(set(self.aux_ids)), grabbed))
            self.aux[:, s:e] = torch.cat([by_id[i] for i in self.aux_ids], dim=-1)
            self.last[:, s:e] = x
        self.len = e
        return x

    def keep(self, rows: torch.Tensor) -> None:
        """Drop finished rows (compaction: later steps cost only the live rows)."""
        self.kv = [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in self.kv]
        for name in ("pad", "ids", "aux", "last", "argmax", "row"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, rows))


# ---------------------------------------------------------------- choosing tokens


def _next_tokens(logits_BV: torch.Tensor, params: SamplingParams, gen: Optional[torch.Generator]) -> torch.Tensor:
    if params.temperature <= 0:
        return logits_BV.argmax(-1)
    probs = torch.softmax(logits_BV.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > params.top_p  # keep the smallest set reaching top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


def _finish(batch: _Batch, b: int, prompt: list[int], stopped: bool) -> Generation:
    """Row ``b`` as a Generation: every token of it, the newest included, has been through the model."""
    start, end = int(batch.pad[b]), batch.len  # left padding: all rows end at the shared cache index
    out = batch.ids[b, start + len(prompt) : end].tolist()
    feats = None
    if batch.aux is not None:
        feats = Features(
            aux_hidden_BTKH=batch.aux[b : b + 1, start:end].clone(),
            last_hidden_BTH=batch.last[b : b + 1, start:end].clone(),
            target_ids_BT=batch.argmax[b : b + 1, start:end].clone(),
        )
    return Generation(list(prompt), out, "stop" if stopped else "length", feats)


# ---------------------------------------------------------------- the loop


def _stop_at(tokens: list[int], stop: set[int]) -> tuple[list[int], bool]:
    """``tokens`` up to and including the first stop token, and whether one came."""
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[: i + 1], True
    return tokens, False


@torch.inference_mode()
def _generate_hf(target: TargetModel, prompts: list[list[int]], params: SamplingParams, stop_ids: set[int],
                 capture: bool, progress) -> list[Generation]:
    """The fallback (``specforge.targets.HF_FALLBACK``): HF ``generate`` over the left-padded batch,
    then one ``capture`` pass over the right-padded prompt + output rows for the features."""
    from transformers import GenerationConfig  # lazy: heavy (transformers)

    dev, B, P = target.device, len(prompts), max(len(p) for p in prompts)
    pad = min(stop_ids) if stop_ids else 0  # finished rows are filled with it, cut off below
    ids = torch.full((B, P), pad, dtype=torch.long, device=dev)
    mask = torch.zeros(B, P, dtype=torch.long, device=dev)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.as_tensor(p, dtype=torch.long, device=dev)
        mask[b, P - len(p):] = 1
    sample = params.temperature > 0
    gcfg = GenerationConfig(max_new_tokens=params.max_new_tokens, do_sample=sample, pad_token_id=pad,
                            eos_token_id=sorted(stop_ids) or None, bos_token_id=None,
                            **({"temperature": params.temperature, "top_p": params.top_p, "top_k": None}
                               if sample else {}))
    with torch.random.fork_rng(devices=[] if dev.type == "cpu" else [dev]):
        torch.manual_seed(params.seed)
        out = target.model.generate(input_ids=ids, attention_mask=mask, generation_config=gcfg)
    results = []
    for b, p in enumerate(prompts):
        toks, stopped = _stop_at(out[b, P:].tolist(), stop_ids)
        results.append(Generation(list(p), toks, "stop" if stopped else "length"))
    if progress is not None:
        progress(sum(len(g.output_ids) for g in results))
    if capture:
        rows = [g.prompt_ids + g.output_ids for g in results]
        T = max(len(r) for r in rows)
        ids = torch.zeros(B, T, dtype=torch.long, device=dev)
        mask = torch.zeros(B, T, dtype=torch.long, device=dev)
        for b, r in enumerate(rows):
            ids[b, : len(r)] = torch.as_tensor(r, dtype=torch.long, device=dev)
            mask[b, : len(r)] = 1
        feats = capture_features(target, ids, mask)
        for b, (g, r) in enumerate(zip(results, rows)):
            g.features = Features(aux_hidden_BTKH=feats.aux_hidden_BTKH[b : b + 1, : len(r)].clone(),
                                  last_hidden_BTH=feats.last_hidden_BTH[b : b + 1, : len(r)].clone(),
                                  target_ids_BT=feats.target_ids_BT[b : b + 1, : len(r)].clone())
    return results


@torch.inference_mode()
def _generate_batch(target: TargetModel, prompts: list[list[int]], params: SamplingParams, stop: torch.Tensor,
                    capture: bool, gen: Optional[torch.Generator], progress) -> list[Generation]:
    batch = _Batch(target, prompts, params.max_new_tokens, capture)
    P = batch.P
    n_out = torch.zeros(len(prompts), dtype=torch.long, device=batch.ids.device)
    stopped = torch.zeros_like(n_out, dtype=torch.bool)
    results: dict[int, Generation] = {}
    h = batch.forward(P)  # prefill
    batch.argmax[:, :P - 1] = _argmax(h[:, :-1], batch.lm_head_VH)
    logits = target.logits(h[:, -1])
    batch.argmax[:, P - 1] = logits.argmax(-1)
    while True:
        cur = batch.len
        # rows whose newest token has been through the model and that are done leave the batch
        done = stopped | (n_out >= params.max_new_tokens)
        if bool(done.any()):
            for b in done.nonzero().flatten().tolist():
                r = int(batch.row[b])
                results[r] = _finish(batch, b, prompts[r], bool(stopped[b]))
            live = (~done).nonzero().flatten()
            if live.numel() == 0:
                break
            batch.keep(live)
            n_out, stopped, logits = n_out[live], stopped[live], logits[live]
        nxt = _next_tokens(logits, params, gen)
        batch.ids[:, cur] = nxt
        n_out += 1
        stopped |= torch.isin(nxt, stop)
        if progress is not None:
            progress(int(nxt.numel()))
        logits = target.logits(batch.forward(1)[:, -1])
        batch.argmax[:, cur] = logits.argmax(-1)  # one lm_head matmul serves the choice and the feature
    return [results[i] for i in range(len(prompts))]


def _argmax(h_BTH: torch.Tensor, lm_head_VH: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    B, T, H = h_BTH.shape
    flat = h_BTH.reshape(B * T, H)
    out = torch.empty(B * T, dtype=torch.long, device=h_BTH.device)
    for s in range(0, B * T, chunk):
        out[s : s + chunk] = (flat[s : s + chunk] @ lm_head_VH.T).argmax(-1)
    return out.view(B, T)


def generate(
    target: TargetModel,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    stop_ids: set[int],
    capture: bool = False,
    batch_size: int = 32,
    progress: Optional[Callable[[int], None]] = None,
) -> list[Generation]:
    """Generate for every prompt (batched, KV-cached); results in the order of ``prompts``.

    Prompts are grouped by length so a batch wastes little padding. ``progress(n)`` is called
    with the number of tokens produced by each decode step.
    """
    # A target split over GPUs (model.num_gpus) runs HF generate, whose device map moves each layer's inputs.
    in_process = target.family.generation == IN_PROCESS and not target.split
    if params.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    gen = None
    if params.temperature > 0:
        gen = torch.Generator(device=target.device).manual_seed(params.seed)
    stop = torch.tensor(sorted(stop_ids) or [-1], device=target.device)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[Optional[Generation]] = [None] * len(prompts)
    for s in range(0, len(order), batch_size):
        idx = order[s : s + batch_size]
        rows = [list(prompts[i]) for i in idx]
        if in_process:
            gens = _generate_batch(target, rows, params, stop, capture, gen, progress)
        else:
            gens = _generate_hf(target, rows, params, set(stop_ids), capture, progress)
        for i, g in zip(idx, gens):
            out[i] = g
    return out  # type: ignore[return-value]
