import contextlib
import os
import sys
import types

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# ``bash scripts/test.sh`` is the CPU suite: gloo and CPU tensors even on a machine with CUDA
# (``device.FORCE_ENV``; Ray workers get it too). ``bash scripts/test.sh -m gpu`` is the GPU suite.
GPU_SUITE = "bash scripts/test.sh -m gpu"


def _gpu_suite(config) -> bool:
    """Whether this run selected the GPU tests (``-m gpu``, not ``-m 'not gpu'``)."""
    expr = (config.option.markexpr or "").replace(" ", "")
    return "gpu" in expr and "notgpu" not in expr


# Under pytest-xdist (scripts/test.sh: two workers on two cores) each worker, and every process it starts
# (CLIs, vLLM engines; Ray sets its actors' own), computes on one thread: two workers' two-thread OpenMP
# pools on two cores wait on each other's descheduled threads, and Intel OpenMP (vLLM's CPU engine)
# spins 200 ms after each parallel region by default. Measured on a 2-core EPYC, the EAGLE-3.1 llama.cpp
# parity test beside the vLLM module: 251 s with neither, 185 s with KMP_BLOCKTIME=0, 75 s alone.
# A run inside the worker keeps to it too: ``train.num_threads`` (2 in the SmolLM2 configs, which the
# llama.cpp parity tests train from) would otherwise give the worker two OpenMP threads until the next
# test (``_clamp_threads``); processes the worker starts get OMP_NUM_THREADS=1 and a passive OpenMP wait
# (GNU OpenMP, torch's, spins before it sleeps) for a run of theirs that asks for more.
XDIST_THREADS = 1


def _xdist_worker() -> bool:
    return bool(os.environ.get("PYTEST_XDIST_WORKER"))


def _clamp_threads() -> None:
    """``torch.set_num_threads`` of this worker process sets at most ``XDIST_THREADS`` (what a test's
    run asks for is the run's business; how many threads the suite's worker computes on is the suite's)."""
    set_num_threads = torch.set_num_threads

    def clamped(n: int) -> None:
        set_num_threads(max(1, min(int(n), XDIST_THREADS)))

    torch.set_num_threads = clamped


# Vector paths (README, "Set up and run the tests"): torch inductor's on-disk cache does not key its compiled
# CPU kernels by the vector path ATen or oneDNN were told to take, so a kernel compiled under one path is
# loaded under another: garbage (2e37, NaN) or a crash in the compiled-vs-eager tests, and an IndexError in
# vLLM's compiled embedding mask (its engine inherits this environment). Measured on a 2-core EPYC, torch
# 2.13.0: each path passes in an empty cache and fails in a cache another path filled. One cache per path.
VECTOR_PATH_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def inductor_cache_dir() -> str:
    import getpass
    import tempfile

    path = "-".join(os.environ.get(k, "native").lower() for k in VECTOR_PATH_ENV)
    return os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}", f"specforge-suite-{path}")


def pytest_configure(config):
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir())
    if _xdist_worker():
        os.environ.setdefault("OMP_NUM_THREADS", str(XDIST_THREADS))
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        os.environ.setdefault("KMP_BLOCKTIME", "0")
        _clamp_threads()
        torch.set_num_threads(XDIST_THREADS)
    if not _gpu_suite(config):
        from specforge.device import FORCE_ENV

        os.environ.setdefault(FORCE_ENV, "cpu")
        # the CPU suite runs Triton kernels in Triton's interpreter (tests/test_soft_ce_kernel.py); triton.jit
        # reads this when it decorates, so it is set before any test imports triton (torch's inductor
        # imports it: a compiled test run earlier would leave triton's own helpers uninterpreted)
        os.environ.setdefault("TRITON_INTERPRET", "1")


