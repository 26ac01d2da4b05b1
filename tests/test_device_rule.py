"""Every tensor the package makes is made on a device someone chose.

On one device a tensor made on the default device (the CPU) meets the data without complaint; on a
GPU it stops the run at its first step ("Expected all tensors to be on the same device"): e.g. a
weight made on the CPU times a CUDA mask, or a CPU ``t2d`` indexed with CUDA ids when a hook sees a
micro-batch before the trainer moves it. Two checks close the class on a CPU-only machine:

* a rule over the source: a tensor factory call (``torch.zeros``, ``torch.arange``, ...; and the
  package's own functions that take a ``device`` and return a tensor, such as ``decay_weights``)
  names its ``device=``, or its line carries a ``# device:`` comment saying why the default device
  is right there (host-side collate, a module's parameters made on the default device, which the
  dry run sets to ``meta``);
* the trainer: every algorithm hook receives micro-batches the trainer has already moved to its
  device (``DraftTrainer.on_device``), whatever device the source left each field on.
"""

import ast
import contextlib
import dataclasses
from pathlib import Path

import pytest
import torch

from specforge.models.features import TrainBatch

ROOT = Path(__file__).resolve().parents[1] / "specforge"
TORCH_FACTORIES = {"zeros", "ones", "empty", "full", "arange", "tensor", "as_tensor", "randn", "rand", "randint",
                   "randperm", "eye", "linspace", "logspace", "empty_strided", "scalar_tensor"}
MARK = "# device:"


def own_factories(sources: dict[str, str]) -> dict[str, int]:
    """The package's functions that take a ``device`` and return a tensor: name -> the position of
    ``device`` among the call's positional arguments."""
    out = {}
    for src in sources.values():
        for node in ast.walk(ast.parse(src)):
            if not isinstance(node, ast.FunctionDef) or node.returns is None:
                continue
            if ast.unparse(node.returns) not in ("torch.Tensor", "Tensor"):
                continue
            args = [a.arg for a in node.args.posonlyargs + node.args.args]
            if "device" in args:
                out[node.name] = args.index("device") - (1 if args[0] in ("self", "cls") else 0)
            elif "device" in [a.arg for a in node.args.kwonlyargs]:
                out[node.name] = 10**6
    return out


def unplaced(src: str, own: dict[str, int]) -> list[tuple[int, str]]:
    """``(line, call)`` of each factory call in ``src`` that neither names a device nor is marked."""
    lines = src.splitlines()
    found = []
    for node in ast.walk(ast.parse(src)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "torch":
            if f.attr not in TORCH_FACTORIES:
                continue
            positional_device = None
        elif isinstance(f, ast.Name) and f.id in own:
            positional_device = own[f.id]
        else:
            continue
        if any(k.arg == "device" or k.arg is None for k in node.keywords):
            continue
        if positional_device is not None and len(node.args) > positional_device:
            continue
        if any(MARK in lines[i - 1] for i in range(node.lineno, (node.end_lineno or node.lineno) + 1)):
            continue
        found.append((node.lineno, ast.get_source_segment(src, node).splitlines()[0][:90]))
    return found


def package_sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT.parent)): p.read_text() for p in sorted(ROOT.rglob("*.py"))}


def test_every_tensor_factory_in_the_package_names_its_device():
    sources = package_sources()
    own = own_factories(sources)
    assert "decay_weights" in own  # the factory that stopped DFlash's first GPU step is covered
    bad = [f"{name}:{line}: {call}" for name, src in sources.items() for line, call in unplaced(src, own)]
    assert not bad, ("tensor factories without device= (name the device of the data the tensor meets, or mark "
                     f"the line '{MARK} <why the default device is right>'):\n" + "\n".join(bad))


def test_the_device_rule_flags_what_it_should_negative_control():
    own = own_factories({"m": "import torch\ndef weights(k: int, gamma: float, device: torch.device) -> torch.Tensor:\n"
                              "    pass\n"})
    assert own == {"weights": 2}
    src = "\n".join([
        "import torch",
        "a = torch.arange(3)",                           # flagged
        "b = torch.zeros(2, 3, dtype=torch.bool)",       # flagged
        "c = torch.ones(3, device=x.device)",            # placed
        "d = torch.zeros_like(x)",                       # takes x's device: not a factory here
        "e = torch.empty(3)  # device: module init",     # marked
        "f = x * weights(4, 0.5)",                       # flagged: the DFlash bug's shape
        "g = x * weights(4, 0.5, x.device)",             # placed positionally
        "h = torch.tensor(",                             # flagged (a call over two lines)
        "    [1.0])",
        "i = torch.tensor(",                             # marked on its second line
        "    [1.0])  # device: host counters",
    ])
    assert sorted(line for line, _ in unplaced(src, own)) == [2, 3, 7, 9]


