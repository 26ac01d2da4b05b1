"""Real chain speculative decoding (greedy) of the target with a trained draft.

    python -m specforge.eval --draft runs/x/checkpoints/step-000400 [--config cfg.yaml] \
        [--target <path or hub id>] [--num-prompts 16] [--max-new-tokens 64] [--chain 7]

Both models keep KV caches. Each round the draft proposes ``chain`` tokens one at a time, the
target verifies them in ONE forward, the longest agreeing prefix is kept plus the target's own
next token (the bonus). Acceptance length = tokens produced per target verify forward. The output
must equal plain greedy decoding of the target token for token; a mismatch is an error.
``--draft prompt-lookup`` runs model-free n-gram drafting as a baseline.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch

from specforge.models.draft import DraftKVCache
from specforge.models.target import TargetModel, argmax_chunked, forward_aux


# ---------------------------------------------------------------- proposers


class PromptLookupProposer:
    """Model-free drafting: continue the latest earlier match of the last n tokens (n = 3..1)."""

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram
        self.ids: list[int] = []

    def start(self, ids: list[int], aux_TH: torch.Tensor) -> None:
        self.ids = list(ids)

    def propose(self, k: int) -> list[int]:
        for n in range(self.max_ngram, 0, -1):
            if len(self.ids) <= n:
                continue
            tail = self.ids[-n:]
            for s in range(len(self.ids) - n - 1, -1, -1):
                if self.ids[s : s + n] == tail:
                    cont = self.ids[s + n : s + n + k]
                    return cont + [cont[-1]] * (k - len(cont)) if cont else [0] * k
        return [self.ids[-1]] * k

    def accept(self, new_tokens: list[int], aux_TH: torch.Tensor) -> None:
        self.ids.extend(new_tokens)


class EagleProposer:
    """Chain drafting with the EAGLE-3 draft's KV cache, the way an inference engine drafts.

    Draft row t takes the target feature at position t and the token at t+1. Rows whose
    features came from the target are committed to the cache; rows drafted from the draft's own
    hidden states are cropped away after verification.
    """

    def __init__(self, draft):
        self.draft = draft
        self.cache = None
        self.pending_ids: list[int] = []
        self.pending_hidden_TH: Optional[torch.Tensor] = None

    def start(self, ids: list[int], aux_TH: torch.Tensor) -> None:
        self.cache = DraftKVCache()
        self._queue(ids[1:], aux_TH)

    def _queue(self, next_ids: list[int], aux_TH: torch.Tensor) -> None:
        assert len(next_ids) == aux_TH.shape[0]
        self.pending_ids = list(next_ids)
        self.pending_hidden_TH = self.draft.project_aux(aux_TH.to(self.draft.fc.weight.dtype))

    @torch.no_grad()
    def propose(self, k: int) -> list[int]:
        draft = self.draft
        start = self.cache.length
        n = len(self.pending_ids)
        pos = torch.arange(start, start + n).unsqueeze(0)
        ids = torch.tensor([self.pending_ids])
        hidden, logits = draft.forward_cached(ids, self.pending_hidden_TH.unsqueeze(0), pos, self.cache)
        self.committed = self.cache.length
        out: list[int] = []
        for j in range(k):
            tok = draft.draft_to_target_ids(logits[0, -1].argmax()).item()
            out.append(tok)
            if j == k - 1:
                break
            p = self.cache.length
            hidden, logits = draft.forward_cached(
                torch.tensor([[tok]]), hidden[:, -1:], torch.tensor([[p]]), self.cache
            )
        return out

    def accept(self, new_tokens: list[int], aux_TH: torch.Tensor) -> None:
        self.cache.crop(self.committed)
        self._queue(new_tokens, aux_TH)


# ---------------------------------------------------------------- decoding loops


@dataclass
class DecodeStats:
    new_tokens: int = 0
    verify_forwards: int = 0
    accepted_at: list[int] = field(default_factory=list)  # rounds whose j-th draft token was accepted
    seconds: float = 0.0


def _crop(cache, keep: int) -> None:
    """Keep the first ``keep`` positions of an HF cache (transformers 5 takes a negative count)."""
    extra = cache.get_seq_length() - keep
    if extra > 0:
        cache.crop(-extra)


def _argmax_rows(target: TargetModel, last_TH: torch.Tensor) -> list[int]:
    return argmax_chunked(last_TH, target.lm_head_weight_VH, chunk=last_TH.shape[0]).tolist()


@torch.no_grad()
def greedy_decode(target: TargetModel, prompt: Sequence[int], max_new: int, eos: set[int]) -> tuple[list[int], float]:
    from transformers import DynamicCache

    t0 = time.perf_counter()
    cache = DynamicCache()
    _, last, _ = forward_aux(target, torch.tensor([list(prompt)]), past_key_values=cache)
    out = [_argmax_rows(target, last[0, -1:])[0]]
    while len(out) < max_new and out[-1] not in eos:
        _, last, _ = forward_aux(target, torch.tensor([[out[-1]]]), past_key_values=cache)
        out.append(_argmax_rows(target, last[0, -1:])[0])
    return out, time.perf_counter() - t0


@torch.no_grad()
def speculative_decode(
    target: TargetModel, proposer, prompt: Sequence[int], max_new: int, chain: int, eos: set[int]
) -> tuple[list[int], DecodeStats]:
    from transformers import DynamicCache

    stats = DecodeStats(accepted_at=[0] * chain)
    t0 = time.perf_counter()
    cache = DynamicCache()
    aux, last, _ = forward_aux(target, torch.tensor([list(prompt)]), past_key_values=cache)
    out = [_argmax_rows(target, last[0, -1:])[0]]
    proposer.start(list(prompt) + out, aux[0])
    while len(out) < max_new and out[-1] not in eos:
        base = cache.get_seq_length()  # everything before the last produced token
        drafted = proposer.propose(chain)
        aux, last, _ = forward_aux(target, torch.tensor([[out[-1]] + drafted]), past_key_values=cache)
        verified = _argmax_rows(target, last[0])
        n = 0
        while n < chain and drafted[n] == verified[n]:
            stats.accepted_at[n] += 1
            n += 1
        new = drafted[:n] + [verified[n]]
        _crop(cache, base + 1 + n)
        proposer.accept(new, aux[0, : n + 1])
        stats.verify_forwards += 1
        out.extend(new)
    # a round may overshoot max_new or run past an EOS: cut where greedy decoding would stop
    for i, tok in enumerate(out):
        if tok in eos:
            out = out[: i + 1]
            break
    out = out[:max_new]
    stats.new_tokens = len(out)
    stats.seconds = time.perf_counter() - t0
    return out, stats


# ---------------------------------------------------------------- evaluation


@dataclass
class EvalReport:
    prompts: int
    chain: int
    acceptance_length: float  # tokens per verify forward, bonus included
    acceptance_by_position: list[float]  # fraction of rounds whose j-th draft token was accepted
    target_tokens_per_s: float
    speculative_tokens_per_s: float
    speedup: float
    new_tokens: int
    verify_forwards: int


def evaluate(
    target: TargetModel, proposer, prompts: Sequence[Sequence[int]], max_new: int, chain: int, progress: bool = True
) -> EvalReport:
    """Speculative vs plain greedy on every prompt; raises if any output differs."""
    from tqdm import tqdm

    eos = _eos_ids(target)
    total = DecodeStats(accepted_at=[0] * chain)
    base_tokens, base_s = 0, 0.0
    for i, prompt in enumerate(tqdm(prompts, desc="spec-decode", disable=not progress)):
        ref, secs = greedy_decode(target, prompt, max_new, eos)
        got, st = speculative_decode(target, proposer, prompt, max_new, chain, eos)
        if got != ref:
            first = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
            raise AssertionError(
                f"prompt {i}: speculative output differs from greedy at token {first} "
                f"(got {got[first:first + 5]}, greedy {ref[first:first + 5]})"
            )
        base_tokens, base_s = base_tokens + len(ref), base_s + secs
        total.new_tokens += st.new_tokens
        total.verify_forwards += st.verify_forwards
        total.seconds += st.seconds
        total.accepted_at = [a + b for a, b in zip(total.accepted_at, st.accepted_at)]
    # The first token of each prompt comes from the prefill forward, not from a verify round.
    produced = total.new_tokens - len(prompts)
    rounds = max(total.verify_forwards, 1)
    spec_tps = total.new_tokens / max(total.seconds, 1e-9)
    base_tps = base_tokens / max(base_s, 1e-9)
    return EvalReport(
        prompts=len(prompts),
        chain=chain,
        acceptance_length=produced / rounds,
        acceptance_by_position=[a / rounds for a in total.accepted_at],
        target_tokens_per_s=base_tps,
        speculative_tokens_per_s=spec_tps,
        speedup=spec_tps / base_tps,
        new_tokens=total.new_tokens,
        verify_forwards=total.verify_forwards,
    )


def _eos_ids(target: TargetModel) -> set[int]:
    ids = set()
    for src in (target.model.generation_config, target.model.config):
        e = getattr(src, "eos_token_id", None)
        ids.update(e if isinstance(e, (list, tuple)) else [e] if e is not None else [])
    return ids


def eval_prompts(rows, num: int, max_prompt_tokens: int) -> list[list[int]]:
    """Held-out rows cut before their first assistant token (the model's first reply)."""
    prompts = []
    for r in rows:
        ids, mask = r["input_ids"], r["loss_mask"]
        first = next((i for i, m in enumerate(mask) if m), None)
        if first is None or first > max_prompt_tokens or first < 2:
            continue
        prompts.append(list(ids[:first]))
        if len(prompts) == num:
            break
    return prompts


def format_report(rep: EvalReport, label: str) -> str:
    pos = " ".join(f"{a:.2f}" for a in rep.acceptance_by_position)
    return (
        f"| {label} | {rep.prompts} | {rep.chain} | {rep.acceptance_length:.3f} | {pos} | "
        f"{rep.target_tokens_per_s:.1f} | {rep.speculative_tokens_per_s:.1f} | {rep.speedup:.2f}x |"
    )


REPORT_HEADER = (
    "| draft | prompts | chain | acceptance length | accepted by position | target tok/s | spec tok/s | speedup |\n"
    "|---|---|---|---|---|---|---|---|"
)


def main(argv: Optional[list[str]] = None) -> int:
    from specforge.config import load_config
    from specforge.data.prepare import prepare_dataset
    from specforge.device import set_threads
    from specforge.models.target import load_target

    ap = argparse.ArgumentParser(prog="python -m specforge.eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", required=True, help="draft checkpoint folder, or 'prompt-lookup'")
    ap.add_argument("--config", default=None, help="run config (target + held-out data); default: built-in defaults")
    ap.add_argument("--target", default=None, help="target path/hub id (overrides model.target_path)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=384)
    ap.add_argument("--chain", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write the report as JSON here")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. data.max_length=512")
    args = ap.parse_args(argv)

    cfg = load_config(args.config, args.overrides + ([f"model.target_path={args.target}"] if args.target else []))
    set_threads(args.threads or cfg.train.num_threads)
    cfg.model.dtype = "float32"  # exact greedy comparison needs the target in fp32
    target = load_target(cfg.model)
    data = prepare_dataset(cfg.data, target.tokenizer, chat_template=cfg.model.chat_template,
                           cache_dir=cfg.model.cache_dir)
    prompts = eval_prompts(data.eval, args.num_prompts, args.max_prompt_tokens)
    if not prompts:
        raise ValueError("no held-out prompt fits; raise --max-prompt-tokens or data.num_eval")
    if args.draft == "prompt-lookup":
        proposer, label = PromptLookupProposer(), "prompt-lookup"
    else:
        from specforge.train.checkpoint import load_draft

        proposer, label = EagleProposer(load_draft(args.draft, target)), str(args.draft)
    rep = evaluate(target, proposer, prompts, args.max_new_tokens, args.chain)
    print(REPORT_HEADER)
    print(format_report(rep, label))
    if args.json:
        Path(args.json).write_text(json.dumps({"draft": label, **asdict(rep)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
