"""How ``models/vllm_engine.VllmEngine`` starts an engine, with a stand-in for vLLM's server (a script
that binds the port it is given and answers /health, or says what vLLM says when the port is taken):
nothing here needs vLLM installed."""

import functools
import os
import socket
import sys
import types

import pytest
import torch

import specforge.models.vllm_engine as vllm_engine
from specforge.jsonhttp import wait_healthy
from specforge.models.vllm_engine import EngineError, EngineSpec, VllmEngine

FAKE_SERVER = """#!{python}
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


try:
    srv = http.server.HTTPServer(("127.0.0.1", port), Health)
except OSError as e:
    print(f"ERROR 11-29 10:00:00 [api_server.py:1] OSError: {{e}}", flush=True)
    sys.exit(1)
srv.serve_forever()
"""


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_SERVER.format(python=sys.executable))
    python.chmod(0o755)
    return EngineSpec(model_path="m", layer_ids=[1, 2], dtype=torch.float32, max_model_len=8, python=str(python),
                      startup_timeout_s=60)


def test_a_port_taken_before_the_engine_binds_it_is_picked_again(fake_vllm, tmp_path, monkeypatch):
    """``free_port`` releases the port it found; another process may bind it before vLLM does. The
    engine then exits ("Address already in use") and is started again on a new port. Control: with
    one try the same start is one EngineError naming the cause."""
    held = socket.socket()  # listening, never answering: a health probe there waits out its timeout
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    real = vllm_engine.free_port
    monkeypatch.setattr(vllm_engine, "wait_healthy", functools.partial(wait_healthy, probe_timeout_s=0.5))
    try:
        for tries in (vllm_engine.PORT_TRIES, 1):
            picks = iter([taken])
            monkeypatch.setattr(vllm_engine, "free_port", lambda: next(picks, None) or real())
            monkeypatch.setattr(vllm_engine, "PORT_TRIES", tries)
            if tries == 1:
                with pytest.raises(EngineError, match="exited .*Address already in use"):
                    VllmEngine(fake_vllm, log_dir=str(tmp_path / "logs"), storage_root=str(tmp_path))
                continue
            engine = VllmEngine(fake_vllm, log_dir=str(tmp_path / "logs"), storage_root=str(tmp_path))
            try:
                assert engine.alive() and not engine.url.endswith(f":{taken}")
                assert "Address already in use" in (tmp_path / "logs" / f"vllm-{taken}.log").read_text()
            finally:
                engine.close()
    finally:
        held.close()


