"""THE held-out rule, once: which conversations are never trained on, and the eval's prompts from them.

The eval split is the LAST ``data.num_eval`` of the usable conversations (a normalized row that
renders with at least one loss token after truncation, and at least ``data.min_length`` tokens;
with ``data.join_parts`` a conversation is every consecutive part of one chat) among the first
``data.max_samples``.
``data/prepare.py`` splits its tokenized rows with ``split_point`` (this module reads its split, so the
rule lives where the split is made); ``specforge.regenerate``
skips the source rows :func:`heldout_sources` names (it never rewrites an eval conversation);
``specforge.eval`` and its llama.cpp engine read :func:`heldout_rows` and cut them into prompts
(:func:`eval_prompts`; :func:`long_prompts` for ``--long``: the same held-out conversations, their
multi-turn context kept up to the target's context). Acceptance figures count only on these rows.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

from specforge.data.prepare import cache_key, prepare_dataset, split_point
from specforge.data.sharegpt import Conversation, iter_conversations
from specforge.data.template import TemplateError, resolve_chat_template, tokenize_conversation


def usable(conv: Conversation, tokenizer, data, template: str) -> bool:
    """What prepare_dataset keeps: a normalized row that renders with >= 1 loss token after truncation
    and at least ``data.min_length`` tokens."""
    if not conv.ok:
        return False
    try:
        ids, mask, _ = tokenize_conversation(tokenizer, conv.messages, data.max_length, template)
    except TemplateError:
        return False
    return any(mask) and len(ids) >= data.min_length


def heldout_sources(data, tokenizer, template: str) -> set[int]:
    """Source row indices of the eval split (``data``: a ``DataConfig``; every part of a joined chat).
    Only the tail is tokenized when max_samples is None."""
    n_eval = max(data.num_eval, 0)
    if n_eval == 0:
        return set()
    if data.max_samples is not None:
        kept: list[tuple[int, ...]] = []
        for conv in iter_conversations(data.path, data.join_parts):
            if len(kept) >= data.max_samples:
                break
            if usable(conv, tokenizer, data, template):
                kept.append(conv.rows)
        return _flat(kept[split_point(len(kept), n_eval):])
    window: deque[Conversation] = deque(maxlen=n_eval + 64)  # usually every tail row is usable
    n_ok = 0
    for conv in iter_conversations(data.path, data.join_parts):
        if conv.ok:
            window.append(conv)
            n_ok += 1
    held = []
    for conv in reversed(window):
        if usable(conv, tokenizer, data, template):
            held.append(conv.rows)
        if len(held) == n_eval:
            return _flat(held)
    if n_ok == len(window):  # the window held every normalized row
        return _flat(held)
    every = [c.rows for c in iter_conversations(data.path, data.join_parts) if usable(c, tokenizer, data, template)]
    return _flat(every[split_point(len(every), n_eval):])


def _flat(rows: list[tuple[int, ...]]) -> set[int]:
    return {i for r in rows for i in r}


def heldout_rows(cfg, tokenizer) -> list[dict]:
    """The eval split's tokenized rows: from the data cache when it exists, else only the held-out
    tail is tokenized (the same rows, without tokenizing the whole dataset: minutes on ShareGPT)."""
    template = resolve_chat_template(tokenizer, cfg.model.chat_template)
    cached = Path(cfg.model.cache_dir).expanduser() / "data" / cache_key(cfg.data, tokenizer, template) / "stats.json"
    if cached.is_file():
        return list(prepare_dataset(cfg.data, tokenizer, chat_template=cfg.model.chat_template,
                                    cache_dir=cfg.model.cache_dir, progress=False).eval)
    held = heldout_sources(cfg.data, tokenizer, template)
    rows = []
    for conv in iter_conversations(cfg.data.path, cfg.data.join_parts):
        if conv.index in held:
            ids, mask, _ = tokenize_conversation(tokenizer, conv.messages, cfg.data.max_length, template)
            rows.append({"input_ids": ids, "loss_mask": mask})
    return rows


def eval_prompts(rows, num: int, max_prompt_tokens: int, min_prompt_tokens: int = 2) -> list[list[int]]:
    """Held-out rows cut before their first assistant token (the model's first reply)."""
    prompts = []
    for r in rows:
        ids, mask = r["input_ids"], r["loss_mask"]
        first = next((i for i, m in enumerate(mask) if m), None)
        if first is None or first > max_prompt_tokens or first < max(min_prompt_tokens, 2):
            continue
        prompts.append(list(ids[:first]))
        if len(prompts) == num:
            break
    return prompts


def long_prompts(cfg, tokenizer, num: int, max_prompt_tokens: int, min_prompt_tokens: int = 2) -> list[list[int]]:
    """The ``num`` longest prompts the held-out conversations give (``--long``): each conversation,
    tokenized up to ``max_prompt_tokens`` (not cut at ``data.max_length``: the held-out rows are the
    same, only more of each is read), is cut before its LAST assistant reply that starts within
    ``max_prompt_tokens``, every earlier turn kept as context. Prompts shorter than
    ``min_prompt_tokens`` are dropped; the rest keep source order."""
    template = resolve_chat_template(tokenizer, cfg.model.chat_template)
    held = heldout_sources(cfg.data, tokenizer, template)
    found = []
    for conv in iter_conversations(cfg.data.path, cfg.data.join_parts):
        if conv.index not in held:
            continue
        ids, mask, _ = tokenize_conversation(tokenizer, conv.messages, max_prompt_tokens + 1, template)
        cut = last_reply_start(mask, max_prompt_tokens)
        if cut is not None and cut >= max(min_prompt_tokens, 2):
            found.append(list(ids[:cut]))
    longest = sorted(range(len(found)), key=lambda i: -len(found[i]))[:num]
    return [found[i] for i in sorted(longest)]


def last_reply_start(mask, limit: int):
    """The last index <= ``limit`` where an assistant span starts (mask 0 -> 1), or None."""
    starts = [i for i in range(min(len(mask), limit + 1)) if mask[i] and (i == 0 or not mask[i - 1])]
    return starts[-1] if starts else None
