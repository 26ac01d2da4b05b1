"""What each training lever buys per minute: held-out simulated acceptance after M minutes of
training on ONE feature store, lever by lever (one process, one job at a time).

    python benchmarks/bench_levers.py --store runs/bench-recipes/self-distilled/features \
        [--minutes 5] [--levers base,ttt2,ttt1,init-ttt2,init-warmup150-ttt7]
    python benchmarks/bench_levers.py --store ... --levers init-ttt1 --fractions 0.25,0.5,1 --epochs 3

The last 16 samples of the store are held out; every lever trains the same draft shape from the
same seed on the rest, batch 4 rows, the default config otherwise, and is measured after equal
*training* seconds (the data and model loading are excluded) by the TTT metrics of the held-out
rows at 7 steps: ``acc_i`` (draft argmax == target argmax at step i, teacher-forced chain) and
``tau`` = 1 + sum_k prod_{i<=k} acc_i, the simulated chain-7 acceptance length. ``tau`` tracks
real speculative decoding (benchmarks/README.md): a quick way to rank levers before running the
eval. With ``--fractions``/``--epochs``: the same lever on growing shares of the data, each for
the same number of epochs (how acceptance scales with distinct samples; the points go to
benchmarks/bench_data_scaling.json and .png). Writes a section of benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_section, header_markdown, markdown_table  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "smollm2-135m-cpu.yaml"
_PLAIN = ["draft.init_midlayer_from_target=false", "draft.ttt_warmup_steps=0"]
LEVERS = {  # name -> (config overrides, loss on every token instead of the answer tokens only)
    "base": (_PLAIN + ["draft.ttt_length=7"], False),
    "init": (["draft.ttt_warmup_steps=0", "draft.init_midlayer_from_target=true", "draft.ttt_length=7"], False),
    "ttt2": (_PLAIN + ["draft.ttt_length=2"], False),
    "ttt1": (_PLAIN + ["draft.ttt_length=1"], False),
    "lr3e-3": (_PLAIN + ["draft.ttt_length=7", "train.lr=3e-3"], False),
    "all-tokens": (_PLAIN + ["draft.ttt_length=7"], True),
    "ttt2-all-tokens": (_PLAIN + ["draft.ttt_length=2"], True),
    "init-ttt1": (["draft.ttt_warmup_steps=0", "draft.init_midlayer_from_target=true", "draft.ttt_length=1"], False),
    "init-ttt2": (["draft.ttt_warmup_steps=0", "draft.init_midlayer_from_target=true", "draft.ttt_length=2"], False),
    "init-warmup150-ttt7": (["draft.init_midlayer_from_target=true", "draft.ttt_warmup_steps=150",
                             "draft.ttt_length=7"], False),
    "init-warmup150-ttt3": (["draft.init_midlayer_from_target=true", "draft.ttt_warmup_steps=150",
                             "draft.ttt_length=3"], False),
}
# the default recipe (init-warmup150-ttt3) with each train.loss and with Muon (issue 58's losses and optimizer)
RECIPE = LEVERS["init-warmup150-ttt3"][0]
LEVERS |= {f"recipe-{k}": (RECIPE + [f"train.loss={k}"], False) for k in ("kl_div", "tv", "nla", "lk_hybrid", "rkl",
                                                                            "jsd", "opd")}
LEVERS["recipe-muon"] = (RECIPE + ["train.optimizer=muon"], False)
LEVERS["recipe-muon-lk_hybrid"] = (RECIPE + ["train.optimizer=muon", "train.loss=lk_hybrid"], False)
# Draft-OPD as the paper runs it, after supervised training: the lever's recipe for the first share of the
# minutes, then a fresh trainer (a new optimizer and schedule, as a run with draft.init_from has) on the same
# draft with these overrides for the rest. "-then-kl_div" is its control: the same restart, the loss unchanged.
SWITCH = {"recipe-then-opd": (0.5, ["train.loss=opd", "draft.ttt_warmup_steps=0"]),
          "recipe-then-kl_div": (0.5, ["draft.ttt_warmup_steps=0"])}
LEVERS |= {name: LEVERS["recipe-kl_div"] for name in SWITCH}


def run_lever(name: str, store, target, minutes: float, evals: int, batch_size: int,
              fraction: float = 1.0, epochs: float = 0.0, seed: int = 0, save: Path | None = None) -> list[dict]:
    """Train lever ``name`` on the first ``fraction`` of the train samples; measure the held-out
    rows ``evals`` times over ``minutes`` of training, or once after ``epochs`` passes if given.
    ``save``: the trained draft is saved there as a checkpoint (``<save>/step-N``) for ``specforge.eval``."""
    from specforge.algorithms.eagle3 import ALGORITHM as EAGLE3
    from specforge.config import load_config
    from specforge.data.vocab import build_draft_vocab
    from specforge.registry import bound_algorithm
    from specforge.training.trainer import DraftTrainer

    overrides, all_tokens = LEVERS[name]
    base = ["train.precision=fp32", f"train.batch_size={batch_size}", f"train.seed={seed}"]
    cfg = load_config(CONFIG, base + overrides)
    cfg7 = load_config(CONFIG, base + overrides + ["draft.ttt_length=7", "draft.ttt_warmup_steps=0"])
    ids = list(store.ids)
    hold, train = ids[-16:], ids[:-16]
    train = train[: max(batch_size, round(len(train) * fraction))]
    rows = [store.read(i) for i in train]
    vocab = build_draft_vocab([{"input_ids": r["input_ids"].tolist(), "loss_mask": r["loss_mask"].tolist()}
                               for r in rows], target.config.vocab_size, cfg.draft.vocab_size)
    draft = EAGLE3.bind(cfg).build_draft(target, vocab)
    teacher = EAGLE3.bind(cfg).train_state(target, vocab)
    trainer = DraftTrainer(bound_algorithm(cfg), draft, teacher, cfg, torch.device("cpu"), total_steps=2000)
    judge = DraftTrainer(bound_algorithm(cfg7), draft, teacher, cfg7, torch.device("cpu"), total_steps=2000)
    held = [store.batch(hold[i : i + 4], 0) for i in range(0, len(hold), 4)]
    marks = [minutes * 60 * (k + 1) / evals for k in range(evals)]
    switch_s, then = SWITCH.get(name, (None, []))
    switch_s = None if switch_s is None else switch_s * minutes * 60
    stop_step = round(epochs * len(train) / batch_size) if epochs else None
    out, step, epoch, train_s = [], 0, 0, 0.0
    while marks:
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(epoch + 1000 * seed)).tolist()
        epoch += 1
        for s in range(len(train) // batch_size):
            b = store.batch([train[i] for i in order[s * batch_size : (s + 1) * batch_size]], 0)
            if all_tokens:
                b.loss_mask_BT = (b.aux_hidden_BTKH.abs().sum(-1) > 0).long()  # every real (unpadded) token
            if switch_s is not None and train_s >= switch_s:  # the second phase: a fresh trainer, same draft
                cfg2 = load_config(CONFIG, base + overrides + then)
                trainer = DraftTrainer(bound_algorithm(cfg2), draft, teacher, cfg2, torch.device("cpu"),
                                       total_steps=2000)
                switch_s = None
            t0 = time.perf_counter()
            trainer.step([b])
            train_s += time.perf_counter() - t0
            step += 1
            if (stop_step is None and train_s >= marks[0]) or step == stop_step:
                marks = marks[1:] if stop_step is None else []
                ev = judge.evaluate(held)
                out.append({"lever": name, "seed": seed, "samples": len(train), "train_min": round(train_s / 60, 2),
                            "steps": step,
                            "epochs": round(step * batch_size / len(train), 2),
                            **{k: round(ev[k], 3) for k in ("acc_0", "acc_1", "acc_2", "tau")}})
                print(json.dumps(out[-1]), flush=True)
                if not marks:
                    break
    if save is not None:
        from specforge.training.checkpoint import save_checkpoint

        out[-1]["checkpoint"] = str(save_checkpoint(save, step, EAGLE3.bind(cfg).hf_config(draft),
                                                    draft.export_state_dict(), train_state={"step": step}))
    return out


def eval_drafts(cfg, target, checkpoints: dict[str, str], prompts: int, max_new: int) -> dict[str, float]:
    """``specforge.eval``'s chain-7 acceptance length of each draft on ``prompts`` held-out prompts of the
    default config (rows no store sample shares: ``data.heldout``; first turns of at most 384 tokens), all
    drafts against ONE greedy reference per prompt (``evaluate_settings``: each output is checked against it
    token for token), the fixed chain only (the CLI adds dynamic drafting), the draft in fp32 as trained."""
    from specforge.data import heldout
    from specforge.eval import Setting, evaluate_settings
    from specforge.registry import algorithm_of, load_draft, read_draft_config

    rows = heldout.eval_prompts(heldout.heldout_rows(cfg, target.tokenizer), prompts, 384, 2)
    settings = []
    for name, ckpt in checkpoints.items():
        algo = algorithm_of(read_draft_config(ckpt), repr(ckpt))
        settings.append(Setting(name, algo.proposer(load_draft(ckpt, target).to(target.device), torch.float32, False)))
    reports = evaluate_settings(target, settings, rows, max_new, 7)
    print(f"eval: {len(rows)} held-out prompts x {max_new} new tokens, {len(settings)} drafts", flush=True)
    return {s.draft: r.acceptance_length for s, r in zip(settings, reports)} | {"prompts": len(rows)}


SCALING = Path(__file__).resolve().parent / "bench_data_scaling.json"


def plot_scaling(points: list[dict], path: Path) -> None:
    """acc_0 and simulated tau vs distinct train samples (log scale), one line per lever."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for lever in dict.fromkeys(p["lever"] for p in points):
        ps = sorted((p for p in points if p["lever"] == lever), key=lambda p: p["samples"])
        for ax, key in zip(axes, ("acc_0", "tau")):
            ax.plot([p["samples"] for p in ps], [p[key] for p in ps], "o-",
                    label=f"{lever}, {ps[0]['epochs']:g} epochs")
    for ax, key, goal in zip(axes, ("acc_0", "tau"), (0.6, 2.5)):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("distinct train samples (conversations)")
        ax.set_ylabel(f"held-out {key}" + (" (simulated chain 7)" if key == "tau" else ""))
        ax.axhline(goal, color="gray", ls="--", lw=0.8,
                   label=f"needed for acceptance 2.5: ~{goal}" if key == "acc_0" else "target 2.5")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    from specforge.config import load_config
    from specforge.data.store import FeatureStore
    from specforge.models.target import load_target

    ap = argparse.ArgumentParser()
    ap.add_argument("--store", default=None, help="a feature store (python -m specforge.regenerate / capture)")
    ap.add_argument("--minutes", type=float, default=5.0, help="training seconds per lever, excluding loading")
    ap.add_argument("--evals", type=int, default=2, help="held-out measurements per lever (evenly spaced)")
    ap.add_argument("--levers", default="base,ttt2,ttt1,init-ttt2,init-warmup150-ttt7")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--fractions", default="1", help="data scaling: train on these fractions of the samples")
    ap.add_argument("--epochs", type=float, default=0.0, help="with --fractions: stop after this many epochs")
    ap.add_argument("--seed", type=int, default=0, help="train.seed (the draft's init) and the data order's")
    ap.add_argument("--section", default=None, help="the benchmarks/README.md section to write (default: the "
                    "levers' or the data-scaling one)")
    ap.add_argument("--eval-prompts", type=int, default=0,
                    help="also run specforge.eval (chain 7) on this many held-out prompts with each lever's draft")
    ap.add_argument("--eval-new-tokens", type=int, default=64)
    ap.add_argument("--out", default="runs/bench-levers", help="where --eval-prompts keeps the drafts")
    ap.add_argument("--plot-only", action="store_true",
                    help="redraw bench_data_scaling.png from bench_data_scaling.json")
    args = ap.parse_args()
    png = SCALING.with_suffix(".png")
    if args.plot_only:
        plot_scaling(json.loads(SCALING.read_text()), png)
        return 0
    if not args.store:
        ap.error("--store is required (a feature store: python -m specforge.capture / regenerate)")
    torch.set_num_threads(2)
    cfg = load_config(CONFIG)
    target = load_target(cfg.model)
    store = FeatureStore(args.store)
    out = REPO / args.out
    points = []
    for name in args.levers.split(","):
        for f in args.fractions.split(","):
            save = out / f"{name}-seed{args.seed}" if args.eval_prompts else None
            points += run_lever(name, store, target, args.minutes, args.evals, args.batch_size, float(f), args.epochs,
                                args.seed, save)
    if args.eval_prompts:  # each lever's last point: its trained draft through the eval, all in one pass
        last = {p["lever"]: p for p in points if "checkpoint" in p}
        got = eval_drafts(cfg, target, {k: p["checkpoint"] for k, p in last.items()}, args.eval_prompts,
                          args.eval_new_tokens)
        args.eval_prompts = got["prompts"]  # what the held-out rows gave (at most the asked count)
        for k, p in last.items():
            p["eval"] = round(got[k], 3)
            print(json.dumps(p), flush=True)
    if args.epochs:  # the data-scaling points, kept and plotted
        SCALING.write_text(json.dumps(points, indent=1) + "\n")
        plot_scaling(points, png)
    rows = [[p["lever"], p["samples"],
             " ".join(LEVERS[p["lever"]][0]) + (" + loss on all tokens" if LEVERS[p["lever"]][1] else "")
             + (f"; after {SWITCH[p['lever']][0]:.0%} of the minutes: " + " ".join(SWITCH[p["lever"]][1])
                if p["lever"] in SWITCH else ""),
             p["train_min"], p["steps"], p["epochs"], p["acc_0"], p["acc_1"], p["acc_2"], p["tau"]]
            + ([p.get("eval", "-")] if args.eval_prompts else []) for p in points]
    table = markdown_table(["lever", "train samples", "overrides", "train min", "steps", "epochs", "acc_0", "acc_1",
                            "acc_2", "tau (sim., chain 7)"]
                           + ([f"eval acceptance ({args.eval_prompts} held-out prompts, chain 7)"]
                              if args.eval_prompts else []), rows)
    n = len(store.ids)
    how = f"--epochs {args.epochs:g} --fractions {args.fractions}" if args.epochs else f"--minutes {args.minutes:g}"
    how += f" --seed {args.seed}" if args.seed else ""
    how += f" --eval-prompts {args.eval_prompts} --eval-new-tokens {args.eval_new_tokens}" if args.eval_prompts else ""
    body = (f"`python benchmarks/bench_levers.py --store {args.store} --levers {args.levers} {how}` -- "
            f"{header_markdown()}\n\n{n - 16} stored samples train, 16 held out; batch {args.batch_size} rows, "
            "fp32.\n\n"
            + table)
    print(body)
    title = args.section or ("Data scaling: held-out acceptance vs distinct samples" if args.epochs else
                             "Training levers: held-out acceptance per training minute")
    append_section(title, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
