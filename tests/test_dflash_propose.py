"""DFlash block proposal: greedy block speculative decoding is lossless on a tiny random Llama target."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specforge.algorithms.dflash.model import ContextCache, DFlashConfig, DFlashDraft
from specforge.algorithms.dflash.propose import context_features, greedy_decode, propose_block, spec_decode_greedy


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).double().eval()


def make_draft(target, block_size=4):
    torch.manual_seed(1)
    cfg = DFlashConfig.from_target(target.config, mask_token_id=127, num_hidden_layers=2,
                                   target_layer_ids=[0, 2], block_size=block_size)
    d = DFlashDraft(cfg).double().eval()
    return d.set_target_weights(target.get_input_embeddings().weight, target.lm_head.weight)


def test_config_from_target(target):
    cfg = make_draft(target).config
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 4, 2, 8)
    assert cfg.vocab_size == 128 and cfg.num_target_layers == 4 and cfg.context_width == 64
    other = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=30,
                        num_attention_heads=4, rope_theta=12345.0)
    for source in (other, other.to_dict()):  # transformers 5 keeps RoPE theta in rope_parameters
        c = DFlashConfig.from_target(source, mask_token_id=1)
        assert c.rope_theta == 12345.0 and c.num_key_value_heads == 4
        assert c.target_layer_ids == [1, 14, 27]  # the reference default for 3 draft layers of 30


def test_propose_block_is_the_argmax_of_one_forward(target):
    draft = make_draft(target)
    ctx = torch.randn(1, 7, draft.config.context_width, dtype=torch.float64)
    cache = ContextCache().extend(draft, ctx)
    drafts = propose_block(draft, cache, torch.tensor([5]))
    block = torch.tensor([[5, 127, 127, 127]])
    assert drafts.shape == (1, 3)
    assert torch.equal(drafts, draft.logits(draft.forward_block(cache, block))[:, 1:].argmax(-1))
    assert cache.length == 7  # proposing does not touch the context
    assert propose_block(draft, cache, torch.tensor([5]), block_size=6).shape == (1, 5)


@pytest.mark.parametrize("block_size", [2, 4])
def test_spec_decode_with_random_draft_is_lossless(target, block_size):
    draft = make_draft(target, block_size)
    prompt = torch.tensor([[3, 17, 42, 9, 88, 1]])
    want = greedy_decode(target, prompt, 24)
    got, accepted = spec_decode_greedy(target, draft, prompt, 24)
    assert torch.equal(got, want)
    assert all(1 <= a <= block_size for a in accepted)


def test_spec_decode_with_oracle_and_half_right_drafts(target):
    """Drafts that are all right (full blocks accepted) or right for one token only: same output."""
    draft = make_draft(target, block_size=5)
    prompt = torch.tensor([[7, 7, 30, 2]])
    n_new = 21
    want = greedy_decode(target, prompt, n_new + 8)
    T0 = prompt.shape[1]

    def oracle(cache, anchor):  # the anchor sits at position cache.length
        s = cache.length
        assert anchor.item() == want[0, s].item()
        return want[:, s + 1:s + 5]

    def half(cache, anchor):  # also: the loop's context equals the target's features of the accepted prefix
        s = cache.length
        fresh = ContextCache().extend(draft, context_features(
            target(want[:, :s], output_hidden_states=True).hidden_states, draft.config.target_layer_ids))
        for (k, v), (k2, v2) in zip(cache.kv, fresh.kv):
            torch.testing.assert_close(k, k2, rtol=0, atol=1e-10)
            torch.testing.assert_close(v, v2, rtol=0, atol=1e-10)
        d = oracle(cache, anchor).clone()
        d[:, 1:] = (d[:, 1:] + 1) % 128
        return d

    got, accepted = spec_decode_greedy(target, draft, prompt, n_new, proposer=oracle)
    assert torch.equal(got, want[:, :T0 + n_new])
    assert accepted == [5, 5, 5, 5]  # 4 drafts + the bonus per round; 20 tokens + the prefill's one
    got, accepted = spec_decode_greedy(target, draft, prompt, n_new, proposer=half)
    assert torch.equal(got, want[:, :T0 + n_new])
    assert set(accepted) == {2}