def _engine_env(monkeypatch, env: dict, ray_ids: list, tp: int = 2, gpus_seen: int = 8) -> dict:
    """The environment an engine started by a worker gets (``spec_for`` on a CUDA device, as the worker
    calls it), the worker's own environment ``env`` and Ray GPU ids ``ray_ids`` ([]: not a Ray actor)."""
    import specforge.device as device
    from specforge.config import load_config

    for var in ("CUDA_VISIBLE_DEVICES", "LOCAL_RANK", "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(device, "_ray_gpu_ids", lambda: list(ray_ids))
    monkeypatch.setattr(device.torch.cuda, "device_count", lambda: gpus_seen)
    cfg = load_config(None, ["rollout.backend=vllm", f"rollout.tp_size={tp}", "placement.mode=disaggregated"])
    spec = vllm_engine.started_spec(cfg, "m", 6, [1, 2], torch.bfloat16, torch.device("cuda", 0))
    assert vllm_engine.spec_for(cfg, "m", 6, [1, 2], torch.bfloat16, torch.device("cuda", 0)).gpus is None
    return spec.env()


def test_each_engine_gets_exactly_its_workers_gpus(monkeypatch):
    """Two rollout workers with tensor parallel 2 on an 8-GPU node: each engine's CUDA_VISIBLE_DEVICES
    names its worker's two GPUs, however the worker sees GPUs (Ray's own CUDA_VISIBLE_DEVICES, Ray with
    RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES, where every actor sees all 8, a torchrun-style LOCAL_RANK).
    Control: the environment as it was copied before (the worker's own): under NOSET both engines would
    see all 8 GPUs and both take 0 and 1. A user's endpoint or a printed command (``spec_for``) takes none
    of this process's GPUs (a client with one GPU may join an engine of eight)."""
    noset = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
    got = [_engine_env(monkeypatch, noset, ids)["CUDA_VISIBLE_DEVICES"] for ids in (["0", "1"], ["2", "3"])]
    assert got == ["0,1", "2,3"]
    assert _engine_env(monkeypatch, {"CUDA_VISIBLE_DEVICES": "4,5"}, ["4", "5"])["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert _engine_env(monkeypatch, {"LOCAL_RANK": "1"}, [])["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert _engine_env(monkeypatch, {"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "1,3,5,7"},
                       [])["CUDA_VISIBLE_DEVICES"] == "5,7"
    assert _engine_env(monkeypatch, {}, [])["CUDA_VISIBLE_DEVICES"] == "0,1"  # one process: the first two
    with pytest.raises(ValueError, match=r"rollout.tp_size'=2: the engine needs 2 GPUs, LOCAL_RANK 3's .* 1 \(6\)"):
        _engine_env(monkeypatch, {"LOCAL_RANK": "3"}, [], gpus_seen=7)
    # the control: what the engine inherited before, the worker's environment as it is, names no GPU
    # under NOSET (vLLM then takes the first tp_size of all 8, the same two for both workers)
    _engine_env(monkeypatch, noset, ["2", "3"])
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    from specforge.device import local_cuda_index

    assert local_cuda_index() == 2  # the worker's own torch device reads the same Ray ids


def test_the_engines_start_follows_the_setup_bound_unless_set(fake_vllm, tmp_path):
    """``rollout.vllm_startup_timeout_s`` unset: the engine may take ``parallel.setup_timeout_s`` (the
    bound of a worker's whole start, which a big target's config raises); set, that value, refused above
    the setup bound (the driver would give up first) with one line naming both keys."""
    from specforge.config import engine_start_timeout, load_config

    base = ["rollout.backend=vllm", "placement.mode=disaggregated"]
    assert engine_start_timeout(load_config(None, [*base, "parallel.setup_timeout_s=3600"])) == 3600
    assert engine_start_timeout(load_config(None, [*base, "rollout.vllm_startup_timeout_s=900"])) == 900
    spec = vllm_engine.spec_for(load_config(None, [*base, "parallel.setup_timeout_s=2400"]), "m", 6, [1, 2],
                                torch.float32, torch.device("cpu"))
    assert spec.startup_timeout_s == 2400
    with pytest.raises(ValueError, match=r"'rollout.vllm_startup_timeout_s'=7200 exceeds parallel.setup_timeout_s"
                                         r"=1800.*raise parallel.setup_timeout_s"):
        load_config(None, [*base, "rollout.vllm_startup_timeout_s=7200"])


# ---------------------------------------------------------------- the hand-off folder (models/handoff.py)


FULL_DISK = """
import resource, signal, sys, torch
from specforge.models import handoff
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
ok = handoff.save_atomically({"hidden_states": torch.zeros(64, 4, 128)}, sys.argv[1])
print("written" if ok else "failed")
"""


def test_a_failed_write_leaves_no_part_and_is_told_at_the_path(tmp_path):
    """The connector's write (``handoff.save_atomically``) on a disk that fills during the write (a file
    size limit of 4 KiB; the hidden states are 128 KiB): no ``.part`` is left, the engine's process goes
    on (nothing raised), and the path holds the error, which the client's read raises. Control: the same
    write without the limit is read back."""
    import subprocess

    from specforge.models import handoff

    path = tmp_path / "req-1.safetensors"
    out = subprocess.run([sys.executable, "-c", FULL_DISK, str(path)], capture_output=True, text=True, timeout=60,
                         cwd=str(vllm_engine.REPO_ROOT))
    assert out.returncode == 0 and out.stdout.strip() == "failed", out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["req-1.safetensors"]  # no .part
    with pytest.raises(handoff.HandoffFailed, match="File too large"):
        handoff.read(str(path))
    assert handoff.save_atomically({"hidden_states": torch.ones(64, 4, 128)}, str(path))
    assert handoff.read(str(path))[0]["hidden_states"].shape == (64, 4, 128)


def test_the_client_raises_a_failed_write_at_once(tmp_path, monkeypatch):
    """A request whose file is an error file ends in one EngineError naming rollout.vllm_storage, at
    once (not after the 600 s request timeout), and the file is removed."""
    import time

    from specforge.models import handoff

    engine = VllmEngine.__new__(VllmEngine)
    engine.spec = EngineSpec(model_path="m", layer_ids=[1, 2], dtype=torch.float32, max_model_len=8)
    engine.proc, engine.log_path, engine._swept = None, None, True
    engine.arrivals = vllm_engine.Arrivals()
    path = str(tmp_path / "req.safetensors")
    monkeypatch.setattr(engine, "_post", lambda body: {"kv_transfer_params": {"hidden_states_path": path}})
    handoff.tell_failure(path, OSError(28, "No space left on device"))
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=r"could not write a request's hidden states .*No space left on device.*"
                                          r"rollout.vllm_storage"):
        engine._one([1, 2, 3])
    assert time.monotonic() - t0 < 5 and not os.path.exists(path)
    engine.arrivals.close()


def test_the_handoff_folder_is_sized_before_the_engine_starts(tmp_path, monkeypatch):
    """64 requests of the longest sample must fit: /dev/shm where it holds them, else the temp folder on
    disk (one line says why), else one error naming rollout.vllm_storage; a configured folder too small is
    refused. A container's 64 MiB /dev/shm against a 8k-token sample of an 8B target's 4 states."""
    from specforge.models import handoff

    shm, disk, mine = tmp_path / "shm", tmp_path / "disk", tmp_path / "mine"
    for d in (shm, disk, mine):
        d.mkdir()
    free = {str(shm): 64 * 2**20, str(disk): 100 * 2**30, str(mine): 2**30}
    monkeypatch.setattr(handoff.shutil, "disk_usage", lambda p: types.SimpleNamespace(free=free[str(p)]))
    need = handoff.MAX_INFLIGHT * handoff.request_bytes(8192, 4, 4096, torch.bfloat16)  # ~16 GiB
    assert handoff.pick_folder(2**20, shm=str(shm), disk=str(disk)) == (str(shm), None)
    root, note = handoff.pick_folder(need, shm=str(shm), disk=str(disk))
    assert root == str(disk) and f"{shm} has 0.06 GiB free" in note and "16.00 GiB" in note
    free[str(disk)] = 2**30
    with pytest.raises(ValueError, match="neither .* has that free: set config key 'rollout.vllm_storage'"):
        handoff.pick_folder(need, shm=str(shm), disk=str(disk))
    with pytest.raises(ValueError, match=r"'rollout.vllm_storage'=.*mine' has 1.00 GiB free"):
        handoff.pick_folder(need, str(mine), shm=str(shm), disk=str(disk))
    assert handoff.pick_folder(2**20, str(mine), shm=str(shm), disk=str(disk)) == (str(mine), None)
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ValueError, match=r"'rollout.vllm_storage'=.*a-file/sub' cannot be made"):
        handoff.pick_folder(2**20, str(tmp_path / "a-file" / "sub"), shm=str(shm), disk=str(disk))
    spec = EngineSpec(model_path="m", layer_ids=[2, 3, 4, 6], dtype=torch.bfloat16, max_model_len=8192,
                      hidden_size=4096)
    assert spec.handoff_bytes() == need


def test_a_killed_owners_folder_is_swept_at_the_next_start(fake_vllm, tmp_path):
    """A worker SIGKILLed never closes its engine's folder; the next engine started on the host removes
    this host's folders whose owner is gone, and keeps those of live owners, another host's (a shared
    folder) and anything else."""
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    mine = f"specforge-vllm-{socket.gethostname()}-"
    (tmp_path / f"{mine}{dead.pid}-abc").mkdir()
    (tmp_path / f"{mine}{dead.pid}-abc" / "req.safetensors.1.part").write_bytes(b"x")
    (tmp_path / f"{mine}{os.getpid()}-live").mkdir()
    (tmp_path / f"specforge-vllm-another-host-{dead.pid}-abc").mkdir()  # a shared folder: not ours to judge
    (tmp_path / "other").mkdir()
    engine = VllmEngine(fake_vllm, log_dir=str(tmp_path / "logs"), storage_root=str(tmp_path))
    try:
        left = sorted(p.name for p in tmp_path.iterdir() if p.name != "logs")
        assert f"{mine}{dead.pid}-abc" not in left and "other" in left
        assert f"specforge-vllm-another-host-{dead.pid}-abc" in left
        assert f"{mine}{os.getpid()}-live" in left and os.path.dirname(engine.storage) == str(tmp_path)
    finally:
        engine.close()
    assert not os.path.exists(engine.storage or "/nonexistent")


def test_each_file_must_name_the_layers_and_model_this_run_needs(tmp_path, monkeypatch):
    """The client reads what captured a file (its header, ``handoff.origin``): the layers and model of
    this run pass; other layer ids, another model, or a file naming nothing are one EngineError each."""
    from specforge.models import handoff

    engine = VllmEngine.__new__(VllmEngine)
    engine.spec = EngineSpec(model_path=str(tmp_path / "target"), layer_ids=[2, 3, 6], dtype=torch.float32,
                             max_model_len=8)
    engine.proc, engine.log_path, engine.url, engine._swept = None, None, "http://127.0.0.1:8000", True
    engine.arrivals = vllm_engine.Arrivals()
    path = str(tmp_path / "req.safetensors")
    monkeypatch.setattr(engine, "_post", lambda body: {"kv_transfer_params": {"hidden_states_path": path}})
    tensors = {"hidden_states": torch.randn(3, 3, 4), "token_ids": torch.tensor([5, 6, 7])}
    cases = [(handoff.origin(tmp_path / "target", [2, 3, 6]), None),
             (handoff.origin(tmp_path / "target", [3, 4, 7]), r"captures layers \[3,4,7\] .* needs layers \[2,3,6\]"),
             (handoff.origin(tmp_path / "other", [2, 3, 6]), r"of .*other; this run needs"),
             (None, "does not say which model and layers")]
    try:
        for meta, refused in cases:
            assert handoff.save_atomically(tensors, path, meta)
            if refused is None:
                assert engine._one([5, 6, 7]).shape == (3, 3, 4)
                continue
            with pytest.raises(EngineError, match=refused):
                engine._one([5, 6, 7])
    finally:
        engine.arrivals.close()


def test_the_store_capture_asks_for_the_next_batch_before_reading_this_one():
    """``iter_features`` through an engine on a GPU (``python -m specforge.capture``, adapt's rounds): the
    next batch's requests go out before this batch's answers are read, so the engine computes while we
    read, norm, argmax and store; the features come out in the batches' order, each sample once. On the
    CPU one batch at a time (measured faster there). (A stand-in engine records the order; the engine's
    own numbers are tests/test_vllm_backend.py's.)"""
    from concurrent.futures import Future

    from specforge.capture import iter_features
    from specforge.models.target import TargetModel
    from tests.helpers.models import tiny_target

    events = []

    class Engine:
        computes_apart = True  # a GPU engine; on the CPU one batch at a time (the control below)

        def submit(self, rows):
            batch = len([e for e in events if e[0] == "submit"])
            events.append(("submit", batch))
            futures = []
            for r in rows:
                f = Future()
                f.set_result(torch.randn(len(r), 4, 48))
                real = f.result
                f.result = lambda real=real, batch=batch: events.append(("read", batch)) or real()
                futures.append(f)
            return futures

    target = TargetModel(model=tiny_target(), tokenizer=types.SimpleNamespace(pad_token_id=0), aux_layer_ids=[1, 2, 3],
                         device=torch.device("cpu"), engine=Engine())
    rows = [{"input_ids": list(range(3, 3 + n)), "loss_mask": [1] * n} for n in (9, 7, 5, 4, 3)]
    batches = [[0, 1], [2, 3], [4]]
    got = [sid for sid, _ in iter_features(target, rows, batches, 1024)]
    assert got == [0, 1, 2, 3, 4]
    order = [e for i, e in enumerate(events) if i == 0 or e != events[i - 1]]  # runs of reads as one
    assert order == [("submit", 0), ("submit", 1), ("read", 0), ("submit", 2), ("read", 1), ("read", 2)], order
    events.clear()
    target.engine.computes_apart = False  # the control: an engine on our cores, one batch at a time
    assert [sid for sid, _ in iter_features(target, rows, batches, 1024)] == [0, 1, 2, 3, 4]
    order = [e for i, e in enumerate(events) if i == 0 or e != events[i - 1]]
    assert order == [("submit", 0), ("read", 0), ("submit", 1), ("read", 1), ("submit", 2), ("read", 2)], order


def test_a_rollout_worker_asks_for_the_next_plan_before_reading_this_one():
    """A rollout worker with an engine on GPUs is a pipeline (``RolloutWorker._requests``): each step sends
    its own plan's requests (unless they went out with the last step), then the next plan's
    (``upcoming``), then reads its own; every row is asked for once and the features equal a one-batch-
    at-a-time worker's. A look-ahead another plan overtakes is dropped, not sent as that plan's. Control:
    an engine on our cores (``computes_apart`` False) runs one batch at a time."""
    from concurrent.futures import Future

    from specforge.config import load_config
    from specforge.contracts import FeatureField, FeatureSpec
    from specforge.models.target import TargetModel
    from specforge.runtime.dataplane import SendHandle, SendWindow
    from specforge.runtime.workers import RolloutWorker
    from tests.helpers.models import tiny_target

    SPEC = FeatureSpec((FeatureField("aux_hidden", 3 * 48, "float32"), FeatureField("last_hidden", 48, "float32"),
                        FeatureField("target_ids", 1, "int64"), FeatureField("input_ids", 1, "int64"),
                        FeatureField("loss_mask", 1, "int64")))
    events = []

    class Engine:
        computes_apart = True

        def submit(self, rows):
            batch = tuple(r[0] for r in rows)  # the batch's first tokens name it
            events.append(("submit", batch))
            futures = []
            for r in rows:
                f = Future()
                g = torch.Generator().manual_seed(sum(r))
                f.set_result(torch.randn(len(r), 4, 48, generator=g))
                f.result = lambda real=f.result, batch=batch: events.append(("read", batch)) or real()
                futures.append(f)
            return futures

    rows = [{"input_ids": [10 * i + 3] + list(range(4, 4 + n)), "loss_mask": [1] * (n + 1)}
            for i, n in enumerate((6, 4, 5, 3, 7, 2))]

    class Split:
        def __getitem__(self, ids):
            return {k: [rows[i][k] for i in ids] for k in ("input_ids", "loss_mask")}

    def plan(step, ids):
        return types.SimpleNamespace(batch_of=lambda rank: ids, split="train", feature_spec=SPEC, step=step)

    def worker(apart):
        w = RolloutWorker.__new__(RolloutWorker)
        engine = Engine()
        engine.computes_apart = apart
        w.rank, w.device, w.cfg = 0, torch.device("cpu"), load_config(None, ["data.max_length=16"])
        w.target = TargetModel(model=tiny_target(), tokenizer=types.SimpleNamespace(pad_token_id=0),
                               aux_layer_ids=[1, 2, 3], device=torch.device("cpu"), engine=engine)
        w.data, sent = types.SimpleNamespace(train=Split()), {}
        w.transport = types.SimpleNamespace(device=torch.device("cpu"),
                                            send_step=lambda plan, feats, my_rank: sent.update(feats) or
                                            SendHandle(None, 0))
        w.window = SendWindow(1 << 30)
        return w, sent

    plans = [plan(0, (0, 1)), plan(1, (2, 3)), plan(2, (4, 5))]
    first = lambda p: tuple(rows[i]["input_ids"][0] for i in p.batch_of(0))  # noqa: E731
    a, b, c = map(first, plans)

    def run(apart):
        events.clear()
        w, sent = worker(apart)
        for i, p in enumerate(plans):
            w.rollout_step(p, plans[i + 1: i + 2])
        return [e for i, e in enumerate(events) if i == 0 or e != events[i - 1]], sent

    order, piped = run(True)
    assert order == [("submit", a), ("submit", b), ("read", a), ("submit", c), ("read", b), ("read", c)], order
    order, serial = run(False)  # the control
    assert order == [("submit", a), ("read", a), ("submit", b), ("read", b), ("submit", c), ("read", c)], order
    assert sorted(piped) == sorted(serial) == list(range(6))
    for sid in serial:
        for name, t in serial[sid].items():
            assert torch.equal(piped[sid][name], t), (sid, name)

    events.clear()  # the look-ahead announced plan 1; plan 2 comes: plan 2's rows are asked for, not plan 1's
    w, sent = worker(True)
    w.rollout_step(plans[0], plans[1:2])
    w.rollout_step(plans[2], ())
    assert [e for e in events if e[0] == "submit"] == [("submit", a), ("submit", b), ("submit", c)]
    assert sorted(sent) == [0, 1, 4, 5] and w._ahead is None


HOST_COPIES = """
import json, re, sys
import torch
import safetensors.torch
from specforge.models import handoff

def peak():  # MiB: this process's peak resident memory so far
    return int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) / 1024

def mapped(t, path):  # whether t's memory lies in a mapping of the file at path
    for line in open("/proc/self/maps"):
        span, *rest = line.split()
        a, b = (int(v, 16) for v in span.split("-"))
        if a <= t.data_ptr() < b:
            return rest[-1] == path
    return False

path, control = sys.argv[1], sys.argv[2] == "control"
hs = torch.ones(128, 2**19, dtype=torch.bfloat16)  # 128 MiB: the engine's copy out of its cache
tensors = {"hidden_states": hs, "token_ids": torch.arange(128)}
before = peak()
if control:  # the file's bytes built in memory first (safetensors < 0.8's save_file), then written
    open(path, "wb").write(safetensors.torch.save(tensors, handoff.origin("m", [1])))
else:
    assert handoff.save_atomically(tensors, path, handoff.origin("m", [1]))
grew = peak() - before
if control:  # read into memory, then parsed (load_file's old way)
    got = safetensors.torch.load(open(path, "rb").read())["hidden_states"]
else:
    got = handoff.read(path)[0]["hidden_states"]
print(json.dumps({"write_grew_mib": grew, "read_is_the_file": mapped(got, path), "equal": torch.equal(got, hs)}))
"""


def test_the_hand_off_copies_each_token_at_most_twice_on_the_host(tmp_path):
    """Between the engine's cache and our device the hand-off copies a token twice on the host: vLLM's
    device-to-host copy into pinned memory (the connector's GPU path; on the CPU its gather) and the
    file write, which safetensors (>= 0.8) makes from the tensor's own memory; the client's read is the
    file's pages themselves (``handoff.read``: memory-mapped), from which the features go to the device.
    Measured in a fresh process on 128 MiB of hidden states: the write grows the peak by under an eighth
    of them, and the tensor read lies in the file's mapping. Control: a write that builds the file's
    bytes first grows it by at least their size, and a read into memory is not the file."""
    import json
    import subprocess

    def run(mode):
        out = subprocess.run([sys.executable, "-c", HOST_COPIES, str(tmp_path / f"{mode}.safetensors"), mode],
                             capture_output=True, text=True, timeout=120, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    ours, control = run("ours"), run("control")
    assert ours["equal"] and control["equal"]
    assert ours["write_grew_mib"] < 16 and ours["read_is_the_file"], ours
    assert control["write_grew_mib"] >= 128 and not control["read_is_the_file"], control


def test_with_an_engine_the_host_converts_only_what_it_computes_with(tmp_path):
    """``load_target(engine_for=...)``: the host copy of the target keeps the checkpoint's dtype (here
    fp32, the run's bf16: memory-mapped, nothing converted, only pages read resident); the final norm and
    the embeddings it computes with are in the run's dtype; the weights' digest (``run_identity``) is the
    one a target loaded in bf16 has. Control: the digest without the run's dtype differs."""
    from specforge.config import load_config
    from specforge.models.target import load_target, text_tower
    from specforge.training.checkpoint import tensor_digest
    from tests.helpers.targets import overrides, target_folder

    target_folder("llama", tmp_path)
    cfg = load_config(None, [*overrides(tmp_path), "model.dtype=bfloat16"])
    seen = []
    eng = load_target(cfg.model, torch.device("cpu"), engine_for=lambda *a: seen.append(a[3]) or "engine")
    assert eng.engine == "engine" and seen == [torch.bfloat16]  # the engine runs in the run's dtype
    m = eng.model
    assert m.model.layers[0].mlp.up_proj.weight.dtype == torch.float32  # as in the checkpoint
    assert {text_tower(m).norm.weight.dtype, m.get_output_embeddings().weight.dtype,
            m.get_input_embeddings().weight.dtype} == {torch.bfloat16}
    plain = load_target(cfg.model, torch.device("cpu"))  # the run's dtype throughout
    want = tensor_digest(plain.model.state_dict().items(), sample=64)
    assert tensor_digest(m.state_dict().items(), sample=64, dtype=eng.digest_dtype) == want
    assert tensor_digest(m.state_dict().items(), sample=64) != want  # the control


def test_a_user_engines_fixed_folder_is_swept_of_files_no_client_will_read(tmp_path):
    """``--vllm-storage`` folders outlive every client (a killed one leaves its files): files older than
    twice the request timeout go at a client's first answer; newer ones, which a client may still be
    waiting for, and other files stay."""
    from specforge.models import handoff

    for name, age in (("old.safetensors", 3000), ("old.safetensors.7.part", 3000), ("new.safetensors", 10),
                      ("notes.txt", 3000)):
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (1e6 - age, 1e6 - age))
    gone = handoff.sweep_stale(str(tmp_path), 2 * vllm_engine.REQUEST_TIMEOUT_S, now=1e6)
    assert sorted(os.path.basename(p) for p in gone) == ["old.safetensors", "old.safetensors.7.part"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.safetensors", "notes.txt"]
