"""Every row of the supported-targets table (``specforge.targets.FAMILIES``), on a tiny random model
built from the family's own transformers config class with its quirks kept (``targets/tiny.py``):
capture == HF ``output_hidden_states``, teacher logits == HF logits, generation == HF greedy
``generate`` token for token (features kept), the draft config derived from the target, one TTT
train step; the README table is ``python -m specforge.targets --table``; bad input is one error."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from pathlib import Path

import pytest
import torch

from specforge import targets
from specforge.algorithms.eagle3.algorithm import Eagle3Options
from specforge.algorithms.eagle3.loss import teacher_weight_from_target, ttt_loss
from specforge.algorithms.eagle3.model import Eagle3Draft, draft_config_from_target
from specforge.data.vocab import build_draft_vocab
from specforge.models.features import TrainBatch
from specforge.models.generate import SamplingParams, generate
from specforge.models.target import capture, text_tower
from specforge.targets import FAMILIES, IN_PROCESS, tiny
from tests.helpers.targets import AUX, NAMES, build_family

README = Path(__file__).resolve().parents[1] / "README.md"


built = functools.lru_cache(maxsize=None)(build_family)  # this module's own cache


def _ids():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 250, (2, 17), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0  # right padding, as capture batches are
    return ids, mask


# ---------------------------------------------------------------- the tiny models keep the quirks

def _cfg(name):
    return targets.text_config(built(name).model.config)


def _layer(name, i):
    return text_tower(built(name).model).layers[i]


QUIRKS = {
    "llama": lambda: _cfg("llama").rope_parameters["rope_type"] == "llama3" and not _cfg("llama").tie_word_embeddings,
    "mistral": lambda: targets.sliding_windows(_cfg("mistral")) == [8] * 6,
    "qwen2": lambda: _layer("qwen2", 0).self_attn.q_proj.bias is not None and _cfg("qwen2").tie_word_embeddings,
    "qwen3": lambda: hasattr(_layer("qwen3", 0).self_attn, "q_norm"),
    "qwen3_moe": lambda: _cfg("qwen3_moe").rope_parameters["rope_type"] == "yarn"
    and hasattr(_layer("qwen3_moe", 1).mlp, "experts") and not hasattr(_layer("qwen3_moe", 0).mlp, "experts"),
    "qwen3_next": lambda: targets.linear_attention_layers(_cfg("qwen3_next")) == [0, 1, 2, 4],
    "qwen3_5": lambda: targets.linear_attention_layers(_cfg("qwen3_5")) == [0, 1, 2, 4]
    and "mrope_section" in _cfg("qwen3_5").rope_parameters,
    "gemma3_text": lambda: targets.logit_softcap(_cfg("gemma3_text")) == 0.5
    and float(text_tower(built("gemma3_text").model).embed_tokens.embed_scale) == 8.0
    and set(targets.sliding_windows(_cfg("gemma3_text"))) == {8, None},
    "gemma3": lambda: _cfg("gemma3").final_logit_softcapping == 0.5 and built("gemma3").family.image_text
    and targets.logit_softcap(built("gemma3").model.config) is None,  # HF's image-text class does not apply it
    "gemma4": lambda: targets.logit_softcap(_cfg("gemma4")) == 0.5 and _cfg("gemma4").num_kv_shared_layers == 2
    and _cfg("gemma4").hidden_size_per_layer_input == 8,
    "phi3": lambda: _cfg("phi3").rope_parameters["partial_rotary_factor"] == 0.75
    and hasattr(_layer("phi3", 0).self_attn, "qkv_proj"),
    "gpt_oss": lambda: hasattr(_layer("gpt_oss", 0).self_attn, "sinks")
    and _cfg("gpt_oss").rope_parameters["rope_type"] == "yarn"
    and set(targets.sliding_windows(_cfg("gpt_oss"))) == {8, None},
    "deepseek_v3": lambda: _cfg("deepseek_v3").kv_lora_rank == 32
    and _cfg("deepseek_v3").rope_parameters["rope_type"] == "yarn"
    and hasattr(_layer("deepseek_v3", 1).mlp, "shared_experts")
    and not hasattr(_layer("deepseek_v3", 0).mlp, "experts"),
    "glm4_moe": lambda: _cfg("glm4_moe").rope_parameters["partial_rotary_factor"] == 0.5
    and hasattr(_layer("glm4_moe", 1).mlp, "shared_experts"),
    "mixtral": lambda: all(hasattr(_layer("mixtral", i).mlp, "experts") for i in range(6)),
    "qwen2_5_vl": lambda: "mrope_section" in _cfg("qwen2_5_vl").rope_parameters
    and built("qwen2_5_vl").family.image_text,
    "qwen3_vl": lambda: _cfg("qwen3_vl").rope_parameters.get("mrope_interleaved") is True,
}


def test_every_family_has_a_quirk_check():
    assert set(QUIRKS) == set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_tiny_model_is_its_family_with_its_quirks(name):
    target = built(name)
    fam = next(f for f in FAMILIES if f.name == name)
    assert targets.family_of(target.model.config) is fam
    assert type(target.model).__name__ == fam.hf_class
    assert target.config.num_hidden_layers == 6 and target.config.hidden_size == tiny.H
    assert QUIRKS[name](), f"the tiny {name} model lost a quirk of its family"


# ---------------------------------------------------------------- capture and teacher logits == HF

@pytest.mark.parametrize("name", NAMES)
def test_capture_and_teacher_logits_equal_hf(name):
    target = built(name)
    ids, mask = _ids()
    feats = capture(target, ids, mask, chunk_tokens=7)
    with torch.no_grad():
        ref = target.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    hs, valid = ref.hidden_states, mask.bool()  # hs[i + 1] = output of layer i; hs[-1] after the final norm
    want_aux = torch.cat([hs[i + 1] for i in AUX], dim=-1)
    torch.testing.assert_close(feats.aux_hidden_BTKH[valid], want_aux[valid])
    torch.testing.assert_close(feats.last_hidden_BTH[valid], hs[-1][valid])
    logits = target.logits(feats.last_hidden_BTH)
    torch.testing.assert_close(logits[valid], ref.logits[valid], rtol=1e-5, atol=2e-4)
    assert torch.equal(feats.target_ids_BT[valid], ref.logits.argmax(-1)[valid])
    if targets.logit_softcap(target.model.config):  # negative control: without the soft-cap it differs
        raw = feats.last_hidden_BTH @ target.lm_head_weight_VH.T
        assert not torch.allclose(raw[valid], ref.logits[valid], atol=1e-2)


@pytest.mark.parametrize("name", NAMES)
def test_final_norm_scale(name):
    """The final norm = rms-normalize, times ``final_norm_scale_H`` (Gemma-style norms: 1 + w)."""
    target = built(name)
    norm = text_tower(target.model).norm
    eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
    x = torch.randn(3, tiny.H)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    torch.testing.assert_close(norm(x), normed * target.final_norm_scale_H)
    wrong = normed * (norm.weight + 1.0 - target.family.norm_offset)  # negative control: the other convention
    assert not torch.allclose(norm(x), wrong, atol=1e-3)


# ---------------------------------------------------------------- generation == HF greedy

def _hf_greedy(model, prompt, max_new, stop):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                         eos_token_id=sorted(stop), pad_token_id=0)[0, len(prompt):].tolist()
    for i, t in enumerate(out):
        if t in stop:
            return out[: i + 1]
    return out


@pytest.mark.parametrize("name", NAMES)
def test_generation_equals_hf_greedy_with_features(name):
    target = built(name)
    ids, _ = _ids()
    prompts = [ids[0, :5].tolist(), ids[1, :11].tolist()]  # different lengths: left padding in one batch
    gens = generate(target, prompts, SamplingParams(max_new_tokens=12), stop_ids={2}, capture=True)
    for p, g in zip(prompts, gens):
        assert g.output_ids == _hf_greedy(target.model, p, 12, {2})
        ref = capture(target, torch.tensor([p + g.output_ids]))
        torch.testing.assert_close(g.features.aux_hidden_BTKH, ref.aux_hidden_BTKH, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(g.features.last_hidden_BTH, ref.last_hidden_BTH, rtol=1e-4, atol=1e-4)
        # greedy: the argmax after each position is the token generated next
        assert g.features.target_ids_BT[0, len(p) - 1 : -1].tolist() == g.output_ids[: len(g.output_ids)]


def test_fallback_sampling_is_seeded():
    target = built("gpt_oss")
    assert target.family.generation != IN_PROCESS
    prompts = [_ids()[0][0, :6].tolist()] * 2

    def run(seed):
        return [g.output_ids for g in generate(target, prompts, SamplingParams(max_new_tokens=10, temperature=1.0,
                                                                                seed=seed), stop_ids=set())]
    assert run(3) == run(3) != run(4)


def test_in_process_sliding_window_is_load_bearing(monkeypatch):
    """Negative control: mistral in-process with its sliding window ignored no longer equals HF."""
    target = built("mistral")
    assert target.family.generation == IN_PROCESS
    ids, _ = _ids()
    prompt = ids[1, :11].tolist()
    want = _hf_greedy(target.model, prompt, 16, set())
    assert generate(target, [prompt], SamplingParams(max_new_tokens=16), stop_ids=set())[0].output_ids == want
    monkeypatch.setattr("specforge.models.generate.sliding_windows", lambda cfg: [None] * 6)
    assert generate(target, [prompt], SamplingParams(max_new_tokens=16), stop_ids=set())[0].output_ids != want


# ---------------------------------------------------------------- the draft's config, and one train step

# (heads, kv heads, head_dim, rope_theta, rope_scaling type) each family's draft gets by default
DRAFT = {
    "llama": (4, 2, 16, 500000.0, "llama3"), "mistral": (4, 2, 32, 10000.0, None), "qwen2": (4, 2, 16, 10000.0, None),
    "qwen3": (4, 2, 32, 10000.0, None), "qwen3_moe": (4, 2, 16, 1e6, None), "qwen3_next": (4, 2, 16, 10000.0, None),
    "qwen3_5": (4, 2, 16, 1e7, None), "gemma3_text": (4, 1, 16, 1e6, "linear"), "gemma3": (4, 1, 16, 1e6, "linear"),
    "gemma4": (4, 1, 16, 1e6, None), "phi3": (4, 2, 16, 10000.0, None), "gpt_oss": (4, 2, 16, 150000.0, None),
    "deepseek_v3": (4, 4, 16, 10000.0, None), "glm4_moe": (4, 2, 16, 10000.0, None), "mixtral": (4, 2, 16, 1e6, None),
    "qwen2_5_vl": (4, 2, 16, 1e6, None), "qwen3_vl": (4, 2, 16, 5e6, None),
}


def test_every_family_has_draft_expectations():
    assert set(DRAFT) == set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_draft_config_from_target(name):
    full = built(name).model.config
    text = targets.text_config(full)
    for src in (full, full.to_dict()):  # the config object and its config.json dict give the same draft
        d = draft_config_from_target(src, Eagle3Options(vocab_size=64), AUX)
        heads, kv, head_dim, theta, kind = DRAFT[name]
        assert (d.hidden_size, d.target_hidden_size, d.vocab_size, d.draft_vocab_size) == (tiny.H, tiny.H, tiny.V, 64)
        assert (d.num_attention_heads, d.num_key_value_heads, d.head_dim) == (heads, kv, head_dim)
        assert d.rope_theta == theta and (d.rope_scaling or {}).get("rope_type") == kind
        assert not {"partial_rotary_factor", "mrope_section"} & set(d.rope_scaling or {})
        assert d.rms_norm_eps == text.rms_norm_eps and d.intermediate_size == text.intermediate_size
        assert d.eos_token_id == 2 and d.aux_layer_ids == AUX


@pytest.mark.parametrize("name", NAMES)
def test_one_ttt_train_step(name):
    """A draft shaped from the target trains on the target's captured features (loss finite, grads flow)."""
    target = built(name)
    ids, mask = _ids()
    feats = capture(target, ids, mask)
    rows = [{"input_ids": r.tolist(), "loss_mask": [1] * 17} for r in feats.target_ids_BT]  # argmax ids in the vocab
    vocab = build_draft_vocab(rows, tiny.V, 48)
    draft = Eagle3Draft(draft_config_from_target(target.model.config, Eagle3Options(vocab_size=48), AUX))
    draft.set_vocab(vocab.d2t, vocab.t2d)
    draft.init_embeddings_from_target(target.embed_weight_VH)
    batch = TrainBatch.from_features(ids, mask * torch.tensor([0] * 4 + [1] * 13), feats)
    loss, counts = ttt_loss(draft, batch, teacher_weight_from_target(target.lm_head_weight_VH, vocab.d2t), ttt_length=3)
    loss.backward()
    assert torch.isfinite(loss) and counts[0, 0] > 0
    assert draft.fc.weight.grad is not None and draft.fc.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("name", NAMES)