# Inductor keys a compiled CPU kernel by its source and its compile command, and the command names the torch
# it builds against by path (``-I <venv>/.../torch/include``, ``-L .../torch/lib``): every fresh clone, a new
# venv at a new path, compiled every kernel of the compiled-math tests again, and first precompiled the kernels'
# header (a 154 MB .gch a venv, left in /tmp; its hash reads the preprocessed header, whose __FILE__s name the
# venv). Measured on a 2-core EPYC, tests/test_rmsnorm.py and tests/test_rotary_compiled.py in one process:
# 13.0 s with the cache warm for the venv's path, 35.7 s at a new path. The suite keys the kernels by the
# torch build instead (its version and commit: the same headers and libraries at any path; a compiled kernel
# loads into the process's own torch libraries, not the ones it was linked beside) and compiles them without
# the precompiled header. Measured there, the two modules: 7.2 s at a new path once any path compiled them;
# from an empty cache 69.9 s, against 53.7 with the header (paid once a machine and torch build, not a clone;
# a CI on a new machine pays it each run: 90 s of a worker in a suite run against 41). Not the header for an
# empty cache only: it is in the kernel's key (-D TORCH_INDUCTOR_PRECOMPILE_HEADERS), so kernels compiled with
# it are not found without it (measured: the next fresh clone compiled all again, 66 s).
# A torch without these internals keeps its own keys (slower, not wrong). A fixture of the modules that
# compile, not a start-up step: inductor's import takes ~2 s, and reaches triton (TRITON_INTERPRET, above).
def torch_build() -> str:
    """What names this torch in a kernel's key: its version and commit."""
    return f"<torch {torch.__version__} {getattr(torch.version, 'git_version', '')}>"


def keyed_by_build(write, where: str, build: str):
    """Inductor's ``codecache.write`` with the torch folder ``where`` named ``build`` in the key's command."""
    import functools

    @functools.wraps(write)
    def keyed(content, extension, extra="", *args, **kwargs):
        return write(content, extension, extra.replace(where, build) if extra else extra, *args, **kwargs)

    return keyed


@pytest.fixture(scope="session")
def kernels_keyed_by_torch_build() -> None:
    try:
        from torch._inductor import codecache
        from torch._inductor import config as inductor_config
        from torch.utils import cpp_extension
    except ImportError:  # no inductor: the compiled tests skip
        return

    where, write = getattr(cpp_extension, "_TORCH_PATH", None), getattr(codecache, "write", None)
    if not where or write is None or not hasattr(inductor_config, "cpp_cache_precompile_headers"):
        return
    inductor_config.cpp_cache_precompile_headers = False
    codecache.write = keyed_by_build(write, where, torch_build())  # once a process: the fixture's scope


# ``SPECFORGE_GPU_REHEARSAL=cpu bash scripts/test.sh -m gpu`` runs the GPU suite's single-GPU entry-point
# tests (those marked ``rehearsal``) on the CPU: the same runs and assertions, minus what only CUDA
# measures, so the suite itself is checked on a machine without a GPU before a GPU runs it.
REHEARSAL_ENV = "SPECFORGE_GPU_REHEARSAL"


