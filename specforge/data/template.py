"""Render a conversation with the tokenizer's chat template and build the exact loss mask.

The whole conversation is rendered ONCE with the chat template (``tokenize=False``) and
tokenized ONCE with ``return_offsets_mapping`` (fast tokenizers only). The loss mask comes
from character spans in that rendered text, never from re-tokenizing prefixes (a prefix can
tokenize differently from the same characters inside the whole text).

Locating assistant spans. For assistant message ``i`` the template renders

* ``A = render(messages[:i], add_generation_prompt=True)``  (ends right after the header), and
* ``B = render(messages[:i+1])``                           (ends after the turn's end marker).

When both are prefixes of the full text (true for ChatML, Llama-3, Gemma, Mistral, ... : every
template that renders history append-only), the assistant span is ``full[len(A):len(B)]`` with
trailing whitespace removed: content + the end-of-turn token(s) (``<|im_end|>``,
``<|eot_id|>``, ``</s>``...), but neither the header (``<|im_start|>assistant\\n``) nor the
newline some templates put after the end-of-turn token. For templates that are not prefix
stable (e.g. ones that rewrite earlier turns), we fall back to searching the message content in
the rendered text after the previous span and extend it over a special token that immediately
follows it (the end-of-turn token).

Token/span boundary rule: a token is in the loss iff at least one of its characters lies inside
an assistant span (a zero-width token counts iff its position is inside). A token straddling the
header/content boundary is therefore trained on: it is the token the target actually sees there.

Only the spans of assistant turns that start before the truncation point are located, so the
prefix renders stay bounded by ``max_length`` tokens even for very long conversations.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

__all__ = ["TemplateError", "resolve_chat_template", "render", "assistant_char_spans", "tokenize_conversation"]


class TemplateError(ValueError):
    """The chat template cannot render this conversation (reason counted as a skip)."""


def resolve_chat_template(tokenizer, chat_template: Optional[str] = None) -> str:
    """The template text to use: the override, else the tokenizer's own; ValueError if neither."""
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: take "default"
        template = template.get("default")
    if not template:
        raise ValueError(
            "the tokenizer has no chat template; set model.chat_template to a Jinja chat template"
        )
    return template


def render(tokenizer, messages: Sequence[dict], chat_template: Optional[str] = None,
           add_generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
            chat_template=resolve_chat_template(tokenizer, chat_template),
        )
    except ValueError:
        raise
    except Exception as e:  # jinja raise_exception(), undefined variables, ...
        raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from e


def _special_tokens(tokenizer) -> list[str]:
    specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
    try:
        specials |= {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    except Exception:
        pass
    return sorted((s for s in specials if s), key=len, reverse=True)


def assistant_char_spans(
    tokenizer, messages: Sequence[dict], full_text: str, chat_template: Optional[str] = None,
    char_limit: Optional[int] = None,
) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of every assistant turn (content + end-of-turn token).

    Spans that would start at or after ``char_limit`` are not computed.
    """
    spans: list[tuple[int, int]] = []
    cursor = 0
    specials = None
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if char_limit is not None and cursor >= char_limit:
            break
        head = render(tokenizer, messages[:i], chat_template, add_generation_prompt=True) if i > 0 else None
        turn = render(tokenizer, messages[: i + 1], chat_template)
        if (head is not None and full_text.startswith(head) and full_text.startswith(turn)
                and cursor <= len(head) < len(turn)):
            start, end = len(head), len(turn)
            while end > start and full_text[end - 1].isspace():
                end -= 1
        else:  # not prefix-stable: search the content after the previous span
            content = m["content"]
            pos = full_text.find(content, cursor)
            if pos < 0:
                content = content.strip()
                pos = full_text.find(content, cursor)
            if pos < 0:
                raise TemplateError(f"assistant turn {i} not found in the rendered text")
            start, end = pos, pos + len(content)
            if specials is None:
                specials = _special_tokens(tokenizer)
            for s in specials:
                if full_text.startswith(s, end):
                    end += len(s)
                    break
        if end > start:
            spans.append((start, end))
        cursor = max(cursor, end)
        if char_limit is not None and start >= char_limit:
            break
    return spans


def tokenize_conversation(
    tokenizer, messages: Sequence[dict], max_length: int, chat_template: Optional[str] = None,
) -> tuple[list[int], list[int], bool]:
    """``(input_ids, loss_mask, truncated)`` for one normalized conversation.

    ``loss_mask[j] == 1`` iff token j belongs to an assistant turn (content or end-of-turn).
    Sequences longer than ``max_length`` are cut to ``max_length`` tokens and flagged.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("tokenize_conversation needs a fast tokenizer (offset mapping)")
    text = render(tokenizer, messages, chat_template)
    # The template already contains BOS etc.: no extra special tokens.
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    offsets = enc["offset_mapping"]
    truncated = len(ids) > max_length
    if truncated:
        ids = ids[:max_length]
        offsets = offsets[:max_length]
    char_limit = offsets[-1][1] if truncated and offsets else None
    spans = assistant_char_spans(tokenizer, messages, text, chat_template, char_limit=char_limit)
    mask = span_mask(offsets, spans)
    return ids, mask, truncated


def span_mask(offsets: Sequence[Sequence[int]], spans: Sequence[tuple[int, int]]) -> list[int]:
    """1 for tokens with at least one character inside a span (zero-width: position inside)."""
    n = len(offsets)
    if n == 0 or not spans:
        return [0] * n
    off = np.asarray(offsets, dtype=np.int64).reshape(n, 2)
    s, e = off[:, 0], np.maximum(off[:, 1], off[:, 0])
    mask = np.zeros(n, dtype=bool)
    for a, b in spans:
        mask |= np.where(e > s, (s < b) & (e > a), (s >= a) & (s < b))
    return mask.astype(np.int64).tolist()
