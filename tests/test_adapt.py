"""``specforge.adapt``: the traffic ledger, the logging proxy's swap under load, and rounds on a tiny
target (capture, fine-tune, gate, swap; a failed gate, a dying server, a killed process)."""

import json
import threading
import time

import pytest

from specforge.adapt.proxy import TrafficProxy
from specforge.adapt.traffic import Ledger, held_out, row_key
from tests.helpers.upstream import FakeServer, chat


def _until(done, timeout_s=30.0):
    """Wait for ``done()``: a poll with a deadline instead of a sleep that a loaded machine can outrun."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.01)


def _chat_row(q, a):
    return {"messages": [{"role": "user", "content": q}], "completion": a}


# ---------------------------------------------------------------- the ledger


def test_ledger_skips_malformed_counts_duplicates_and_splits(tmp_path):
    traffic = tmp_path / "traffic.jsonl"
    good = [_chat_row(f"question {i}", f"answer {i}") for i in range(40)]
    lines = [json.dumps(r) for r in good]
    lines += ["{not json", json.dumps([1, 2]), json.dumps({"messages": [{"role": "user", "content": "q"}]}),
              json.dumps(_chat_row("q", "  ")), json.dumps({"unparsed": True}), json.dumps(good[3])]
    traffic.write_text("\n".join(lines) + "\n" + json.dumps(good[0])[:10])  # a torn last line, not read yet
    ledger = Ledger(tmp_path, holdout_share=0.25)
    got = ledger.ingest(traffic, 0)
    assert got.train + got.gate == 40 and got.duplicates == 1
    assert sum(got.skipped.values()) == 5 and got.skipped["bad json"] == 1, got.skipped
    assert got.offset == len("\n".join(lines)) + 1  # the unfinished line waits for its end
    assert 4 <= got.gate <= 16  # ~a quarter, by hash
    gate_keys = {row_key(m) for m in ledger.gate_rows()}
    assert all(held_out(k, 0.25) for k in gate_keys) and len(gate_keys) == got.gate
    # a restart reads the same files: nothing is added twice, and the split never moves
    again = Ledger(tmp_path, holdout_share=0.25).ingest(traffic, 0)
    assert again.train == again.gate == 0 and again.duplicates == 41
    # the negative control: another share puts other rows in the held-out slice
    assert {k for k in gate_keys if held_out(k, 0.5)} != set() and any(not held_out(k, 0.1) for k in gate_keys)


# ---------------------------------------------------------------- the proxy


def test_proxy_records_and_swaps_under_load_without_an_error(tmp_path):
    a, b = FakeServer("a", delay_s=0.05), FakeServer("b", delay_s=0.05)
    results, stop = [], threading.Event()

    def client(k):
        i = 0
        while not stop.is_set() and i < 200:  # bounded
            results.append(chat(proxy.url, f"client {k} request {i}"))
            i += 1

    with TrafficProxy(a.url, tmp_path / "traffic.jsonl") as proxy:
        threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        old = proxy.switch(b.url)
        assert old == a.url
        waited = proxy.drain(old, timeout_s=10)
        answered_a = a.answered
        a.stop()  # the old server goes once drained: no request may still need it
        time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(timeout=30)
        assert proxy.errors == 0 and proxy.in_flight(b.url) == 0
    assert waited < 10 and answered_a > 0 and b.answered > 0
    assert all(code == 200 for code, _ in results) and len(results) == answered_a + b.answered
    rows = [json.loads(line) for line in (tmp_path / "traffic.jsonl").read_text().splitlines()]
    assert len(rows) == len(results)
    assert {r["completion"].split(":")[0] for r in rows} == {"a", "b"}
    assert all(r["completion"].endswith(r["messages"][-1]["content"]) for r in rows)
    b.stop()


def test_proxy_without_drain_drops_requests(tmp_path):
    """The negative control: stopping the old server at the switch, without draining, fails the
    requests still on it, which the swap test above would catch."""
    a, b = FakeServer("a", delay_s=2.0), FakeServer("b")
    with TrafficProxy(a.url, tmp_path / "traffic.jsonl") as proxy:
        results = []
        threads = [threading.Thread(target=lambda: results.append(chat(proxy.url, "q"))) for _ in range(3)]
        for t in threads:
            t.start()
        _until(lambda: proxy.in_flight(a.url) == 3)  # all three on the old server, however slowly they started
        proxy.switch(b.url)
        a.die()
        for t in threads:
            t.join(timeout=30)
        assert any(code != 200 for code, _ in results) and proxy.errors > 0
    b.stop()


def test_proxy_records_an_answer_it_cannot_read_as_malformed(tmp_path):
    up = FakeServer("garbled")
    with TrafficProxy(up.url, tmp_path / "traffic.jsonl") as proxy:
        assert chat(proxy.url, "q")[0] == 200
    got = Ledger(tmp_path, 0.2).ingest(tmp_path / "traffic.jsonl", 0)
    assert got.train == got.gate == 0 and sum(got.skipped.values()) == 1
    up.stop()


def test_proxy_refuses_a_port_in_use(tmp_path):
    up = FakeServer("a")
    with TrafficProxy(up.url, tmp_path / "t.jsonl") as p:
        port = int(p.url.rsplit(":", 1)[1])
        with pytest.raises(ValueError, match="adapt.port"):
            TrafficProxy(up.url, tmp_path / "t.jsonl", port=port)
    up.stop()


# ---------------------------------------------------------------- rounds on a tiny target

WORDS = "hello world user assistant system question answer".split()


def _traffic_rows(start, n):
    """Served rows over the tiny tokenizer's words (``start`` makes them new)."""
    return [_chat_row(" ".join(WORDS[(i + j) % 7] for j in range(2 + i % 3)) + f" {i}",
                      " ".join(WORDS[(3 * i + j) % 7] for j in range(8))) for i in range(start, start + n)]


