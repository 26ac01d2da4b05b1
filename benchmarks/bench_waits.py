"""The data plane's waits: what a receive costs while its peer computes, and how fast an abort ends it.

    python benchmarks/bench_waits.py [--wait-s 3] [--no-readme]

Two gloo ranks (``run_ranks``): rank 0 sends a 4-float tensor ``--wait-s`` after rank 1 posted its
receive, as a rollout worker sends once its forward is done while the train rank waits. Rank 1
waits with ``Completion.finish`` under NCCL's semantics (``SPECFORGE_EMULATE_NCCL``'s ``StreamWork``,
what the CPU tests run) in two ways:

* "poll": ``Completion._poll``, the wait every backend used before: ``is_completed()`` polled,
  sleeping 0.1 ms doubling to 5 ms between looks (still the wait on real NCCL, whose works give the
  host no other signal);
* "event": ``Completion.finish`` on gloo: the caller sleeps on a condition that a watcher thread (the
  blocking wait) or an abort signals.

Measured on rank 1: the CPU time of the whole process (every thread: the watchers too) over the
wait, and, with ``abort()`` called from another thread ``--wait-s / 2`` into the wait, the time from
the call to the waiter raising ``PeerLost`` (the median of ``--repeats``).

The vLLM client's wait for its hidden-states files (``models/arrivals.py``): 64 threads (a batch in
flight) each wait for its own file, which a writer thread renames into a shared-memory folder
``--wait-s`` later, as the engine's connector does. "look every 2 ms": each thread checks its path
every 2 ms (the client before, and the fallback where inotify cannot be had); "inotify": the threads
sleep until the watcher thread wakes them (and look every 0.1 s). Measured: the process' CPU over the
wait, and the time from the last rename to the last waiter awake.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import append_section, git_commit, header_markdown, markdown_table  # noqa: E402


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _ranks(rank: int, world: int, wait_s: float, repeats: int, out: str) -> None:
    import json

    import torch
    import torch.distributed as dist

    from specforge.runtime.completion import Completion, PeerLost

    cases = [(how, abort) for abort in (False, True) for how in ("poll", "event") for _ in range(repeats)]
    if rank == 0:
        for _ in cases:
            time.sleep(wait_s)
            dist.send(torch.ones(4), dst=1)
            dist.barrier()
        return
    rows = []
    for how, abort in cases:
        c = Completion(stream=False, timeout_s=10 * wait_s, emulate=True)
        buf = torch.zeros(4)
        works = c.post([dist.P2POp(dist.irecv, buf, peer=0)])
        wait = c._poll if how == "poll" else c.finish
        said: list = []
        if abort:
            timer = threading.Timer(wait_s / 2, lambda: (said.append(time.perf_counter()), c.abort("bench")))
            timer.start()
        cpu0, t0 = _cpu_s(), time.perf_counter()
        try:
            wait(works, "bench")
            raised = None
        except PeerLost:
            raised = time.perf_counter()
        rows.append({"how": how, "abort": abort, "cpu_s": _cpu_s() - cpu0, "wall_s": time.perf_counter() - t0,
                     "abort_ms": (raised - said[0]) * 1e3 if raised is not None and said else None})
        while not all(w.is_completed() for w in works):  # the late send lands before the next case
            time.sleep(0.01)
        dist.barrier()
    Path(out).write_text(json.dumps(rows))


def _client_wait(notify: bool, wait_s: float, threads: int = 64) -> tuple[float, float]:
    """(CPU seconds of this process over the wait, seconds from the last rename to the last waiter up)."""
    import tempfile

    from specforge.models.arrivals import Arrivals

    root = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    arrivals = Arrivals(notify=notify)
    with tempfile.TemporaryDirectory(dir=root) as d:
        paths = [os.path.join(d, f"req-{i}.safetensors") for i in range(threads)]
        woke: list[float] = []
        renamed: list[float] = []

        def writer():
            time.sleep(wait_s)
            for p in paths:
                with open(p + ".part", "wb") as f:
                    f.write(b"x" * 4096)
                os.replace(p + ".part", p)
            renamed.append(time.perf_counter())

        def wait(p):
            arrivals.wait(p, 10 * wait_s)
            woke.append(time.perf_counter())

        waiters = [threading.Thread(target=wait, args=(p,)) for p in paths]
        cpu0 = _cpu_s()
        for t in [*waiters, threading.Thread(target=writer)]:
            t.start()
        for t in waiters:
            t.join()
        cpu = _cpu_s() - cpu0
    arrivals.close()
    return cpu, max(woke) - renamed[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wait-s", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-readme", action="store_true")
    args = ap.parse_args()
    import json
    import tempfile

    from specforge.parallel.launch import run_ranks

    os.environ["SPECFORGE_EMULATE_NCCL"] = "1"
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "rows.json")
        run_ranks(_ranks, 2, args.wait_s, args.repeats, out, workdir=Path(d), backend="gloo",
                  timeout_s=60 + 8 * args.repeats * args.wait_s)
        rows = json.loads(Path(out).read_text())
    table = []
    for how in ("poll", "event"):
        done = [r for r in rows if r["how"] == how and not r["abort"]]
        aborted = [r for r in rows if r["how"] == how and r["abort"]]
        cpu = statistics.median(r["cpu_s"] for r in done)
        table.append([how, f"{args.wait_s:g}", f"{cpu * 1e3:.1f}", f"{100 * cpu / args.wait_s:.2f}%",
                      f"{statistics.median(r['abort_ms'] for r in aborted):.3f}",
                      f"{max(r['abort_ms'] for r in aborted):.3f}"])
    md = markdown_table(["wait", "peer computes (s)", "CPU over the wait (ms)", "of one core",
                         "abort to raise, median (ms)", "max (ms)"], table)
    client = []
    for notify, name in ((False, "look every 2 ms"), (True, "inotify")):
        runs = [_client_wait(notify, args.wait_s) for _ in range(args.repeats)]
        cpu = statistics.median(r[0] for r in runs)
        client.append([name, f"{args.wait_s:g}", f"{cpu * 1e3:.0f}", f"{100 * cpu / args.wait_s:.1f}%",
                       f"{statistics.median(r[1] for r in runs) * 1e3:.2f}"])
    md += "\n\n" + markdown_table(["64 client threads", "engine computes (s)", "CPU over the wait (ms)", "of one core",
                                   "last rename to last waiter up, median (ms)"], client)
    print(md)
    if not args.no_readme:
        append_section("Data-plane waits: polling against an event (bench_waits.py)",
                       f"{header_markdown()} | **commit** {git_commit()} | {args.repeats} repeats, "
                       f"load: this script alone\n\n{__doc__.split(chr(10) * 2, 2)[2]}\n{md}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
