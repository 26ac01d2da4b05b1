"""The package layering, checked on the import statements and literals (cheap, keeps the architecture visible)."""

import ast
from pathlib import Path

import pytest

from specforge.algorithms import NAMES

PKG = Path(__file__).parent.parent / "specforge"


def _imports(folder: str) -> set[str]:
    found = set()
    for path in (PKG / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
    return found


@pytest.mark.parametrize("folder, forbidden", [
    ("models", ("ray", "torch.distributed", "specforge.parallel", "specforge.runtime", "specforge.train",
                "specforge.algorithms.")),  # the registry (specforge.algorithms) only
    ("parallel", ("ray", "specforge.runtime", "specforge.train", "specforge.models")),
    ("train", ("ray", "specforge.runtime")),
    ("data", ("ray", "specforge.runtime", "specforge.train")),  # the store hands over models/features' TrainBatch
])
def test_layer_does_not_import(folder, forbidden):
    bad = sorted(m for m in _imports(folder) if m.startswith(forbidden))
    assert not bad, f"specforge/{folder} imports {bad}"


# ---------------------------------------------------------------- the algorithm seam


def seam_violations(source: str, names=NAMES) -> list[str]:
    """What in ``source`` (a module outside specforge/algorithms/) bypasses the seam: an import of an
    algorithm's own modules (only the seam ``specforge.algorithms``), or an
    algorithm name as a literal (compared, a key, an argument: the choice belongs in a hook)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        mods = []
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods = [node.module] + ([f"{node.module}.{a.name}" for a in node.names]
                                    if node.module == "specforge.algorithms" else [])
        out += [f"line {node.lineno}: imports {m}" for m in mods
                if m.startswith("specforge.algorithms.")
                and m.split(".")[2] in names]
        if isinstance(node, ast.Constant) and node.value in names:
            out.append(f"line {node.lineno}: the literal {node.value!r}")
    return out


# config.py names the default algorithm once (DEFAULT_ALGORITHM): the one literal outside the packages
ALLOWED = {("config.py", 'DEFAULT_ALGORITHM = "eagle3"')}


def test_no_algorithm_choice_outside_the_algorithm_packages():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        if rel.parts[0] == "algorithms":
            continue
        text = path.read_text()
        lines = text.splitlines()
        for v in seam_violations(text):
            line = lines[int(v.split(":")[0].split()[1]) - 1]
            if not any(str(rel) == f and line.startswith(start) for f, start in ALLOWED):
                bad.append(f"specforge/{rel} {v}: {line.strip()}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("source", [
    'if cfg.draft.algorithm == "dflash":\n    pass',
    'x = {"eagle3": 1}',
    'x = cfg.draft.algorithm in ("eagle3", "other")',
    "from specforge.algorithms.dflash.export import tokens_per_round",
    "from specforge.algorithms import dflash",
    "import specforge.algorithms.eagle3.model",
])
def test_the_seam_check_catches_a_bypass(source):
    """Negative control: each way around the seam is caught."""
    assert seam_violations(source)


@pytest.mark.parametrize("source", [
    "from specforge.algorithms import get_algorithm\nget_algorithm(cfg.draft.algorithm).feature_layers(cfg, 30)",
    "from specforge.algorithms import ExportRequest",
    'x = "eagle3-like text in a sentence"',
])
def test_the_seam_check_passes_the_registry(source):
    assert not seam_violations(source)


# ---------------------------------------------------------------- the tests' own layering

TESTS = Path(__file__).parent


def cross_test_imports(source: str) -> list[str]:
    """Imports of a test module in ``source``: ``tests.test_*`` (or ``test_*``, the name pytest imports it
    under) as a module, or a ``test_*`` name from the ``tests`` package. Shared fixtures belong in
    tests/conftest.py, shared helpers in tests/helpers/."""
    def is_test_module(name: str) -> bool:
        parts = name.split(".")
        return parts[-1].startswith("test_") and parts[:-1] in ([], ["tests"])

    out = []
    for node in ast.walk(ast.parse(source)):
        mods = []
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            mods = [base] + [f"{base.rstrip('.')}.{a.name}".lstrip(".") for a in node.names
                             if node.module in (None, "tests")]
        out += [f"line {node.lineno}: imports {m}" for m in mods if is_test_module(m.lstrip("."))]
    return out


def test_no_test_module_imports_another():
    bad = [f"tests/{path.relative_to(TESTS)} {v}" for path in sorted(TESTS.rglob("*.py"))
           for v in cross_test_imports(path.read_text())]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("source", [
    "from tests.test_ray_train import assets, make_cfg",
    "import tests.test_target",
    "from tests import test_target",
    "from test_ray_train import make_cfg",
    "from .test_target import tiny_target",
    "def f():\n    from tests.test_targets_train import overrides, target_folder",
])
def test_the_test_import_check_catches_a_cross_import(source):
    """Negative control: each way of importing a test module is caught."""
    assert cross_test_imports(source)


@pytest.mark.parametrize("source", [
    "from tests.helpers.ray_run import make_cfg",
    "import tests.helpers.models",
    "from tests.helpers import data",
    "from specforge.algorithms import get_algorithm",
    'x = "tests.test_target"',
])
def test_the_test_import_check_passes_helpers(source):
    assert not cross_test_imports(source)