# The modules that take longest, longest first (benchmarks/README.md, "Test suite durations"): they are
# collected first so that pytest-xdist (scripts/test.sh: ``-n 2 --dist loadfile --no-loadscope-reorder``,
# which hands each worker one module at a time in collection order) never starts one of them last. Kept by
# hand: the recorded run's own order (benchmarks/test_durations.json, Ray-heavy test_failures beside the vLLM
# module first) took 31.5 min of pytest from a fresh clone at 767b251 against 29.7-30.8 with this one.
LONGEST_FIRST = (
    "test_vllm_backend.py", "test_engine_llamacpp.py", "test_eagle31.py", "test_targets_export.py",
    "test_engine_dflash.py", "test_dspark.py", "test_bad_input.py", "test_ray_train.py", "test_failures.py",
    "test_adapt.py", "test_new_algorithms_placements.py", "test_resume.py", "test_install.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
    rehearsal = _gpu_suite(config) and os.environ.get(REHEARSAL_ENV) == "cpu"
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
    elif not _gpu_suite(config):
        skip = pytest.mark.skip(reason=f"the CPU suite forces the CPU; GPU tests run with `{GPU_SUITE}`")
    else:
        return
    for item in items:
        if "gpu" in item.keywords and not (rehearsal and "rehearsal" in item.keywords):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ------------------------------------------------------------------ the tiny Ray run (tests/helpers/ray_run.py)
# Module-scoped, as they were in tests/test_ray_train.py, whose fixtures other modules imported: each
# test module that uses them gets its own instance. tests/test_store.py, tests/test_peagle.py and
# tests/test_dspark.py define other module-local ``assets`` (other targets/data), which take precedence there.


@pytest.fixture(scope="session")
def _ray_cluster():
    """One local Ray cluster for the whole session (a start costs seconds), shut down at its end."""
    yield
    ray = sys.modules.get("ray")
    # a ray without a version is a stand-in (the GPU machine's .gpu-bench/raystub): nothing to shut down
    if getattr(ray, "__version__", None) and ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="session")
def _ray_zygote(request, tmp_path_factory):
    """``.python``: what the session cluster's raylet starts its workers with, a script that hands a worker
    (``... default_worker.py ARGS``, ``... setup_worker.py ...``) to the zygote's ``.run`` command, which
    forks it from a process that imported torch (tests/helpers/ray_zygote.py, one per pytest
    process), and runs Ray's other Python processes as the venv's Python would; None for the GPU suite
    (workers spawned)."""
    import shlex

    from tests.helpers import ray_zygote

    if _gpu_suite(request.config) or os.environ.get(ray_zygote.OFF_ENV) == "1":
        yield None
        return
    with _zygote([sys.executable, ray_zygote.__file__], "the Ray worker zygote", 120, prefix="sfz-") as sock:
        run = shlex.join([sys.executable, ray_zygote.__file__, "run", sock])
        python = ray_zygote.write_python(tmp_path_factory.mktemp("ray-python") / "python", sys.executable, run,
                                         "*/default_worker.py|*/setup_worker.py")
        yield types.SimpleNamespace(python=python, run=run)


@contextlib.contextmanager
def _zygote(command: list[str], what: str, timeout_s: float, prefix: str, **popen):
    """A zygote (tests/helpers/ray_zygote.py's ``serve``) started as ``command serve SOCKET``: its socket's path
    once it says it is ready; terminated at the end."""
    import subprocess
    import tempfile

    from tests.helpers import ray_zygote

    sock = tempfile.mktemp(prefix=prefix, suffix=".sock", dir="/tmp")  # AF_UNIX: a short path
    server = subprocess.Popen([*command, "serve", sock], stdout=subprocess.PIPE, text=True, **popen)
    try:
        line = ray_zygote.wait_ready(server, timeout_s=timeout_s)
        assert line == ray_zygote.READY, f"{what} did not start: {line!r}"
        yield sock
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        if os.path.exists(sock):
            os.unlink(sock)


# The vLLM zygote (tests/helpers/vllm_zygote.py): what a module's vLLM engines and venv scripts fork from
VLLM_PYTHON_ENV = "SPECFORGE_VLLM_PYTHON"  # specforge.models.vllm_engine.default_python reads it
VLLM_SPAWN_ENV = "SPECFORGE_TEST_SPAWN_VLLM"  # =1: the suite's vLLM processes start as vLLM's python starts them
_VLLM_REAL: dict = {}  # the zygote's wrapper -> the python of vLLM's venv it stands for


