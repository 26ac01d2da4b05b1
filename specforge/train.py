"""The single-process placement: ``python -m specforge.train --config cfg.yaml [dotted.overrides=...]``.

One in-process train worker under THE loop (``runtime/loop.py``) with the same global batch, data
order and loss as ``specforge.ray_train``: the reference the distributed placements are tested
against. It sits above ``runtime/`` and ``training/`` (the step it runs lives in ``training/trainer.py``,
the loop in ``runtime/``), so neither of those imports the other's entry point.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from specforge.cli import check_flags, run_cli, with_dry_run_flags
from specforge.config import Config, load_config
from specforge.tracking import MetricsLogger


def run(cfg: Config) -> Optional[Path]:
    """Train in this process; returns the newest checkpoint folder. The torch thread count and CUDA
    device the run sets (``train.num_threads``, ``model.device``) are the caller's again afterwards."""
    from specforge.device import kept_process_settings  # lazy: keeps specforge.train torch-free

    with kept_process_settings():
        return _run(cfg)


def _run(cfg: Config) -> Optional[Path]:
    from specforge.preflight import check_single_process  # lazy: keeps specforge.train torch-free
    from specforge.runtime.loop import (  # lazy: keeps specforge.train torch-free
        LocalCluster,
        not_applied,
        restore_rows,
        train_loop,
    )
    from specforge.runtime.plan import Planner, prepare  # lazy: keeps specforge.train torch-free
    from specforge.training.checkpoint import latest_checkpoint  # lazy: keeps specforge.train torch-free
    from specforge.training.trainer import (  # lazy: keeps specforge.train torch-free
        checkpoint_root,
        keep_old_checkpoints,
    )

    local, use_gpu = check_single_process(cfg)  # every check, before anything loads
    if skipped := not_applied(cfg, "single"):
        print(f"single process: not applying {', '.join(skipped)} "
              "(they distribute a run: python -m specforge.ray_train)")
    data = prepare(local, use_gpu=use_gpu)
    cluster = LocalCluster(local, data)
    plan = Planner(local, data, cluster.layout)
    keep_old_checkpoints(cfg)  # every check passed: only now may a fresh start move old checkpoints aside
    logger = MetricsLogger(cfg.tracking, cfg.train.output_dir, cfg.to_dict())
    try:
        restore_rows(local, cluster, plan, logger, latest_checkpoint(checkpoint_root(cfg)))
        train_loop(local, cluster, plan, logger)
    finally:
        cluster.save()
        logger.close()
    path = latest_checkpoint(checkpoint_root(cfg))
    print(f"saved {path}")
    return path


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specforge.train", description="Single-process draft training.")
    ap.add_argument("--config", default=None)
    ap.add_argument("overrides", nargs="*")
    with_dry_run_flags(ap)
    args = ap.parse_args(argv)
    check_flags(args)
    cfg = load_config(args.config, args.overrides)  # an unknown key: one line before torch is imported
    if args.dry_run:
        from specforge.dryrun import dry_run  # lazy: keeps specforge.train torch-free

        dry_run(cfg, args.target_config, single_process=True)
        return 0
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
