"""Self-distilled data: every assistant turn of a dataset rewritten by the target.

    python -m specforge.regenerate --config cfg.yaml [section.key=value ...]

Rows. The conversations of ``data.path`` as ``specforge.data.sharegpt.iter_conversations``
yields them; a row's id is its index there (``source_row``, recorded). Rows the data pipeline
holds out for evaluation (``data.heldout.heldout_sources``: the last ``data.num_eval`` usable conversations,
exactly as ``prepare_dataset`` splits) are never regenerated, so eval prompts cannot leak into
training data (``data.max_samples`` only moves that split, as in ``prepare_dataset``).
``regenerate.max_samples`` keeps the first N remaining normalized rows, ``regenerate.max_turns``
the first K assistant turns of each.

Turns. Rows are processed in chunks; inside a chunk, turn k of every row is generated (one
batched call) before turn k+1, and each prompt is the chat template over the REGENERATED history,
tokenized like training data (``add_special_tokens=False``). A row whose first prompt exceeds
``data.max_length - 1`` tokens is skipped; a later turn whose prompt does not fit ends the row
there (its earlier turns are kept). New tokens are capped so prompt + answer <= data.max_length.
A row with an empty answer is skipped (the data reader rejects empty turns).

Backends. ``local``: ``specforge.models.generate`` (batched, KV cache) in this process, or in
``regenerate.num_workers`` Ray tasks that each take the rows with ``position % W == k``.
``openai``: any OpenAI-compatible ``/chat/completions`` endpoint (e.g. SGLang), ``concurrency``
requests in flight, ``timeout_s`` each, ``retries`` with exponential backoff; after the retries it
fails with an error naming the endpoint, every finished row already written.

Output. JSONL that ``data.path`` reads: ``{"id", "source_row", "conversations": [{"from", "value"}],
"generation": {backend, model, max_new_tokens, temperature, top_p, seed, finish_reasons}}``.
Rows are appended as they finish (flush + fsync per write), in finishing order (deterministic).
A rerun skips finished rows: it drops a torn last line, refuses an output written with other
settings, and appends the rest.

Features (local backend, ``capture_features``). The hidden states the target computes while it
writes a row's LAST turn are the training features of the whole regenerated sequence (prompt +
answer): they go straight to the feature store (``store.dir``; ``<dir>/worker-k-of-W`` per Ray
worker), sample id = source_row, loss mask = 1 on every assistant token. A row counts as finished
only if it is in the JSONL AND in the store's complete shards: features still buffered when a run
dies (or raises) are lost with their shard, so on resume those rows are removed from the JSONL and
regenerated. The JSONL line is always written before ``add``, so the store never holds a row the
JSONL lacks (unless the JSONL was deleted: then such rows are regenerated but not re-added).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence, Union

import torch
from tqdm.auto import tqdm

from specforge import device
from specforge.config import Config, load_config
from specforge.data import store as fs
from specforge.data.heldout import heldout_sources
from specforge.data.sharegpt import iter_conversations
from specforge.data.store import store_root
from specforge.data.template import (
    TemplateError,
    assistant_char_spans,
    render,
    resolve_chat_template,
    span_mask,
)
from specforge.device import set_threads
from specforge.files import check_writable
from specforge.jsonhttp import HttpFailure, post_json
from specforge.models import generate as engine
from specforge.models.target import capture as capture_features
from specforge.models.target import load_target, load_tokenizer
from specforge.models.vllm_engine import check_storage, engine_factory
from specforge.preflight import before_local_ray, check_workers, ray_resources
from specforge.registry import feature_layers
from specforge.runtime.actors import exit_on_head_lost, not_inherited, shutdown_ray, start_ray
from specforge.training.batch import collate, pad_id

HELD_OUT = "held out for eval"
PROMPT_TOO_LONG = "first prompt longer than data.max_length - 1"  # later turns that do not fit end the row
EMPTY_ANSWER = "empty generated answer"
TEMPLATE_FAILED = "chat template failed"
FROM = {"system": "system", "user": "human", "assistant": "gpt"}
CHUNK_BATCHES = 4  # rows per chunk = 4 x batch_size (local) / concurrency (openai): room to group by length


class EndpointError(ValueError):
    """The OpenAI-compatible endpoint failed a request (after its retries)."""


# ---------------------------------------------------------------- which rows


@dataclass
class Job:
    """One conversation being regenerated. ``messages``: its source turns (cut to max_turns)."""

    source_row: int
    messages: list[dict]
    out: list[dict] = field(default_factory=list)  # the regenerated conversation so far
    k: int = 0  # assistant turns regenerated so far
    finish_reasons: list[str] = field(default_factory=list)
    prompt: Optional["Prompt"] = None  # the prompt of turn k

    @property
    def turns(self) -> list[int]:
        return [i for i, m in enumerate(self.messages) if m["role"] == "assistant"]


def _cut_turns(messages: list[dict], max_turns: Optional[int]) -> list[dict]:
    if max_turns is None:
        return list(messages)
    seen = 0
    for i, m in enumerate(messages):
        seen += m["role"] == "assistant"
        if seen == max_turns:
            return list(messages[: i + 1])
    return list(messages)


def select_jobs(cfg: Config, tokenizer, template: str, skipped: dict[str, int]) -> list[Job]:
    """The rows to regenerate, in source order; counts every row left out by reason."""
    held = heldout_sources(cfg.data, tokenizer, template)
    jobs: list[Job] = []
    limit = cfg.regenerate.max_samples
    for conv in iter_conversations(cfg.data.path):
        if limit is not None and len(jobs) >= limit:
            break
        reason = conv.reason if not conv.ok else (HELD_OUT if conv.index in held else None)
        if reason is not None:
            skipped[reason] = skipped.get(reason, 0) + 1
            continue
        jobs.append(Job(conv.index, _cut_turns(conv.messages, cfg.regenerate.max_turns)))
    return jobs


# ---------------------------------------------------------------- prompts


@dataclass
class Prompt:
    messages: list[dict]  # the history the next assistant turn answers
    ids: list[int]
    mask: list[int]  # 1 on assistant tokens of earlier turns (only when capturing features)
    max_new_tokens: int
    seed: int = 0  # sampling seed of this row's turn


def turn_seed(seed: int, source_row: int, turn: int) -> int:
    """One seed per (row, turn), derived from regenerate.seed, so that with sampling rows in
    different chunks do not replay one random stream. The endpoint gets it per request; the local
    engine seeds one generator per call, taken from the call's first row."""
    digest = hashlib.sha256(f"{seed}:{source_row}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


@dataclass
class Tokens:
    """How prompts are tokenized: like training data (template.tokenize_conversation)."""

    tokenizer: object
    template: str
    max_length: int
    max_new_tokens: int
    with_mask: bool
    seed: int = 0

    def prompt(self, messages: list[dict]) -> Optional[Prompt]:
        """The generation prompt over ``messages``, or None if it leaves no room for an answer."""
        text = render(self.tokenizer, messages, self.template, add_generation_prompt=True)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=self.with_mask)
        ids = list(enc["input_ids"])
        room = self.max_length - len(ids)
        if room < 1:
            return None
        mask = []
        if self.with_mask:  # char spans of the earlier assistant turns, as for training rows
            mask = span_mask(enc["offset_mapping"], assistant_char_spans(self.tokenizer, messages, text, self.template))
        return Prompt(messages, ids, mask, min(self.max_new_tokens, room))


