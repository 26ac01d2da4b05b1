from pathlib import Path

import pytest

from specforge.config import Config, draft_options, load_config, parse_override

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


def test_there_are_shipped_configs():
    names = {p.name for p in CONFIGS}
    assert {"smollm2-135m-cpu.yaml", "llama3.1-8b-instruct.yaml", "qwen3-8b.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    assert type(cfg.draft) is draft_options(cfg.draft.algorithm)  # its algorithm's own keys


def test_defaults_and_overrides(tmp_path):
    cfg = load_config(None, ["train.lr=1e-4", "draft.ttt_length=3", "model.aux_layer_ids=[1,2,3]", "ray.address=auto"])
    assert cfg.train.lr == pytest.approx(1e-4) and isinstance(cfg.train.lr, float)
    assert cfg.draft.ttt_length == 3
    assert cfg.model.aux_layer_ids == [1, 2, 3]
    assert cfg.ray.address == "auto"
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  lr: 2\n  max_minutes: null\n")
    cfg = load_config(f, ["train.max_steps=7"])
    assert cfg.train.lr == 2.0 and cfg.train.max_steps == 7 and cfg.train.max_minutes is None


def test_unknown_key_names_the_dotted_key(tmp_path):
    with pytest.raises(ValueError, match=r"'train\.lrr'.*allowed.*\blr\b"):
        load_config(None, ["train.lrr=1"])
    f = tmp_path / "c.yaml"
    f.write_text("draft:\n  vocab_size: 10\n  bogus: 1\n")
    with pytest.raises(ValueError, match=r"'draft\.bogus'"):
        load_config(f)
    with pytest.raises(ValueError, match=r"unknown config key 'nosection'"):
        load_config(None, ["nosection.x=1"])


@pytest.mark.parametrize(
    "override, pattern",
    [
        ("train.max_steps=ten", r"'train\.max_steps'.*expected int"),
        ("train.max_steps=1.5", r"'train\.max_steps'"),
        ("placement.mode=sideways", r"'placement\.mode'.*'colocated'"),
        ("train.batch_size=true", r"'train\.batch_size'"),
        ("model.aux_layer_ids=[1,x]", r"'model\.aux_layer_ids\[1\]'"),
        ("train=3", r"'train'.*mapping"),
        ("draft.ttt_length=0", r"'draft\.ttt_length'"),
    ],
)
def test_wrong_type_or_value_names_the_key(override, pattern):
    with pytest.raises(ValueError, match=pattern):
        load_config(None, [override])


def test_bad_override_syntax_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="section.key=value"):
        parse_override("train.lr")
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_store_and_regenerate_sections():
    cfg = load_config(None, ["store.dtype=int8", "regenerate.temperature=0.7", "regenerate.max_turns=1"])
    assert (cfg.store.dtype, cfg.regenerate.temperature, cfg.regenerate.max_turns) == ("int8", 0.7, 1)
    with pytest.raises(ValueError, match="store.dtype"):
        load_config(None, ["store.dtype=fp4"])