@pytest.fixture(scope="session")
def _vllm_zygote(request, tmp_path_factory):
    """``.python``: a ``python`` that forks ``-m``/``-c`` runs from a process of vLLM's venv that imported vLLM
    (one per pytest process, started by the first module that asks: ``vllm_python``), ``.real``: vLLM's
    python. None where vLLM is not installed (its tests say so), for the GPU suite, or with ``VLLM_SPAWN_ENV``."""
    from pathlib import Path

    from specforge.models.vllm_engine import default_python, intel_openmp
    from tests.helpers import vllm_zygote
    from tests.helpers.vllm_fork.sitecustomize import __file__ as fork_site

    real = default_python()
    if _gpu_suite(request.config) or os.environ.get(VLLM_SPAWN_ENV) == "1" or not real.exists():
        yield None
        return
    repo = str(Path(__file__).resolve().parents[1])
    # an engine's start-up environment (EngineSpec.env, tests/test_vllm_backend.py's _engines_fork): what
    # the interpreter reads as it starts, and the OpenMP library vLLM's CPU build asks to be preloaded
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.path.dirname(fork_site),
                                                       *filter(None, [os.environ.get("PYTHONPATH")])]))
    iomp = intel_openmp(real)
    if iomp.exists() and "LD_PRELOAD" not in env:
        env["LD_PRELOAD"] = str(iomp)
    with _zygote([str(real), vllm_zygote.__file__], "the vLLM zygote", 300, prefix="sfv-", env=env, cwd=repo) as sock:
        python = vllm_zygote.wrapper(tmp_path_factory.mktemp("vllm-python"), str(real), sock)
        _VLLM_REAL[python] = str(real)
        yield types.SimpleNamespace(python=python, real=str(real))


@pytest.fixture(scope="module")
def vllm_python(_vllm_zygote):
    """For the module, vLLM's python (``SPECFORGE_VLLM_PYTHON``) is the zygote's: its engines' servers and its
    scripts in vLLM's venv are forked from vLLM's imports (~15 CPU-s less each on 2 cores)."""
    if _vllm_zygote is None:
        yield None
        return
    with pytest.MonkeyPatch.context() as m:
        m.setenv(VLLM_PYTHON_ENV, _vllm_zygote.python)
        yield _vllm_zygote


def forking_workers(zygote):
    """For the block, ``sys.executable`` is ``_ray_zygote``'s script: a Ray node started in it (``ray.init``,
    ``ray.cluster_utils.Cluster``) forks its workers from the zygote. Nothing where the zygote is off (None)."""
    from unittest import mock

    return mock.patch.object(sys, "executable", zygote.python) if zygote else contextlib.nullcontext()


# What the session's cluster runs without (its runs log nothing to the driver; one node, never scaled): Ray's
# log monitor and autoscaler monitor, and its agents' metrics collection. ``ray.init`` has no argument for
# the first two: they are ``RayParams`` fields, set here for the start (a renamed field fails the start,
# loudly). Measured, an idle cluster of this machine: its start 4.5 -> 3.3 CPU-s, then 2.2 -> 1.4 CPU-s a
# minute while it waits between the modules that use it (gw0's is up ~14 minutes of a run).
LEAN_CLUSTER = {"include_log_monitor": False, "no_monitor": True}
LEAN_SYSTEM_CONFIG = {"enable_metrics_collection": False}


@contextlib.contextmanager
def lean_cluster():
    """For the block, a Ray node started in this process runs without ``LEAN_CLUSTER``'s processes."""
    import functools
    from unittest import mock

    from ray._private.parameter import RayParams

    init = RayParams.__init__

    @functools.wraps(init)
    def lean(self, *args, **kwargs):
        init(self, *args, **{**kwargs, **LEAN_CLUSTER})

    with mock.patch.object(RayParams, "__init__", lean):
        yield


