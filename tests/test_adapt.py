"""``specforge.adapt``: the traffic ledger, the logging proxy's swap under load, and rounds on a tiny
target (capture, fine-tune, gate, swap; a failed gate, a dying server, a killed process)."""

import json
import threading
import time

import pytest

from specforge.adapt.proxy import TrafficProxy
from specforge.adapt.traffic import Ledger, held_out, row_key
from tests.helpers.upstream import FakeServer, chat


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
    a, b = FakeServer("a", delay_s=0.5), FakeServer("b")
    with TrafficProxy(a.url, tmp_path / "traffic.jsonl") as proxy:
        results = []
        threads = [threading.Thread(target=lambda: results.append(chat(proxy.url, "q"))) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.2)
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
