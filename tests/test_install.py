"""A good install prints no ERROR: scripts/install.sh into a fresh venv (what a new user's first
command runs). Overridden pins are said once, on purpose, in one ``note:`` line."""

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


FRESH_ENV = "SPECFORGE_FRESH_INSTALL"  # scripts/test.sh: the folder holding its own fresh install's output


def _fresh_install(tmp_path) -> tuple[str, str, str]:
    """(stdout, stderr, VENV as given) of scripts/install.sh into an empty venv: the one scripts/test.sh
    has just made when its venv did not exist (a fresh clone, CI), else one made here."""
    kept = os.environ.get(FRESH_ENV)
    if kept and (Path(kept) / "venv").is_file():
        folder = Path(kept)
        return (folder / "stdout").read_text(), (folder / "stderr").read_text(), (folder / "venv").read_text().strip()
    venv = str(tmp_path / "venv")
    out = subprocess.run(["bash", "scripts/install.sh"], cwd=REPO, env=dict(os.environ, VENV=venv),
                         capture_output=True, text=True, timeout=840)
    assert out.returncode == 0, "\n".join((out.stdout + out.stderr).splitlines()[-30:])
    return out.stdout, out.stderr, venv


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_fresh_install_prints_no_error(tmp_path):
    """scripts/install.sh into an empty venv, as a new user runs it. When scripts/test.sh has just done
    exactly that (its venv was new), its output is the one read; otherwise this installs into a new venv,
    which takes over 30 s: every wheel is installed (from pip's cache after the first time). It leaves our
    modules compiled, as pip leaves a regular install's (an editable one it does not compile)."""
    stdout, stderr, venv = _fresh_install(tmp_path)
    _check_output(stdout, stderr, venv)
    assert not uncompiled(REPO / "specforge"), "scripts/install.sh left these modules uncompiled"


def _check_output(stdout: str, stderr: str, venv: str) -> None:
    lines = (stdout + stderr).splitlines()
    assert not [line for line in lines if line.startswith("ERROR")], "\n".join(lines)
    assert not [line for line in lines if "BuildBackendWarning" in line], "\n".join(lines)
    notes = [line for line in lines if line.startswith("note: ")]
    assert len(notes) == 1 and "speculators" in notes[0] and "on purpose" in notes[0], notes
    assert stdout.splitlines()[-1].startswith(f"installed into {venv}: torch "), stdout.splitlines()[-3:]
    assert (REPO / venv / "bin" / "python").is_file()  # a relative VENV is the repository's


def uncompiled(package: Path) -> list[str]:
    """The modules under ``package`` without a .pyc that Python would use for the source as it is now (the
    cache file, its header's source mtime and size, or source hash): each process importing one compiles it
    again where PYTHONDONTWRITEBYTECODE=1 is set."""
    import importlib.util
    import struct

    missing = []
    for src in sorted(package.rglob("*.py")):
        pyc = Path(importlib.util.cache_from_source(str(src)))
        st = src.stat()
        try:
            head = pyc.read_bytes()[:16]
        except OSError:
            head = b""
        ok = len(head) == 16 and head[:4] == importlib.util.MAGIC_NUMBER
        if ok and struct.unpack("<I", head[4:8])[0] & 1:  # hash-based (compileall under SOURCE_DATE_EPOCH)
            ok = head[8:16] == importlib.util.source_hash(src.read_bytes())
        elif ok:  # timestamp-based: the source's mtime and size as they are now
            ok = struct.unpack("<III", head[4:]) == (0, int(st.st_mtime) & 0xFFFFFFFF, st.st_size & 0xFFFFFFFF)
        if not ok:
            missing.append(str(src.relative_to(package)))
    return missing


