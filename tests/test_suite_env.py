"""The suite's own environment (tests/conftest.py): one torch inductor cache per vector path, and a
pytest-xdist worker that keeps to its one thread whatever a run inside it asks for."""

import os

import pytest
import torch

from tests.conftest import VECTOR_PATH_ENV, XDIST_THREADS, inductor_cache_dir


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


@pytest.mark.skipif(not os.environ.get("PYTEST_XDIST_WORKER"), reason="the clamp is a pytest-xdist worker's")
def test_a_run_in_an_xdist_worker_keeps_to_its_threads():
    torch.set_num_threads(2)  # what specforge.device.set_threads does for train.num_threads=2
    assert torch.get_num_threads() == XDIST_THREADS
    assert os.environ.get("OMP_NUM_THREADS") == str(XDIST_THREADS)  # and what the worker starts
