import os

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


def pytest_configure(config):
    if not _gpu_suite(config):
        from specforge.device import FORCE_ENV

        os.environ.setdefault(FORCE_ENV, "cpu")


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
    elif not _gpu_suite(config):
        skip = pytest.mark.skip(reason=f"the CPU suite forces the CPU; GPU tests run with `{GPU_SUITE}`")
    else:
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
