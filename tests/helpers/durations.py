"""What the suite's recorded test times say (``benchmarks/test_durations.json``, written by
``benchmarks/suite_durations.py`` from one run of the whole suite): which slow tests do not say why they
are slow."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent.parent
DURATIONS = REPO / "benchmarks" / "test_durations.json"
SLOW_S = 30.0
SAYS_WHY = re.compile(rf"over {SLOW_S:g} s", re.IGNORECASE)  # "Over 30 s: <what it does that takes the time>"


def recorded(path: Path = DURATIONS) -> Optional[dict]:
    """The recorded run (``info``, ``modules``, ``tests``), or None where there is none or it is unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _docstrings(source: str) -> dict[str, str]:
    """Every test function's docstring ("" where it has none), by name; a class's methods as Class::name."""
    out: dict[str, str] = {}
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = ast.get_docstring(node) or ""
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[f"{node.name}::{sub.name}"] = ast.get_docstring(sub) or ""
    return out


def unexplained_slow_tests(tests: dict[str, float], repo: Path = REPO, slow_s: float = SLOW_S) -> list[str]:
    """The test ids in ``tests`` (``tests/test_x.py::name[param]`` -> seconds) that took over ``slow_s``
    and whose function's docstring does not say why ("Over 30 s: ..."). A test no longer in its file
    (renamed or removed since the run was recorded) is not judged: the next recording sees it."""
    sources: dict[str, dict[str, str]] = {}
    bad = []
    for node, seconds in tests.items():
        if seconds <= slow_s:
            continue
        file, _, name = node.partition("::")
        if file not in sources:
            path = repo / file
            sources[file] = _docstrings(path.read_text()) if path.is_file() else {}
        doc = sources[file].get(name.split("[", 1)[0])
        if doc is not None and not SAYS_WHY.search(doc):
            bad.append(node)
    return bad