@pytest.fixture(scope="module")
def adapt_base(assets, tmp_path_factory):
    """A tiny run's store (the reference store) and its trained draft: (overrides, draft folder)."""
    from specforge.capture import capture_store
    from specforge.config import load_config
    from specforge.train import run
    from tests.helpers.ray_run import cfg_overrides

    out = tmp_path_factory.mktemp("adapt-base")
    over = cfg_overrides(assets, out, "train.num_workers=1", "placement.mode=offline", "checkpoint.every_steps=0")
    capture_store(load_config(None, over), progress=False)
    draft = run(load_config(None, over))
    return over, draft


def _adapt_cfg(base, root, *more):
    from specforge.config import load_config

    over, draft = base
    return load_config(None, [*over, f"adapt.dir={root}", f"adapt.draft={draft}", "adapt.steps=3", "adapt.min_rows=8",
                              "adapt.holdout_share=0.3", "adapt.gate_prompts=4", "adapt.general_prompts=2",
                              "adapt.max_new_tokens=8", "adapt.chain=3", "adapt.poll_s=0.2", *more])


def _rows(root):
    return [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]


def test_adapt_round_passes_then_fails_its_gate(adapt_base, tmp_path):
    from specforge.adapt.rounds import Adapter, State, check
    from specforge.data.store import FeatureStore

    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text("\n".join([json.dumps(r) for r in _traffic_rows(0, 20)] + ["{oops", "[]"]) + "\n")
    root = tmp_path / "adapt"
    # a gate that must pass: any change of domain acceptance, any fall of the general one
    cfg = _adapt_cfg(adapt_base, root, "adapt.serve=false", f"adapt.traffic={traffic}", "adapt.min_gain=-100",
                     "adapt.gate_margin=100")
    check(cfg)
    with Adapter(cfg) as ad:
        assert ad.run() == 1  # 20 rows -> one round of >= 8 training rows; then too few new rows
    (row,) = _rows(root)
    assert row["status"] == "swapped" and row["steps"] == 3 and row["skipped_rows"] == 2
    state = State.load(root)
    assert state.live == str(root / "drafts" / "round-0001") == row["live"] and state.phase == "idle"
    assert len(FeatureStore(root / "store")) == row["train_rows"] == state.trained_rows
    first_weights = (root / "drafts" / "round-0001" / "model.safetensors").read_bytes()
    assert first_weights != (root / "drafts" / "start" / "model.safetensors").read_bytes()

    # more traffic and a gate that cannot pass: nothing changes but the candidate kept aside
    with open(traffic, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in _traffic_rows(100, 20)))
    cfg = _adapt_cfg(adapt_base, root, "adapt.serve=false", f"adapt.traffic={traffic}", "adapt.min_gain=100")
    with Adapter(cfg) as ad:
        assert ad.run() == 1
    row = _rows(root)[-1]
    assert row["status"] == "rejected" and "adapt.min_gain" in row["why"]
    assert State.load(root).live == str(root / "drafts" / "round-0001")
    assert (root / "rejected" / "round-0002" / "model.safetensors").is_file()
    assert not (root / "drafts" / "round-0002").exists()
    assert (root / "drafts" / "round-0001" / "model.safetensors").read_bytes() == first_weights
    assert len(FeatureStore(root / "store")) == row["train_rows"] > len(FeatureStore(root / "store")) - 20


