"""Real chain speculative decoding (greedy) of the target: acceptance AND wall-clock speedup.

    python -m specforge.eval --config cfg.yaml --draft runs/x/checkpoints/step-000400 \
        [--draft prompt-lookup ...] [--num-prompts 16] [--max-new-tokens 64] [--chain 7] [--json out.json]
        [--buckets 1024,4096,8192] [--long] [--min-prompt-tokens N]
    python -m specforge.eval ... --engine llama.cpp [--engine-n-max 1,2,3] [--engine-p-min 0,0.5]
        (the same drafts and prompts served by llama-server: specforge/eval/served.py)

Both models keep KV caches. Each round the draft proposes up to ``chain`` tokens one at a time, the
target verifies them in ONE forward, the longest agreeing prefix is kept plus the target's own next
token (the bonus). Acceptance length = tokens produced per target verify forward.

The same figure is also reported per context-length bucket of the prompt (``--buckets``, default
edges 1024,4096,8192: under 1k, 1k-4k, 4k-8k and 8k or more tokens): tokens produced / verify
forwards over the prompts of that bucket only. A bucket without a prompt has no figure (blank in
the table, null in the JSON), never 0. Prompts are the held-out conversations cut before their first
reply; ``--long`` takes the longest multi-turn contexts of the same held-out conversations instead,
up to the target's context (``max_position_embeddings`` minus ``--max-new-tokens``; the default
target, SmolLM2-135M, has 8192 positions, so its 8k-or-more bucket stays empty, and the run says so).

One table row per draft and setting: "chain 7 fixed" drafts the whole chain every round (the
acceptance figure comparable with upstream); "dynamic" (EAGLE drafts) stops drafting once the
draft's own estimate that all its tokens get accepted no longer pays for one more draft step, with
both costs measured while decoding (:class:`RoundCosts`), as EAGLE-2's dynamic drafting does.
Speed baseline: target-only greedy decoding with the same target, cache, dtype and threads, run
alternately with the speculative runs prompt by prompt so that load changes hit both.

Every speculative output must equal plain greedy decoding. In bf16 a verify forward over 8 tokens
and a 1-token decode forward can round differently, so at the first mismatch the reference's own
logits decide: a speculative token within ``TIE_RTOL[dtype]`` of the max (relative to the logit
scale) is a numerical tie (counted; that prompt is compared no further), anything else raises.
``--draft prompt-lookup`` runs model-free n-gram drafting as a baseline.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional, Sequence

import torch
from tqdm import tqdm

from specforge.compat import check_drafts, check_target_weights
from specforge.config import load_config
from specforge.device import autocast_dtype, set_threads, torch_dtype
from specforge.eval import served
from specforge.eval.prompts import (  # noqa: F401 (bucket_of, unreachable_buckets: specforge.eval names them too)
    DEFAULT_BUCKETS,
    bucket_labels,
    bucket_of,
    bucket_rows,
    format_buckets,
    parse_buckets,
    pick_prompts,
    prompt_meta,
    prompt_note,
    unreachable_buckets,
)
from specforge.eval.served import add_arguments, engine_settings
from specforge.models.target import TargetModel, forward_aux, load_target
from specforge.registry import algorithm_of, feature_layers, load_draft, read_draft_config
from specforge.targets import CROP, RESTORE

# Relative logit gap below which two tokens are a numerical tie, per target dtype (see the docstring).
TIE_RTOL = {torch.float64: 1e-8, torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


# ---------------------------------------------------------------- proposers


class PromptLookupProposer:
    """Model-free drafting: continue the latest earlier match of the last n tokens (n = 3..1)."""

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram
        self.ids: list[int] = []

    def start(self, ids: list[int], aux_TH: torch.Tensor) -> None:
        self.ids = list(ids)

    def propose(self, k: int, costs: Optional["RoundCosts"] = None) -> list[int]:
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


class RoundCosts:
    """What a round costs, measured while decoding, and whether one more draft token pays off.

    A drafted token that is accepted saves about one target decode step, ``verify_s(1)``. Drafting
    one more costs a draft step (``draft_step_s``) plus what it adds to the verify forward
    (``extra_verify_s``); verifying an already drafted one costs only the latter. Either pays iff
    ``p_all`` -- the draft's own probability that every token drafted so far, this one included,
    is accepted -- times the saving exceeds the cost. Running averages (``smoothing``) follow load
    changes; nothing is tuned on the eval prompts. Before anything is measured everything pays.
    """

    def __init__(self, smoothing: float = 0.2):
        self.smoothing = smoothing
        self.draft_step_s: Optional[float] = None
        self.target_s_by_len: dict[int, float] = {}  # target forward + argmax over n tokens

    def _avg(self, old: Optional[float], new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)

    def observe_draft(self, steps: int, seconds: float) -> None:
        if steps > 0:
            self.draft_step_s = self._avg(self.draft_step_s, seconds / steps)

    def observe_target(self, tokens: int, seconds: float) -> None:
        self.target_s_by_len[tokens] = self._avg(self.target_s_by_len.get(tokens), seconds)

    def _line(self) -> tuple[float, float]:
        """(intercept, slope) through the averages of verify lengths >= 2: 1-token forwards take
        another kernel path (matrix-vector) and would bend the line."""
        pts = [(n, s) for n, s in self.target_s_by_len.items() if n >= 2] or list(self.target_s_by_len.items())
        if len(pts) == 1:
            return pts[0][1], 0.0
        mx, my = sum(n for n, _ in pts) / len(pts), sum(s for _, s in pts) / len(pts)
        slope = sum((n - mx) * (s - my) for n, s in pts) / sum((n - mx) ** 2 for n, _ in pts)
        return my - slope * mx, slope

    def verify_s(self, n: int) -> float:
        if n in self.target_s_by_len:
            return self.target_s_by_len[n]
        a, b = self._line()
        return a + b * n

    def extra_verify_s(self, drafted: int) -> float:
        """What the ``drafted``-th draft token adds to the verify forward (1 + drafted tokens)."""
        if drafted == 1:
            return max(self.verify_s(2) - self.verify_s(1), 0.0)
        return max(self._line()[1], 0.0)

    def _measured(self) -> bool:
        return self.draft_step_s is not None and bool(self.target_s_by_len)

    def verify_pays(self, drafted: int, p_all: float) -> bool:
        return not self._measured() or p_all * self.verify_s(1) > self.extra_verify_s(drafted)

    def step_pays(self, drafted: int, p_all: float) -> bool:
        """Whether to draft token ``drafted + 1`` (its own probability is unknown until drafted)."""
        return not self._measured() or p_all * self.verify_s(1) > self.draft_step_s + self.extra_verify_s(drafted + 1)


# ---------------------------------------------------------------- decoding loops


@dataclass
class DecodeStats:
    new_tokens: int = 0
    verify_forwards: int = 0
    accepted_at: list[int] = field(default_factory=list)  # rounds whose j-th draft token was accepted
    seconds: float = 0.0
    drafted: int = 0  # draft tokens proposed over all rounds
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0


@dataclass
class GreedyRun:
    tokens: list[int]
    logits: list[torch.Tensor]  # the reference's logits row behind each token (for the tie check)
    seconds: float
    decode_step_s: float  # mean time of one 1-token decode step (forward + argmax)


def _crop(cache, keep: int) -> None:
    """Keep the first ``keep`` positions of an HF cache (transformers 5 takes a negative count)."""
    extra = cache.get_seq_length() - keep
    if extra > 0:
        cache.crop(-extra)


def new_cache(target: TargetModel):
    """The target's cache for one decode. A family whose rejected tokens a crop takes back
    (``Family.rollback`` CROP) gets plain layers that keep every key (sliding layers too: the
    attention masks apply the window, so a crop is exact); a family with linear-attention layers
    gets its own layer kinds (their conv + recurrent state)."""
    from transformers import DynamicCache  # lazy: heavy (transformers)

    return DynamicCache() if target.family.rollback == CROP else DynamicCache(config=target.model.config)


def _recurrent_snapshot(cache) -> dict:
    """Copies of the cache layers a crop cannot take back (linear attention: a state, not per-token keys)."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin  # lazy: heavy (transformers)

    return {i: copy.deepcopy(layer) for i, layer in enumerate(cache.layers)
            if isinstance(layer, LinearAttentionCacheLayerMixin)}