def test_the_compiled_module_check_finds_a_missing_or_stale_one(tmp_path):
    """``uncompiled``'s controls: compiled modules pass (by timestamp and by hash); ones whose source changed
    after, and one never compiled, are named."""
    import py_compile

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "b.py").write_text("y = 2\n")
    py_compile.compile(str(pkg / "a.py"), doraise=True)
    py_compile.compile(str(pkg / "b.py"), doraise=True, invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
    assert uncompiled(pkg) == []
    (pkg / "a.py").write_text("x = 11\n")  # a size Python's check sees (the mtime may tick within a second)
    (pkg / "b.py").write_text("y = 3\n")  # the same size: only the hash tells
    (pkg / "c.py").write_text("z = 3\n")
    assert uncompiled(pkg) == ["a.py", "b.py", "c.py"]


def test_the_kept_install_output_is_the_one_read(tmp_path, monkeypatch):
    """The check above reads scripts/test.sh's kept output when there is one: an ERROR line in it fails the
    check (the control), and the shipped test.sh keeps exactly what the check reads."""
    kept = tmp_path / "kept"
    kept.mkdir()
    venv = tmp_path / "v"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    (kept / "venv").write_text(f"{venv}\n")
    note = "note: speculators 0.9.0 ... on purpose"
    (kept / "stdout").write_text(f"{note}\ninstalled into {venv}: torch 2.13.0+cpu\n")
    (kept / "stderr").write_text("")
    monkeypatch.setenv(FRESH_ENV, str(kept))
    _check_output(*_fresh_install(tmp_path))
    (kept / "stderr").write_text("ERROR: pip's dependency resolver does not currently take into account ...\n")
    with pytest.raises(AssertionError):
        _check_output(*_fresh_install(tmp_path))
    script = (REPO / "scripts" / "test.sh").read_text()
    assert all(f in script for f in ('"$FRESH/stdout"', '"$FRESH/stderr"', '"$FRESH/venv"', f"export {FRESH_ENV}="))


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


def test_the_prepared_gpu_call_names_parts_that_exist(tmp_path):
    """scripts/gpu_check.sh (issue 46's one device call), dry: its four parts in order, each under a
    timeout, 8.5 minutes in all, whose scripts and flags exist here; no OUT: refused (the device tool
    sets it)."""
    import re

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "DRY": "1", "OUT": str(tmp_path)}
    run = subprocess.run(["bash", str(root / "scripts/gpu_check.sh")], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    parts = [line.split(" (")[0] for line in run.stdout.splitlines()]
    assert parts == ["gpu_suite", "gpu_step", "losses", "vs_v020"], run.stdout
    # issue 46 asked for 8 minutes; the suite's measured 110+ s (H200, 2026-11-30) needs half a minute more
    assert sum(int(s) for s in re.findall(r"\((\d+)s\)", run.stdout)) <= 8.5 * 60
    for script in re.findall(r"(benchmarks/\w+\.py|tests/\w+\.py)", run.stdout):
        assert (root / script).is_file(), script
    for script, flags in (("bench_gpu_step.py", ["--attention", "--pack", "--no-readme"]),
                          ("bench_soft_ce.py", ["--kinds", "--reps", "--no-readme"])):
        text = (root / "benchmarks" / script).read_text()
        assert all(f'"{f}"' in text for f in flags), (script, flags)
    bench = root.parent / "shared" / "gpu-bench" / "ttt_vs_upstream.py"
    if bench.is_file():  # the yardstick beside the checkout (CI has ../shared)
        assert all(f in bench.read_text() for f in ("--time-budget-s", "--fp32-check-T", "--project"))
    no_out = subprocess.run(["bash", str(root / "scripts/gpu_check.sh")], capture_output=True, text=True,
                            env={k: v for k, v in env.items() if k != "OUT"})
    assert no_out.returncode != 0 and "OUT" in no_out.stderr


def test_our_calls_into_transformers_raise_no_deprecation():
    """The capture and the eval's cached decoding (what the default run does first and last) call
    transformers' current API: no DeprecationWarning/FutureWarning and no logged "deprecated" line
    (transformers 5.2x logs one for ``past_key_values=``, once per process). Control: the same
    detector sees the line when the old keyword is used."""
    import logging
    import warnings

    import torch

    from specforge.eval import greedy_run, new_cache
    from specforge.models.target import TargetModel, _cache_kwarg, capture, text_tower
    from tests.helpers.models import tiny_target

    target = TargetModel(model=tiny_target(num_layers=4), tokenizer=None, aux_layer_ids=[0, 1, 2],
                         device=torch.device("cpu"))
    ids = torch.randint(0, 320, (2, 12))

    class Lines(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    def said(call) -> list[str]:
        cached = getattr(logging.Logger, "warning_once", None)
        if hasattr(cached, "cache_clear"):  # transformers logs each deprecation once per process
            cached.cache_clear()
        lines, log = Lines(), logging.getLogger("transformers")  # its own root: it does not propagate
        log.addHandler(lines)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                call()
        finally:
            log.removeHandler(lines)
        # a deprecated keyword warns from inside torch's Module.__call__: no filter by the warning's file
        return [str(w.message) for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))] + [
            line for line in lines.lines if "deprecat" in line]

    assert said(lambda: capture(target, ids)) == []
    assert said(lambda: greedy_run(target, ids[0].tolist(), 6, eos=set())) == []
    if _cache_kwarg(text_tower(target.model)) == "cache":  # the renaming transformers: the old keyword is caught
        old = said(lambda: text_tower(target.model)(input_ids=ids[:1], past_key_values=new_cache(target)))
        assert any("deprecated" in m for m in old), old
