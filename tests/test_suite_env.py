"""The suite's own environment (tests/conftest.py): one torch inductor cache per vector path, its compiled
kernels keyed by the torch build rather than the venv's folder, and a pytest-xdist worker that keeps to its
one thread whatever a run inside it asks for."""

import os

import pytest
import torch

from tests.conftest import VECTOR_PATH_ENV, XDIST_THREADS, inductor_cache_dir, keyed_by_build, torch_build


def test_each_vector_path_compiles_into_its_own_inductor_cache(monkeypatch):
    for key in VECTOR_PATH_ENV:
        monkeypatch.delenv(key, raising=False)
    native = inductor_cache_dir()
    seen = {native}
    for key, value in [("ATEN_CPU_CAPABILITY", "default"), ("ATEN_CPU_CAPABILITY", "avx2"),
                       ("ONEDNN_MAX_CPU_ISA", "AVX2"), ("MKL_ENABLE_INSTRUCTIONS", "AVX2")]:
        monkeypatch.setenv(key, value)
        seen.add(inductor_cache_dir())
        monkeypatch.delenv(key)
    assert len(seen) == 5, seen  # another path, another folder
    assert inductor_cache_dir() == native  # the same path keeps its folder (and its compiled kernels) across runs
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR")  # pytest_configure set it (or the user did)


def test_a_compiled_kernel_is_keyed_by_the_torch_build_not_by_the_venvs_folder(tmp_path):
    """What ``kernels_keyed_by_torch_build`` gives the compiled-math modules: a kernel compiled under one venv's
    folder is found under another's with the same torch build, and another build compiles its own. Control:
    inductor's own key names the folder (why a fresh clone compiled every kernel again)."""
    pytest.importorskip("torch._inductor")
    from torch._inductor import codecache
    from torch._inductor.cpp_builder import CppBuilder, CppTorchDeviceOptions
    from torch.utils import cpp_extension

    write = getattr(codecache.write, "__wrapped__", codecache.write)  # inductor's own, even after the fixture
    here, there = cpp_extension._TORCH_PATH, "/elsewhere/venv/lib/python3.11/site-packages/torch"
    cmd = CppBuilder(name="o", sources="i", BuildOption=CppTorchDeviceOptions(device_type="cpu")).get_command_line()
    assert f"-I{here}/include" in cmd  # what the fixture renames: the command names this torch by its folder

    def key(w, folder: str) -> str:
        return w('extern "C" int f() { return 1; }', "cpp", extra=cmd.replace(here, folder),
                 specified_dir=str(tmp_path))[0]

    assert key(write, here) != key(write, there)
    ours = key(keyed_by_build(write, here, torch_build()), here)
    assert key(keyed_by_build(write, there, torch_build()), there) == ours  # the same build elsewhere
    assert key(keyed_by_build(write, there, "<torch 0.0 another>"), there) != ours  # another build


@pytest.mark.skipif(not os.environ.get("PYTEST_XDIST_WORKER"), reason="the clamp is a pytest-xdist worker's")
def test_a_run_in_an_xdist_worker_keeps_to_its_threads():
    torch.set_num_threads(2)  # what specforge.device.set_threads does for train.num_threads=2
    assert torch.get_num_threads() == XDIST_THREADS
    assert os.environ.get("OMP_NUM_THREADS") == str(XDIST_THREADS)  # and what the worker starts
