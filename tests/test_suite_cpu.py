"""benchmarks/suite_cpu.py charges each process's CPU to the test its pytest worker was running."""

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
    }
    per_test, kinds, none = attribute(processes, workers)
    assert per_test == {"tests/t.py::a": 2.0, "tests/t.py::b": 8.0, "tests/u.py::c": 5.0}
    assert kinds["tests/t.py::b"] == {"pytest worker": 3.0, "ray actor TrainWorker": 4.0, "llama-server": 1.0}
    assert kinds["tests/u.py::c"] == {"cli specforge.capture": 5.0}
    assert none == 6.5


def test_kinds_of_processes():
    assert kind_of("ray::RolloutWorker.__init__") == "ray actor RolloutWorker"
    assert kind_of("/x/ray/core/src/ray/raylet/raylet --raylet_socket_name=/tmp/a") == "ray daemon"
    assert kind_of("/v/bin/python -m vllm.entrypoints.openai.api_server --model m") == "vllm"
    assert kind_of("/v/bin/python -m specforge.ray_train a=b") == "cli specforge.ray_train"
    assert kind_of("/bin/true") == "other"
