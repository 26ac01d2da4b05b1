"""The package layering, checked on the import statements (cheap, keeps the architecture visible)."""

import ast
from pathlib import Path

import pytest

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
    ("models", ("ray", "torch.distributed", "specforge.parallel", "specforge.runtime", "specforge.train")),
    ("parallel", ("ray", "specforge.runtime", "specforge.train", "specforge.models")),
    ("train", ("ray",)),
])
def test_layer_does_not_import(folder, forbidden):
    bad = sorted(m for m in _imports(folder) if m.startswith(forbidden))
    assert not bad, f"specforge/{folder} imports {bad}"


def test_train_does_not_import_the_runtime():
    """The step sits below the runtime; the single-process entry (specforge/local.py) above both.
    The one exception is runtime/contracts.py: stdlib-only records (slicing bounds) both sides share."""
    bad = sorted(m for m in _imports("train") if m.startswith("specforge.runtime") and m != "specforge.runtime.contracts")
    assert not bad, f"specforge/train imports {bad} (the runtime imports train: a circle)"
