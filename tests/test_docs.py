"""docs/ARCHITECTURE.md against the code: its module tree and its "Interfaces" section.

* every file and folder of the module tree exists under ``specforge/``;
* every quoted name of the Interfaces section exists: a module path is a file, a name resolves in
  the module its bullet opens with (or as ``specforge.<dotted>``, an attribute, a dataclass field, a
  parameter of a signature quoted beside it, or a config key), a quoted signature lists the real
  parameters in their order (``...`` for any run of them, left-out trailing ones must have
  defaults) with the defaults it writes, a value list after a config key is that key's values;
* the docs cite nothing outside the repository;
* negative controls: a name, a parameter order, a default, a file and a value list that are not
  the code's each fail.

Nothing loads a model: the names resolve on imported modules only.
"""

import ast
import dataclasses
import importlib
import inspect
import re
import typing
from pathlib import Path
from types import ModuleType

import pytest

from specforge.config import load_config

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ARCHITECTURE.md"
SPAN = re.compile(r"`([^`]+)`")
CALL = re.compile(r"^\.?([A-Za-z_][\w.]*)\(")
NAME = re.compile(r"^\.?[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


# ---------------------------------------------------------------- reading the page

def section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def bullets(text: str) -> list[str]:
    """The section's bullets, each joined to one line."""
    out, cur = [], None
    for line in text.splitlines():
        if line.startswith("* "):
            cur = [line[2:]]
            out.append(cur)
        elif cur is not None and line.startswith("  "):
            cur.append(line.strip())
        else:
            cur = None
    return [" ".join(b) for b in out]


def tree_paths(text: str) -> list[str]:
    """The files and folders of the module tree (the first code block), as paths under the repo."""
    block = text.split("```", 2)[1]
    paths, stack = [], []
    for line in block.splitlines():
        m = re.match(r"^( *)(\S+)", line)
        if not m or not (m.group(2).endswith("/") or m.group(2).endswith(".py")):
            continue  # a continuation line of a description
        depth = len(m.group(1)) // 2
        if depth > len(stack):  # deeper than any folder above: a description's own word
            continue
        del stack[depth:]
        name = m.group(2)
        paths.append("/".join(stack + [name.rstrip("/")]))
        if name.endswith("/"):
            stack.append(name.rstrip("/"))
    return paths


# ---------------------------------------------------------------- resolving names

def _module(dotted: str):
    for name in (f"specforge.{dotted}", dotted):
        if name.split(".")[0] != "specforge":
            continue
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            pass
    return None


def _attr(obj, name: str):
    if not isinstance(obj, type):
        if hasattr(obj, name):
            return getattr(obj, name)
    elif dataclasses.is_dataclass(obj) and name in {f.name for f in dataclasses.fields(obj)}:
        return dataclasses.MISSING  # a field of a class: it exists, with nothing to walk further
    else:
        for klass in obj.__mro__:
            if name in vars(klass):
                return getattr(obj, name)
    raise AttributeError(name)


def _walk(obj, parts: list[str]):
    for p in parts:
        obj = _attr(obj, p)
    return obj


def _config_values(key: str):
    """The config key's value (``model.num_gpus``), or AttributeError; its Literal values if any."""
    cfg = load_config(None)
    *path, last = key.split(".")
    obj = _walk(cfg, path) if path else cfg
    if not dataclasses.is_dataclass(obj) or last not in {f.name for f in dataclasses.fields(obj)}:
        raise AttributeError(key)
    tp = typing.get_type_hints(type(obj))[last]
    return typing.get_args(tp) if typing.get_origin(tp) is typing.Literal else None


class Context:
    """One bullet: its module, the objects quoted so far (for ``.attr`` and bare fields), the
    parameter names of its quoted signatures, the last config key (for a value list)."""

    def __init__(self, module: ModuleType):
        self.module, self.objects, self.params, self.key = module, [], set(), None

    def resolve(self, dotted: str):
        head, *rest = dotted.lstrip(".").split(".")
        if not dotted.startswith("."):
            if hasattr(self.module, head):
                return _walk(getattr(self.module, head), rest)
            for i in range(len(rest), -1, -1):  # the longest module prefix, then attributes
                mod = _module(".".join([head, *rest[:i]]))
                if mod is not None:
                    return _walk(mod, rest[i:])
        for obj in reversed(self.objects):  # `.attr`, or a field of a class quoted before
            try:
                return _walk(obj, [head, *rest])
            except AttributeError:
                pass
        if not rest and head in self.params:
            return None
        raise AttributeError(f"{dotted!r} is not in {self.module.__name__} nor quoted beside it")


def _params(text: str) -> list[tuple[str, str | None]]:
    out = []
    for part in (p.strip() for p in re.split(r",(?![^()\[\]]*[)\]])", text) if p.strip()):
        if part in ("...", "*"):
            out.append(("...", None))
            continue
        name, eq, default = part.partition("=")
        out.append((name.split(":")[0].strip().lstrip("*"), default.strip() if eq else None))
    return out


def _match(quoted: list, real: list[inspect.Parameter]) -> bool:
    if not quoted:
        return all(p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                   for p in real)
    (name, default), rest = quoted[0], quoted[1:]
    if name == "...":
        return any(_match(rest, real[i:]) for i in range(len(real) + 1))
    if not real or real[0].name != name:
        return False
    if default is not None and default != "..." and real[0].default is not inspect.Parameter.empty:
        try:
            if ast.literal_eval(default) != real[0].default:
                return False
        except ValueError:
            pass  # not a literal (``identity``): the name is what is checked
    return _match(rest, real[1:])


def parse_call(span: str) -> tuple[str, str, str]:
    """``name(args) -> ret`` as (name, args, ret); the args end at the parenthesis that closes."""
    m = CALL.match(span)
    depth = 0
    for i in range(m.end() - 1, len(span)):
        depth += {"(": 1, ")": -1}.get(span[i], 0)
        if depth == 0:
            break
    ret = span[i + 1:].strip()
    return m.group(1), span[m.end():i], ret[2:].strip() if ret.startswith("->") else ""


def check_signature(ctx: Context, span: str) -> None:
    name, args, ret = parse_call(span)
    obj = ctx.resolve(("." if span.startswith(".") else "") + name)
    real = list(inspect.signature(obj).parameters.values())
    if real and real[0].name == "self" and not isinstance(obj, type):
        real = real[1:]
    quoted = _params(args)
    if not _match(quoted, real):
        raise AssertionError(f"`{span}`: the code has {name}({', '.join(p.name for p in real)})")
    ctx.params.update(n for n, _ in quoted if n != "...")
    ctx.objects.append(obj)
    if ret and re.fullmatch(r"[A-Z]\w*", ret.strip()):
        ctx.objects.append(ctx.resolve(ret.strip()))


def check_span(ctx: Context, span: str) -> None:
    span = span.strip()
    if span.startswith('"') and span.endswith('"'):  # a string the module uses (a dict key)
        assert span in inspect.getsource(ctx.module), f"`{span}` is not in {ctx.module.__name__}"
    elif CALL.match(span):
        check_signature(ctx, span)
    elif "/" in span or span.endswith((".py", ".md")):
        for path in span.split():
            if ("/" in path or path.endswith((".py", ".md"))) and re.fullmatch(r"[\w./-]+", path):
                assert (ROOT / path).exists() or (ROOT / "specforge" / path).exists(), f"`{span}`: no such file"
    elif "|" in span:
        values = tuple(v.strip() for v in span.split("|"))
        assert ctx.key is not None, f"`{span}`: a value list with no config key before it"
        assert set(values) == set(_config_values(ctx.key)), \
            f"`{span}`: {ctx.key} takes {_config_values(ctx.key)}"
    elif NAME.match(span):
        if ctx.key is not None and span in (_config_values(ctx.key) or ()):
            return  # one of the values of the config key quoted before it
        try:
            ctx.objects.append(ctx.resolve(span))
        except AttributeError:
            _config_values(span)  # a config key, or AttributeError naming the span
            ctx.key = span


def check_interfaces(text: str) -> None:
    for bullet in bullets(section(text, "Interfaces")):
        spans = SPAN.findall(bullet)
        opening = spans[0]
        assert opening.startswith("specforge/") and opening.endswith(".py"), bullet[:80]
        assert (ROOT / opening).is_file(), f"`{opening}`: no such file"
        ctx = Context(importlib.import_module(opening[:-3].replace("/", ".")))
        for span in spans[1:]:
            try:
                check_span(ctx, span)
            except AttributeError as e:
                raise AssertionError(f"`{span}` ({opening}): {e}") from None


# ---------------------------------------------------------------- the page as it is

def test_the_module_tree_names_files_that_exist():
    paths = tree_paths(DOC.read_text())
    assert "specforge/training/trainer.py" in paths and "specforge/algorithms/eagle3" in paths, paths
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, missing


def test_every_name_and_signature_of_the_interfaces_section_is_in_the_code():
    text = DOC.read_text()
    assert len(bullets(section(text, "Interfaces"))) >= 8
    check_interfaces(text)


def test_the_docs_cite_nothing_outside_the_repository():
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        assert "../" not in text and "shared/" not in text, doc


# ---------------------------------------------------------------- negative controls

def _one_bullet(body: str) -> str:
    return f"intro\n\n## Interfaces\n\n* {body}\n\n## Next\n"


@pytest.mark.parametrize("body, says", [
    ("`specforge/models/target.py`: `load_target_model(cfg)`", "load_target_model"),
    ("`specforge/algorithms/eagle3/loss.py`: `ttt.COUNTERS`", "ttt.COUNTERS"),
    ("`specforge/training/trainer.py`: `DraftTrainer(draft, state, cfg, device, algorithm=None)`",
     "DraftTrainer(algorithm, draft"),
    ("`specforge/models/target.py`: `capture(target, input_ids_BT, attention_mask_BT, chunk_tokens=512)`",
     "capture"),
    ("`specforge/training/checkpoint.py`: `CheckpointManager(root)`: `.store(trainer)`", "store"),
    ("`specforge/train/trainer.py`: `DraftTrainer`", "no such file"),
    ("`specforge/data/vocab.py`: `DraftVocab`, see `docs/NOWHERE.md`", "no such file"),
    ("`specforge/data/prepare.py`: `\"token_ids\"`", "token_ids"),
    ("`specforge/algorithms/eagle3/attention.py`: `draft.attention` is `auto | sdpa | flash`", "draft.attention"),
])
def test_a_page_whose_name_is_not_the_codes_fails(body, says):
    with pytest.raises(AssertionError, match=re.escape(says)):
        check_interfaces(_one_bullet(body))


def test_the_checks_pass_the_same_bullets_when_they_are_right():
    for body in ["`specforge/models/target.py`: `load_target(cfg, ..., engine_for=None) -> TargetModel` (`.split`)",
                 "`specforge/algorithms/eagle3/loss.py`: `COUNTERS`, `ttt_loss(draft, batch, teacher_weight_NH, ...)`",
                 "`specforge/training/checkpoint.py`: `CheckpointManager(root)`: `.save(trainer)`",
                 "`specforge/algorithms/eagle3/attention.py`: `draft.attention`: `flex | eager | sdpa | fast | auto`"]:
        check_interfaces(_one_bullet(body))


def test_a_tree_entry_that_does_not_exist_is_reported():
    text = "x\n```\nspecforge/\n  training/\n    trainer.py   the step\n    ttt.py       gone\n```\n"
    paths = tree_paths(text)
    assert paths == ["specforge", "specforge/training", "specforge/training/trainer.py", "specforge/training/ttt.py"]
    assert [p for p in paths if not (ROOT / p).exists()] == ["specforge/training/ttt.py"]
