"""benchmarks/suite_cpu.py charges each process's CPU to the test its pytest worker was running, and no CPU a
process spent before the run."""

import os

from benchmarks.suite_cpu import attribute, kind_of


def test_cpu_goes_to_the_test_running_on_the_owning_worker():
    workers = {100: {"tests/t.py::a": [0.0, 10.0], "tests/t.py::b": [10.0, 20.0]},
               500: {"tests/u.py::c": [0.0, 30.0]}}
    processes = {
        "100:1": {"cmd": "python -c import sys;exec(eval(sys.stdin.readline()))", "ppid": 1,
                  "series": [[5.0, 2.0], [15.0, 5.0]]},  # the worker itself: 2 in a, 3 in b
        "200:7": {"cmd": "ray::TrainWorker.train_step", "ppid": 100, "series": [[12.0, 4.0]]},  # b
        "300:9": {"cmd": "llama-server -m x.gguf", "ppid": 200, "series": [[19.0, 1.0], [25.0, 1.5]]},  # b, none
        "400:2": {"cmd": "python -m specforge.train", "ppid": 999, "series": [[3.0, 6.0]]},  # no known parent
        "600:3": {"cmd": "python -m specforge.capture x", "ppid": 500, "series": [[3.0, 2.0]]},  # the other worker
        # pid 200 again, a later process under the other worker: its own parent, not the first 200's
        "200:88": {"cmd": "python -m specforge.capture y", "ppid": 500, "series": [[25.0, 3.0]]},
        # running before the run (the first sweep: base), 300 CPU-s then: only its 2 since count, in none
        "73:127": {"cmd": "?", "ppid": 2, "series": [[0.0, 300.0], [25.0, 302.0]], "base": 300.0},
    }
    per_test, kinds, none = attribute(processes, workers)
    assert per_test == {"tests/t.py::a": 2.0, "tests/t.py::b": 8.0, "tests/u.py::c": 5.0}
    assert kinds["tests/t.py::b"] == {"pytest worker": 3.0, "ray actor TrainWorker": 4.0, "llama-server": 1.0}
    assert kinds["tests/u.py::c"] == {"cli specforge.capture": 5.0}
    assert none == 8.5
    del processes["73:127"]["base"]  # control: without its base, its CPU before the run would count
    assert attribute(processes, workers)[2] == 308.5


def test_the_report_counts_no_cpu_spent_before_the_run(tmp_path):
    import json

    from benchmarks.suite_cpu import report

    (tmp_path / "windows-gw0.json").write_text(json.dumps({"pid": 100, "tests": {"tests/t.py::a": [0.0, 10.0]}}))
    procs = {"100:1": {"cmd": "python -m pytest", "ppid": 1, "series": [[5.0, 2.0]]},
             "73:127": {"cmd": "?", "ppid": 2, "series": [[0.0, 300.0], [9.0, 302.0]], "base": 300.0}}
    (tmp_path / "processes.json").write_text(json.dumps(procs))
    assert report(tmp_path).startswith("4 CPU-s sampled, 2 of them during a test, 2 in none")
    del procs["73:127"]["base"]  # control: a file without the base (the sampler before it kept one)
    (tmp_path / "processes.json").write_text(json.dumps(procs))
    assert report(tmp_path).startswith("304 CPU-s sampled, 2 of them during a test, 302 in none")


def test_kinds_of_processes():
    assert kind_of("ray::RolloutWorker.__init__") == "ray actor RolloutWorker"
    assert kind_of("/x/ray/core/src/ray/raylet/raylet --raylet_socket_name=/tmp/a") == "ray daemon"
    assert kind_of("/v/bin/python -m vllm.entrypoints.openai.api_server --model m") == "vllm"
    assert kind_of("/v/bin/python -m specforge.ray_train a=b") == "cli specforge.ray_train"
    assert kind_of("/bin/true") == "other"


def test_the_sampler_keeps_what_a_process_spent_before_it_started(tmp_path):
    """Exactly the processes of the sampler's first sweep (here: this one) get their CPU then as their base;
    one started later (a child that spins ~0.3 s, then waits to be seen) gets none: its CPU counts from zero."""
    import json
    import signal
    import subprocess
    import sys
    import time

    from benchmarks.suite_cpu import PERIOD_S, REPO

    out, ready = tmp_path / "processes.json", tmp_path / "ready"
    sampler = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "suite_cpu.py"), "sample", str(out),
                                "--ready", str(ready)])
    try:
        deadline = time.monotonic() + 60  # its first sweep done, however slowly it started
        while not ready.exists():
            assert sampler.poll() is None and time.monotonic() < deadline, "the sampler never swept once"
            time.sleep(0.05)
        spin = f"import time\nt = time.time()\nwhile time.time() - t < 0.3:\n    pass\ntime.sleep({3 * PERIOD_S})"
        child = subprocess.Popen([sys.executable, "-S", "-c", spin])
        child.wait(timeout=30)
    finally:
        sampler.send_signal(signal.SIGTERM)
        sampler.wait(timeout=30)
    seen = json.loads(out.read_text())
    first = min(p["series"][0][0] for p in seen.values())
    assert all(("base" in p) == (p["series"][0][0] == first) for p in seen.values())
    assert next(p for k, p in seen.items() if k.startswith(f"{os.getpid()}:"))["base"] > 0  # pytest's imports
    spun = [p for k, p in seen.items() if k.startswith(f"{child.pid}:")]
    assert spun and all("base" not in p for p in spun), spun  # control: a process of the run has no base
