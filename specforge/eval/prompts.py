"""The eval's prompts and prompt-length buckets: what our eval (``specforge.eval``) and the served
eval (``specforge.eval.served``, the same prompts through llama-server) share.

Prompts are the held-out conversations (``data/heldout.py``) cut before their first reply, or with
``--long`` their longest multi-turn contexts; buckets split them by prompt length (default edges
1024,4096,8192: under 1k, 1k-4k, 4k-8k and 8k or more tokens).
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Optional, Sequence

from specforge.data import heldout

DEFAULT_BUCKETS = (1024, 4096, 8192)  # prompt tokens: <1k, 1k-4k, 4k-8k, >=8k


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def bucket_labels(edges: Sequence[int]) -> list[str]:
    """``[<1k, 1k-4k, 4k-8k, >=8k]`` for the default edges: bucket b holds prompts of
    ``edges[b-1] <= tokens < edges[b]``."""
    inner = [f"{_k(lo)}-{_k(hi)}" for lo, hi in zip(edges, edges[1:])]
    return [f"<{_k(edges[0])}", *inner, f">={_k(edges[-1])}"]


def bucket_of(prompt_tokens: int, edges: Sequence[int]) -> int:
    return bisect_right(list(edges), prompt_tokens)


def parse_buckets(text: str) -> tuple[int, ...]:
    """``--buckets`` edges: strictly increasing token counts >= 1, or one error naming the flag."""
    try:
        edges = tuple(int(x) for x in str(text).split(","))
    except ValueError:
        edges = ()
    if not edges or edges[0] < 1 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"--buckets {text}: expected strictly increasing comma-separated prompt token counts >= 1, "
                         "e.g. --buckets 1024,4096,8192")
    return edges


def bucket_rows(edges: Sequence[int], prompt_lengths: Sequence[int], tokens: Sequence[int],
                forwards: Sequence[int]) -> list[dict]:
    """Per bucket: prompts, tokens produced after the prefill's first one, verify forwards, and the
    acceptance length ``tokens / forwards`` (None for a bucket without a prompt). ``tokens`` and
    ``forwards`` are per prompt, in the order of ``prompt_lengths``."""
    labels = bucket_labels(edges)
    lows, highs = (0, *edges), (*edges, None)
    rows = [{"bucket": labels[b], "min_tokens": lows[b], "max_tokens": highs[b], "prompts": 0, "tokens": 0,
             "verify_forwards": 0, "acceptance_length": None} for b in range(len(labels))]
    for n, t, f in zip(prompt_lengths, tokens, forwards):
        row = rows[bucket_of(n, edges)]
        row["prompts"] += 1
        row["tokens"] += t
        row["verify_forwards"] += f
    for row in rows:
        if row["prompts"]:
            row["acceptance_length"] = row["tokens"] / max(row["verify_forwards"], 1)
    return rows


def unreachable_buckets(edges: Sequence[int], max_prompt_tokens: int) -> list[str]:
    """Buckets no prompt of at most ``max_prompt_tokens`` tokens can fall into."""
    return [label for label, lo in zip(bucket_labels(edges), (0, *edges)) if lo > max_prompt_tokens]


def format_buckets(reports: Sequence, labels: Sequence[str], value: str = "acceptance_length") -> str:
    """The acceptance per prompt-length bucket, one row per draft and setting (``reports``: rows with
    ``draft``, ``setting`` and ``buckets``); the header counts each bucket's prompts, a bucket
    without a prompt is a blank cell."""
    counts = [b["prompts"] for b in reports[0].buckets] if reports else [0] * len(labels)
    lines = ["| draft | setting | " + " | ".join(f"{lab} ({n})" for lab, n in zip(labels, counts)) + " |",
             "|---|---|" + "---|" * len(labels)]
    for r in reports:
        cells = ["" if b[value] is None else f"{b[value]:.3f}" for b in r.buckets]
        lines.append(f"| {r.draft} | {r.setting} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def pick_prompts(cfg, tokenizer, args, max_positions: Optional[int]) -> tuple[list[list[int]], int]:
    """The held-out prompts (``--long``: the longest multi-turn contexts) and the most tokens a prompt
    may have: ``--max-prompt-tokens`` (default 384, or the target's room under ``--long``), never more
    than the target's ``max_positions`` minus ``--max-new-tokens``."""
    room = max_positions - args.max_new_tokens if max_positions else None
    if room is not None and room < 2:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the target's "
                         f"{max_positions} positions; lower --max-new-tokens")
    asked = args.max_prompt_tokens or (None if args.long and room else 384)
    cap = min(x for x in (asked, room) if x is not None)
    if args.long:
        prompts = heldout.long_prompts(cfg, tokenizer, args.num_prompts, cap, args.min_prompt_tokens)
    else:
        prompts = heldout.eval_prompts(heldout.heldout_rows(cfg, tokenizer), args.num_prompts, cap,
                                       args.min_prompt_tokens)
    if not prompts:
        raise ValueError(f"no held-out prompt of {args.min_prompt_tokens}-{cap} tokens; lower --min-prompt-tokens, "
                         "raise --max-prompt-tokens or data.num_eval" + ("" if args.long else ", or use --long"))
    return prompts, cap


def prompt_note(edges: Sequence[int], cap: int, max_positions: Optional[int], args) -> Optional[str]:
    """Which buckets no prompt can fill, and why (the target's context or the prompt limit)."""
    out = unreachable_buckets(edges, cap)
    if not out:
        return None
    why = (f"the target has {max_positions} positions and {args.max_new_tokens} are left for new tokens"
           if max_positions and cap == max_positions - args.max_new_tokens else
           "--max-prompt-tokens" + ("" if args.long else "; --long takes the longest held-out contexts"))
    return f"prompt-length buckets {', '.join(out)} stay empty: prompts are at most {cap} tokens ({why})"


def prompt_meta(prompts: Sequence[Sequence[int]], cap: int, args, note: Optional[str]) -> dict:
    """What the JSON says about the prompts behind the buckets."""
    return {"bucket_edges": list(args.bucket_edges), "long_prompts": bool(args.long), "max_prompt_tokens": cap,
            "prompt_tokens": [len(p) for p in prompts],
            "unreachable_buckets": unreachable_buckets(args.bucket_edges, cap), "bucket_note": note}