def test_teacher_equals_hf_logits_on_the_draft_vocab(name):
    """EAGLE-3's teacher (its train state + the TTT loss's ``teacher_probs``) = HF's logits on the draft
    vocab rows, renormalized over them: Gemma's final soft-cap included, where the HF class applies it."""
    from specforge.algorithms.eagle3.loss import teacher_probs, ttt_loss_reference
    from specforge.config import Config
    from specforge.data.vocab import DraftVocab
    from specforge.registry import get_algorithm

    target = built(name)
    ids, mask = _ids()
    feats = capture(target, ids, mask)
    valid = mask.bool()
    keep = torch.sort(torch.randperm(tiny.V, generator=torch.Generator().manual_seed(3))[:48]).values
    t2d = torch.zeros(tiny.V, dtype=torch.bool)
    t2d[keep] = True
    vocab = DraftVocab(d2t=keep - torch.arange(48), t2d=t2d)
    eagle3 = get_algorithm("eagle3")
    head = eagle3.bind(Config()).train_state(target, vocab)
    assert head.softcap == targets.logit_softcap(target.model.config)
    with torch.no_grad():
        hf_logits = target.model(input_ids=ids, attention_mask=mask).logits[valid][:, keep]
    got = teacher_probs(feats.last_hidden_BTH[valid], head.weight_NH, head.softcap)
    torch.testing.assert_close(got, hf_logits.softmax(-1), rtol=1e-4, atol=1e-5)

    # the train step's loss uses it: EAGLE-3's loss == the reference TTT loss with the same soft-cap
    draft = Eagle3Draft(draft_config_from_target(target.model.config, Eagle3Options(vocab_size=48), AUX))
    draft.set_vocab(vocab.d2t, vocab.t2d)
    draft.init_embeddings_from_target(target.embed_weight_VH)
    batch = TrainBatch.from_features(ids, mask, feats)
    cfg = Config()
    cfg.draft.vocab_size, cfg.draft.ttt_length, cfg.draft.ttt_warmup_steps = 48, 2, 0
    with torch.no_grad():
        loss, _ = eagle3.bind(cfg).loss(draft, batch, head, 0, None, training=False)
        want, _ = ttt_loss_reference(draft, batch, head.weight_NH, 2, cfg.draft.ttt_decay, softcap=head.softcap)
        torch.testing.assert_close(loss, want)
    if head.softcap:  # negative control: the uncapped teacher is another distribution
        raw = teacher_probs(feats.last_hidden_BTH[valid], head.weight_NH)
        assert not torch.allclose(raw, hf_logits.softmax(-1), atol=1e-3)
        with torch.no_grad():
            uncapped = eagle3.bind(cfg).loss(draft, batch, head.weight_NH, 0, None, training=False)[0]
            assert not torch.allclose(uncapped, want)