def _take_back(target: TargetModel, cache, snapshot: Optional[dict], base: int, accepted: list[int]) -> None:
    """Put the cache where it would be had the verify forward run over ``accepted`` only (the last
    produced token + the accepted draft tokens, after ``base`` cached positions). Without a snapshot:
    a crop. With one (``Family.rollback`` RESTORE), unless every token was accepted: the recurrent
    layers go back to the snapshot, the attention layers are cropped to ``base``, and the accepted
    tokens run through the target again (one more forward: exact, where a crop would be wrong)."""
    if snapshot is None:
        _crop(cache, base + len(accepted))
        return
    if cache.get_seq_length() == base + len(accepted):
        return
    for i, layer in enumerate(cache.layers):
        if i in snapshot:
            cache.layers[i] = snapshot[i]
        elif (extra := layer.get_seq_length() - base) > 0:
            layer.crop(-extra)
    forward_aux(target, torch.tensor([accepted], device=target.device), cache=cache)


def _logits_rows(target: TargetModel, last_TH: torch.Tensor) -> torch.Tensor:
    return target.head_logits(last_TH)


def _verify(target: TargetModel, last_TH: torch.Tensor, drafted: list[int]) -> list[int]:
    """The target's argmax at the verified rows, only as far as it can matter: row 0 alone (the
    decode step's matrix-vector shape: on a CPU ~1/3 of an 8-row product over the full vocab),
    the other rows in one product only if the first draft token was accepted."""
    first = _logits_rows(target, last_TH[:1]).argmax(-1).tolist()
    if not drafted or drafted[0] != first[0]:
        return first
    return first + _logits_rows(target, last_TH[1:]).argmax(-1).tolist()


