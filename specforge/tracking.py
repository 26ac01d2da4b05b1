"""Metrics out: a JSONL log (always readable), wandb (offline unless a key is configured), tensorboard."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Optional

from specforge.config import TrackingConfig


def wandb_mode(cfg: TrackingConfig) -> str:
    """``auto`` = online only when an API key is configured; offline works with no network."""
    if cfg.wandb_mode != "auto":
        return cfg.wandb_mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


class MetricsLogger:
    def __init__(self, cfg: TrackingConfig, out_dir: str | Path, run_config: Optional[dict] = None):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.out_dir / "metrics.jsonl", "a") if cfg.jsonl else None
        self._wandb = None
        self._tb = None
        self._t0 = time.time()
        if cfg.wandb and wandb_mode(cfg) != "disabled":
            import wandb

            self._wandb = wandb.init(
                project=cfg.project,
                name=cfg.run_name,
                mode=wandb_mode(cfg),
                dir=str(self.out_dir),
                config=run_config or {},
                reinit="finish_previous",
            )
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.out_dir / "tb"))

    def log(self, step: int, metrics: dict[str, Any], kind: str = "train") -> None:
        clean = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if self._jsonl:
            rec = {"kind": kind, "step": step, "time_s": round(time.time() - self._t0, 3), **clean}
            self._jsonl.write(json.dumps(rec) + "\n")
            self._jsonl.flush()
        if self._wandb is not None:
            self._wandb.log({f"{kind}/{k}": v for k, v in clean.items()}, step=step)
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(f"{kind}/{k}", v, step)

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
            self._jsonl = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