def test_adapt_swaps_the_served_draft_under_load(adapt_base, tmp_path):
    from specforge.adapt.rounds import Adapter, State
    from tests.helpers.upstream import FakeServers

    root = tmp_path / "adapt"
    servers = FakeServers(delay_s=0.02)
    cfg = _adapt_cfg(adapt_base, root, "adapt.port=0", "adapt.rounds=1", "adapt.min_gain=-100", "adapt.gate_margin=100")
    results, stop = [], threading.Event()
    with Adapter(cfg, servers=servers, log=lambda s: None) as ad:
        rows = _traffic_rows(0, 24)

        def client():
            i = 0
            while not stop.is_set() and i < 2000:  # bounded; repeats are duplicates
                r = rows[i % len(rows)]
                results.append(chat(ad.proxy.url, r["messages"][0]["content"]))
                i += 1

        threads = [threading.Thread(target=client) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            assert ad.run() == 1
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
        assert ad.proxy.upstream == servers.started[1].url
    (row,) = _rows(root)
    assert row["status"] == "swapped" and row["drain_s"] < cfg.adapt.drain_timeout_s
    assert [s.tag for s in servers.started] == ["start", "round-0001"]
    assert servers.started[0].proc.poll() is not None  # the old server was stopped once drained
    assert results and all(code == 200 for code, _ in results), [c for c, _ in results if c != 200]
    assert any(body["choices"][0]["message"]["content"].startswith("round-0001") for _, body in results)
    assert State.load(root).live == str(root / "drafts" / "round-0001")


def test_adapt_round_ends_when_the_server_dies(adapt_base, tmp_path):
    from specforge.adapt.rounds import Adapter, State
    from tests.helpers.upstream import FakeServers

    root = tmp_path / "adapt"
    servers = FakeServers()
    traffic = root / "traffic.jsonl"
    root.mkdir()
    traffic.write_text("".join(json.dumps(r) + "\n" for r in _traffic_rows(0, 20)))
    cfg = _adapt_cfg(adapt_base, root, "adapt.port=0", "adapt.rounds=1", "adapt.min_gain=-100", "adapt.gate_margin=100")

    def kill_when_training():
        for _ in range(600):
            if (root / "rounds" / "round-0001" / "config.yaml").is_file():
                servers.started[0].die()
                return
            time.sleep(0.1)

    with Adapter(cfg, servers=servers, log=lambda s: None) as ad:
        killer = threading.Thread(target=kill_when_training)
        killer.start()
        assert ad.run() == 1
        killer.join()
        assert ad.proxy.upstream == servers.started[1].url and chat(ad.proxy.url, "q")[0] == 200
    (row,) = _rows(root)
    assert row["status"] == "server died" and "exited" in row["why"]
    state = State.load(root)
    assert state.live == str(root / "drafts" / "start") and state.restarts == 1 and state.phase == "idle"
    assert [s.tag for s in servers.started] == ["start", "start"]  # restarted with the live draft
    assert not (root / "drafts" / "round-0001").exists()


@pytest.mark.slow
def test_killed_adapt_resumes_its_round(adapt_base, tmp_path):
    """specforge.adapt SIGKILLed inside a round's fine-tune, then rerun: it resumes that round. Over 30 s:
    two adapt processes, each loading the target, capturing the traffic and fine-tuning (no server)."""
    import os
    import signal
    import subprocess
    import sys

    from specforge.adapt.rounds import State

    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text("".join(json.dumps(r) + "\n" for r in _traffic_rows(0, 20)))
    root = tmp_path / "adapt"
    over, draft = adapt_base
    args = [sys.executable, "-m", "specforge.adapt", *over, f"adapt.dir={root}", f"adapt.draft={draft}",
            "adapt.steps=8", "adapt.min_rows=8", "adapt.holdout_share=0.3", "adapt.gate_prompts=4",
            "adapt.general_prompts=2", "adapt.max_new_tokens=8", "adapt.chain=3", "adapt.serve=false",
            f"adapt.traffic={traffic}", "adapt.min_gain=-100", "adapt.gate_margin=100", "adapt.rounds=1"]
    ckpts = root / "rounds" / "round-0001" / "checkpoints"
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(1200):  # killed once the round's fine-tune has saved a step, before it ends
            if any(p.name.startswith("step-") for p in ckpts.glob("step-*")) or proc.poll() is not None:
                break
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert State.load(root).phase == "train", "the kill came too late to test a resume"
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = _rows(root)
    assert row["round"] == 1 and row["status"] == "swapped" and row["steps"] == 8
    assert "resum" in (root / "rounds" / "round-0001" / "train.log").read_text().lower()


def test_adapt_bad_input_is_one_line_before_anything_loads(adapt_base, tmp_path, monkeypatch, capsys):
    """Each case: one ``error:`` line naming the key, exit 1, and no Adapter made. The first case runs
    ``python -m specforge.adapt`` in its own process (the entry point's one line and exit code); the
    others call the same entry (run_cli over main) in this one, each subprocess being ~3.5 s of imports."""
    import subprocess
    import sys

    import specforge.adapt.__main__ as entry
    from specforge.cli import run_cli

    over, draft = adapt_base
    cases = [
        (["adapt.serve=false"], "adapt.traffic is not set"),
        (["adapt.serve=false", f"adapt.traffic={tmp_path / 'none.jsonl'}"], "no such file"),
        (["adapt.holdout_share=1.5"], "adapt.holdout_share=1.5"),
        ([f"adapt.draft={tmp_path}"], "adapt.draft: no draft checkpoint"),
        (["adapt.serve=false", f"adapt.traffic={draft / 'config.json'}", f"adapt.reference_store={tmp_path}"],
         "adapt.reference_store: no feature store"),
    ]
    def no_adapter(*args, **kwargs):
        raise AssertionError("an Adapter was made: the bad input was not refused first")

    monkeypatch.setattr(entry, "Adapter", no_adapter)
    for i, (extra, want) in enumerate(cases):
        argv = [*over, f"adapt.dir={tmp_path / 'a'}", f"adapt.draft={draft}", *extra]
        if i == 0:
            r = subprocess.run([sys.executable, "-m", "specforge.adapt", *argv], capture_output=True, text=True,
                               timeout=120)
            code, err = r.returncode, r.stderr
        else:
            code = run_cli(lambda: entry.main(argv), errors=(RuntimeError,))
            err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert code == 1 and len(lines) == 1 and lines[0].startswith("error:") and want in lines[0], err


def test_adapt_answers_the_requests_in_flight_when_it_stops(adapt_base, tmp_path):
    from specforge.adapt.rounds import Adapter
    from tests.helpers.upstream import FakeServers

    servers = FakeServers(delay_s=1.0)
    results = []
    ad = Adapter(_adapt_cfg(adapt_base, tmp_path / "adapt", "adapt.port=0"), servers=servers, log=lambda s: None)
    with ad:
        t = threading.Thread(target=lambda: results.append(chat(ad.proxy.url, "slow")))
        t.start()
        _until(lambda: ad.proxy.in_flight() == 1)  # the request is on the server when adapt stops
    t.join(timeout=30)
    assert results and results[0][0] == 200 and servers.started[0].proc.poll() is not None


# ---------------------------------------------------------------- checked first, never stuck


def _write(path, rows, lines=()):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(f"{line}\n" for line in lines))
    return path