@torch.inference_mode()
def greedy_run(target: TargetModel, prompt: Sequence[int], max_new: int, eos: set[int]) -> GreedyRun:
    dev = target.device
    t0 = time.perf_counter()
    cache = new_cache(target)
    _, last, _ = forward_aux(target, torch.tensor([list(prompt)], device=dev), cache=cache)
    logits = [_logits_rows(target, last[0, -1:])[0]]
    out = [int(logits[-1].argmax())]
    t1 = time.perf_counter()
    while len(out) < max_new and out[-1] not in eos:
        _, last, _ = forward_aux(target, torch.tensor([[out[-1]]], device=dev), cache=cache)
        logits.append(_logits_rows(target, last[0, -1:])[0])
        out.append(int(logits[-1].argmax()))
    t2 = time.perf_counter()
    return GreedyRun(out, logits, t2 - t0, (t2 - t1) / max(len(out) - 1, 1))


def greedy_decode(target: TargetModel, prompt: Sequence[int], max_new: int, eos: set[int]) -> tuple[list[int], float]:
    run = greedy_run(target, prompt, max_new, eos)
    return run.tokens, run.seconds


@torch.inference_mode()
def speculative_decode(
    target: TargetModel, proposer, prompt: Sequence[int], max_new: int, chain: int, eos: set[int],
    costs: Optional[RoundCosts] = None,
) -> tuple[list[int], DecodeStats]:
    """Chain speculative decoding; with ``costs`` the chain stops early (dynamic drafting)."""
    dev = target.device
    stats = DecodeStats(accepted_at=[0] * chain)
    t0 = time.perf_counter()
    cache = new_cache(target)
    restore = target.family.rollback == RESTORE
    aux, last, _ = forward_aux(target, torch.tensor([list(prompt)], device=dev), cache=cache)
    out = [int(_logits_rows(target, last[0, -1:]).argmax())]
    proposer.start(list(prompt) + out, aux[0])
    kw = {} if costs is None else {"costs": costs}
    while len(out) < max_new and out[-1] not in eos:
        base = cache.get_seq_length()  # everything before the last produced token
        t1 = time.perf_counter()
        drafted = proposer.propose(chain, **kw)
        t2 = time.perf_counter()
        snapshot = _recurrent_snapshot(cache) if restore else None
        aux, last, _ = forward_aux(target, torch.tensor([[out[-1]] + drafted], device=dev), cache=cache)
        verified = _verify(target, last[0], drafted)
        n = 0
        while n < len(drafted) and drafted[n] == verified[n]:
            stats.accepted_at[n] += 1
            n += 1
        new = drafted[:n] + [verified[n]]
        _take_back(target, cache, snapshot, base, [out[-1]] + drafted[:n])
        t3 = time.perf_counter()
        proposer.accept(new, aux[0, : n + 1])
        out.extend(new)
        stats.verify_forwards += 1
        stats.drafted += len(drafted)
        stats.draft_seconds += t2 - t1
        stats.verify_seconds += t3 - t2
        if costs is not None:
            costs.observe_draft(len(drafted), t2 - t1)
            costs.observe_target(1 + len(drafted), t3 - t2)
        if any(t in eos for t in new):  # an EOS inside the round ends the answer: no round after it counts
            break
    # a round may overshoot max_new or run past an EOS: cut where greedy decoding would stop
    for i, tok in enumerate(out):
        if tok in eos:
            out = out[: i + 1]
            break
    out = out[:max_new]
    stats.new_tokens = len(out)
    stats.seconds = time.perf_counter() - t0
    return out, stats


