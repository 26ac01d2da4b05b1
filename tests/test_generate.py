"""The generation engine: greedy output equals step-by-step HF decoding, and the features kept
while generating equal a teacher-forced ``capture`` of the finished sequence."""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from specforge.models.generate import SamplingParams, generate
from specforge.models.target import TargetModel, capture
from tests.helpers.models import tiny_target


def _target(model, aux=(1, 2, 4)) -> TargetModel:
    return TargetModel(model=model, tokenizer=None, aux_layer_ids=list(aux), device=torch.device("cpu"))


def _hf_greedy(model, prompt: list[int], max_new: int, stop: set[int]) -> list[int]:
    """Reference: full forward over the whole sequence for every new token (no cache at all)."""
    ids = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        while len(out) < max_new:
            nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(nxt)
            out.append(nxt)
            if nxt in stop:
                break
    return out


def _prompts(n: int, lo: int = 3, hi: int = 20, vocab: int = 320) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_greedy_equals_uncached_reference_with_ragged_prompts_and_stops():
    model = tiny_target(num_layers=6)
    target = _target(model)
    prompts = _prompts(5)
    ref0 = _hf_greedy(model, prompts[0], 12, set())
    stop = {ref0[4]}  # make at least one row stop early, so compaction happens mid-batch
    gens = generate(target, prompts, SamplingParams(max_new_tokens=12), stop_ids=stop, batch_size=4)
    assert [g.prompt_ids for g in gens] == prompts
    for p, g in zip(prompts, gens):
        want = _hf_greedy(model, p, 12, stop)
        assert g.output_ids == want
        assert g.finish_reason == ("stop" if want[-1] in stop else "length")
    assert any(g.finish_reason == "stop" for g in gens) and any(g.finish_reason == "length" for g in gens)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 6e-2)])
def test_generation_features_equal_teacher_forced_capture(dtype, atol):
    model = tiny_target(num_layers=6).to(dtype)
    target = _target(model)
    prompts = _prompts(3)
    gens = generate(target, prompts, SamplingParams(max_new_tokens=9), stop_ids=set(), capture=True, batch_size=3)
    for g in gens:
        seq = torch.tensor([g.prompt_ids + g.output_ids])
        want = capture(target, seq)
        got = g.features
        assert got.aux_hidden_BTKH.shape == want.aux_hidden_BTKH.shape == (1, seq.shape[1], 3 * 48)
        torch.testing.assert_close(got.aux_hidden_BTKH.float(), want.aux_hidden_BTKH.float(), atol=atol, rtol=atol)
        torch.testing.assert_close(got.last_hidden_BTH.float(), want.last_hidden_BTH.float(), atol=atol, rtol=atol)
        agree = (got.target_ids_BT == want.target_ids_BT).float().mean().item()
        assert agree == 1.0 if dtype == torch.float32 else agree > 0.9
        # greedy: the argmax at the last prompt position and each output position is the next output token
        P = len(g.prompt_ids)
        assert got.target_ids_BT[0, P - 1 : P - 1 + len(g.output_ids)].tolist() == g.output_ids


def test_qwen3_layout_with_head_norms():
    cfg = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).eval()
    target = _target(model, aux=(0, 1, 2))
    prompts = _prompts(2, vocab=300)
    gens = generate(target, prompts, SamplingParams(max_new_tokens=6), stop_ids=set(), capture=True)
    for p, g in zip(prompts, gens):
        assert g.output_ids == _hf_greedy(model, p, 6, set())
        want = capture(target, torch.tensor([p + g.output_ids]))
        torch.testing.assert_close(g.features.aux_hidden_BTKH, want.aux_hidden_BTKH, atol=2e-5, rtol=2e-5)


def test_sampling_is_seeded_and_respects_top_p():
    model = tiny_target(num_layers=2)
    target = _target(model, aux=(0, 1, 1))
    prompts = _prompts(4)
    a = generate(target, prompts, SamplingParams(max_new_tokens=8, temperature=1.0, seed=3), stop_ids=set())
    b = generate(target, prompts, SamplingParams(max_new_tokens=8, temperature=1.0, seed=3), stop_ids=set())
    c = generate(target, prompts, SamplingParams(max_new_tokens=8, temperature=1.0, seed=4), stop_ids=set())
    assert [g.output_ids for g in a] == [g.output_ids for g in b] != [g.output_ids for g in c]
    # top_p -> 0 keeps only the most likely token: sampling becomes greedy
    tiny_p = generate(target, prompts, SamplingParams(max_new_tokens=8, temperature=1.0, top_p=1e-6), stop_ids=set())
    greedy = generate(target, prompts, SamplingParams(max_new_tokens=8), stop_ids=set())
    assert [g.output_ids for g in tiny_p] == [g.output_ids for g in greedy]


def test_unsupported_architecture_and_bad_input_are_clear():
    model = tiny_target(num_layers=2)
    model.config.model_type = "gpt2"
    with pytest.raises(ValueError, match="'gpt2' is not a supported target family"):  # specforge.targets
        generate(_target(model, aux=(0, 1, 1)), [[1, 2]], SamplingParams(), set())
    model.config.model_type = "llama"
    with pytest.raises(ValueError, match="at least one token"):
        generate(_target(model, aux=(0, 1, 1)), [[]], SamplingParams(), set())