def _main(args, capsys):
    """``python -m specforge.adapt`` in this process: (exit code, its error lines)."""
    from specforge.adapt.__main__ import main
    from specforge.cli import run_cli

    code = run_cli(lambda: main(args), errors=(RuntimeError,))
    return code, [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


def _no_holdout_share(rows):
    """A holdout share under which none of ``rows`` is held out (rows go by content hash)."""
    from specforge.adapt.traffic import row_messages

    keys = [row_key(row_messages(r)) for r in rows]
    return next(s for s in (0.01, 0.02, 0.03, 0.05) if not any(held_out(k, s) for k in keys))


def test_adapt_checks_draft_store_port_and_traffic_before_any_work(adapt_base, assets, tmp_path, capsys):
    """Each of these is one error line before any work, exit 1: not a failure after a copy, a capture
    or a conversion, nor an exit 0 having done nothing."""
    import shutil
    import socket

    over, draft = adapt_base
    rows = _traffic_rows(0, 20)
    traffic = _write(tmp_path / "traffic.jsonl", rows)
    junk = _write(tmp_path / "junk.jsonl", [{"prompt": f"q {i}", "answer": "a"} for i in range(41)])
    other = tmp_path / "other-store"  # the reference store of another target (its fingerprint differs)
    shutil.copytree(over_store(over), other)
    index = json.loads((other / "index.json").read_text())
    index["meta"]["target"] = "0" * 16
    (other / "index.json").write_text(json.dumps(index))
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    cases = [
        ([f"adapt.draft={assets / 'target'}"], ["adapt.draft=", "cannot start a round's fine-tune"]),
        ([f"adapt.traffic={junk}"], ["adapt.traffic=", "0 new usable training row(s)", "skipped 41 malformed",
                                     "no round can run"]),
        (["adapt.min_rows=50"], ["fewer than adapt.min_rows=50"]),
        ([f"adapt.holdout_share={_no_holdout_share(rows)}"], ["adapt.holdout_share=", "held-out slice"]),
        ([f"adapt.reference_store={other}"], ["adapt.reference_store=", "target (the store: '0000000000000000'"]),
        (["adapt.serve=true", f"adapt.port={port}"], [f"adapt.port={port}", "another process holds it"]),
    ]
    try:
        for extra, needles in cases:
            root = tmp_path / "a"
            code, errors = _main([*over, f"adapt.dir={root}", f"adapt.draft={draft}", "adapt.serve=false",
                                  f"adapt.traffic={traffic}", "adapt.min_rows=8", "adapt.holdout_share=0.3", *extra],
                                 capsys)
            assert code == 1 and len(errors) == 1, (extra, errors)
            assert all(n in errors[0] for n in needles), (extra, errors[0])
            assert not (root / "drafts").exists() and not (root / "store").exists(), extra  # nothing done
    finally:
        busy.close()


def over_store(over):
    return next(o.split("=", 1)[1] for o in over if o.startswith("train.output_dir=")) + "/features"


def test_a_rerun_with_a_corrected_draft_gets_past_a_start_copied_from_a_wrong_folder(adapt_base, assets, tmp_path,
                                                                                     capsys):
    """An adapt.dir whose drafts/start holds a non-draft (the target's folder), named in state.json:
    the command with a correct adapt.draft gets past it (the start copy follows adapt.draft until a
    round replaces it, and the round in progress starts again)."""
    import shutil

    from specforge.adapt.rounds import State

    over, draft = adapt_base
    root = tmp_path / "adapt"
    shutil.copytree(assets / "target", root / "drafts" / "start")
    State(round=1, phase="train", live=str(root / "drafts" / "start"), trained_rows=14).save(root)
    traffic = _write(tmp_path / "traffic.jsonl", _traffic_rows(0, 20))
    code, errors = _main([*over, f"adapt.dir={root}", f"adapt.draft={draft}", "adapt.steps=3", "adapt.min_rows=8",
                          "adapt.holdout_share=0.3", "adapt.gate_prompts=4", "adapt.general_prompts=2",
                          "adapt.max_new_tokens=8", "adapt.chain=3", "adapt.serve=false", f"adapt.traffic={traffic}",
                          "adapt.min_gain=-100", "adapt.gate_margin=100", "adapt.rounds=1"], capsys)
    assert code == 0, errors
    (row,) = _rows(root)
    assert row["status"] == "swapped" and row["round"] == 1
    assert (root / "drafts" / "start" / "model.safetensors").read_bytes() == (draft / "model.safetensors").read_bytes()


def test_a_failed_round_is_undone_and_the_same_command_gets_past_it(adapt_base, tmp_path, capsys, monkeypatch):
    """A round that fails its gate (too few held-out prompts) is undone (the live draft and the domain
    store as before it), not left in phase ``gate``: the same command after more traffic runs a new round."""
    from specforge.adapt.rounds import Adapter, State

    real_gate = Adapter.gate

    def gate(self, live, candidate):  # a gate that needs 10 held-out rows, as a long-prompt one would
        if len(self.ledger.gate_rows()) < 10:
            raise RuntimeError(f"adapt: no held-out traffic prompt to gate on ({len(self.ledger.gate_rows())} rows)")
        return real_gate(self, live, candidate)

    monkeypatch.setattr(Adapter, "gate", gate)
    over, draft = adapt_base
    root = tmp_path / "adapt"
    traffic = _write(tmp_path / "traffic.jsonl", _traffic_rows(0, 16))
    args = [*over, f"adapt.dir={root}", f"adapt.draft={draft}", "adapt.steps=3", "adapt.min_rows=8",
            "adapt.holdout_share=0.3", "adapt.gate_prompts=4", "adapt.general_prompts=2", "adapt.max_new_tokens=8",
            "adapt.chain=3", "adapt.serve=false", f"adapt.traffic={traffic}", "adapt.min_gain=-100",
            "adapt.gate_margin=100", "adapt.rounds=1"]
    code, errors = _main(args, capsys)
    assert code == 1 and "no held-out traffic prompt" in errors[0], errors
    state = State.load(root)
    assert state.phase == "idle" and state.live == str(root / "drafts" / "start") and state.trained_rows == 0
    assert not (root / "store").exists()  # the capture of the failed round is undone
    assert _rows(root)[-1]["status"] == "failed"
    _write(traffic, _traffic_rows(0, 60))  # more traffic, as the error said
    code, errors = _main(args, capsys)
    assert code == 0, errors
    row = _rows(root)[-1]
    assert row["status"] == "swapped" and row["round"] == 2 and row["gate_rows"] >= 10


@pytest.mark.parametrize("replay_share", [0.0, 0.5])
def test_with_vllm_a_round_captures_through_the_engine_and_gates_with_transformers(adapt_base, tmp_path,
                                                                                   monkeypatch, replay_share):
    """rollout.backend=vllm: a round's capture goes through a vLLM engine started for it and stopped
    after it (the fine-tune and the gate need its GPUs); the gate decodes with a transformers target,
    the one check() loaded to compare the reference store (replay_share > 0) or one loaded for the gate.
    Control: with the hf backend the capture uses that same transformers target. (The loads are stand-ins
    that record which target each phase got; the engine path itself is tests/test_vllm_backend.py's.)"""
    import types

    import specforge.adapt.rounds as rounds

    loads, closed, captured = [], [], []

    def load(model, layers=None, engine_for=None, **kw):
        kind = "engine" if engine_for is not None else "transformers"
        loads.append(kind)
        return types.SimpleNamespace(kind=kind, engine=types.SimpleNamespace(close=lambda: closed.append(kind))
                                     if engine_for is not None else None)

    monkeypatch.setattr(rounds, "load_target", load)
    monkeypatch.setattr(rounds, "engine_factory", lambda cfg: (lambda *a: None) if cfg.rollout.backend == "vllm"
                        else None)
    monkeypatch.setattr(rounds, "capture_store", lambda cfg, progress, target, source: captured.append(target.kind))
    for backend in ("vllm", "hf"):
        given = types.SimpleNamespace(kind="transformers (check)", engine=None) if replay_share else None
        cfg = _adapt_cfg(adapt_base, tmp_path / backend, f"rollout.backend={backend}",
                         f"adapt.replay_share={replay_share}")
        ad = rounds.Adapter(cfg, log=lambda s: None, target=given)
        loads.clear(), closed.clear(), captured.clear()
        ad.capture()
        gate = ad.target()
        assert gate.engine is None and gate.kind.startswith("transformers") and (given is None or gate is given)
        if backend == "vllm":
            assert captured == ["engine"] and closed == ["engine"]  # started for the capture, stopped after it
        else:
            assert captured == [gate.kind] and closed == []
