"""How fast this machine is right now: a yardstick to read the suite's and the main command's times by.

    python benchmarks/machine_speed.py            # ~20 s; prints one markdown row

The same 2-core VM gave the same tree 14.1 min of pytest one day and 21 min the next (the main command's
capture: 2,437 then 1,169 tokens/s): a suite time means little without the machine's speed beside it.
Four figures, each the best of a few repeats (the machine's speed, not its worst moment):

* ``matmul 1t``: fp32 GFLOPS of one thread on 512x512 matrices (the vector units), and bf16 on 1024x1024
  (AMX or AVX-512 bf16 where the CPU has them: the default recipe's target runs in bf16);
* ``copy``: GB/s of one thread copying 64 MiB (memory bandwidth: decoding a 135M fp32 model reads
  its weights every token);
* ``python``: seconds for 3M iterations of a Python loop (interpreter-bound work: imports, Ray, pytest);
* ``SmolLM2 fwd``: tokens/s of the embedded target's decoder in fp32 on 256 tokens, two threads (what
  the suite's capture and eval do most).

``benchmarks/suite_durations.py --yardstick`` records them with the suite's durations.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import machine_info, markdown_table  # noqa: E402


def _best(fn, repeats: int, seconds: float) -> float:
    """The highest rate (work a second) over ``repeats`` windows of ``seconds``; each call of ``fn`` does its
    work and returns how much it did."""
    best = 0.0
    for _ in range(repeats):
        work, t0 = 0.0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            work += fn()
        best = max(best, work / (time.perf_counter() - t0))
    return best


def measure() -> dict[str, float]:
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        gflops = _best(lambda: (a @ b, 2 * 512**3 / 1e9)[1], 3, 1.0)
        c, d = torch.randn(1024, 1024, dtype=torch.bfloat16), torch.randn(1024, 1024, dtype=torch.bfloat16)
        bf16 = _best(lambda: (c @ d, 2 * 1024**3 / 1e9)[1], 3, 1.0)
        x = torch.empty(16 * 2**20)
        y = torch.empty_like(x)
        gbs = _best(lambda: (y.copy_(x), 2 * x.numel() * 4 / 1e9)[1], 3, 1.0)
        loop = []
        for _ in range(3):
            t0, s = time.perf_counter(), 0
            for i in range(3_000_000):
                s += i * i
            loop.append(time.perf_counter() - t0)
        torch.set_num_threads(2)
        tok_s = _smollm2_tokens_per_s()
    finally:
        torch.set_num_threads(before)
    return {"matmul_1t_gflops": round(gflops, 1), "matmul_bf16_1t_gflops": round(bf16, 1),
            "copy_gb_s": round(gbs, 1), "python_loop_s": round(min(loop), 2),
            "smollm2_fwd_tok_s": round(tok_s)}


def _smollm2_tokens_per_s() -> float:
    import torch
    from transformers import AutoModelForCausalLM

    from specforge.config import ModelConfig
    from specforge.models.target import resolve_target_path

    model = AutoModelForCausalLM.from_pretrained(resolve_target_path(ModelConfig()), dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 256), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model.model(input_ids=ids)  # warm-up
        return _best(lambda: (model.model(input_ids=ids), ids.numel())[1], 3, 2.0)


def main() -> None:
    m, info = measure(), machine_info()
    print(markdown_table(["date", "commit", "matmul 1t GFLOPS fp32 / bf16", "copy GB/s", "python loop s",
                          "SmolLM2 fwd tok/s"],
                         [[info["date"], info["commit"][:7], f'{m["matmul_1t_gflops"]} / {m["matmul_bf16_1t_gflops"]}',
                           m["copy_gb_s"], m["python_loop_s"], m["smollm2_fwd_tok_s"]]]))


if __name__ == "__main__":
    main()
