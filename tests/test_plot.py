import json

from specforge.plot import load_records, main, plot_run


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
