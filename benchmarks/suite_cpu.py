"""Where the suite's CPU goes, test by test: every process's CPU, charged to the test that was running.

    python benchmarks/suite_cpu.py run --out /tmp/cpu [-- <arguments for scripts/test.sh>]
    python benchmarks/suite_cpu.py report /tmp/cpu

On two busy cores the suite's time is its CPU divided by two, so what shortens it is less CPU, and most of
the CPU is not in the pytest workers: Ray actors, vLLM engines, llama-server, CLIs and converters started by
a test, and the daemons of the Ray clusters tests start. ``run`` runs ``bash scripts/test.sh`` (the README's
test command) while a sampler reads every process's CPU (utime + stime) from /proc every 0.5 s, and a pytest
plugin records when each test ran on each xdist worker. ``report`` charges every increment of a process's CPU
to the test its worker (the pytest worker it descends from) was running at that moment, and prints:

* CPU by kind of process over the whole run;
* CPU by test module and the 30 tests that cost the most CPU, each split by kind of process.

What it misses: a process that lives less than 0.5 s (its CPU is read once, when seen); the CPU of a process
that left no trace of its parent (reparented before it was first seen) goes to "no test". A worker's own
Ray session cluster is charged to the tests running while its daemons spend it (it is one of their costs).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import REPO, markdown_table  # noqa: E402

WINDOWS_ENV = "SPECFORGE_SUITE_CPU_DIR"  # where the plugin writes each worker's test windows
PERIOD_S = 0.5


# ---------------------------------------------------------------- the sampler (a process of its own)


def sample(out: Path, ready: Path | None = None) -> None:
    """Until SIGTERM: every ``PERIOD_S``, each process's CPU seconds; then ``out`` (JSON):
    ``{"pid:start": {"cmd", "ppid", "series": [[time, cpu_s], ...], "base": cpu_s}}``, a point only where the
    CPU moved; ``base`` (processes already running at the first sweep: the machine's own, a kernel thread) the
    CPU they had spent before the run, which is not the run's. ``ready``, if given, is created after the first
    sweep: a process started after it is the run's."""
    hz = os.sysconf("SC_CLK_TCK")
    seen: dict[str, dict] = {}
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    first = True
    while not stop:
        now = time.time()
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    stat = f.read()
                rest = stat.rsplit(")", 1)[1].split()
                cpu = (int(rest[11]) + int(rest[12])) / hz
                key = f"{d}:{rest[19]}"
                entry = seen.get(key)
                if entry is None or cpu != entry["series"][-1][1]:
                    # read again while it runs: an exec (children.tied's prelude) or Ray's renaming of a worker
                    # that took an actor changes it; the last one seen names the process
                    with open(f"/proc/{d}/cmdline", "rb") as f:
                        cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:300] or "?"
                    if entry is None:
                        seen[key] = entry = {"cmd": cmd, "ppid": int(rest[1]), "series": [[now, cpu]]}
                        if first:
                            entry["base"] = cpu
                    else:
                        entry["series"].append([now, cpu])
                    if cmd != "?":
                        entry["cmd"] = cmd
            except (OSError, IndexError, ValueError):  # gone meanwhile
                pass
        if first and ready is not None:
            ready.touch()
        first = False
        time.sleep(PERIOD_S)
    out.write_text(json.dumps(seen))


# ---------------------------------------------------------------- the pytest plugin (-p, in every worker)


_WINDOWS: dict[str, list[float]] = {}


def pytest_runtest_protocol(item, nextitem):  # noqa: ARG001 (pytest's hook signature)
    _WINDOWS[item.nodeid] = [time.time()]


def pytest_runtest_logfinish(nodeid, location):  # noqa: ARG001
    if nodeid in _WINDOWS:
        _WINDOWS[nodeid].append(time.time())


def pytest_sessionfinish(session):  # noqa: ARG001
    folder = os.environ.get(WINDOWS_ENV)
    if folder:
        name = os.environ.get("PYTEST_XDIST_WORKER", "main")
        rows = {k: v for k, v in _WINDOWS.items() if len(v) == 2}
        (Path(folder) / f"windows-{name}.json").write_text(json.dumps({"pid": os.getpid(), "tests": rows}))


# ---------------------------------------------------------------- the report


def kind_of(cmd: str) -> str:
    """A process's kind, from its command line."""
    if "ray::" in cmd:
        return "ray actor " + cmd.split("ray::", 1)[1].split(".")[0].split()[0][:24]
    if "ray_zygote" in cmd:
        return "ray zygote"
    for daemon in ("gcs_server", "raylet", "dashboard", "log_monitor", "monitor.py", "runtime_env", "plasma",
                   "default_worker", "setup_worker"):
        if daemon in cmd:
            return "ray daemon" if daemon not in ("default_worker", "setup_worker") else "ray worker starting"
    if "vllm" in cmd.lower():
        return "vllm"
    if "llama-server" in cmd:
        return "llama-server"
    if "convert_" in cmd and "gguf" in cmd:
        return "gguf converter"
    m = re.search(r"-m (specforge\.[a-z_]+)", cmd)
    if m:
        return "cli " + m.group(1)
    if "forkserver" in cmd:
        return "forkserver child"
    if "pip" in cmd and "install" in cmd:
        return "pip"
    if "pytest" in cmd or "exec(eval(sys.stdin" in cmd:
        return "pytest"
    return "other"


