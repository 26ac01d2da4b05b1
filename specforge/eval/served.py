"""Drafts served by llama.cpp: ``python -m specforge.eval --engine llama.cpp --draft CKPT ...``.

The target and every draft llama.cpp serves (``--spec-type`` its algorithm's: draft-eagle3, draft-dflash, \
draft-dspark; from the
draft's architecture) are converted with llama.cpp's converter (``engines/llamacpp.py``),
``llama-server`` runs the target alone and the target + each draft at each ``--spec-draft-n-max``
/ ``--spec-draft-p-min`` setting, all on the held-out prompts ``specforge.eval`` uses (the same
token ids, chat template included), greedy. Every server is started first and the prompts are run
alternately, prompt by prompt (as ``specforge.eval`` does), so that load changes hit every row.

Per row: acceptance = tokens per verify round, bonus included (the server's own "mean len":
1 + draft_n_accepted / verification steps, the steps read from its ``/metrics`` around each
request), tokens/s of the decode phase (``timings.predicted_*``), speedup against the target
alone, and how many outputs equal the target alone's. The best setting per draft is the fastest
one whose outputs all match; the table says which.

Per prompt-length bucket (``--buckets``, as ``specforge.eval``): tokens per target forward over the
prompts of that bucket, the same figure as the eval's per-bucket acceptance length. ``--long`` /
``--min-prompt-tokens`` pick the prompts as the eval does; each server gets a context
(``-c``) that holds the longest prompt plus ``--max-new-tokens``.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from tqdm import tqdm

from specforge.compat import check_drafts, check_target_weights, draft_aux_ids
from specforge.engines.llamacpp import (
    Completion,
    LlamaServer,
    cached_target_gguf,
    convert_draft,
    find_converter,
    find_server,
)
from specforge.eval.prompts import bucket_labels, bucket_rows, format_buckets, pick_prompts, prompt_meta, prompt_note
from specforge.models.target import load_target, load_target_config, load_tokenizer, resolve_target_path
from specforge.registry import algorithm_of, read_draft_config


@dataclass
class EngineRow:
    draft: str  # "target alone" or the checkpoint
    n_max: int = 0
    p_min: float = 0.0
    prompts: int = 0
    acceptance: float = 1.0  # tokens per verify round (llama-server's "mean len")
    tokens_per_forward: float = 1.0  # tokens per target decode forward (specforge.eval's acceptance length)
    tokens_per_s: float = 0.0
    speedup: float = 1.0
    equal_outputs: int = 0
    new_tokens: int = 0
    drafted_per_round: float = 0.0
    best: bool = False
    buckets: list[dict] = field(default_factory=list)  # specforge.eval.bucket_rows: tokens/target forward per bucket

    @property
    def setting(self) -> str:
        return f"n_max {self.n_max}, p_min {self.p_min:g}" if self.n_max else "-"


@dataclass
class Setting:
    draft: str
    gguf: Optional[Path]
    n_max: int = 0
    p_min: float = 0.0
    synth_len: Optional[float] = None  # llama.cpp's synthetic acceptance (a break-even line), else None


def forwards_of(r: Completion) -> int:
    """Target decode forwards of one completion after the prefill: each produces one token more
    than the draft tokens it accepted (the eval's count; the prefill made the first token)."""
    return r.predicted_n - 1 - r.draft_n_accepted


def summarize(s: Setting, runs: Sequence[Completion], reference: Sequence[Completion], base_tps: float,
              prompt_lengths: Sequence[int] = (), edges: Sequence[int] = ()) -> EngineRow:
    """One table row from a setting's completions (``reference``: the target alone's, same prompts),
    with its per-bucket figures when ``prompt_lengths`` (per completion) and ``edges`` are given."""
    accepted = sum(r.draft_n_accepted for r in runs)
    rounds = sum(r.verify_rounds for r in runs)
    tps = 1e3 * sum(r.predicted_n for r in runs) / max(sum(r.predicted_ms for r in runs), 1e-9)
    return EngineRow(
        draft=s.draft, n_max=s.n_max, p_min=s.p_min, prompts=len(runs),
        acceptance=1.0 + accepted / rounds if rounds else 1.0, tokens_per_s=tps,
        tokens_per_forward=sum(r.predicted_n - 1 for r in runs) / max(sum(forwards_of(r) for r in runs), 1),
        speedup=tps / base_tps if base_tps else 0.0,
        equal_outputs=sum(r.tokens == ref.tokens for r, ref in zip(runs, reference)),
        new_tokens=sum(r.predicted_n for r in runs),
        drafted_per_round=sum(r.draft_n for r in runs) / rounds if rounds else 0.0,
        buckets=bucket_rows(edges, prompt_lengths, [r.predicted_n - 1 for r in runs], [forwards_of(r) for r in runs])
        if edges else [],
    )


def run_settings(target_gguf: Path, settings: Sequence[Setting], prompts: Sequence[Sequence[int]], max_new: int,
                 threads: Optional[int] = None, progress: bool = True,
                 buckets: Sequence[int] = ()) -> list[EngineRow]:
    """Target alone + every setting, alternately prompt by prompt; rows in the settings' order."""
    ctx = context_size(prompts, max_new)
    with contextlib.ExitStack() as stack:
        base = stack.enter_context(LlamaServer(target_gguf, threads=threads, ctx_size=ctx))
        servers = [stack.enter_context(LlamaServer(target_gguf, s.gguf, n_max=s.n_max, p_min=s.p_min,
                                                   synth_len=s.synth_len, threads=threads, ctx_size=ctx))
                   for s in settings]
        base.complete(prompts[0], 4)  # untimed warm-up: first calls pay for allocations
        for srv in servers:
            srv.complete(prompts[0], 8)
        ref: list[Completion] = []
        got: list[list[Completion]] = [[] for _ in settings]
        for prompt in tqdm(prompts, desc="llama-server", disable=not progress):
            ref.append(base.complete(prompt, max_new))
            for runs, srv in zip(got, servers):
                runs.append(srv.complete(prompt, max_new))
    base_tps = 1e3 * sum(r.predicted_n for r in ref) / max(sum(r.predicted_ms for r in ref), 1e-9)
    lengths = [len(p) for p in prompts]
    rows = [EngineRow("target alone", prompts=len(ref), tokens_per_s=base_tps, equal_outputs=len(ref),
                      new_tokens=sum(r.predicted_n for r in ref))]
    rows += [summarize(s, runs, ref, base_tps, lengths, buckets) for s, runs in zip(settings, got)]
    mark_best(rows)
    return rows


def context_size(prompts: Sequence[Sequence[int]], max_new: int) -> int:
    """llama-server's ``-c``: the longest prompt + the new tokens + a round's draft tokens \
(LlamaServer's 4096 at least)."""
    return max(4096, max((len(p) for p in prompts), default=0) + max_new + 64)


def mark_best(rows: list[EngineRow]) -> None:
    """Per draft, the fastest setting whose outputs all equal the target alone's."""
    for name in dict.fromkeys(r.draft for r in rows if r.n_max):
        ok = [r for r in rows if r.draft == name and r.n_max and r.equal_outputs == r.prompts]
        if ok:
            max(ok, key=lambda r: r.tokens_per_s).best = True


HEADER = ("| draft | n_max | p_min | prompts | acceptance (tokens/round) | tokens/target forward | drafted/round | "
          "tok/s | speedup | outputs = target alone |\n|---|---|---|---|---|---|---|---|---|---|")


def format_row(r: EngineRow) -> str:
    if not r.n_max:
        return (f"| {r.draft} | - | - | {r.prompts} | 1.000 | 1.000 | - | {r.tokens_per_s:.1f} | 1.00x | "
                f"{r.equal_outputs}/{r.prompts} |")
    mark = " **best**" if r.best else ""
    return (f"| {r.draft} | {r.n_max}{mark} | {r.p_min:g} | {r.prompts} | {r.acceptance:.3f} | "
            f"{r.tokens_per_forward:.3f} | "
            f"{r.drafted_per_round:.2f} | {r.tokens_per_s:.1f} | {r.speedup:.2f}x | {r.equal_outputs}/{r.prompts} |")


def evaluate_engine(target_dir: str | Path, drafts: Sequence[str | Path], prompts: Sequence[Sequence[int]],
                    max_new: int, n_max: Sequence[int] = (1, 2, 3), p_min: Sequence[float] = (0.0,),
                    target_outtype: str = "f32", draft_outtype: str = "f32", threads: Optional[int] = None,
                    progress: bool = True, buckets: Sequence[int] = ()) -> list[EngineRow]:
    """Convert (target cached, drafts into a temporary folder), serve, measure: the table rows."""
    find_server()
    find_converter()
    target_gguf = cached_target_gguf(target_dir, target_outtype)
    with tempfile.TemporaryDirectory(prefix="specforge-engine-") as tmp:
        settings = []
        for i, d in enumerate(dict.fromkeys(str(d) for d in drafts)):
            gguf = convert_draft(d, target_dir, Path(tmp) / f"draft-{i}.gguf", draft_outtype)
            settings += [Setting(d, gguf, n, p) for n in _n_max_for(d, n_max) for p in p_min]
        return run_settings(target_gguf, settings, prompts, max_new, threads, progress, buckets)


def _n_max_for(draft: str | Path, n_max: Sequence[int]) -> list[int]:
    """The n_max values a draft can run: a block draft (DFlash) drafts at most its
    ``max_tokens_per_round`` (block_size - 1) a round, and llama-server clamps a larger
    --spec-draft-n-max to that: the row would be mislabelled."""
    config = read_draft_config(draft)
    algo = algorithm_of(config, repr(str(draft)))
    top = algo.max_tokens_per_round(config)
    if top is None:
        return list(n_max)
    kept = [n for n in n_max if n <= top]
    if len(kept) < len(n_max):
        print(f"llama.cpp engine: {algo.architecture} draft {draft} drafts at most {top} tokens a round; "
              "--engine-n-max values above it skipped", file=sys.stderr)
    return kept or [top]


def _values(flag: str, text: str, kind, low: float, high: float, what: str) -> list:
    """A comma-separated flag's values, each of ``kind`` in [low, high], or one error naming the flag."""
    try:
        values = [kind(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(not low <= v <= high for v in values):
        raise ValueError(f"{flag} {text}: expected comma-separated {what}, e.g. {flag} "
                         f"{'1,2,3' if kind is int else '0,0.5'}")
    return values


def engine_settings(args) -> tuple[list[int], list[float]]:
    """The ``--engine-n-max`` / ``--engine-p-min`` values, checked before anything starts (llama-server
    exits at once on an n-max below 1 and would leave only a dead connection to report)."""
    n_max = _values("--engine-n-max", args.engine_n_max, int, 1, 1 << 16, "integers >= 1 (draft tokens per round)")
    p_min = _values("--engine-p-min", args.engine_p_min, float, 0.0, 1.0, "probabilities in [0, 1]")
    return n_max, p_min


def main(args, cfg) -> int:
    """The ``--engine llama.cpp`` branch of ``specforge.eval``: ``args`` are eval's parsed arguments."""
    n_max, p_min = engine_settings(args)  # every --engine-* value before a server starts
    find_server()  # the install command before anything slow happens
    drafts = [d for d in args.draft if d != "prompt-lookup"]
    if len(drafts) != len(args.draft):
        print("llama.cpp engine: prompt-lookup is not a draft model; skipped", file=sys.stderr)
    if not drafts:
        raise ValueError("--engine llama.cpp needs at least one --draft checkpoint")
    aux = check_drafts(drafts, cfg, args.allow_mismatch)
    for name, ids in aux.items():  # the engine runs the layers the checkpoint records, nothing else
        if cfg.model.aux_layer_ids is not None and ids != _recorded(name):
            raise ValueError(f"--engine llama.cpp serves draft {name!r} on the layers it records; "
                             "drop model.aux_layer_ids")
    target_dir = resolve_target_path(cfg.model)
    if any((Path(d) / "training_state.pt").is_file() for d in drafts):  # the weights fingerprint check

        target = load_target(cfg.model)
        for name in drafts:
            if note := check_target_weights(name, target.model, args.allow_mismatch):
                print(note, file=sys.stderr)
        del target
    max_positions = getattr(load_target_config(cfg.model), "max_position_embeddings", None)
    prompts, cap = pick_prompts(cfg, load_tokenizer(cfg.model), args, max_positions)
    threads = args.threads or cfg.train.num_threads
    rows = evaluate_engine(target_dir, drafts, prompts, args.max_new_tokens, n_max, p_min,
                           args.engine_target_type, args.engine_draft_type, threads, buckets=args.bucket_edges)
    print(f"llama.cpp llama-server (specforge.engines.llamacpp), target {cfg.model.target_path} as "
          f"{args.engine_target_type} GGUF, drafts {args.engine_draft_type}, {threads or 'all'} threads, "
          f"{len(prompts)} held-out prompts x {args.max_new_tokens} new tokens, greedy")
    print(HEADER)
    for r in rows:
        print(format_row(r))
    for name in drafts:
        best = [r for r in rows if r.draft == name and r.best]
        print(f"best for {name}: " + (f"--spec-draft-n-max {best[0].n_max} --spec-draft-p-min {best[0].p_min:g} "
                                      f"({best[0].speedup:.2f}x)" if best
                                      else "none: no setting matched the target alone's outputs"))
    note = prompt_note(args.bucket_edges, cap, max_positions, args)
    print("\ntokens per target forward by prompt length in tokens (header: prompts per bucket; blank: no prompt there)"
          + (f"\n{note}" if note else ""))
    print(format_buckets([r for r in rows if r.n_max], bucket_labels(args.bucket_edges)))
    if args.json:
        meta = prompt_meta(prompts, cap, args, note)
        Path(args.json).write_text(json.dumps({"engine": "llama.cpp", **meta, "rows": [asdict(r) for r in rows]},
                                              indent=2))
    return 0


def _recorded(path: str) -> Optional[list[int]]:
    return draft_aux_ids(read_draft_config(path))


def add_arguments(ap) -> None:
    """eval's flags for ``--engine llama.cpp``."""
    ap.add_argument("--engine", default="hf", choices=["hf", "llama.cpp"],
                    help="hf: our own speculative decoding (default); llama.cpp: serve the drafts with llama-server")
    ap.add_argument("--engine-n-max", default="1,2,3", help="llama.cpp: --spec-draft-n-max values to measure")
    ap.add_argument("--engine-p-min", default="0,0.5", help="llama.cpp: --spec-draft-p-min values to measure")
    ap.add_argument("--engine-target-type", default="f32", choices=["f32", "bf16", "f16", "q8_0"],
                    help="llama.cpp: GGUF type of the target")
    ap.add_argument("--engine-draft-type", default="f32", choices=["f32", "bf16", "f16", "q8_0"],
                    help="llama.cpp: GGUF type of the drafts")
