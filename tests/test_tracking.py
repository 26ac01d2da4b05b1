"""What a run tells its user about held-out vs training: the wandb overlay charts and summary,
and the end-of-training console line."""

import json

import pytest

from specforge.config import TrackingConfig
from specforge.tracking import PARTED_ACC0, MetricsLogger, end_summary, overlay_charts


def _history():
    train = [{"step": s, "loss": 3.0 / s, "acc_0": 0.05 * s, "acc_1": 0.02 * s, "tau": 1 + 0.05 * s}
             for s in range(1, 13)]
    heldout = [{"step": s, "loss": 2.5, "acc_0": 0.31, "acc_1": 0.1, "tau": 1.33} for s in (4, 8, 12)]
    return {"train": train, "eval": heldout}


def test_overlay_charts_hold_both_series_of_each_shared_metric():
    charts = overlay_charts(_history())
    assert set(charts) == {f"train_vs_heldout/{k}" for k in ("loss", "acc_0", "acc_1", "tau")}
    rows = charts["train_vs_heldout/acc_0"].table.data  # [step, series, value]
    assert [(s, v) for s, k, v in rows if k == "held-out"] == [(4, 0.31), (8, 0.31), (12, 0.31)]
    assert [s for s, k, _ in rows if k == "train"] == list(range(1, 13))


def test_logger_keeps_jsonl_and_gives_the_final_heldout_summary(tmp_path):
    log = MetricsLogger(TrackingConfig(wandb=False), tmp_path)
    for kind, rows in _history().items():
        for r in rows:
            log.log(r["step"], {k: v for k, v in r.items() if k != "step"} | {"lr": 1e-3}, kind=kind)
    summary = log.final_summary()
    log.close()
    assert summary == pytest.approx({"final/heldout_acc_0": 0.31, "final/heldout_tau": 1.33, "final/heldout_step": 12,
                                     "final/train_acc_0": 0.6, "final/train_tau": 1.6, "final/train_step": 12})
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kinds.count("eval") == 3 and kinds.count("train") == 12


def test_offline_wandb_run_gets_the_charts_and_summary(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = MetricsLogger(TrackingConfig(wandb=True, wandb_mode="offline", project="t"), tmp_path)
    run = log._wandb
    rows = sorted(((r["step"], kind == "eval", kind, r) for kind, rs in _history().items() for r in rs))
    for step, _, kind, r in rows:  # in step order, held-out after the train row of its step (as the loop logs)
        log.log(step, {k: v for k, v in r.items() if k != "step"}, kind=kind)
    finish = run.finish
    monkeypatch.setattr(run, "finish", lambda *a, **k: None)  # read the summary close() wrote while the run is open
    log.close()
    assert run.summary["final/heldout_tau"] == 1.33 and run.summary["final/heldout_acc_0"] == 0.31
    assert run.summary["final/train_acc_0"] == pytest.approx(0.6)
    finish()
    tables = {p.name.split("_table_")[0] for p in tmp_path.rglob("train_vs_heldout/*.table.json")}
    assert tables == {"loss", "acc_0", "acc_1", "tau"}


def test_end_summary_says_what_helps_when_train_and_heldout_part():
    recent = [{"acc_0": 0.58, "tau": 1.9}, {"acc_0": 0.62, "tau": 2.0}]
    parted = end_summary(recent, {"acc_0": 0.31, "tau": 1.33, "step": 300})
    assert "0.60 train" in parted and "0.31 held-out at step 300" in parted and "tau 1.95 / 1.33" in parted
    assert "more epochs will not help" in parted and "capture" in parted and "regenerate" in parted
    close = end_summary(recent, {"acc_0": 0.60 - PARTED_ACC0 + 0.01, "tau": 1.9})
    assert "no sign of overfitting" in close and "capture" not in close
    assert "train.eval_every=0" in end_summary(recent, None)
    assert "\n" not in parted
