"""With an engine computing the hidden states, a process that only sends features on (a rollout worker)
reads the final norm, the output embedding and the input embeddings from the checkpoint's files and nothing
else (``load_target(..., head_only=True)``, ``models/target.head_only_model``)."""

import concurrent.futures
import dataclasses

import pytest
import torch
from safetensors.torch import save_file

from specforge.config import load_config
from specforge.models.target import (
    _read_tensor,
    capture,
    checkpoint_key,
    dequantize_fp8,
    head_only_model,
    load_target,
)
from tests.helpers.targets import NAMES, overrides, target_folder


def _load(root, head_only: bool):
    cfg = load_config(None, [*overrides(root), "model.dtype=bfloat16"])
    return load_target(cfg.model, torch.device("cpu"), engine_for=lambda *a: "engine", head_only=head_only)


@pytest.mark.parametrize("family", NAMES)
def test_a_capture_process_reads_only_the_head_and_gets_the_same_tensors(family, tmp_path, capsys):
    """Every family (image-text ones and transformers' renamed keys included): the three tensors equal the
    whole model's load, in the same dtype, and no decoder layer holds a weight (all on the meta device).
    Control: the whole model's load holds them. No fallback note is printed."""
    target_folder(family, tmp_path)
    whole, head = _load(tmp_path, False), _load(tmp_path, True)
    for name in ("final_norm_scale_H", "lm_head_weight_VH", "embed_weight_VH"):
        a, b = getattr(whole, name), getattr(head, name)
        assert a.dtype == b.dtype and not b.is_meta and torch.equal(a, b), name
    assert all(p.is_meta for p in head.decoder_layers.parameters())
    assert not any(p.is_meta for p in whole.decoder_layers.parameters())  # the control
    assert head.config.num_hidden_layers == whole.config.num_hidden_layers
    assert "whole model loads" not in capsys.readouterr().err


class _Engine:
    """An engine's answers: each row's captured layers and its last layer, [T, K + 1, H]."""

    computes_apart = False  # on this process' cores (as a CPU engine): one batch at a time

    def __init__(self, K: int, H: int):
        self.K, self.H = K, H

    def submit(self, rows):
        out = []
        for r in rows:
            f = concurrent.futures.Future()
            g = torch.Generator().manual_seed(len(r))
            f.set_result(torch.randn(len(r), self.K + 1, self.H, generator=g).to(torch.bfloat16))
            out.append(f)
        return out


