"""Dashboards without wandb: turn a run's metrics.jsonl into PNGs.

    python -m specforge.plot runs/smollm2-135m-cpu [--out dir]
    python -m specforge.plot runs/smollm2-135m-cpu/metrics.jsonl

Writes ``loss.png`` (total + per TTT position), ``accuracy.png`` (acc_i and tau),
``time.png`` (per-step time breakdown: rollout forward, transfer, train, train-wait) and
``throughput.png`` (tokens/s, in-flight bytes) next to the JSONL or into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Optional


def load_records(path: str | Path, kind: str = "train") -> list[dict]:
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{str(path)!r} is not a metrics.jsonl (or a run folder holding one)")
    recs = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from e
        if rec.get("kind", "train") == kind:
            recs.append(rec)
    return recs


def _series(recs: list[dict], key: str) -> tuple[list, list]:
    pts = [(r["step"], r[key]) for r in recs if key in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def _positions(recs: list[dict], prefix: str) -> list[str]:
    keys = {k for r in recs for k in r if re.fullmatch(rf"{prefix}_\d+", k)}
    return sorted(keys, key=lambda k: int(k.rsplit("_", 1)[1]))


def _figure(title: str, panels: list[tuple[str, list[tuple[str, str]]]], recs: list[dict], out: Path,
            log_y: tuple[str, ...] = ()) -> Optional[Path]:
    """One PNG with one panel per (ylabel, [(key, label)]); skipped if no key has data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(y, [(k, lb) for k, lb in lines if _series(recs, k)[0]]) for y, lines in panels]
    panels = [p for p in panels if p[1]]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (ylabel, lines) in zip(axes[0], panels):
        for key, label in lines:
            xs, ys = _series(recs, key)
            ax.plot(xs, ys, marker="." if len(xs) < 50 else None, label=label)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        if ylabel in log_y:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_run(path: str | Path, out_dir: Optional[str | Path] = None) -> list[Path]:
    """All PNGs for one run; returns the files written."""
    recs = load_records(path)
    if not recs:
        raise ValueError(f"{path}: no train records")
    src = Path(path)
    out = Path(out_dir) if out_dir else (src if src.is_dir() else src.parent)
    out.mkdir(parents=True, exist_ok=True)
    loss_pos = [(k, k) for k in _positions(recs, "loss")]
    acc_pos = [(k, k) for k in _positions(recs, "acc")]
    written = [
        _figure("loss", [("loss", [("loss", "loss (decayed TTT sum)")]), ("loss per TTT position", loss_pos)],
                recs, out / "loss.png"),
        _figure("accuracy", [("accuracy per TTT position", acc_pos), ("tau (simulated acceptance length)", [("tau", "tau")])],
                recs, out / "accuracy.png"),
        _figure("time per step", [("ms", [("rollout_forward_ms", "rollout forward"), ("transfer_ms", "transfer (send)"),
                                          ("train_ms", "train"), ("train_wait_ms", "train wait (idle for features)")])],
                recs, out / "time.png"),
        _figure("throughput", [("tokens/s", [("tokens_per_s", "tokens/s")]),
                               ("bytes", [("inflight_bytes", "in flight"), ("transfer_bytes", "sent this step")]),
                               ("optimizer", [("lr", "lr"), ("grad_norm", "grad norm")])],
                recs, out / "throughput.png"),
    ]
    return [w for w in written if w is not None]


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
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
