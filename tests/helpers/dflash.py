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