# ---------------------------------------------------------------- the README table

def _readme_block() -> str:
    m = re.search(r"<!-- targets-table:start -->\n(.*?)\n<!-- targets-table:end -->", README.read_text(), re.S)
    assert m, "README.md lost its <!-- targets-table:start/end --> markers"
    return m.group(1)


def test_readme_table_is_generated_from_the_table():
    assert _readme_block() == targets.table_markdown(), "regenerate it: python -m specforge.targets --table"
    # negative control: any change to a row changes the table
    changed = dataclasses.replace(FAMILIES[0], quirks="something else")
    orig = targets.FAMILIES
    try:
        targets.FAMILIES = (changed,) + orig[1:]
        assert targets.table_markdown() != _readme_block()
    finally:
        targets.FAMILIES = orig


def test_table_cli_prints_the_table(capsys):
    from specforge.targets.__main__ import main

    assert main(["--table"]) == 0
    assert capsys.readouterr().out.strip() == targets.table_markdown()


# ---------------------------------------------------------------- bad input: one clear error each

def test_family_not_in_the_table():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match=r"'gpt2' is not a supported target family.*add a Family row"):
        targets.family_of(GPT2Config())


def test_image_text_config_without_its_text_tower():
    raw = {"model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
           "vision_config": {"depth": 1}}
    with pytest.raises(ValueError, match="no text_config.*full Qwen2_5_VLForConditionalGeneration checkpoint"):
        targets.check_target(raw, AUX)
    targets.check_target(built("qwen2_5_vl").model.config.to_dict(), AUX)  # with its text tower: fine


