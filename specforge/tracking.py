"""Metrics out: a JSONL log (always readable), wandb (offline unless a key is configured), tensorboard.

wandb: every row goes under ``train/<key>`` or ``eval/<key>`` (held-out, the periodic eval), and
after each held-out row one chart per shared metric (``loss``, ``loss_i``, ``acc_i``, ``tau``) under
``train_vs_heldout/<key>`` draws both series together, so overfitting shows in one picture. At
the end the run summary holds the last held-out and training acc_0 / tau (``final/...``).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any, Callable, Optional

from specforge.config import TrackingConfig
from specforge.plot import read_rows

# Held-out acc_0 this far below training acc_0 means the draft memorizes its samples. Why 0.10: the
# periodic eval reads 8 held-out samples and the train side is the mean of the last
# ``RECENT_STEPS`` steps (40 samples on the default), so each side carries ~0.02-0.04 of sampling
# noise; 0.10 is beyond that noise and well below the gap data starvation gives (0.6 vs 0.31 on
# the embedded default after its first epoch).
PARTED_ACC0 = 0.10
RECENT_STEPS = 10  # training steps averaged for the end-of-training line (one step is one noisy batch)

OVERLAID = re.compile(r"loss|tau|(loss|acc)_\d+")  # metrics both a train and a held-out row carry
MAX_CHART_POINTS = 1000  # train points per overlay chart: a long run's charts stay small tables


def wandb_mode(cfg: TrackingConfig) -> str:
    """``auto`` = online only when an API key is configured; offline works with no network."""
    if cfg.wandb_mode != "auto":
        return cfg.wandb_mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def end_summary(recent_train: list[dict], heldout: Optional[dict]) -> str:
    """The one console line at the end of training: the last held-out acc_0 and tau beside the
    training ones (mean of ``recent_train`` steps), and what helps when they have parted by more
    than ``PARTED_ACC0``."""
    train = {k: sum(vs) / len(vs) for k in ("acc_0", "tau") if (vs := [r[k] for r in recent_train if k in r])}
    line = f"end of training: acc_0 {train.get('acc_0', math.nan):.2f} train (last {len(recent_train)} steps)"
    if not heldout or "acc_0" not in heldout:
        return f"{line}, tau {train.get('tau', math.nan):.2f} (no held-out rows: train.eval_every=0)"
    at = f" at step {heldout['step']}" if "step" in heldout else ""
    line += (f" / {heldout['acc_0']:.2f} held-out{at}, tau {train.get('tau', math.nan):.2f} / "
             f"{heldout.get('tau', math.nan):.2f}")
    gap = train.get("acc_0", math.nan) - heldout["acc_0"]
    if gap > PARTED_ACC0:
        return (f"{line}: parted by {gap:.2f} (> {PARTED_ACC0}), the draft is memorizing its samples; more epochs will "
                "not help, more distinct data will (capture or regenerate more rows: python -m specforge.capture "
                "data.max_samples=..., or python -m specforge.regenerate regenerate.max_samples=...)")
    return f"{line}: within {PARTED_ACC0} of each other, no sign of overfitting (more steps may still help)"


class MetricsLogger:
    def __init__(self, cfg: TrackingConfig, out_dir: str | Path, run_config: Optional[dict] = None):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = None
        if cfg.jsonl:
            drop_torn_tail(self.out_dir / "metrics.jsonl")
            self._jsonl = open(self.out_dir / "metrics.jsonl", "a")
        self._wandb = None
        self._tb = None
        self._t0 = time.time()
        self.history: dict[str, list[dict]] = {"train": [], "eval": []}  # the overlay charts redraw from it
        if cfg.wandb and wandb_mode(cfg) != "disabled":
            import wandb  # lazy: optional (wandb)

            self._wandb = wandb.init(
                project=cfg.project,
                name=cfg.run_name,
                mode=wandb_mode(cfg),
                dir=str(self.out_dir),
                config=run_config or {},
                reinit="finish_previous",
            )
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # lazy: keeps specforge.tracking torch-free

            self._tb = SummaryWriter(str(self.out_dir / "tb"))

    def log(self, step: int, metrics: dict[str, Any], kind: str = "train") -> None:
        clean = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        kept = {k: v for k, v in clean.items() if OVERLAID.fullmatch(k)}  # only what the charts and summary read
        self.history.setdefault(kind, []).append({"step": step, **kept})
        if self._jsonl:
            rec = {"kind": kind, "step": step, "time_s": round(time.time() - self._t0, 3), **clean}
            self._jsonl.write(json.dumps(rec) + "\n")
            self._jsonl.flush()
        if self._wandb is not None:
            self._wandb.log({f"{kind}/{k}": v for k, v in clean.items()}, step=step)
            if kind == "eval":  # a new held-out point: redraw the train-vs-held-out charts
                self._wandb.log(overlay_charts(self.history), step=step)
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(f"{kind}/{k}", v, step)

    def restore(self, recorded: list[dict], start_step: int, owed: Callable[[str, int], bool]) -> list[tuple[str, int]]:
        """On resuming at ``start_step``: log each row a checkpoint ``recorded`` that this run owes
        (``owed(kind, step)``, steps up to ``start_step``) but its metrics.jsonl lacks, because the
        driver died between the workers' save and its own log line. The rows carry ``restored: 1``
        (the workers' metrics; no driver timings). Returns the ``(kind, step)`` restored."""
        path = self.out_dir / "metrics.jsonl"
        have = {(r.get("kind", "train"), r.get("step")) for r in read_rows(path)} if path.is_file() else set()
        done = []
        for row in sorted(recorded, key=lambda r: (r["step"], r["kind"] != "train")):
            key = (row["kind"], row["step"])
            if row["step"] <= start_step and key not in have and owed(*key):
                self.log(row["step"], {**{k: v for k, v in row.items() if k not in ("kind", "step")}, "restored": 1},
                         kind=row["kind"])
                have.add(key)
                done.append(key)
        return done

    def final_summary(self) -> dict[str, float]:
        """The last held-out and training acc_0 / tau. The held-out tau is the periodic eval's
        simulated acceptance length; the measured one comes from ``python -m specforge.eval``."""
        out = {}
        for kind, name in (("eval", "heldout"), ("train", "train")):
            last = self.history.get(kind) or [{}]
            out.update({f"final/{name}_{k}": last[-1][k] for k in ("acc_0", "tau", "step") if k in last[-1]})
        return out

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
            self._jsonl = None
        if self._wandb is not None:
            self._wandb.summary.update(self.final_summary())
            self._wandb.finish()
            self._wandb = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def drop_torn_tail(path: Path) -> None:
    """A process killed while writing a row leaves half a line: cut it (and say so) before rows are
    appended after it, which would otherwise run into it. The step it belonged to is either in the
    checkpoint (``MetricsLogger.restore``) or trained again by the resumed run."""
    if not path.is_file() or not path.stat().st_size:
        return
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return
    keep = data.rfind(b"\n") + 1
    with open(path, "r+b") as f:
        f.truncate(keep)
    print(f"{path}: cut a half-written last line ({len(data) - keep} bytes) left by a killed run")


def overlay_charts(history: dict[str, list[dict]]) -> dict[str, Any]:
    """One wandb line chart per metric that both train and held-out rows carry, both series in it."""
    import wandb  # lazy: optional (wandb)

    train, heldout = history.get("train", []), history.get("eval", [])
    keys = sorted({k for r in heldout for k in r if OVERLAID.fullmatch(k)} & {k for r in train for k in r})
    charts = {}
    stride = max(1, len(train) // MAX_CHART_POINTS)
    for key in keys:
        series = [[(r["step"], r[key]) for r in rows if key in r] for rows in (train[::stride], heldout)]
        charts[f"train_vs_heldout/{key}"] = wandb.plot.line_series(
            xs=[[s for s, _ in pts] for pts in series], ys=[[v for _, v in pts] for pts in series],
            keys=["train", "held-out"], title=f"{key}: train vs held-out", xname="step")
    return charts
