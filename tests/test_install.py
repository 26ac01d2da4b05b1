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


def test_the_default_runs_stated_duration_is_the_measured_one():
    """The README and the config header state one range for the default run, and the latest
    fresh-clone measurement in benchmarks/README.md lies in it (a figure a user reads as a promise
    is a measured one)."""
    import re

    stated = {name: re.search(r"(\d+)-(\d+) min", (REPO / name).read_text().replace("\n#", "").replace("\n", " "))
              for name in ("README.md", "configs/smollm2-135m-cpu.yaml")}
    ranges = {name: (int(m.group(1)), int(m.group(2))) for name, m in stated.items() if m}
    assert len(ranges) == 2 and len(set(ranges.values())) == 1, ranges
    low, high = ranges["README.md"]
    latest = re.search(r"Latest default run from a fresh clone: (\d+(?:\.\d+)?) min",
                       (REPO / "benchmarks/README.md").read_text())
    assert latest and low <= float(latest.group(1)) <= high, (latest and latest.group(1), low, high)