@pytest.fixture(scope="module")
def ray_session(_ray_cluster, _ray_zygote):
    """The session's Ray cluster, (re)started if a test before shut it down (tests of what starts and
    stops Ray do). ``address="local"``: always this process' own cluster, never another pytest
    worker's (``-n``) nor one that ``ray start`` / ``ray.cluster_utils`` left its address for. Its
    processes inherit the workers' environment from this one at its start, as ``start_ray``'s clusters
    do, and no runtime environment (with one, Ray starts every worker through its setup_worker.py, a
    process importing Ray: ~0.3 CPU-s a worker)."""
    ray = pytest.importorskip("ray", minversion="2.40")  # pyproject's floor; a stand-in (no version) skips
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")  # as start_ray's clusters (RAY_START_ENV)
    if not ray.is_initialized():
        from specforge import failpoints
        from specforge.device import EMULATE_NCCL_ENV
        from specforge.runtime.actors import note_inherited
        from tests.helpers.vllm_fork.sitecustomize import FLAG as VLLM_FORK

        # the engines its actors start are started as vLLM starts them (tests/helpers/vllm_fork: off); a
        # test's switches reach its workers through spawn_actors, not through the cluster's start; each key
        # as it was after the start
        with pytest.MonkeyPatch.context() as env, forking_workers(_ray_zygote), lean_cluster():
            env.setenv("TOKENIZERS_PARALLELISM", "false")
            env.setenv(VLLM_FORK, "0")
            if (real := _VLLM_REAL.get(os.environ.get(VLLM_PYTHON_ENV, ""))) is not None:
                env.setenv(VLLM_PYTHON_ENV, real)  # its actors' engines start with vLLM's python as well
            for key in (EMULATE_NCCL_ENV, failpoints.ENV, failpoints.DIR_ENV):
                env.delenv(key, raising=False)
            ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
                     _temp_dir="/tmp/sfray", _system_config=LEAN_SYSTEM_CONFIG)
            note_inherited(dict(os.environ))
    return ray


@pytest.fixture
def no_ray():
    """No Ray in this process when the test starts: a test of what a run does when it starts Ray itself
    (its own temp folder and environment, a ``ray.address`` to join) would otherwise join the cluster an
    earlier module's ``ray_session`` left up. The next module's ``ray_session`` starts it again."""
    ray = sys.modules.get("ray")
    # a ray without a version is a stand-in (the GPU machine's .gpu-bench/raystub): nothing to shut down
    if getattr(ray, "__version__", None) and ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tiny random Llama target + tokenizer folder and a tiny ShareGPT JSONL (14 rows)."""
    from tests.helpers.data import write_tiny_assets

    write_tiny_assets(root := tmp_path_factory.mktemp("assets"))
    return root


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):
    from specforge.train import run
    from tests.helpers.ray_run import make_cfg

    out = tmp_path_factory.mktemp("single")
    # one process, global batch = 2 x the per-rank batch; a periodic eval after step 2
    run(make_cfg(assets, out, "train.grad_accum=2", "train.num_workers=1", "train.eval_every=2"))
    return out


# ------------------------------------------------------------------ the embedded SmolLM2's small store


@pytest.fixture(scope="session")
def smollm2_store(tmp_path_factory):
    """(store folder, its overrides): features of the embedded SmolLM2 target in fp32 for 36 of 48
    ShareGPT conversations (12 held out), cut to 256 tokens, at the non-default layers
    ``tests.helpers.shared.SMOLLM2_AUX`` (a converter that ignored our ids would read others). Captured
    once per run (~1 min on 2 cores) for the drafts tests/test_engine_llamacpp.py and
    tests/test_eagle31.py train and serve."""
    from specforge.capture import capture_store
    from specforge.config import load_config
    from tests.helpers.shared import SMOLLM2, SMOLLM2_STORE, built_once

    def build(folder):
        capture_store(load_config(SMOLLM2, [*SMOLLM2_STORE, f"store.dir={folder}", "tracking.wandb=false",
                                            f"train.output_dir={folder.parent / 'unused'}"]), progress=False)

    folder = built_once(tmp_path_factory, "smollm2-store", build)
    return folder, [*SMOLLM2_STORE, f"store.dir={folder}"]
