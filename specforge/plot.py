"""Dashboards without wandb: turn a run's metrics.jsonl into PNGs.

    python -m specforge.plot runs/smollm2-135m-cpu [--out dir]
    python -m specforge.plot runs/smollm2-135m-cpu/metrics.jsonl

Writes ``loss.png`` (total + per TTT position), ``accuracy.png`` (acc_i and tau),
``time.png`` (per-step time breakdown: rollout forward, transfer, train, train-wait) and
``throughput.png`` (tokens/s, in-flight bytes) next to the JSONL or into ``--out``.
Loss, accuracy and tau draw the held-out rows (the periodic eval, dashed with dots) over the
training ones (solid) in the same colour, with the epoch boundaries as grey dotted lines: where
the two part, more epochs stop helping and more distinct data would.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Optional

PNGS = {  # file -> what it shows (the CLI prints it beside each path)
    "loss.png": "loss, total and per TTT position: train vs held-out, epochs marked",
    "accuracy.png": "acc_i per TTT position and simulated tau: train vs held-out, epochs marked",
    "time.png": "time per step: rollout forward, transfer, train, train wait",
    "throughput.png": "tokens/s, bytes in flight, lr and grad norm",
}


def read_rows(path: str | Path) -> list[dict]:
    """Every row of the run's newest training (a fresh start appends to the same file)."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{str(path)!r} is not a metrics.jsonl (or a run folder holding one)")
    rows: list[dict] = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from e
        if rec.get("kind", "train") == "train" and rec.get("step") == 1:
            rows = []  # step 1 is logged by every run that starts from scratch: older rows are another run
        rows.append(rec)
    return rows


def load_records(path: str | Path, kind: str = "train") -> list[dict]:
    """Rows of one kind ("train", or "eval" = held-out), one per step (a resumed run redoes the
    steps after its checkpoint: the later row wins), sorted by step."""
    by_step = {r["step"]: r for r in read_rows(path) if r.get("kind", "train") == kind}
    recs = [by_step[s] for s in sorted(by_step)]
    return [drop_untrained(r) for r in recs] if kind == "train" else recs


def drop_untrained(rec: dict) -> dict:
    """Files written before untrained TTT steps were left out of the rows (``ttt_warmup_steps``)
    hold them as exact zeros; a trained step's soft cross-entropy is never exactly 0."""
    untrained = {m.group(1) for k, v in rec.items() if (m := re.fullmatch(r"loss_(\d+)", k)) and v == 0.0}
    return {k: v for k, v in rec.items() if not (re.fullmatch(r"(loss|acc|accept_rate)_\d+", k)
                                                  and k.rsplit("_", 1)[1] in untrained)}


def epoch_boundaries(train: list[dict]) -> list[float]:
    """Steps at which an epoch ends, from the ``epoch`` field of train rows (passes over the
    data after that step: linear in the step); none for files without it."""
    last = next((r for r in reversed(train) if r.get("epoch")), None)
    if last is None:
        return []
    steps_per_epoch = last["step"] / last["epoch"]
    return [k * steps_per_epoch for k in range(1, int(last["epoch"] + 1e-9) + 1)]


def warmup_end(train: list[dict]) -> Optional[int]:
    """The last logged step that did not train TTT step 1 (``train.ttt_warmup_steps``) before
    one that did: until there the total loss and tau cover step 0 alone, hence their jump."""
    first = next((i for i, r in enumerate(train) if "loss_1" in r), None)
    return train[first - 1]["step"] if first else None