def check_lossless(got: list[int], ref: GreedyRun, rtol: float, where: str = "") -> bool:
    """True at a numerical tie (see the module docstring), False if equal; raises on a real difference."""
    n = min(len(got), len(ref.tokens))
    first = next((j for j in range(n) if got[j] != ref.tokens[j]), None)
    if first is None:
        if len(got) == len(ref.tokens):
            return False
        raise AssertionError(f"{where}speculative output has {len(got)} tokens, greedy {len(ref.tokens)}")
    logits = ref.logits[first].float()
    gap = float(logits.max() - logits[got[first]])
    scale = float(logits.abs().max())
    if gap <= rtol * scale:
        return True
    raise AssertionError(
        f"{where}speculative output differs from greedy at token {first} (got {got[first:first + 5]}, "
        f"greedy {ref.tokens[first:first + 5]}; logit gap {gap:.4g} > {rtol:g} x scale {scale:.4g}: not a tie)"
    )


# ---------------------------------------------------------------- evaluation


@dataclass
class Setting:
    """One table row: a proposer and whether it drafts dynamically."""

    draft: str
    proposer: object
    dynamic: bool = False
    target: Optional[TargetModel] = None  # the target capturing this draft's layers (None: the shared one)

    def name(self, chain: int) -> str:
        name = f"dynamic <={chain}" if self.dynamic else f"chain {chain} fixed"
        return name + (", block as served" if getattr(self.proposer, "as_served", False) else "")


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
    draft: str = ""
    setting: str = ""
    ties: int = 0  # prompts whose comparison stopped at a numerical tie
    drafted_per_round: float = 0.0
    draft_ms_per_round: float = 0.0
    verify_ms_per_round: float = 0.0
    buckets: list[dict] = field(default_factory=list)  # bucket_rows: acceptance per prompt-length bucket


def evaluate(
    target: TargetModel, proposer, prompts: Sequence[Sequence[int]], max_new: int, chain: int,
    progress: bool = True, dynamic: bool = False, buckets: Sequence[int] = DEFAULT_BUCKETS,
) -> EvalReport:
    """Speculative vs plain greedy on every prompt; raises if an output differs beyond a tie."""
    return evaluate_settings(target, [Setting("draft", proposer, dynamic)], prompts, max_new, chain, progress,
                             buckets)[0]


