"""specforge.models.arrivals: the vLLM client's threads sleep until their hidden-states file is renamed
into the engine's folder (inotify), instead of each looking for it every 2 ms."""

import os
import threading
import time

from specforge.models.arrivals import Arrivals


def _arrive_later(folder, names, delay_s, how="rename"):
    def write():
        time.sleep(delay_s)
        stamps.append(time.monotonic())  # before the first file appears: a waiter cannot read it too early
        for name in names:
            part = folder / f"{name}.123.part"
            part.write_bytes(b"x")
            if how == "rename":  # as the connector writes: a temporary name, then the final one
                os.replace(part, folder / name)
            else:  # a hard link: no event the watcher asks for (the control)
                os.link(part, folder / name)

    stamps: list[float] = []
    threading.Thread(target=write, daemon=True).start()
    return stamps


def _wait_all(arrivals, paths, timeout_s):
    woke = {}

    def one(p):
        woke[p] = (arrivals.wait(str(p), timeout_s), time.monotonic())

    threads = [threading.Thread(target=one, args=(p,)) for p in paths]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 10)
    return woke


def test_waiters_wake_when_their_file_is_renamed_in_not_at_their_next_look(tmp_path):
    """8 threads wait with a look every 3 s; their files are renamed in 0.3 s later: each wakes at
    the rename (well under a second after). The control: files that appear by a hard link, which
    sends no event the watcher reads, are seen only at the next look (~3 s): the test can tell."""
    arrivals = Arrivals(check_s=3.0)
    assert arrivals.notified
    try:
        for how, at_once in (("rename", True), ("link", False)):
            folder = tmp_path / how
            folder.mkdir()
            names = [f"req-{i}.safetensors" for i in range(8)]
            stamps = _arrive_later(folder, names, 0.3, how)
            woke = _wait_all(arrivals, [folder / n for n in names], timeout_s=30)
            assert all(ok for ok, _ in woke.values()), (how, woke)
            late = max(at for _, at in woke.values()) - stamps[0]
            assert (late < 1.5) if at_once else (late > 1.5), (how, late)
    finally:
        arrivals.close()


def test_a_file_already_there_a_timeout_and_a_dead_engine(tmp_path):
    arrivals = Arrivals()
    try:
        (tmp_path / "there").write_bytes(b"x")
        assert arrivals.wait(str(tmp_path / "there"), 0.1)
        t0 = time.monotonic()
        assert not arrivals.wait(str(tmp_path / "never"), 0.3)
        assert 0.25 < time.monotonic() - t0 < 5
        t0 = time.monotonic()
        assert not arrivals.wait(str(tmp_path / "never"), 30, alive=lambda: False)  # the engine is gone
        assert time.monotonic() - t0 < 5
    finally:
        arrivals.close()
    fallback = Arrivals(notify=False)  # no inotify: the waiter looks every 2 ms, with the same answers
    assert not fallback.notified
    _arrive_later(tmp_path, ["late"], 0.2)
    assert fallback.wait(str(tmp_path / "late"), 10)
    assert not fallback.wait(str(tmp_path / "never"), 0.1)