def _series(recs: list[dict], key: str) -> tuple[list, list]:
    pts = [(r["step"], r[key]) for r in recs if key in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def _positions(recs: list[dict], prefix: str) -> list[str]:
    keys = {k for r in recs for k in r if re.fullmatch(rf"{prefix}_\d+", k)}
    return sorted(keys, key=lambda k: int(k.rsplit("_", 1)[1]))


def _draw(ax, key: str, label: str, color: str, train: list[dict], heldout: list[dict]) -> None:
    """The training series solid, the held-out one (sparse: every eval_every steps) dashed with dots."""
    xs, ys = _series(train, key)
    if xs:
        ax.plot(xs, ys, color=color, marker="." if len(xs) < 50 else None, label=label)
    xs, ys = _series(heldout, key)
    if xs:
        ax.plot(xs, ys, color=color, ls="--", marker="o", ms=3, label=f"{label} held-out")


def _figure(title: str, panels: list[tuple[str, list[tuple[str, str]]]], train: list[dict], heldout: list[dict],
            epochs: list[float], warmup: Optional[int] = None, log_y: tuple[str, ...] = ()):
    """One figure with one panel per (ylabel, [(key, label)]); None if no key has data."""
    import matplotlib  # lazy: optional (matplotlib)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: optional (matplotlib)

    panels = [(y, [(k, lb) for k, lb in lines if _series(train, k)[0] or _series(heldout, k)[0]])
              for y, lines in panels]
    panels = [p for p in panels if p[1]]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (ylabel, lines) in zip(axes[0], panels):
        for n, (key, label) in enumerate(lines):
            _draw(ax, key, label, f"C{n % 10}", train, heldout)
        if warmup:
            ax.axvspan(0, warmup, color="gray", alpha=0.1, lw=0, label="TTT step 0 only (warm-up)")
        for k, x in enumerate(epochs):
            ax.axvline(x, color="gray", ls=":", lw=0.8, label="epoch boundary" if k == 0 else None)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        if ylabel in log_y:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def run_figures(path: str | Path) -> dict:
    """The figures of one run, by PNG name (not saved; ``plot_run`` saves them)."""
    train, heldout = load_records(path), load_records(path, "eval")
    if not train:
        raise ValueError(f"{path}: no train records")
    epochs = epoch_boundaries(train)
    both = train + heldout
    loss_pos = [(k, k) for k in _positions(both, "loss")]
    acc_pos = [(k, k) for k in _positions(both, "acc")]
    vs = " (solid: train, dashed: held-out)" if heldout else ""
    specs = {
        "loss.png": ("loss" + vs, [("loss", [("loss", "loss (decayed TTT sum)")]),
                                   ("loss per TTT position", loss_pos)]),
        "accuracy.png": ("accuracy" + vs, [("accuracy per TTT position", acc_pos),
                                           ("tau (simulated acceptance length)", [("tau", "tau")])]),
        "time.png": ("time per step", [("ms", [("rollout_forward_ms", "rollout forward"),
                                               ("transfer_ms", "transfer (send)"), ("train_ms", "train"),
                                               ("train_wait_ms", "train wait (idle for features)")])]),
        "throughput.png": ("throughput", [("tokens/s", [("tokens_per_s", "tokens/s")]),
                                          ("bytes", [("inflight_bytes", "in flight"),
                                                     ("transfer_bytes", "sent this step")]),
                                          ("optimizer", [("lr", "lr"), ("grad_norm", "grad norm")])]),
    }
    # held-out rows (and the warm-up span) only where they mean something: not time or bytes
    quality = ("loss.png", "accuracy.png")
    figs = {name: _figure(title, panels, train, heldout if name in quality else [], epochs,
                          warmup_end(train) if name in quality else None)
            for name, (title, panels) in specs.items()}
    return {name: fig for name, fig in figs.items() if fig is not None}


def plot_run(path: str | Path, out_dir: Optional[str | Path] = None) -> list[Path]:
    """All PNGs for one run; returns the files written."""
    import matplotlib.pyplot as plt  # lazy: optional (matplotlib)

    figs = run_figures(path)
    src = Path(path)
    out = Path(out_dir) if out_dir else (src if src.is_dir() else src.parent)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fig in figs.items():
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        written.append(out / name)
    return written


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specforge.plot", description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="run folder or metrics.jsonl")
    ap.add_argument("--out", default=None, help="where to write the PNGs (default: next to the JSONL)")
    args = ap.parse_args(argv)
    try:
        files = plot_run(args.path, args.out)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for f in files:
        print(f"{f}  {PNGS[f.name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