def evaluate_settings(
    target: TargetModel, settings: Sequence[Setting], prompts: Sequence[Sequence[int]], max_new: int, chain: int,
    progress: bool = True, buckets: Sequence[int] = DEFAULT_BUCKETS,
) -> list[EvalReport]:
    """Every setting against ONE greedy reference per prompt, run alternately prompt by prompt."""
    eos = _eos_ids(target)
    rtol = TIE_RTOL.get(target.lm_head_weight_VH.dtype, 2e-2)
    _warm_up(target, settings, prompts[0], chain, eos)
    costs = [RoundCosts() if s.dynamic else None for s in settings]
    totals = [DecodeStats(accepted_at=[0] * chain) for _ in settings]
    per_prompt: list[list[DecodeStats]] = [[] for _ in settings]  # for the buckets
    ties = [0] * len(settings)
    base_tokens, base_s = 0, 0.0
    for i, prompt in enumerate(tqdm(prompts, desc="spec-decode", disable=not progress)):
        ref = greedy_run(target, prompt, max_new, eos)
        base_tokens, base_s = base_tokens + len(ref.tokens), base_s + ref.seconds
        for j, s in enumerate(settings):
            if costs[j] is not None:  # the baseline's decode steps are target forwards over 1 token
                costs[j].observe_target(1, ref.decode_step_s)
            got, st = speculative_decode(s.target or target, s.proposer, prompt, max_new, chain, eos, costs[j])
            ties[j] += check_lossless(got, ref, rtol, where=f"{s.draft} ({s.name(chain)}), prompt {i}: ")
            _add(totals[j], st)
            per_prompt[j].append(st)
    base_tps = base_tokens / max(base_s, 1e-9)
    lengths = [len(p) for p in prompts]
    # The first token of each prompt comes from the prefill forward, not from a verify round.
    return [replace(_report(s, t, n, len(prompts), chain, base_tps),
                    buckets=bucket_rows(buckets, lengths, [st.new_tokens - 1 for st in runs],
                                        [st.verify_forwards for st in runs]))
            for s, t, n, runs in zip(settings, totals, ties, per_prompt)]


def _warm_up(target: TargetModel, settings: Sequence[Setting], prompt: Sequence[int], chain: int,
             eos: set[int]) -> None:
    """Untimed: first calls pay for allocations and kernel selection, on both sides."""
    greedy_run(target, prompt, 4, set())
    for s in settings:
        speculative_decode(s.target or target, s.proposer, prompt, 2 * chain + 2, chain, set(),
                           RoundCosts() if s.dynamic else None)


def _add(total: DecodeStats, st: DecodeStats) -> None:
    for name in ("new_tokens", "verify_forwards", "seconds", "drafted", "draft_seconds", "verify_seconds"):
        setattr(total, name, getattr(total, name) + getattr(st, name))
    total.accepted_at = [a + b for a, b in zip(total.accepted_at, st.accepted_at)]


def _report(s: Setting, total: DecodeStats, ties: int, prompts: int, chain: int, base_tps: float) -> EvalReport:
    # The first token of each prompt comes from the prefill forward, not from a verify round.
    rounds = max(total.verify_forwards, 1)
    spec_tps = total.new_tokens / max(total.seconds, 1e-9)
    return EvalReport(
        prompts=prompts,
        chain=chain,
        acceptance_length=(total.new_tokens - prompts) / rounds,
        acceptance_by_position=[a / rounds for a in total.accepted_at],
        target_tokens_per_s=base_tps,
        speculative_tokens_per_s=spec_tps,
        speedup=spec_tps / base_tps,
        new_tokens=total.new_tokens,
        verify_forwards=total.verify_forwards,
        draft=s.draft,
        setting=s.name(chain),
        ties=ties,
        drafted_per_round=total.drafted / rounds,
        draft_ms_per_round=1e3 * total.draft_seconds / rounds,
        verify_ms_per_round=1e3 * total.verify_seconds / rounds,
    )