def next_prompt(job: Job, tokens: Tokens) -> tuple[Optional[Prompt], str]:
    """Turn ``job.k``'s prompt (the regenerated history + the source turns up to that assistant
    turn), or None and why not."""
    turns = job.turns
    start = turns[job.k - 1] + 1 if job.k else 0
    try:
        prompt = tokens.prompt(job.out + [dict(m) for m in job.messages[start : turns[job.k]]])
    except TemplateError:
        return None, TEMPLATE_FAILED
    if prompt is None:
        return None, PROMPT_TOO_LONG
    prompt.seed = turn_seed(tokens.seed, job.source_row, job.k)
    return prompt, ""


def stop_token_ids(tokenizer, template: str, model=None) -> set[int]:
    """eos (tokenizer and generation config) + the template's end-of-turn token (ChatML <|im_end|>)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids |= set(eos) if isinstance(eos, (list, tuple)) else ({eos} if eos is not None else set())
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Ok"}]
    try:
        text = render(tokenizer, msgs, template)
        start, end = assistant_char_spans(tokenizer, msgs, text, template)[-1]
    except (TemplateError, IndexError):
        return ids
    tail = text[start:end].split("Ok", 1)[-1]  # what closes an assistant turn
    tail_ids = tokenizer(tail, add_special_tokens=False)["input_ids"] if tail else []
    if len(tail_ids) == 1:
        ids.add(tail_ids[0])
    return ids


# ---------------------------------------------------------------- backends


@dataclass
class Answer:
    text: str
    finish_reason: str  # "stop" | "length"
    num_tokens: int
    output_ids: list[int] = field(default_factory=list)  # local backend
    features: object = None  # specforge.models.target.Features of prompt + output (local, capture)


class LocalBackend:
    """Batched generation in this process (specforge.models.generate)."""

    def __init__(self, target, cfg: Config, stop_ids: set[int], capture: bool, progress: Callable[[int], None]):
        self.target, self.r = target, cfg.regenerate
        self.stop_ids, self.capture, self.progress = stop_ids, capture, progress

    def run(self, prompts: list[Prompt]) -> list[Union[Answer, Exception]]:
        # One call at the largest cap; each row is cut to its own cap afterwards (decoding is
        # causal, so the first n tokens and their features are what a call capped at n gives).
        # The engine seeds one generator per call: the call's first row/turn names it.
        params = engine.SamplingParams(max_new_tokens=max(p.max_new_tokens for p in prompts),
                                       temperature=self.r.temperature, top_p=self.r.top_p, seed=prompts[0].seed)
        gens = engine.generate(self.target, [p.ids for p in prompts], params, self.stop_ids,
                               capture=self.capture, batch_size=self.r.batch_size, progress=self.progress)
        return [self._answer(p, g) for p, g in zip(prompts, gens)]

    def _answer(self, prompt: Prompt, gen) -> Answer:
        out = list(gen.output_ids[: prompt.max_new_tokens])
        reason = gen.finish_reason if len(out) == len(gen.output_ids) else "length"
        body = out[:-1] if reason == "stop" and out and out[-1] in self.stop_ids else out
        text = self.target.tokenizer.decode(body, skip_special_tokens=True)
        feats = gen.features
        if feats is not None:
            T = len(prompt.ids) + len(out)
            feats = type(feats)(feats.aux_hidden_BTKH[:, :T], feats.last_hidden_BTH[:, :T], feats.target_ids_BT[:, :T])
        return Answer(text, reason, len(out), out, feats)


class VllmBackend:
    """``rollout.backend=vllm`` with the local backend: the target's vLLM engine writes the answers
    (token ids in, token ids out, the requests in flight together), then the features of prompt +
    answer are one capture of those rows through the same engine (``models.target.capture``)."""

    def __init__(self, target, cfg: Config, stop_ids: set[int], capture: bool, progress: Callable[[int], None]):
        self.target, self.r, self.cfg = target, cfg.regenerate, cfg
        self.stop_ids, self.capture, self.progress = stop_ids, capture, progress

    def run(self, prompts: list[Prompt]) -> list[Union[Answer, Exception]]:
        eng = self.target.engine

        def one(p: Prompt) -> tuple[list[int], str]:
            out = eng.generate(p.ids, p.max_new_tokens, self.r.temperature, self.r.top_p, p.seed, self.stop_ids)
            self.progress(len(out[0]))
            return out

        with cf.ThreadPoolExecutor(max_workers=min(64, len(prompts))) as pool:
            gens = list(pool.map(one, prompts))
        feats = None
        if self.capture:
            rows = [{"input_ids": p.ids + out, "loss_mask": [1] * (len(p.ids) + len(out))}
                    for p, (out, _) in zip(prompts, gens)]
            ids, _, attn = collate(rows, pad_id(self.target.tokenizer))
            feats = capture_features(self.target, ids, attn, self.cfg.model.argmax_chunk_tokens)
        answers = []
        for b, (p, (out, reason)) in enumerate(zip(prompts, gens)):
            body = out[:-1] if reason == "stop" and out and out[-1] in self.stop_ids else out
            text = self.target.tokenizer.decode(body, skip_special_tokens=True)
            f = None
            if feats is not None:
                T = len(p.ids) + len(out)
                f = type(feats)(feats.aux_hidden_BTKH[b : b + 1, :T], feats.last_hidden_BTH[b : b + 1, :T],
                                feats.target_ids_BT[b : b + 1, :T])
            answers.append(Answer(text, reason, len(out), out, f))
        return answers


class OpenAIBackend:
    """POST {endpoint}/chat/completions, ``concurrency`` at a time, with timeouts and retries."""

    def __init__(self, cfg: Config, tokenizer, progress: Callable[[int], None]):
        self.r, self.tokenizer, self.progress = cfg.regenerate, tokenizer, progress
        self.url = cfg.regenerate.endpoint.rstrip("/") + "/chat/completions"
        self.model_name = cfg.regenerate.api_model or cfg.model.target_path
        self.pool = cf.ThreadPoolExecutor(max_workers=cfg.regenerate.concurrency, thread_name_prefix="regenerate")

    def run(self, prompts: list[Prompt]) -> list[Union[Answer, Exception]]:
        futures = [self.pool.submit(self._complete, p) for p in prompts]
        results: list[Union[Answer, Exception]] = []
        failed: Optional[Exception] = None
        for fut in futures:
            try:
                results.append(fut.result())
            except (EndpointError, cf.CancelledError) as err:
                if failed is None:  # fail fast: requests not yet sent are cancelled
                    failed = err
                    for f in futures:
                        f.cancel()
                results.append(failed)
        return results

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def _complete(self, prompt: Prompt) -> Answer:
        body = {"model": self.model_name,
                "messages": [{"role": m["role"], "content": m["content"]} for m in prompt.messages],
                "max_tokens": prompt.max_new_tokens, "temperature": self.r.temperature, "top_p": self.r.top_p,
                "seed": prompt.seed}
        reply = self._post_with_retries(json.dumps(body).encode())
        try:
            choice = reply["choices"][0]
            text = choice["message"]["content"] or ""
        except (KeyError, IndexError, TypeError) as e:
            raise EndpointError(f"endpoint {self.url} answered without choices[0].message.content: "
                                f"{str(reply)[:200]}") from e
        n = (reply.get("usage") or {}).get("completion_tokens")
        n = n if isinstance(n, int) else len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        self.progress(n)
        return Answer(text, "length" if choice.get("finish_reason") == "length" else "stop", n)

    def _post_with_retries(self, data: bytes) -> dict:
        last = ""
        for attempt in range(self.r.retries + 1):
            if attempt:
                time.sleep(min(0.5 * 2 ** (attempt - 1), 8.0))  # 0.5, 1, 2, 4, 8, 8, ... seconds
            try:
                return post_json(self.url, data, self.r.timeout_s)
            except HttpFailure as e:
                last = f"HTTP {e.code}: {e.detail[:200]}" if e.code is not None else e.detail
                if e.code is not None and e.code != 429 and e.code < 500:  # a bad request stays bad: do not retry
                    raise EndpointError(f"endpoint {self.url} rejected the request ({last})") from e
        raise EndpointError(f"endpoint {self.url} failed after {self.r.retries + 1} attempts "
                            f"(regenerate.retries={self.r.retries}); last error: {last}")


# ---------------------------------------------------------------- output


def settings_of(cfg: Config, model_name: str) -> dict:
    r = cfg.regenerate
    return {"backend": r.backend, "model": model_name, "max_new_tokens": r.max_new_tokens,
            "temperature": r.temperature, "top_p": r.top_p, "seed": r.seed}


def row_record(job: Job, settings: dict) -> dict:
    return {"id": f"regen-{job.source_row}", "source_row": job.source_row,
            "conversations": [{"from": FROM[m["role"]], "value": m["content"]} for m in job.out],
            "generation": {**settings, "finish_reasons": list(job.finish_reasons)}}


def read_output(path: Path) -> tuple[list[dict], bool]:
    """The complete rows of an output JSONL, and whether its last line was torn (no newline)."""
    if not path.is_file():
        return [], False
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    torn = lines[-1] != ""  # every row we write ends with a newline
    rows = []
    for lineno, line in enumerate(lines[:-1], 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"regenerate.output {path}: line {lineno} is not JSON ({e.msg}); "
                                 "fix or move the file") from e
    return rows, torn


def check_settings(path: Path, rows: list[dict], settings: dict) -> None:
    """A resumed output must not mix rows generated with different settings."""
    for row in rows[:1]:
        old = {k: v for k, v in row.get("generation", {}).items() if k != "finish_reasons"}
        diffs = [f"{k}={old.get(k)!r} (now {v!r})" for k, v in settings.items() if old.get(k) != v]
        if diffs:
            raise ValueError(f"regenerate.output {path} holds rows generated with {', '.join(diffs)}; "
                             "restore those settings to resume, or set another regenerate.output")


def resume_output(path: Path, settings: dict, features_done: Optional[set[int]]) -> set[int]:
    """Finished source rows; rewrites the file (atomically) without a torn tail, duplicates, or rows
    whose features are not in the store (they are regenerated)."""
    rows, torn = read_output(path)
    check_settings(path, rows, settings)
    keep, seen = [], set()
    for row in rows:
        sid = row.get("source_row")
        if sid not in seen and (features_done is None or sid in features_done):
            keep.append(row)
            seen.add(sid)
    if torn or len(keep) != len(rows):
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in keep)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return seen


class RowSink:
    """Appends finished rows to the JSONL (flush + fsync), THEN their features to the store."""

    def __init__(self, path: Path, settings: dict, store=None):
        self.path, self.settings, self.store = path, settings, store
        self.in_store = store.done() if store is not None else set()
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, finished: list[tuple[Job, Answer]]) -> None:
        if not finished:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(row_record(job, self.settings), ensure_ascii=False) + "\n" for job, _ in finished)
            f.flush()
            os.fsync(f.fileno())
        if self.store is None:
            return

        for job, ans in finished:
            if job.source_row in self.in_store:  # the JSONL had lost it; its features are there
                continue
            ids = torch.tensor(job.prompt.ids + ans.output_ids)  # device: host (a store row)
            mask = torch.tensor(job.prompt.mask + [1] * len(ans.output_ids))  # device: host (a store row)
            f = ans.features
            self.store.add(job.source_row, ids, mask, f.aux_hidden_BTKH[0], f.last_hidden_BTH[0], f.target_ids_BT[0])


# ---------------------------------------------------------------- the turn loop


@dataclass
class Summary:
    rows_done: int = 0  # written by this run
    rows_resumed: int = 0  # finished before this run
    skipped: dict[str, int] = field(default_factory=dict)
    turns_dropped: int = 0  # later turns whose prompt did not fit
    tokens: int = 0
    seconds: float = 0.0
    output: str = ""
    features: Optional[str] = None

    def skip(self, reason: str, n: int = 1) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + n

    def merge(self, other: "Summary") -> None:
        self.rows_done += other.rows_done
        self.rows_resumed += other.rows_resumed
        self.turns_dropped += other.turns_dropped
        self.tokens += other.tokens
        for reason, n in other.skipped.items():
            self.skip(reason, n)

    def line(self) -> str:
        skips = ", ".join(f"{r}: {n}" for r, n in sorted(self.skipped.items())) or "none"
        rate = self.tokens / self.seconds if self.seconds > 0 else 0.0
        return (f"regenerated {self.rows_done} rows ({self.rows_resumed} already done) -> {self.output}; "
                f"skipped: {skips}; later turns dropped (prompt too long or not renderable): {self.turns_dropped}; "
                f"{self.tokens} tokens in {self.seconds:.1f} s = {rate:.1f} tok/s"
                + (f"; features -> {self.features}" if self.features else ""))


def run_chunk(jobs: list[Job], backend, tokens: Tokens, sink: RowSink, summary: Summary, bar) -> None:
    """Regenerate ``jobs`` turn by turn; rows are written as soon as their last turn is done."""
    active = []
    for job in jobs:
        job.prompt, why = next_prompt(job, tokens)
        if job.prompt is None:
            summary.skip(why)
            bar.update(1)
        else:
            active.append(job)
    while active:
        answers = backend.run([j.prompt for j in active])
        finished, still, error = [], [], None
        for job, ans in zip(active, answers):
            if isinstance(ans, Exception):
                error = error or ans
                continue
            summary.tokens += ans.num_tokens
            if not ans.text.strip():
                summary.skip(EMPTY_ANSWER)
                bar.update(1)
                continue
            job.out = job.prompt.messages + [{"role": "assistant", "content": ans.text}]
            job.finish_reasons.append(ans.finish_reason)
            job.k += 1
            last_prompt = job.prompt
            job.prompt = next_prompt(job, tokens)[0] if job.k < len(job.turns) else None
            if job.prompt is not None:
                still.append(job)
                continue
            summary.turns_dropped += len(job.turns) - job.k  # later turns that do not fit (or render)
            job.prompt = last_prompt  # the features cover this prompt + its answer
            finished.append((job, ans))
        sink.write(finished)
        summary.rows_done += len(finished)
        bar.update(len(finished))
        if error is not None:
            raise error
        active = still


def _chunks(items: Sequence, n: int) -> Iterable[Sequence]:
    for s in range(0, len(items), n):
        yield items[s : s + n]


def _bar(total: int, start: float, desc: str):
    bar = tqdm(total=total, desc=desc, unit="row", mininterval=1.0, dynamic_ncols=True)
    state = {"tokens": 0, "shown": 0.0}

    def on_tokens(n: int) -> None:  # per decode step / per request: rows finish only per turn, so redraw here
        now = time.perf_counter()
        state["tokens"] += n
        redraw = now - state["shown"] >= 1.0
        state["shown"] = now if redraw else state["shown"]
        bar.set_postfix_str(f"{state['tokens']} tok, {state['tokens'] / max(now - start, 1e-9):.1f} tok/s",
                            refresh=redraw)

    return bar, on_tokens


# ---------------------------------------------------------------- one process


def source_tag(cfg: Config, settings: dict, template: str) -> str:
    """The store's meta.source: what the regenerated samples are."""
    what = {**settings, "data_path": str(cfg.data.path), "max_turns": cfg.regenerate.max_turns, "template": template}
    return "regenerated:" + hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def _estimate_bytes(jobs: list[Job], max_length: int, per_token: float) -> int:
    """Upper-ish estimate of the store size: ~3 characters per token, each row cut to max_length."""
    chars = (sum(len(m["content"]) for m in j.messages) for j in jobs)
    return int(sum(min(max_length, c // 3 + 16) for c in chars) * per_token)


def _open_store(cfg: Config, target, root: Path, settings: dict, template: str, jobs: list[Job]):
    meta = fs.store_meta(cfg, target, source_tag(cfg, settings, template), like=fs.recorded_fingerprint(root))
    writer = fs.FeatureStoreWriter(root, meta, dtype=cfg.store.dtype, shard_mb=cfg.store.shard_mb)
    todo = [j for j in jobs if j.source_row not in writer.done()]
    fs.check_disk(root, _estimate_bytes(todo, cfg.data.max_length,
                                        fs.bytes_per_token(meta.hidden_size, cfg.store.dtype)))
    return writer


def run_shard(cfg: Config, jobs: list[Job], output: Path, store_dir: Optional[Path], target=None,
              tokenizer=None, desc: str = "regenerate") -> Summary:
    """Regenerate ``jobs`` into ``output`` (and the store at ``store_dir`` when capturing)."""
    r = cfg.regenerate
    local = r.backend == "local"
    own = local and target is None
    if own:
        # with an engine only the head is read from the checkpoint (as a capture's: ``head_only_capture``)
        target = load_target(cfg.model, layers=lambda n: feature_layers(cfg, n), engine_for=engine_factory(cfg),
                             head_only=store_dir is None or fs.head_only_capture(store_dir))
    try:
        return _run_shard(cfg, jobs, output, store_dir, target, tokenizer, desc)
    finally:
        if own and target.engine is not None:
            target.engine.close()


def _run_shard(cfg: Config, jobs: list[Job], output: Path, store_dir: Optional[Path], target, tokenizer,
               desc: str) -> Summary:
    r = cfg.regenerate
    local = r.backend == "local"
    tokenizer = target.tokenizer if local else tokenizer
    template = resolve_chat_template(tokenizer, cfg.model.chat_template)
    model_name = cfg.model.target_path if local else (r.api_model or cfg.model.target_path)
    settings = settings_of(cfg, model_name)
    capture = local and r.capture_features and store_dir is not None
    summary = Summary(output=str(output), features=str(store_dir) if capture else None)
    store = _open_store(cfg, target, store_dir, settings, template, jobs) if capture else None
    finished = resume_output(output, settings, store.done() if store is not None else None)
    pending = [j for j in jobs if j.source_row not in finished]
    summary.rows_resumed = len(jobs) - len(pending)
    start = time.perf_counter()
    bar, on_tokens = _bar(len(pending), start, desc)
    tokens = Tokens(tokenizer, template, cfg.data.max_length, r.max_new_tokens, with_mask=capture, seed=r.seed)
    if local:
        kind = VllmBackend if target.engine is not None else LocalBackend
        backend = kind(target, cfg, stop_token_ids(tokenizer, template, target.model), capture, on_tokens)
    else:
        backend = OpenAIBackend(cfg, tokenizer, on_tokens)
    chunk = CHUNK_BATCHES * (r.batch_size if local else r.concurrency)
    try:
        with store if store is not None else contextlib.nullcontext():
            sink = RowSink(output, settings, store)
            for part in _chunks(pending, chunk):
                run_chunk(list(part), backend, tokens, sink, summary, bar)
    finally:
        bar.close()
        if not local:
            backend.close()
        summary.seconds = time.perf_counter() - start
    return summary


# ---------------------------------------------------------------- Ray data parallel


def part_path(output: Path, k: int, num_workers: int) -> Path:
    return output.with_name(f"{output.stem}.part{k}-of-{num_workers}{output.suffix}")


def _worker(cfg: Config, jobs: list[Job], output: str, store_dir: Optional[str], k: int, threads: int) -> dict:
    """One Ray task: load the target, regenerate its rows into its own part file and store."""
    torch.set_num_threads(threads)  # Ray sets OMP_NUM_THREADS=1 in workers
    s = run_shard(cfg, jobs, Path(output), Path(store_dir) if store_dir else None, desc=f"worker {k}")
    return asdict(s)


def _check_parts(output: Path, W: int) -> None:
    """An output's num_workers is fixed: parts of another W (or a plain W=1 output) would mix."""
    others = [p for p in output.parent.glob(f"{output.stem}.part*-of-*{output.suffix}")
              if not p.name.endswith(f"-of-{W}{output.suffix}")]
    plain = W > 1 and output.is_file() and output.stat().st_size > 0 and not part_path(output, 0, W).exists()
    if others or plain:
        raise ValueError(f"regenerate.output {output} was written with another regenerate.num_workers "
                         f"({', '.join(p.name for p in others) or output.name}); use the same value or another output")


def merge_parts(output: Path, W: int) -> int:
    """Rewrite ``output`` as the rows of all part files in source order (atomic); returns rows."""
    rows = []
    for k in range(W):
        rows += read_output(part_path(output, k, W))[0]
    rows.sort(key=lambda r: r["source_row"])
    tmp = output.with_name(output.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, output)
    return len(rows)


def run_ray(cfg: Config, jobs: list[Job], output: Path, store_dir: Optional[Path]) -> Summary:
    """``num_workers`` Ray tasks, worker k taking rows k, k+W, ... (stable across reruns)."""
    import ray  # lazy: heavy (ray)

    W = cfg.regenerate.num_workers
    if local := before_local_ray(cfg):  # before Ray prestarts a process per CPU it is given
        check_workers("regenerate.num_workers", W, *local, gpus=cfg.model.num_gpus)
    started = start_ray(cfg, W, on_head_lost=exit_on_head_lost(
        lambda: "the rows finished so far are kept: rerun the same command to go on from them"))
    try:
        use_gpu = device.wants_gpu(cfg.model.device, ray.cluster_resources().get("GPU", 0))
        check_workers("regenerate.num_workers", W, use_gpu, *ray_resources(cfg, started), gpus=cfg.model.num_gpus)
        threads = cfg.train.num_threads or max(1, (os.cpu_count() or 1) // W)
        env = {"runtime_env": {"env_vars": switches}} if (switches := not_inherited(device.worker_env())) else {}
        task = ray.remote(_worker).options(num_cpus=1, num_gpus=cfg.model.num_gpus if use_gpu else 0, max_retries=0,
                                           **env)
        refs = [task.remote(cfg, jobs[k::W], str(part_path(output, k, W)),
                            str(store_dir / f"worker-{k}-of-{W}") if store_dir else None, k, threads) for k in range(W)]
        summary = Summary(output=str(output), features=str(store_dir) if store_dir else None)
        for s in _wait_all(refs):
            part = Summary(**s)
            summary.merge(part)
            summary.seconds = max(summary.seconds, part.seconds)
    finally:
        if started:
            shutdown_ray()
    merge_parts(output, W)
    return summary


def _wait_all(refs: list) -> list:
    """Results of every task; a failed worker raises at once, its ValueError kept a ValueError.

    No overall deadline (a long dataset takes hours); a dead worker fails its ref right away."""
    import ray  # lazy: heavy (ray)

    results, pending = {}, list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=30.0)  # wakes up for Ctrl-C
        for ref in ready:
            k = refs.index(ref)
            try:
                results[k] = ray.get(ref, timeout=60.0)
            except ray.exceptions.RayTaskError as err:
                if isinstance(err.cause, ValueError):
                    raise ValueError(f"regenerate worker {k}: {err.cause}") from err
                raise
    return [results[i] for i in range(len(refs))]


# ---------------------------------------------------------------- entry


def validate(cfg: Config) -> None:
    r = cfg.regenerate
    checks = [
        (r.backend != "openai" or bool(r.endpoint), "regenerate.endpoint",
         "is required with regenerate.backend=openai"),
        (r.concurrency >= 1, "regenerate.concurrency", "must be >= 1"),
        (r.timeout_s > 0, "regenerate.timeout_s", "must be > 0"),
        (r.retries >= 0, "regenerate.retries", "must be >= 0"),
        (r.max_new_tokens >= 1, "regenerate.max_new_tokens", "must be >= 1"),
        (r.temperature >= 0, "regenerate.temperature", "must be >= 0 (0 = greedy)"),
        (0 < r.top_p <= 1, "regenerate.top_p", "must be in (0, 1]"),
        (r.batch_size >= 1, "regenerate.batch_size", "must be >= 1"),
        (r.num_workers >= 1, "regenerate.num_workers", "must be >= 1"),
        (r.backend == "local" or r.num_workers == 1, "regenerate.num_workers",
         f"({r.num_workers}) applies only to regenerate.backend=local (Ray generation workers); with the openai "
         "backend the server is the worker: set regenerate.concurrency for requests in flight"),
        (r.max_samples is None or r.max_samples >= 1, "regenerate.max_samples", "must be >= 1 or null"),
        (r.max_turns is None or r.max_turns >= 1, "regenerate.max_turns", "must be >= 1 or null"),
    ]
    for ok, key, msg in checks:
        if not ok:
            raise ValueError(f"config key {key!r} {msg}")


def output_path(cfg: Config) -> Path:
    return Path(cfg.regenerate.output or Path(cfg.train.output_dir) / "regenerated.jsonl").expanduser()


def regenerate(cfg: Config, target=None) -> Summary:
    """Regenerate the configured dataset; ``target`` = an already loaded TargetModel (local backend)."""
    validate(cfg)
    r = cfg.regenerate
    if target is not None:
        tokenizer = target.tokenizer
    else:
        tokenizer = load_tokenizer(cfg.model)
    template = resolve_chat_template(tokenizer, cfg.model.chat_template)
    skipped: dict[str, int] = {}
    jobs = select_jobs(cfg, tokenizer, template, skipped)
    if not jobs:
        raise ValueError(f"data.path {cfg.data.path!r}: no conversation left to regenerate ({skipped or 'no rows'})")
    output = output_path(cfg)
    store_dir = store_root(cfg) if r.backend == "local" and r.capture_features else None
    # what it writes, before the target, its engine or a worker starts
    check_writable("regenerate.output" if r.output else "train.output_dir (its regenerated.jsonl)", output.parent)
    if store_dir is not None:
        check_writable("store.dir", store_dir)
    if r.backend == "local":
        check_storage(cfg)
    ray_mode = r.backend == "local" and r.num_workers > 1
    _check_parts(output, r.num_workers if ray_mode else 1)
    if ray_mode:
        summary = run_ray(cfg, jobs, output, store_dir)
    else:
        set_threads(cfg.train.num_threads)  # as the Ray workers and the trainer do
        summary = run_shard(cfg, jobs, output, store_dir, target=target, tokenizer=tokenizer)
    for reason, n in skipped.items():
        summary.skip(reason, n)
    return summary


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specforge.regenerate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, help="run config YAML (sections data, model, regenerate, store)")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. regenerate.max_samples=32")
    args = ap.parse_args(argv)
    try:
        summary = regenerate(load_config(args.config, args.overrides))
    except ValueError as err:
        print("error: " + " ".join(str(err).split()), file=sys.stderr)  # one line (HTTP bodies carry newlines)
        return 1
    except KeyboardInterrupt:
        print("interrupted: finished rows are kept; rerun the same command to resume", file=sys.stderr)
        return 130
    print(summary.line())
    return 0


if __name__ == "__main__":
    from specforge.cli import run_cli

    sys.exit(run_cli(main))  # main reports ValueErrors itself; this catches the rest (files)