# ------------------------------------------------------------------------ the trainer's one move


class _Spy:
    """An algorithm whose hooks record whether each micro-batch they get went through ``.to``."""

    def __init__(self, algorithm):
        self.inner, self.seen = algorithm, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _record(self, hook, batch):
        self.seen.append((hook, getattr(batch, "moved", False)))

    def normalizer(self, draft, batch, step, *, training):
        self._record("normalizer", batch)
        return self.inner.normalizer(draft, batch, step, training=training)

    def loss(self, draft, batch, state, step, normalizer, *, training):
        self._record("loss", batch)
        return self.inner.loss(draft, batch, state, step, normalizer, training=training)


@dataclasses.dataclass
class _Tracked(TrainBatch):
    """A micro-batch as a source may hand it over; ``to`` marks the copy it returns as moved."""

    moved: bool = False

    def to(self, device):
        fields = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(TrainBatch)}
        return _Tracked(**fields, moved=True)


@pytest.mark.parametrize("evaluate", [False, True])
def test_every_hook_sees_micro_batches_already_on_the_trainers_device(evaluate):
    from tests.helpers.trainer import feature_batch, setup_trainer

    target, rows, trainer = setup_trainer()
    trainer.algorithm = spy = _Spy(trainer.algorithm)
    mbs = []
    for part in (rows[:2], rows[2:]):
        b = feature_batch(target, part)
        mbs.append(_Tracked(**{f.name: getattr(b, f.name) for f in dataclasses.fields(TrainBatch)}))
    m = trainer.evaluate(mbs) if evaluate else trainer.step(mbs)
    assert m["loss"] == m["loss"]  # a number
    hooks = [h for h, _ in spy.seen]
    assert hooks == (["loss"] * 2 if evaluate else ["normalizer"] * 2 + ["loss"] * 2), hooks
    assert all(moved for _, moved in spy.seen), spy.seen
    # negative control: a trainer that skipped its move would hand the hooks the sources' batches
    spy.seen.clear()
    trainer.on_device = lambda batches: list(batches)
    trainer.evaluate(mbs) if evaluate else trainer.step(mbs)
    assert not any(moved for _, moved in spy.seen)


# ------------------------------------------------------------- checkpoints across devices


@contextlib.contextmanager
def saved_as_if_on_cuda():
    """``torch.save`` inside tags every storage ``cuda:0``, as a save on a GPU does; loading such a
    file on a machine without CUDA and without ``map_location`` then fails as it does for real."""
    from torch import serialization

    entry = (-100, lambda storage: "cuda:0", lambda storage, location: None)  # deserializing: the usual path
    serialization._package_registry.append(entry)
    serialization._package_registry.sort(key=lambda e: e[0])
    try:
        yield
    finally:
        serialization._package_registry.remove(entry)


def test_a_checkpoint_saved_on_cuda_resumes_and_evaluates_on_a_cpu_only_machine(tmp_path):
    from specforge.compat import check_target_weights
    from specforge.data.vocab import DraftVocab
    from specforge.registry import load_draft
    from specforge.training.checkpoint import CheckpointManager, load_train_state
    from specforge.training.trainer import run_identity
    from tests.helpers.trainer import feature_batch, setup_trainer

    target, rows, trainer = setup_trainer()
    batch = feature_batch(target, rows)
    trainer.step([batch])
    identity = run_identity(trainer.algorithm, trainer.cfg, target, DraftVocab(trainer.draft.d2t, trainer.draft.t2d),
                            {"data": "d", "num_samples": 4, "global_batch": 4}, total_steps=10)
    with saved_as_if_on_cuda():
        path = CheckpointManager(tmp_path, identity=identity).save(trainer)
    if not torch.cuda.is_available():  # the negative control: the file does record CUDA storages
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(path / "training_state.pt", weights_only=False)
    assert load_train_state(path)["step"] == 1
    _, _, fresh = setup_trainer()
    assert CheckpointManager(tmp_path, identity=identity).load(fresh, path) == 1  # resume
    after = fresh.step([batch])
    assert after["loss"] == trainer.step([batch])["loss"]  # the same next step as the run that saved it
    assert check_target_weights(path, target.model, allow=False) is None  # eval's fingerprint check
    draft = load_draft(str(path), target)
    assert {p.device.type for p in draft.parameters()} == {"cpu"}
