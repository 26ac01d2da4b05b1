"""What several test modules build the same way (a captured store, a trained draft), built once per
pytest run and shared: one folder per name under the run's base temp folder, which pytest-xdist's
workers (``-n``) have in common, made under a file lock by the first worker that asks for it."""

import os
import shutil
from pathlib import Path
from typing import Callable

from filelock import FileLock


def built_once(tmp_path_factory, name: str, build: Callable[[Path], object]) -> Path:
    """``build(folder)`` fills ``folder`` the first time ``name`` is asked for in this pytest run;
    every later caller, in any worker, gets the finished folder. A build that raised leaves no
    ``.done`` mark: the next caller builds it again from an empty folder."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # gw0, gw1, ...: each has its own basetemp in a shared one
        root = root.parent
    folder = root / "shared" / name
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if not (folder / ".done").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            (folder / ".done").touch()
    return folder


CONFIGS = Path(__file__).resolve().parent.parent.parent / "configs"
SMOLLM2 = CONFIGS / "smollm2-135m-cpu.yaml"
SMOLLM2_AUX = [3, 12, 22]  # layer outputs (SGLang numbering); the default is [1, 14, 26]
# what tests/conftest.py's smollm2_store captures, and what a run reading it must say the same way
SMOLLM2_STORE = ["model.dtype=float32", "model.device=cpu", f"model.aux_layer_ids=[{','.join(map(str, SMOLLM2_AUX))}]",
                 "data.max_samples=48", "data.num_eval=12", "data.max_length=256", "placement.mode=offline"]


def flip_bound(chain: int, forwards: int) -> float:
    """How far an engine's tokens-per-forward may sit from our eval's on the same fp32 weights: two drafted
    tokens flipped at a near-tie (ggml and torch round differently), each moving its round by at most
    ``chain`` tokens, over ``forwards`` target forwards. The llama.cpp parity tests hold their figures to it."""
    return 2 * chain / forwards