def test_module_without_a_text_tower():
    vision = built("qwen2_5_vl").model.model.visual
    with pytest.raises(ValueError, match="no text tower with decoder layers"):
        text_tower(vision)


def test_aux_ids_on_linear_attention_layers(monkeypatch):
    cfg = built("qwen3_next").model.config
    # SGLang captures any layer's output (its qwen3_next set_eagle3_layers_to_capture)
    targets.check_target(cfg, [0, 2, 3])
    fam = targets.family_of(cfg)
    monkeypatch.setitem(targets._BY_TYPE, "qwen3_next", dataclasses.replace(fam, aux_on_linear_layers=False))
    with pytest.raises(ValueError, match=r"linear-attention layer\(s\) \[0, 2\].*choose 3 of \[3\]"):
        targets.check_target(cfg, [0, 2, 3])


def test_draft_vocab_larger_than_the_target():
    cfg = built("llama").model.config
    with pytest.raises(ValueError, match=r"'draft.vocab_size'=257 exceeds the target's vocabulary \(256"):
        targets.check_target(cfg, AUX, draft_vocab_size=257)
    targets.check_target(cfg, AUX, draft_vocab_size=256)


def test_preflight_refuses_an_unsupported_family(tmp_path):
    from transformers import GPT2Config

    from specforge.config import Config
    from specforge.preflight import check_run

    GPT2Config(n_layer=8).save_pretrained(tmp_path / "t")
    cfg = Config()
    cfg.model.target_path = str(tmp_path / "t")
    cfg.train.output_dir = str(tmp_path / "out")
    with pytest.raises(ValueError, match="not a supported target family"):
        check_run(cfg)
    (tmp_path / "vl").mkdir()
    (tmp_path / "vl" / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    cfg.model.target_path = str(tmp_path / "vl")
    with pytest.raises(ValueError, match="no text_config"):
        check_run(cfg)
