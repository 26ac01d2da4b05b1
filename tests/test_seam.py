"""The draft-algorithm seam says all it needs (``specforge/seam.py``): every registered algorithm plays
every member of every role, checked when the registry first hands it out (an algorithm missing one is
refused there, in one line naming it); each member is declared by one role; and the code outside the
algorithms reads of an algorithm only what a role declares."""

import ast
import sys
import types
from pathlib import Path

import pytest

import specforge.registry as registry
from specforge.registry import NAMES, get_algorithm
from specforge.seam import BINDING, ROLES, missing_members, role_members

ROOT = Path(__file__).resolve().parent.parent / "specforge"
OWN = ("algorithms", "seam.py", "registry.py")  # where an algorithm's own members may be read
# the names callers hold an algorithm by, and the lookups that return one
HOLDERS = {"algo", "algorithm", "bound", "alg"}
LOOKUPS = {"get_algorithm", "algorithm_of", "bound_algorithm", "by_gguf"}


def test_every_registered_algorithm_plays_every_role():
    for name in NAMES:
        algorithm = get_algorithm(name)  # the registry's own check passed
        assert missing_members(algorithm) == [], name
        assert name in registry._CHECKED


def test_each_member_is_declared_by_one_role():
    seen: dict[str, str] = {}
    for role in ROLES:
        for member in role_members(role):
            assert member not in seen, f"{member} is declared by {seen[member]} and {role.__name__}"
            seen[member] = role.__name__
    assert "reads_last_layer" in seen and "hf_config" in seen and "sp_halo" in seen


def test_an_algorithm_missing_a_member_is_refused_when_registered(monkeypatch):
    """A package whose ALGORITHM lacks ``owns_gguf`` is refused at its first lookup with one line naming
    ``Format.owns_gguf``. Control: the same object with every member passes."""
    members = {m: None for role in ROLES for m in role_members(role)}
    for name, algorithm in (("fake_whole", types.SimpleNamespace(**members)),
                            ("fake_short", types.SimpleNamespace(**{m: v for m, v in members.items()
                                                                    if m != "owns_gguf"}))):
        module = types.ModuleType(f"specforge.algorithms.{name}")
        module.ALGORITHM = algorithm
        monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(registry, "NAMES", NAMES + ("fake_whole", "fake_short"))
    assert get_algorithm("fake_whole") is sys.modules["specforge.algorithms.fake_whole"].ALGORITHM
    with pytest.raises(TypeError) as e:
        get_algorithm("fake_short")
    msg = str(e.value)
    assert msg.count("\n") == 0 and "'fake_short'" in msg and "lacks Format.owns_gguf:" in msg
    registry._CHECKED.discard("fake_whole")


def undeclared_reads(source: str) -> list[str]:
    """``line: name`` of each attribute read off an algorithm (a name ``HOLDERS`` lists, ``self.algo``,
    or a registry lookup's result) that no role declares and ``Binds`` does not add."""
    declared = {m for role in ROLES for m in role_members(role)} | set(BINDING)
    bad = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        held = (isinstance(v, ast.Name) and v.id in HOLDERS) or \
            (isinstance(v, ast.Attribute) and v.attr in HOLDERS) or \
            (isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id in LOOKUPS)
        if held and node.attr not in declared:
            bad.append(f"line {node.lineno}: {node.attr}")
    return bad


def test_callers_read_only_what_a_role_declares():
    """Every attribute the code outside the algorithms reads of an algorithm is a role's member. Control:
    a read of an undeclared one (``reads_last_layer`` was, before Configured declared it) is caught."""
    bad = [f"{path.relative_to(ROOT)} {v}" for path in sorted(ROOT.rglob("*.py"))
           if not str(path.relative_to(ROOT)).startswith(OWN) for v in undeclared_reads(path.read_text())]
    assert not bad, "\n".join(bad)
    assert undeclared_reads("top = algo.title\nx = get_algorithm(n).secret\nok = self.algo.loss\n") == [
        "line 1: title", "line 2: secret"]