def test_the_features_of_a_head_only_target_equal_the_whole_ones(tmp_path):
    """The capture from an engine's states (final norm, argmax through the lm_head) is the same from either
    load, token for token; control: another final norm changes the last hidden state."""
    target_folder("llama", tmp_path)
    whole, head = _load(tmp_path, False), _load(tmp_path, True)
    for t in (whole, head):
        t.engine = _Engine(len(t.aux_layer_ids), t.config.hidden_size)
    ids = torch.randint(0, 19, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    a, b = capture(whole, ids, mask), capture(head, ids, mask)
    for name in ("aux_hidden_BTKH", "last_hidden_BTH", "target_ids_BT"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    with torch.no_grad():
        head.model.model.norm.weight.add_(0.5)
    assert not torch.equal(capture(head, ids, mask).last_hidden_BTH, a.last_hidden_BTH)  # the control


def test_a_key_is_matched_by_its_longest_tail_and_only_once():
    files = dict.fromkeys(["language_model.model.norm.weight", "language_model.model.layers.0.input_layernorm.weight",
                           "lm_head.weight", "vision.a.norm.weight", "vision.b.norm.weight"], "x")
    assert checkpoint_key("lm_head.weight", files) == "lm_head.weight"  # itself
    assert checkpoint_key("model.language_model.norm.weight", files) is None  # three keys end in norm.weight
    del files["vision.a.norm.weight"], files["vision.b.norm.weight"]
    assert checkpoint_key("model.language_model.norm.weight", files) == "language_model.model.norm.weight"
    assert checkpoint_key("model.embed_tokens.weight", files) is None  # nowhere; never by "weight" alone


def _dequantized_by_blocks(w_q, s, r, c):
    """The reference: each tile multiplied by its own scale, one tile at a time, in fp64."""
    out = torch.empty(w_q.shape, dtype=torch.float64)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            tile = (slice(i * r, (i + 1) * r), slice(j * c, (j + 1) * c))
            out[tile] = w_q[tile].double() * float(s[i, j])
    return out


def test_fp8_weights_come_back_dequantized_tile_by_tile(tmp_path):
    """A block-scaled FP8 tensor (DeepSeek-V3's ``weight_scale_inv`` layout, shapes not a multiple of the
    block) read as ``head_only_model`` reads it equals the per-tile reference within bf16's rounding.
    Control: without its scales the raw FP8 values come back, far from it."""
    torch.manual_seed(0)
    w = torch.randn(37, 20) * torch.linspace(0.01, 30, 20)
    r, c = 16, 8
    s = torch.rand(3, 3) + 0.5
    w_q = (w / s.repeat_interleave(r, 0)[:37].repeat_interleave(c, 1)[:, :20]).to(torch.float8_e4m3fn)
    want = _dequantized_by_blocks(w_q, s, r, c)
    got = dequantize_fp8(w_q, s, (r, c))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=2 ** -8, atol=0)  # bf16's 8 bits of mantissa
    save_file({"lm_head.weight": w_q, "lm_head.weight_scale_inv": s}, str(tmp_path / "model.safetensors"))
    files = dict.fromkeys(["lm_head.weight", "lm_head.weight_scale_inv"], "model.safetensors")
    cfg = type("C", (), {"quantization_config": {"quant_method": "fp8", "weight_block_size": [r, c]}})()
    torch.testing.assert_close(_read_tensor(str(tmp_path), files, "lm_head.weight", cfg).double(), want,
                               rtol=2 ** -8, atol=0)
    raw = _read_tensor(str(tmp_path), {"lm_head.weight": "model.safetensors"}, "lm_head.weight", cfg)
    assert raw.dtype == torch.float8_e4m3fn and not torch.allclose(raw.double(), want, rtol=0.1)  # the control


def test_a_checkpoint_it_cannot_match_loads_whole(tmp_path, capsys):
    """A checkpoint whose final norm is under a key no tail finds (renamed on purpose): one note, and the
    caller's whole load follows (None)."""
    from safetensors.torch import load_file

    from specforge.models.target import load_target_config
    from specforge.targets import family_of

    target_folder("llama", tmp_path)
    f = tmp_path / "target" / "model.safetensors"
    sd = load_file(str(f))
    sd["model.final_ln.scale"] = sd.pop("model.norm.weight")
    save_file(sd, str(f), metadata={"format": "pt"})
    cfg = load_config(None, overrides(tmp_path))
    hf = load_target_config(cfg.model)
    assert head_only_model(str(tmp_path / "target"), hf, family_of(hf), False) is None
    assert "model.norm.weight is not one key" in capsys.readouterr().err


# ---------------------------------------------------------------- a store an engine's capture writes


def _engine_capture(root, head_only: bool, store: str = "features"):
    """The store a capture through an engine (the stand-in above) writes, this process holding the head
    alone or the whole model."""
    from specforge.capture import capture_store

    cfg = load_config(None, [*overrides(root), "model.dtype=bfloat16", f"store.dir={root / store}"])
    target = _load(root, head_only)
    target.engine = _Engine(len(target.aux_layer_ids), target.config.hidden_size)
    return capture_store(cfg, progress=False, target=target)


def _other_checkpoint(root, other):
    """``root``'s target folder copied to ``other`` with one decoder weight changed (the head as it was)."""
    import shutil

    from safetensors.torch import load_file

    shutil.copytree(root / "target", other / "target")
    shutil.copy(root / "data.jsonl", other / "data.jsonl")
    f = other / "target" / "model.safetensors"
    sd = load_file(str(f))
    sd["model.layers.1.mlp.down_proj.weight"] += 0.05
    save_file(sd, str(f), metadata={"format": "pt"})


def _trainer_target(root):
    cfg = load_config(None, overrides(root))  # a trainer's: the whole model, fp32, no engine
    return cfg, load_target(cfg.model, torch.device("cpu"))


def test_a_capture_holding_only_the_head_writes_a_store_the_trainer_accepts(tmp_path):
    """An engine's capture that reads only the head records its target from the checkpoint's files: the
    same meta as the capture holding the whole model, and an offline trainer's target (fp32, whole, no
    engine) opens the store. Control: a trainer whose checkpoint differs in one decoder weight only (which
    the head-only process never read) is refused, naming the target."""
    from specforge.data.store import FeatureStore
    from specforge.runtime.sources import open_store

    target_folder("llama", tmp_path)
    head = FeatureStore(_engine_capture(tmp_path, True))
    whole = FeatureStore(_engine_capture(tmp_path, False, store="whole"))
    assert head.meta.target.startswith("files:") and head.meta == whole.meta
    cfg, trainer = _trainer_target(tmp_path)
    assert open_store(cfg, trainer).meta == head.meta
    _other_checkpoint(tmp_path, tmp_path / "other")
    other_cfg, other = _trainer_target(tmp_path / "other")
    other_cfg.store.dir = cfg.store.dir
    with pytest.raises(ValueError, match=r"captured for a different setup: target \(store: 'files:"):
        open_store(other_cfg, other)
    with pytest.raises(ValueError, match=r"captured for a different setup: target .*no safetensors files to read"):
        open_store(cfg, dataclasses.replace(trainer, path=None))  # a target of no files is not waved through


def test_a_store_fingerprinted_from_the_whole_model_stays_usable(tmp_path):
    """A store written before (its target fingerprinted from the model in memory) is still checked in that
    kind: the right target opens it, another is refused (control), and a capture resuming it loads the whole
    model (``head_only_capture``), since the head alone cannot give that kind. A replayed store of the other
    kind is held against the run's target itself, not against the run's store."""
    import json

    from specforge.data.store import FeatureStore, check_replay_meta, head_only_capture, target_fingerprint
    from specforge.runtime.sources import open_store

    target_folder("llama", tmp_path)
    root = _engine_capture(tmp_path, True)
    cfg, trainer = _trainer_target(tmp_path)
    _other_checkpoint(tmp_path, tmp_path / "other")
    other_cfg, other = _trainer_target(tmp_path / "other")

    def recorded(target, where):
        idx = json.loads((where / "index.json").read_text())
        idx["meta"]["target"] = target_fingerprint(target, like="0" * 24)  # the older kind
        (where / "index.json").write_text(json.dumps(idx))

    recorded(trainer, root)
    assert not FeatureStore(root).meta.target.startswith("files:")
    assert open_store(cfg, trainer).meta.target == target_fingerprint(trainer, like="0" * 24)
    assert not head_only_capture(root) and head_only_capture(tmp_path / "none")
    with pytest.raises(ValueError, match="holds only the target's head"):
        _engine_capture(tmp_path, True)  # resuming it with the head alone: refused, not miscompared
    _engine_capture(tmp_path, False)  # with the whole model: resumed (nothing left to capture)
    recorded(other, root)
    with pytest.raises(ValueError, match=r"captured for a different setup: target"):
        open_store(cfg, trainer)  # the control
    # a store replayed beside another: kinds apart, compared on every other field only (control: same kind)
    own = FeatureStore(_engine_capture(tmp_path, True, store="own"))
    check_replay_meta(own, FeatureStore(root))
    with pytest.raises(ValueError, match="holds features of another setup than the run's store: target"):
        check_replay_meta(own, FeatureStore(_engine_capture(tmp_path / "other", True)))
    # the legacy store of another target replayed beside a files-kind store: held against the run's target
    cfg.store.dir, cfg.store.replay_dir = str(tmp_path / "own"), str(root)
    with pytest.raises(ValueError, match="'store.replay_dir'=.* holds features of another target"):
        open_store(cfg, trainer)
    recorded(trainer, root)
    open_store(cfg, trainer)


def test_a_tensor_torch_cannot_read_counts_by_its_key_shape_and_dtype():
    """The store fingerprint's per-tensor digest (``_sample_digest``): values where torch reads them; a dtype
    it has no type for (a packed 4-bit format) by key, shape and dtype name, not a crash. Control: other
    values of a readable tensor change the digest."""
    from safetensors import SafetensorError

    from specforge.models.target import _sample_digest

    class Slice:
        def __init__(self, values=None, dtype="F4"):
            self.values, self.dtype = values, dtype

        def get_shape(self):
            return [8, 4] if self.values is None else list(self.values.shape)

        def get_dtype(self):
            return self.dtype

        def __getitem__(self, index):
            if self.values is None:
                raise SafetensorError(f"{self.dtype} has no torch type")
            return self.values[index]

    assert _sample_digest("w", Slice()) == _sample_digest("w", Slice())
    assert _sample_digest("w", Slice()) != _sample_digest("w", Slice(dtype="F6"))
    x = torch.randn(8, 4)
    assert _sample_digest("w", Slice(x)) == _sample_digest("w", Slice(x.clone()))
    assert _sample_digest("w", Slice(x)) != _sample_digest("w", Slice(x + 1))  # the control
