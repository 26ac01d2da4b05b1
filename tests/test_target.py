import importlib.metadata
from pathlib import Path

import pytest
import torch

from specforge.algorithms.eagle3.algorithm import aux_layer_ids
from specforge.config import ModelConfig
from specforge.models.target import TargetModel, argmax_chunked, capture, resolve_target_path
from tests.helpers.models import tiny_target


@pytest.mark.parametrize("tie", [False, True])
def test_capture_matches_output_hidden_states(tie):
    model = tiny_target(tie=tie)
    layers = aux_layer_ids(ModelConfig(), model.config.num_hidden_layers)
    assert layers == [1, 2, 2]  # [1, L//2 - 1, L - 4] for L = 6
    target = TargetModel(model=model, tokenizer=None, aux_layer_ids=layers, device=torch.device("cpu"))
    ids = torch.randint(0, 320, (2, 17))
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0  # right padding in the second row
    feats = capture(target, ids, mask, chunk_tokens=5)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    hs = ref.hidden_states  # hs[i + 1] = output of layer i; hs[-1] is after the final norm
    want_aux = torch.cat([hs[i + 1] for i in layers], dim=-1)
    assert feats.aux_hidden_BTKH.shape == (2, 17, 3 * 48)
    torch.testing.assert_close(feats.aux_hidden_BTKH, want_aux)
    torch.testing.assert_close(feats.last_hidden_BTH, hs[-1])
    assert torch.equal(feats.target_ids_BT, ref.logits.argmax(-1))


def test_argmax_chunked_equals_full():
    h = torch.randn(37, 16)
    w = torch.randn(101, 16)
    assert torch.equal(argmax_chunked(h, w, 4), (h @ w.T).argmax(-1))


def test_aux_layer_ids_override_and_range():
    assert aux_layer_ids(ModelConfig(aux_layer_ids=[0, 3, 6]), 8) == [0, 3, 6]
    with pytest.raises(ValueError, match="model.aux_layer_ids"):
        aux_layer_ids(ModelConfig(aux_layer_ids=[1, 3, 7]), 8)  # 0..L-2 (tests/test_bad_input.py has the rest)


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        resolve_target_path(ModelConfig(target_path=str(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        resolve_target_path(ModelConfig(target_path=str(tmp_path / "empty")))


def test_capture_attention_avoids_materialized_scores_where_transformers_can():
    """A class without SDPA (gpt-oss: attention sinks) captures with flex attention on CUDA (sinks
    folded in by log-sum-exp: no B x H x T x T scores), eager on the CPU (transformers' flex cannot
    take sinks there; the dry run counts the scores); every other family keeps transformers' SDPA."""
    from dataclasses import replace

    from specforge.models.target import capture_attention
    from specforge.targets import FAMILIES

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    by_name = {f.name: f for f in FAMILIES}
    assert capture_attention(by_name["gpt_oss"], gpu) == "flex_attention"
    assert capture_attention(by_name["gpt_oss"], cpu) == "eager"
    assert {capture_attention(f, d) for f in FAMILIES if f.name != "gpt_oss" for d in (cpu, gpu)} == {"default"}
    # negative control: a class with neither SDPA nor flex falls back to eager on CUDA too
    import transformers

    class NoFlex(transformers.GptOssForCausalLM):
        _supports_flex_attn = False

    transformers.NoFlexForTest = NoFlex
    try:
        assert capture_attention(replace(by_name["gpt_oss"], hf_class="NoFlexForTest"), gpu) == "eager"
    finally:
        del transformers.NoFlexForTest


def test_the_embedded_conversion_is_shared_by_every_venv_with_the_same_package(tmp_path, monkeypatch):
    """The converted embedded target is named by the package's version and the GGUF's name and size, not by
    the venv it lies in: a second venv (a fresh clone's) reuses it. Controls: another size or another
    version is converted again."""
    from specforge.models import target as t

    converted = []
    monkeypatch.setattr(t, "_convert_embedded", lambda gguf, out: (converted.append(gguf), out.mkdir(),
                                                                   (out / "config.json").write_text("{}")))
    cfg = ModelConfig(cache_dir=str(tmp_path / "cache"))

    def gguf_in(venv: str, size: int = 64) -> Path:
        f = tmp_path / venv / t._GGUF_NAME
        f.parent.mkdir(exist_ok=True)
        f.write_bytes(b"\0" * size)
        monkeypatch.setattr(t, "embedded_gguf_path", lambda: f)
        return f

    gguf_in("venv-a")
    first = resolve_target_path(cfg)
    gguf_in("venv-b")
    assert resolve_target_path(cfg) == first and len(converted) == 1
    gguf_in("venv-c", size=65)  # control: another file
    assert resolve_target_path(cfg) != first and len(converted) == 2
    gguf_in("venv-d")
    version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.9.9" if name == t._GGUF_DIST else version(name))
    assert resolve_target_path(cfg) != first and len(converted) == 3  # control: another release of the package


def test_a_conversion_published_first_by_another_process_is_kept(tmp_path):
    """Two first uses at once (two runs, two test workers): the second to finish keeps the first's folder
    instead of failing on it; a folder there that is not a finished conversion still fails
    (``files.publish_folder``, as the embedded conversion calls it)."""
    from specforge.files import publish_folder

    def _publish(tmp, out):
        publish_folder(tmp, out, "config.json")

    out, mine = tmp_path / "model", tmp_path / ".convert-mine"
    for d, text in ((out, "theirs"), (mine, "mine")):
        d.mkdir()
        (d / "config.json").write_text(text)
    _publish(mine, out)
    assert (out / "config.json").read_text() == "theirs"
    (out / "config.json").rename(out / "partial")  # control: a folder without config.json is no conversion
    with pytest.raises(OSError):
        _publish(mine, out)
    fresh = tmp_path / "fresh"
    _publish(mine, fresh)
    assert (fresh / "config.json").read_text() == "mine" and not mine.exists()
