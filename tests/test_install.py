"""A good install prints no ERROR: scripts/install.sh into a fresh venv (what a new user's first
command runs). Overridden pins are said once, on purpose, in one ``note:`` line."""

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_fresh_install_prints_no_error(tmp_path):
    env = dict(os.environ, VENV=str(tmp_path / "venv"))
    out = subprocess.run(["bash", "scripts/install.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=840)
    lines = (out.stdout + out.stderr).splitlines()
    assert out.returncode == 0, "\n".join(lines[-30:])
    assert not [line for line in lines if line.startswith("ERROR")], "\n".join(lines)
    assert not [line for line in lines if "BuildBackendWarning" in line], "\n".join(lines)
    notes = [line for line in lines if line.startswith("note: ")]
    assert len(notes) == 1 and "speculators" in notes[0] and "on purpose" in notes[0], notes
    assert out.stdout.splitlines()[-1].startswith(f"installed into {tmp_path / 'venv'}: torch ")
