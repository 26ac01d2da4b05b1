import json

import pytest

from specforge.plot import load_records, main, plot_run


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    import matplotlib.pyplot as plt

    plt.close("all")  # run_figures leaves its figures open for the tests to read


def _write(path, n=6):
    lines = []
    for s in range(1, n + 1):
        rec = {"kind": "train", "step": s, "time_s": s * 0.5, "loss": 5.0 / s, "tau": 1 + 0.1 * s, "lr": 1e-3,
               "grad_norm": 0.4, "tokens_per_s": 900.0 + s, "rollout_forward_ms": 40.0, "transfer_ms": 3.0,
               "train_ms": 80.0, "train_wait_ms": 2.0, "inflight_bytes": 1e6, "transfer_bytes": 5e5}
        rec.update({f"loss_{i}": 2.0 / (s + i) for i in range(3)})
        rec.update({f"acc_{i}": 0.1 * s / (i + 1) for i in range(3)})
        lines.append(json.dumps(rec))
    lines.append(json.dumps({"kind": "eval", "step": n, "loss": 1.0}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_plot_writes_pngs(tmp_path):
    jsonl = _write(tmp_path / "metrics.jsonl")
    assert len(load_records(jsonl)) == 6
    files = plot_run(tmp_path, tmp_path / "png")
    assert {f.name for f in files} == {"loss.png", "accuracy.png", "time.png", "throughput.png"}
    for f in files:
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f.stat().st_size > 5000


def test_plot_cli_and_single_process_jsonl(tmp_path, capsys):
    # a single-process run has no transfer columns: the time plot still shows what exists
    recs = [{"kind": "train", "step": s, "loss": 1.0, "loss_0": 1.0, "acc_0": 0.5, "tau": 1.5, "train_ms": 10.0}
            for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    assert main([str(tmp_path / "metrics.jsonl")]) == 0
    assert "loss.png" in capsys.readouterr().out and (tmp_path / "time.png").is_file()
    assert main([str(tmp_path / "nope")]) == 1


# ---------------------------------------------------------------- held-out beside training


def _run_rows(steps=12, eval_every=4, per_epoch=5, warmup=0):
    """A run's rows: training acc_0 climbing, held-out acc_0 flat (a data-starved draft); the TTT
    steps past 0 are written as zeros during ``warmup`` (files written before they were left out)."""
    rows = []
    for s in range(1, steps + 1):
        rec = {"kind": "train", "step": s, "loss": 3.0 / s, "tau": 1.2 + 0.05 * s, "epoch": s / per_epoch,
               "train_ms": 10.0}
        for i in range(3):
            trained = i == 0 or s > warmup
            rec.update({f"loss_{i}": 2.0 / (s + i) if trained else 0.0,
                        f"acc_{i}": 0.05 * s / (i + 1) if trained else 0.0,
                        f"accept_rate_{i}": 0.3 if trained else 0.0})
        rows.append(rec)
        if s % eval_every == 0:
            rows.append({"kind": "eval", "step": s, "loss": 2.5 + 0.1 * s, "loss_0": 1.5, "loss_1": 1.8, "loss_2": 2.0,
                         "acc_0": 0.31, "acc_1": 0.2, "acc_2": 0.1, "tau": 1.33})
    return rows


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _line(fig, panel_ylabel, label):
    """(xs, ys) of the line labelled ``label`` in the panel with that y label; None if absent."""
    ax = next(a for a in fig.axes if a.get_ylabel() == panel_ylabel)
    lines = [ln for ln in ax.get_lines() if ln.get_label() == label]
    return (list(lines[0].get_xdata()), list(lines[0].get_ydata())) if lines else None


def _epoch_lines(fig, panel_ylabel):
    ax = next(a for a in fig.axes if a.get_ylabel() == panel_ylabel)
    return sorted(ln.get_xdata()[0] for ln in ax.get_lines() if ln.get_linestyle() == ":")


def test_heldout_series_drawn_over_training_with_epoch_boundaries(tmp_path):
    from specforge.plot import run_figures

    figs = run_figures(_jsonl(tmp_path / "metrics.jsonl", _run_rows()))
    acc, loss = figs["accuracy.png"], figs["loss.png"]
    assert _line(acc, "accuracy per TTT position", "acc_0 held-out") == ([4, 8, 12], [0.31, 0.31, 0.31])
    assert _line(acc, "accuracy per TTT position", "acc_0")[1][-1] == pytest.approx(0.6)  # training beside it
    assert _line(acc, "tau (simulated acceptance length)", "tau held-out") == ([4, 8, 12], [1.33] * 3)
    assert _line(loss, "loss", "loss (decayed TTT sum) held-out")[0] == [4, 8, 12]
    assert _line(loss, "loss per TTT position", "loss_2 held-out") == ([4, 8, 12], [2.0] * 3)
    # 5 steps per epoch, 12 steps: epochs end after steps 5 and 10, marked in every panel
    assert _epoch_lines(acc, "accuracy per TTT position") == pytest.approx([5.0, 10.0])
    assert _epoch_lines(loss, "loss") == pytest.approx([5.0, 10.0])
    # held-out rows mean nothing for the time and throughput pictures
    assert not any("held-out" in ln.get_label() for a in figs["time.png"].axes for ln in a.get_lines())


def test_run_without_eval_rows_draws_training_alone(tmp_path):
    from specforge.plot import run_figures

    rows = [r for r in _run_rows() if r["kind"] == "train"]
    acc = run_figures(_jsonl(tmp_path / "metrics.jsonl", rows))["accuracy.png"]
    assert _line(acc, "accuracy per TTT position", "acc_0") is not None
    assert _line(acc, "accuracy per TTT position", "acc_0 held-out") is None


def test_warmup_zeros_of_an_old_file_are_not_drawn(tmp_path):
    from specforge.plot import run_figures

    figs = run_figures(_jsonl(tmp_path / "metrics.jsonl", _run_rows(warmup=6)))
    xs, ys = _line(figs["loss.png"], "loss per TTT position", "loss_1")
    assert xs == list(range(7, 13)) and 0.0 not in ys
    xs, ys = _line(figs["accuracy.png"], "accuracy per TTT position", "acc_2")
    assert xs == list(range(7, 13)) and 0.0 not in ys
    assert _line(figs["loss.png"], "loss per TTT position", "loss_0")[0] == list(range(1, 13))


def test_a_rerun_appended_to_the_file_is_plotted_alone(tmp_path):
    """A fresh start appends to metrics.jsonl; a resume redoes the steps after its checkpoint."""
    rows = _run_rows(steps=8)
    resumed = [dict(r, loss=9.0) for r in _run_rows(steps=8)[6:]]  # steps >= 6 again, from a checkpoint
    _jsonl(tmp_path / "metrics.jsonl", _run_rows(steps=3) + rows + resumed)
    train = load_records(tmp_path)
    assert [r["step"] for r in train] == list(range(1, 9))
    assert [r["loss"] for r in train][5:] == [9.0, 9.0, 9.0] and train[0]["loss"] == 3.0


def test_a_warmup_run_logs_and_draws_no_untrained_ttt_steps(assets, tmp_path, capsys):
    """End to end, single process: TTT steps 1-2 are not trained for the first 4 steps, so their
    rates are absent from those rows (not 0) and from the picture; held-out rows are drawn, the
    epoch ends where the data runs out, and the console's last line compares train and held-out."""
    from specforge.plot import run_figures
    from specforge.train import run
    from tests.helpers.ray_run import make_cfg

    out = tmp_path / "run"
    run(make_cfg(assets, out, "train.num_workers=1", "train.max_steps=14", "draft.ttt_warmup_steps=4",
                 "train.eval_every=5", "train.log_every=1"))
    train = load_records(out)
    assert [("loss_1" in r, "acc_2" in r) for r in train] == [(False, False)] * 4 + [(True, True)] * 10
    figs = run_figures(out)
    xs, ys = _line(figs["loss.png"], "loss per TTT position", "loss_1")
    assert xs == list(range(5, 15)) and min(ys) > 0
    assert _line(figs["accuracy.png"], "accuracy per TTT position", "acc_0 held-out")[0] == [5, 10]
    per_epoch = train[-1]["step"] / train[-1]["epoch"]  # = train samples / global batch of 1
    assert per_epoch == round(per_epoch) and _epoch_lines(figs["loss.png"], "loss") == pytest.approx([per_epoch])
    assert "end of training: acc_0" in capsys.readouterr().out


def test_warmup_span_is_shaded_where_ttt_step_1_was_not_trained(tmp_path):
    from specforge.plot import run_figures

    figs = run_figures(_jsonl(tmp_path / "metrics.jsonl", _run_rows(warmup=6)))
    ax = next(a for a in figs["loss.png"].axes if a.get_ylabel() == "loss")
    spans = [p for p in ax.patches if p.get_label().startswith("TTT step 0 only")]
    assert len(spans) == 1 and spans[0].get_x() + spans[0].get_width() == 6
    no_warmup = run_figures(_jsonl(tmp_path / "metrics.jsonl", _run_rows()))["loss.png"]
    assert not any(p.get_label().startswith("TTT") for a in no_warmup.axes for p in a.patches)
