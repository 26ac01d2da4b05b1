"""Packed target forward (``rollout.pack_tokens``) vs the right-padded one.

    python benchmarks/bench_pack_capture.py [--reps 3] [--threads 2] [--no-readme]

What a rollout worker, the single process and ``python -m specforge.capture`` run per batch:
``capture`` (aux layers + last hidden + chunked argmax) over right-padded rows, or with
``pack_tokens`` the same samples end to end in rows of at most that many tokens (position ids
restart at 0; transformers' SDPA path builds a block-diagonal mask from them; "flex" runs the packed
rows with ``attn_implementation="flex_attention"``, whose block mask skips the cross-sample blocks,
compiled by inductor once per process: the warm-up rep absorbs it). Target: SmolLM2-135M
(the embedded default, configs/smollm2-135m-cpu.yaml), batches of the default's train split: a
rollout batch (``train.batch_size`` samples drawn by the training sampler, any lengths) and a
store-capture batch (``plan_batches``: longest first, little padding). Methods alternate rep by
rep (the machine is shared); medians reported. tokens/s counts real tokens (padding excluded).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    append_section,
    default_cpu_run,
    header_markdown,
    machine_info,
    markdown_table,
)
from specforge.capture import CAPTURE_TOKENS, plan_batches  # noqa: E402
from specforge.data.packing import target_packs  # noqa: E402
from specforge.models.target import capture  # noqa: E402
from specforge.training.batch import collate, global_batch_ids  # noqa: E402


def rollout_batches(rows, batch_size: int, reps: int) -> list[list[dict]]:
    return [[rows[i] for i in global_batch_ids(len(rows), batch_size, seed=0, step=s)] for s in range(reps + 1)]


def store_batches(rows, batch_size: int, reps: int) -> list[list[dict]]:
    """plan_batches of the split (longest first), every k-th batch: long and short ones alike."""
    lengths = [len(r["input_ids"]) for r in rows]
    plan = plan_batches(lengths, batch_size, CAPTURE_TOKENS)
    step = max(1, len(plan) // (reps + 1))
    return [[rows[i] for i in plan[k * step]] for k in range(reps + 1)]


def run_case(target, batches: list[list[dict]], pack_tokens: int, pad: int) -> dict:
    padded_s, packed_s, flex_s, tokens, padded_tokens = [], [], [], 0, 0
    sdpa = target.model.config._attn_implementation
    for rep, rows in enumerate(batches):  # rep 0 warms up
        ids, _, attn = collate(rows, pad)
        order = [(padded_s, None, sdpa), (packed_s, pack_tokens, sdpa), (flex_s, pack_tokens, "flex_attention")]
        for out, pack, impl in order if rep % 2 == 0 else order[::-1]:
            target.model.set_attn_implementation(impl)
            t0 = time.perf_counter()
            capture(target, ids, attn, packs=target_packs(attn, pack))
            if rep:
                out.append(time.perf_counter() - t0)
        target.model.set_attn_implementation(sdpa)
        if rep:
            tokens += int(attn.sum())
            padded_tokens += attn.numel()
    reps = len(batches) - 1
    a, b, c = statistics.median(padded_s), statistics.median(packed_s), statistics.median(flex_s)
    tok = tokens / reps
    return {"tokens": tok, "pad_frac": 1 - tokens / padded_tokens, "padded_s": a, "packed_s": b, "flex_s": c,
            "padded_tps": tok / a, "packed_tps": tok / b, "flex_tps": tok / c}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-readme", action="store_true")
    args = ap.parse_args()
    cfg, target, data = default_cpu_run(args.threads)
    rows = [{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]} for r in data.train]
    pad = target.tokenizer.pad_token_id or 0
    L, B = cfg.data.max_length, cfg.train.batch_size
    cases = [("rollout batch", rollout_batches(rows, B, args.reps), L),
             ("rollout batch", rollout_batches(rows, B, args.reps), B * L),
             ("store capture batch", store_batches(rows, B, args.reps), CAPTURE_TOKENS)]
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    results = [(name, pack, run_case(target, batches, pack, pad)) for name, batches, pack in cases]
    load_after = Path("/proc/loadavg").read_text().split()[:3]
    table = markdown_table(
        ["batch", "rollout.pack_tokens", "real tokens/batch", "padding (padded)", "padded fwd s", "padded tokens/s",
         "packed sdpa s", "packed sdpa tokens/s", "packed flex s", "packed flex tokens/s"],
        [[name, pack, f"{r['tokens']:.0f}", f"{100 * r['pad_frac']:.0f}%", f"{r['padded_s']:.2f}",
          f"{r['padded_tps']:.0f}", f"{r['packed_s']:.2f} ({r['padded_s'] / r['packed_s']:.2f}x)",
          f"{r['packed_tps']:.0f}", f"{r['flex_s']:.2f} ({r['padded_s'] / r['flex_s']:.2f}x)", f"{r['flex_tps']:.0f}"]
         for name, pack, r in results])
    info = machine_info()
    info["dtype"] = str(target.model.dtype).removeprefix("torch.")
    info["attention"] = target.model.config._attn_implementation
    info["load"] = f"{' '.join(load_before)} before, {' '.join(load_after)} after"
    body = (f"`python benchmarks/bench_pack_capture.py --reps {args.reps}` -- {header_markdown(info)}\n\n"
            f"{__doc__.split(chr(10) + chr(10), 2)[2].strip()}\n\n{table}\n")
    print(body)
    if not args.no_readme:
        append_section("Packing: the target forward", body)


if __name__ == "__main__":
    main()