def attribute(processes: dict, workers: dict) -> tuple[dict, dict, float]:
    """(CPU by test, {test: {kind: CPU}}, CPU charged to no test). ``processes``: the sampler's JSON;
    ``workers``: {pid: {test: [start, end]}} of each pytest worker."""
    parent = {}
    for key, p in processes.items():
        parent.setdefault(int(key.split(":")[0]), p["ppid"])
    spans = {pid: sorted((w[0], w[1], t) for t, w in tests.items()) for pid, tests in workers.items()}
    starts = {pid: [s[0] for s in rows] for pid, rows in spans.items()}

    def owner(pid: int):
        for _ in range(32):  # up the parent chain to a pytest worker
            if pid in workers:
                return pid
            if pid not in parent or parent[pid] == pid:
                return None
            pid = parent[pid]
        return None

    per_test: dict[str, float] = collections.Counter()
    kinds: dict[str, dict] = collections.defaultdict(collections.Counter)
    none = 0.0
    for key, p in processes.items():
        pid = int(key.split(":")[0])
        # the first hop from this process' own record: a pid reused by a later process has another parent
        w = pid if pid in workers else owner(p["ppid"])
        kind, before = kind_of(p["cmd"]), p.get("base", 0.0)
        for t, cpu in p["series"]:
            spent, before = cpu - before, cpu
            if spent <= 0:
                continue
            test = None
            if w is not None:
                i = bisect.bisect_right(starts[w], t) - 1
                if i >= 0 and t <= spans[w][i][1] + PERIOD_S:
                    test = spans[w][i][2]
            if test is None:
                none += spent
            else:
                per_test[test] += spent
                kinds[test]["pytest worker" if pid == w else kind] += spent
    return per_test, kinds, none


def report(folder: Path) -> str:
    if not (folder / "processes.json").is_file():
        raise SystemExit(f"error: {folder} holds no processes.json: give the --out folder of a finished "
                         "`suite_cpu.py run`")
    processes = json.loads((folder / "processes.json").read_text())
    workers = {}
    for f in sorted(folder.glob("windows-*.json")):
        d = json.loads(f.read_text())
        workers[d["pid"]] = d["tests"]
    per_test, kinds, none = attribute(processes, workers)
    by_kind: dict[str, float] = collections.Counter()
    count: dict[str, int] = collections.Counter()
    for p in processes.values():
        kind = kind_of(p["cmd"])
        by_kind[kind] += p["series"][-1][1] - p.get("base", 0.0)
        count[kind] += 1
    total = sum(by_kind.values())
    out = [f"{total:,.0f} CPU-s sampled, {sum(per_test.values()):,.0f} of them during a test, {none:,.0f} in none "
           "(install, collection, between tests)", "",
           markdown_table(["CPU-s", "share", "processes", "kind"],
                          [[f"{c:.0f}", f"{100 * c / total:.1f}%", count[k], k]
                           for k, c in sorted(by_kind.items(), key=lambda kv: -kv[1])[:16]]), ""]
    modules: dict[str, float] = collections.Counter()
    for t, c in per_test.items():
        modules[t.split("::")[0]] += c
    out += [markdown_table(["CPU-s", "module"], [[f"{c:.0f}", f"`{m}`"] for m, c in
                                                 sorted(modules.items(), key=lambda kv: -kv[1])[:15]]), ""]
    rows = []
    for t, c in sorted(per_test.items(), key=lambda kv: -kv[1])[:30]:
        split = ", ".join(f"{k} {v:.0f}" for k, v in sorted(kinds[t].items(), key=lambda kv: -kv[1]) if v >= 1)
        rows.append([f"{c:.0f}", f"`{t}`", split])
    out.append(markdown_table(["CPU-s", "test", "by kind of process"], rows))
    return "\n".join(out)


def run(folder: Path, test_args: list[str]) -> int:
    """``bash scripts/test.sh`` with the sampler beside it and the plugin in every worker."""
    folder.mkdir(parents=True, exist_ok=True)
    shim = Path(tempfile.mkdtemp(prefix="suite-cpu-"))
    (shim / "suite_cpu_plugin.py").write_text(
        f"import sys\nsys.path.insert(0, {str(REPO)!r})\nfrom benchmarks.suite_cpu import (  # noqa: F401\n"
        "    pytest_runtest_logfinish, pytest_runtest_protocol, pytest_sessionfinish)\n")
    sampler = subprocess.Popen([sys.executable, __file__, "sample", str(folder / "processes.json")])
    env = {**os.environ, WINDOWS_ENV: str(folder),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH")]))}
    try:
        rc = subprocess.call(["bash", "scripts/test.sh", "-p", "suite_cpu_plugin", *test_args], cwd=REPO, env=env)
    finally:
        sampler.send_signal(signal.SIGTERM)
        sampler.wait(timeout=120)
        shutil.rmtree(shim, ignore_errors=True)
    print(report(folder))
    return rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the suite under the sampler; then the report")
    r.add_argument("--out", type=Path, required=True, help="folder for processes.json and windows-*.json")
    r.add_argument("test_args", nargs=argparse.REMAINDER, help="after --: arguments for scripts/test.sh")
    s = sub.add_parser("sample", help="(internal) the sampler")
    s.add_argument("json", type=Path)
    s.add_argument("--ready", type=Path, help="a file to create once the first sweep is done")
    p = sub.add_parser("report", help="the tables, from a run's folder")
    p.add_argument("folder", type=Path)
    args = ap.parse_args()
    if args.cmd == "sample":
        sample(args.json, args.ready)
        return 0
    if args.cmd == "report":
        print(report(args.folder))
        return 0
    return run(args.out, [a for a in args.test_args if a != "--"])


if __name__ == "__main__":
    sys.exit(main())