def undocumented(package: Path) -> list[str]:
    """The modules of an algorithm package (or, for ``algorithms/`` itself, the packages) its
    ``__init__`` docstring does not name (in double backquotes)."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    if package.name == "algorithms":
        have = {p.name for p in package.iterdir() if (p / "__init__.py").is_file()}
        return sorted(f"{n}/" for n in have if f"``{n}/``" not in doc)
    return sorted(f.stem for f in package.glob("*.py") if f.stem != "__init__" and f"``{f.stem}``" not in doc)


def test_the_package_docstrings_name_what_is_there(tmp_path):
    """``algorithms/__init__.py`` names every algorithm package, and each package's docstring each of its
    modules. Control: a package whose docstring skips a module is reported."""
    root = ROOT / "algorithms"
    assert sorted(p.name for p in root.iterdir() if (p / "__init__.py").is_file()) == sorted(NAMES)
    assert {p.name: undocumented(p) for p in [root, *sorted(root.iterdir())] if (p / "__init__.py").is_file()} == \
        {p: [] for p in ["algorithms", *sorted(NAMES)]}
    (tmp_path / "__init__.py").write_text('"""``model`` (the draft)."""\n')
    (tmp_path / "model.py").write_text("")
    (tmp_path / "loss.py").write_text("")
    assert undocumented(tmp_path) == ["loss"]


def _folders():
    """A saved config.json of each algorithm's and a GGUF's (architecture, tensor names) of each
    llama.cpp serves, with the algorithm that owns it."""
    from specforge.algorithms.eagle31.export import GGUF_MARKER

    configs = [({"architectures": [get_algorithm(n).architecture]}, n) for n in NAMES if n not in ("eagle31", "mtp")]
    configs += [({"architectures": ["LlamaForCausalLMEagle3"], "norm_before_fc": True}, "eagle31"),
                ({"architectures": [get_algorithm("mtp").architecture], "speculators_model_type": "mtp"}, "mtp")]
    ggufs = [(("eagle3", set()), "eagle3"), (("eagle3", {GGUF_MARKER}), "eagle31"),
             (("dflash", set()), "dflash"), (("dflash", {"markov_w1.weight"}), "dspark")]
    return configs, ggufs


def test_who_owns_a_folder_does_not_depend_on_the_order_of_the_names(monkeypatch):
    """Each algorithm's folder and GGUF is its own, with the registry's names in either order (EAGLE-3.1
    refines EAGLE-3's folder, DSpark DFlash's GGUF: ``Format.refines``). Control: without EAGLE-3.1's
    ``refines`` both own its folder, and the registry says so instead of picking by order."""
    from specforge.registry import algorithm_name, by_gguf

    configs, ggufs = _folders()
    for names in (NAMES, tuple(reversed(NAMES))):
        monkeypatch.setattr(registry, "NAMES", names)
        assert [algorithm_name(c) for c, _ in configs] == [n for _, n in configs]
        assert [by_gguf(*g).name for g, _ in ggufs] == [n for _, n in ggufs]
    monkeypatch.setattr(type(get_algorithm("eagle31")), "refines", None)
    with pytest.raises(RuntimeError, match="eagle3, eagle31 each own the same folder"):
        algorithm_name(configs[-2][0])


def _dflash_step():
    """(bound DFlash algorithm, tiny fp64 draft, one micro-batch of random ids and features)."""
    import torch

    from specforge.config import load_config
    from specforge.models.features import TrainBatch
    from tests.helpers.dflash import tiny_draft

    cfg = load_config(None, ["draft.algorithm=dflash", "draft.block_size=4", "draft.num_anchors=3"])
    draft = tiny_draft()
    g = torch.Generator().manual_seed(0)
    B, T, c = 2, 24, draft.config
    ids = torch.randint(0, c.vocab_size - 1, (B, T), generator=g)
    batch = TrainBatch(ids, torch.ones_like(ids), torch.randn(B, T, c.context_width, generator=g, dtype=torch.float64),
                       torch.randn(B, T, c.hidden_size, generator=g, dtype=torch.float64),
                       torch.randint(0, c.vocab_size - 1, (B, T), generator=g))
    return get_algorithm("dflash").bind(cfg), draft, batch


def test_a_train_steps_hooks_under_no_grad_compute_the_train_step():
    """``training`` comes from the trainer, never from grad mode: a DFlash train step's normalizer and loss
    run under ``no_grad`` draw the train step's anchors (the same loss as with grad), while
    ``training=False`` (held-out metrics) draws the eval's: another loss (the control)."""
    import torch

    algo, draft, batch = _dflash_step()

    def loss(training):
        n = algo.normalizer(draft, batch, 5, training=training)
        return algo.loss(draft, batch, None, 5, n.reshape(()).double(), training=training)[0]

    with_grad = loss(True)
    assert with_grad.requires_grad
    with torch.no_grad():
        assert torch.equal(loss(True), with_grad.detach())
        assert not torch.equal(loss(False), with_grad.detach())


