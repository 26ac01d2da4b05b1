"""The tiny DFlash draft (from tests/test_dflash_model.py)."""

import torch

from specforge.algorithms.dflash.model import DFlashConfig, DFlashDraft


def tiny_cfg(**kw):
    base = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                intermediate_size=64, vocab_size=97, num_target_layers=6, target_layer_ids=[1, 3, 4],
                block_size=4, mask_token_id=96, rope_theta=10000.0)
    base.update(kw)
    return DFlashConfig(**base)


def tiny_draft(dtype=torch.float64, **kw):
    torch.manual_seed(0)
    d = DFlashDraft(tiny_cfg(**kw)).to(dtype)
    with torch.no_grad():  # non-trivial norm weights, so a missing norm shows
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return d


def rounds_against_the_whole_block(proposer_for, ctx_1TF, ids_1T, whole, anchors) -> int:
    """The block family's eval proposers against one forward of the whole block, fed what the eval feeds
    them (the target's features of every token before the anchor). ``proposer_for(as_served)`` makes
    one; ``whole(cache, anchor_B)`` drafts a whole block's tokens ``[1, drafts per block]``. At every
    anchor and every k up to the drafts of a block, the default proposer's k drafts are the first k of
    the whole block's (asserted); returns in how many (anchor, k) rounds ``as_served`` (a block of the
    rows an engine runs for k drafts) drafts others: none at k = drafts per block (asserted)."""
    from specforge.algorithms.dflash.model import ContextCache

    trained, served = proposer_for(False), proposer_for(True)
    draft, differ = trained.draft, 0
    for s in anchors:
        full = whole(ContextCache().extend(draft, ctx_1TF[:, :s]), ids_1T[:, s])[0].tolist()
        for p in (trained, served):
            p.start(ids_1T[0, : s + 1].tolist(), ctx_1TF[0, :s])
        for k in range(1, len(full) + 1):
            assert trained.propose(k) == full[:k], (s, k)
            short = served.propose(k)
            assert len(short) == k and (k < len(full) or short == full), (s, k)
            differ += short != full[:k]
    return differ


# ---------------------------------------------------------------- the block family against speculators

VERIFIER = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight")


def qwen3_target(vocab_size: int, hidden_size: int, num_layers: int):
    """A random Qwen3 target, fp32, eval mode (seed 0): what the block drafts are compared on."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    tc = Qwen3Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=128,
                     num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     max_position_embeddings=256, tie_word_embeddings=False)
    return Qwen3ForCausalLM(tc).eval()


def with_our_weights(model, folder, target, train: bool = False):
    """speculators' block-draft ``model`` holding our saved folder's tensors as saved (nothing left over,
    nothing missing but the verifier's parts) and the target's embedding, head and final norm, frozen
    (its ``load_verifier_weights()`` needs a verifier path: copied by hand), in fp32."""
    from safetensors.torch import load_file

    missing, unexpected = model.load_state_dict(load_file(folder / "model.safetensors"), strict=False)
    assert not unexpected and set(missing) == set(VERIFIER), (missing, unexpected)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        model.lm_head.weight.copy_(target.lm_head.weight)
        model.verifier_lm_head.weight.copy_(target.lm_head.weight)
        model.verifier_norm.weight.copy_(target.model.norm.weight)
    for name in VERIFIER:
        model.get_parameter(name).requires_grad_(False)
    return model.float().train(train)


def sharp_dflash2_draft(target_config, *, mask, ids, block, rank, top_k, sample_from_anchor=False, seed=0):
    """A random DFlash2 draft whose every part matters: sharp context attention (q/k norm weights 3, as
    the DFlash tests), convolutions away from identity (random base kernels and kernel projections) and a
    selector whose transition scores are as large as the unary logits."""
    from specforge.algorithms.dflash2.model import DFlash2Config, DFlash2Draft

    torch.manual_seed(seed)
    cfg = DFlash2Config.from_target(target_config, mask_token_id=mask, num_hidden_layers=2, target_layer_ids=ids,
                                    block_size=block, conv_kernel_size=2, conv_group_size=16, selector_rank=rank,
                                    selector_top_k=top_k, sample_from_anchor=sample_from_anchor)
    draft = DFlash2Draft(cfg)
    with torch.no_grad():
        for layer in draft.layers:
            layer.self_attn.q_norm.weight.fill_(3.0)
            layer.self_attn.k_norm.weight.fill_(3.0)
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.add_(0.5 * torch.randn_like(conv.base_kernel))
                conv.kernel_projection.weight.normal_(0.0, 0.2)
        sel = draft.candidate_selector
        sel.predecessor_codebook.normal_(0.0, 1.0)
        sel.successor_codebook.normal_(0.0, 1.0)
        sel.hidden_projection.weight.normal_(0.0, 0.3)
    return draft


def both_layouts(root, target, make_draft, save, load) -> dict:
    """``{anchor_first: (folder, our draft loaded from it, eval mode)}`` for both block layouts: the draft
    ``make_draft(target_config, anchor_first, seed=int(anchor_first))`` saved in fp32 by ``save(draft, folder,
    dtype)`` and read back by ``load(folder, embedding, lm_head)`` with ``target``'s."""
    drafts = {}
    for anchor_first in (False, True):
        draft = make_draft(target.config.to_dict(), anchor_first, seed=int(anchor_first))
        folder = save(draft, root / f"draft-{int(anchor_first)}", torch.float32)
        drafts[anchor_first] = folder, load(folder, target.get_input_embeddings().weight, target.lm_head.weight).eval()
    return drafts