def _eos_ids(target: TargetModel) -> set[int]:
    ids = set()
    for src in (target.model.generation_config, target.model.config):
        e = getattr(src, "eos_token_id", None)
        ids.update(e if isinstance(e, (list, tuple)) else [e] if e is not None else [])
    return ids


# ---------------------------------------------------------------- the table and the CLI


REPORT_HEADER = (
    "| draft | setting | prompts | acceptance length | accepted by position | drafted/round | "
    "round ms (draft + verify) | target tok/s | spec tok/s | speedup | ties |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)


def format_report(rep: EvalReport, label: Optional[str] = None) -> str:
    pos = " ".join(f"{a:.2f}" for a in rep.acceptance_by_position)
    return (
        f"| {label or rep.draft} | {rep.setting} | {rep.prompts} | {rep.acceptance_length:.3f} | {pos} | "
        f"{rep.drafted_per_round:.2f} | {rep.draft_ms_per_round:.0f} + {rep.verify_ms_per_round:.0f} | "
        f"{rep.target_tokens_per_s:.1f} | {rep.speculative_tokens_per_s:.1f} | {rep.speedup:.2f}x | {rep.ties} |"
    )


def build_settings(drafts: Sequence[str], target: TargetModel, draft_dtype: Optional[torch.dtype],
                   aux_ids: Optional[dict[str, Optional[list[int]]]] = None, as_served: bool = False) -> list[Setting]:
    """prompt-lookup: the fixed chain; a checkpoint: the fixed chain and dynamic drafting, each fed
    the target layers ``aux_ids[name]`` (default: the target's). ``as_served``: block drafts run blocks as
    long as the drafts asked for, as vLLM and llama.cpp do (default: the whole block, as trained)."""
    settings: list[Setting] = []
    for name in dict.fromkeys(drafts):  # a draft named twice runs once
        if name == "prompt-lookup":
            settings.append(Setting(name, PromptLookupProposer()))
            continue
        algo = algorithm_of(read_draft_config(name), repr(name))
        draft = load_draft(name, target).to(target.device)
        layers = (aux_ids or {}).get(name)
        view = replace(target, aux_layer_ids=layers) if layers and layers != target.aux_layer_ids else None
        settings.append(Setting(name, algo.proposer(draft, draft_dtype, as_served), target=view))
        if algo.dynamic_drafting:  # a chain can stop early token by token; a DFlash block is drafted whole
            settings.append(Setting(name, algo.proposer(draft, draft_dtype, as_served), dynamic=True, target=view))
    return settings


def _draft_dtype(choice: str, precision: str, device: torch.device) -> torch.dtype:
    """auto = the dtype the draft's matmuls ran in during training (train.precision's autocast)."""
    if choice == "auto":
        return autocast_dtype(precision, device) or torch.float32
    return torch_dtype(choice)


def _parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m specforge.eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", action="append", required=True,
                    help="draft checkpoint folder, or 'prompt-lookup'; repeat for several drafts in one run")
    ap.add_argument("--config", default=None, help="run config (target + held-out data); default: built-in defaults")
    ap.add_argument("--target", default=None, help="target path/hub id (overrides model.target_path)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=None,
                    help="longest prompt (default 384; with --long the target's context minus --max-new-tokens)")
    ap.add_argument("--min-prompt-tokens", type=int, default=2, help="shortest prompt: drop held-out prompts below it")
    ap.add_argument("--long", action="store_true",
                    help="prompts = the longest held-out multi-turn contexts (cut before their last reply that fits), "
                         "not the first turn: fills the long prompt-length buckets")
    ap.add_argument("--buckets", default=",".join(map(str, DEFAULT_BUCKETS)),
                    help="prompt-length bucket edges in tokens: acceptance is also reported per bucket")
    ap.add_argument("--chain", type=int, default=7)
    ap.add_argument("--as-served", action="store_true",
                    help="block drafts (DFlash, DSpark, DFlash2) propose --chain drafts from a block of that many "
                         "rows, as vLLM (num_speculative_tokens) and llama.cpp (n_max) run them; default: the whole "
                         "trained block, its first --chain drafts")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--draft-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="dtype the draft runs in; auto = the autocast dtype of train.precision")
    ap.add_argument("--json", default=None, help="also write every row as JSON here")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. model.dtype=bfloat16")
    ap.add_argument("--allow-mismatch", action="store_true",
                    help="evaluate a draft even if it records another target, "
                         "or model.aux_layer_ids differs from its own")

    add_arguments(ap)  # --engine llama.cpp and its settings
    args = ap.parse_args(argv)
    engine_settings(args)  # every --engine-* value, before a server (or anything else) starts
    for flag, value, low in (("--chain", args.chain, 1), ("--num-prompts", args.num_prompts, 1),
                             ("--max-new-tokens", args.max_new_tokens, 1),
                             ("--max-prompt-tokens", args.max_prompt_tokens, 2),
                             ("--threads", args.threads, 1), ("--min-prompt-tokens", args.min_prompt_tokens, 2)):
        if value is not None and value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    if args.max_prompt_tokens is not None and args.min_prompt_tokens > args.max_prompt_tokens:
        raise ValueError(f"--min-prompt-tokens {args.min_prompt_tokens} exceeds --max-prompt-tokens "
                         f"{args.max_prompt_tokens}; no prompt could be kept")
    args.bucket_edges = parse_buckets(args.buckets)
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = _parse_args(argv)
    cfg = load_config(args.config, args.overrides + ([f"model.target_path={args.target}"] if args.target else []))
    set_threads(args.threads or cfg.train.num_threads)
    if args.engine == "llama.cpp":  # the drafts served by llama-server instead (specforge/eval/served.py)

        return served.main(args, cfg)

    aux_ids = check_drafts(args.draft, cfg, args.allow_mismatch)  # before any weights load
    # in cfg.model.dtype: the dtype the features were captured in
    target = load_target(cfg.model, layers=lambda n: feature_layers(cfg, n))
    for name in aux_ids:
        if note := check_target_weights(name, target.model, args.allow_mismatch):
            print(note, file=sys.stderr)
    max_positions = getattr(target.model.config, "max_position_embeddings", None)
    prompts, cap = pick_prompts(cfg, target.tokenizer, args, max_positions)
    draft_dtype = _draft_dtype(args.draft_dtype, cfg.train.precision, target.device)
    settings = build_settings(args.draft, target, draft_dtype, aux_ids, args.as_served)
    reports = evaluate_settings(target, settings, prompts, args.max_new_tokens, args.chain, buckets=args.bucket_edges)
    target_dtype = str(target.lm_head_weight_VH.dtype).replace("torch.", "")
    print(f"target {cfg.model.target_path} in {target_dtype} on {target.device.type}, draft in "
          f"{str(draft_dtype).replace('torch.', '')}, {torch.get_num_threads()} threads, {len(prompts)} held-out "
          f"prompts x {args.max_new_tokens} new tokens, greedy, output checked against greedy decoding")
    print(REPORT_HEADER)
    for rep in reports:
        print(format_report(rep))
    note = prompt_note(args.bucket_edges, cap, max_positions, args)
    print(f"\nacceptance length by prompt length in tokens "
          f"({'--long: longest held-out contexts' if args.long else 'first turns'}; "
          "header: prompts per bucket; blank: no prompt there)" + (f"\n{note}" if note else ""))
    print(format_buckets(reports, bucket_labels(args.bucket_edges)))
    if args.json:
        rows = [asdict(r) for r in reports]
        # the first row also at the top level, for callers that read one report per run
        meta = {"target_dtype": target_dtype, "draft_dtype": str(draft_dtype), "threads": torch.get_num_threads(),
                **prompt_meta(prompts, cap, args, note)}
        Path(args.json).write_text(json.dumps({**rows[0], **meta, "rows": rows}, indent=2))
    return 0