def test_each_block_draft_names_its_own_saved_format():
    """The block family's hooks reach a saved folder through the declared ``saved`` (``BlockFormat``), no
    module found by name: each algorithm's functions are its own export module's. Control: a DSpark
    that kept DFlash's would load DFlash's folder class."""
    from specforge.algorithms.dflash.export import FORMAT as DFLASH

    def own(name, saved) -> bool:
        return {f.__module__ for f in vars(saved).values()} == {f"specforge.algorithms.{name}.export"}

    blocks = [n for n in NAMES if hasattr(get_algorithm(n), "saved")]
    assert sorted(blocks) == ["dflash", "dflash2", "dspark", "xpress"]
    assert [n for n in blocks if not own(n, get_algorithm(n).saved)] == []
    assert not own("dspark", DFLASH)


FAMILY_BASE = {"dspark": "dflash", "dflash2": "dflash", "xpress": "dflash", "eagle31": "eagle3", "peagle": "eagle3"}


def sibling_imports(package: Path) -> list[str]:
    """``file: module`` of each import in an algorithm package of another algorithm's package than its
    family's base (DFlash's for the block drafts, EAGLE-3's for its refinements)."""
    own, base = package.name, FAMILY_BASE.get(package.name)
    bad = []
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specforge.algorithms."):
                other = node.module.split(".")[2]
                if other not in (own, base):
                    bad.append(f"{path.name}: {node.module}")
    return bad


def test_no_algorithm_imports_a_siblings_modules(tmp_path):
    """The block drafts take what they share from DFlash's package (``dflash/blocks.py``), never from each
    other. Control: an XPress module importing DFlash2's loss is reported."""
    root = ROOT / "algorithms"
    assert {n: sibling_imports(root / n) for n in NAMES} == {n: [] for n in NAMES}
    (tmp_path / "xpress").mkdir()
    (tmp_path / "xpress" / "loss.py").write_text("from specforge.algorithms.dflash2.loss import rows_at\n")
    assert sibling_imports(tmp_path / "xpress") == ["loss.py: specforge.algorithms.dflash2.loss"]


def test_a_block_drafts_anchors_and_targets_are_drawn_once_per_micro_batch(monkeypatch):
    """The normalizer's draw of a micro-batch's anchors and targets is the loss's (``blocks.DrawnOnce``):
    one draw for both, for DFlash and the shifted layouts alike; another step draws again."""

    import specforge.algorithms.dflash.algorithm as dflash_algorithm

    draws = []
    real = dflash_algorithm.sample_anchors
    monkeypatch.setattr(dflash_algorithm, "sample_anchors", lambda *a, **k: draws.append(1) or real(*a, **k))
    algo, draft, batch = _dflash_step()
    for step in (1, 2):
        n = algo.normalizer(draft, batch, step, training=True)
        algo.loss(draft, batch, None, step, n.reshape(()).double(), training=True)
    assert len(draws) == 2  # one a step: the loss took the normalizer's


# a value other than every algorithm's default for each shared draft key
OTHER = {"intermediate_size": 96, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8,
         "rope_theta": 12345.0, "rms_norm_eps": 1e-3}


def _draft_config(algorithm: str, *overrides: str):
    """The config of the draft ``algorithm`` builds (on the meta device, as the dry run does) for a tiny target."""
    import torch
    from transformers import LlamaConfig

    from specforge.config import load_config
    from specforge.dryrun import meta_models

    target = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return meta_models(load_config(None, [f"draft.algorithm={algorithm}", *overrides]), target, torch.float32)[1].config


def test_the_shared_draft_keys_are_read_by_every_algorithm():
    """``DraftConfig`` holds only keys every algorithm reads: each one set reaches every algorithm's draft
    (``algorithm`` picks the class, ``init_from`` is read by training/init_from.py for all). A key only some
    read belongs in their options: EAGLE-3's ``vocab_size`` is refused for DFlash in one line. Control: the
    check fails for a key that does not reach the draft (EAGLE-3's vocab_size is its draft_vocab_size, not
    its config's vocab_size, the target's)."""
    import dataclasses

    from specforge.config import DraftConfig, load_config

    shared = {f.name for f in dataclasses.fields(DraftConfig)} - {"algorithm", "init_from"}
    assert shared == set(OTHER), "a new shared draft key: add it to OTHER, and check every algorithm reads it"
    for name in NAMES:
        for key, value in OTHER.items():
            assert getattr(_draft_config(name, f"draft.{key}={value}"), key) == value, (name, key)
    assert _draft_config("eagle3", "draft.vocab_size=200").vocab_size != 200  # the control
    with pytest.raises(ValueError, match=r"'draft\.vocab_size'=200 applies to draft\.algorithm=eagle3, not dflash"):
        load_config(None, ["draft.algorithm=dflash", "draft.vocab_size=200"])
