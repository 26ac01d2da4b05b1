"""DFlash2 (``specforge.algorithms.dflash2``): DFlash's block draft + in-block dynamic convolutions +
a candidate selector, equal to speculators 0.9.0's ``DFlash2DraftModel``.

* With the same weights (our saved folder loaded into speculators' model by hand: it cannot
  ``from_pretrained`` the flat format) and the same features, speculators' training forward gives
  our unary logits and selector scores, our loss (given its row-count normaliser) and our gradients,
  for both block layouts, in fp32 (measured: unary logits 1.1e-6, selector scores 3.6e-5 (of ~10),
  loss 4e-7 relative, gradients 2e-5 of each tensor's largest entry; asserted: 1e-5 of the largest entry
  for logits and scores, 1e-5 relative for the loss, 1e-4 of the largest entry for gradients).
  Negative controls: a perturbed convolution tensor, a perturbed predecessor codebook, or the
  selector fed the other layout's previous tokens, each break the comparison.
* A fresh draft (identity convolutions) computes DFlash's hidden states; the saved folder loads
  back to the same logits; the proposer drafts the selector's greedy chain from the same rows as
  the training forward; spec decoding with it is lossless.
* Through the runtime: ``draft.algorithm=dflash2`` trains single-process (loss finite, falling) and
  its checkpoint round-trips through the registry; resume continues the uninterrupted run's losses.
* Config errors: one ValueError naming the key.
"""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.dflash import both_layouts, qwen3_target, sharp_dflash2_draft, with_our_weights

pytestmark = [pytest.mark.timeout(900)]

L, H, V, MASK, IDS, K, R, TOPK = 6, 64, 128, 127, [1, 3, 4], 4, 16, 8


def _close(got, want, rel):
    """fp32 sums taken in other orders: ``max |got - want| <= rel x max |want|`` (one scale per tensor,
    so entries near 0 of a large tensor are held to that tensor's precision, not their own)."""
    scale = want.abs().max()
    return bool(scale > 0) and bool((got - want).abs().max() <= rel * scale)


def _tiny_draft(target_config, sample_from_anchor=False, seed=0):
    return sharp_dflash2_draft(target_config, mask=MASK, ids=IDS, block=K, rank=R, top_k=TOPK,
                               sample_from_anchor=sample_from_anchor, seed=seed)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF Qwen3 target fp32 (6 layers, random), {layout: (our folder, our draft loaded from it)})."""
    from specforge.algorithms.dflash2.export import load_dflash2, save_dflash2

    root = tmp_path_factory.mktemp("dflash2")
    target = qwen3_target(V, H, L)
    drafts = both_layouts(root, target, _tiny_draft, save_dflash2, load_dflash2)
    return target, drafts


# ---------------------------------------------------------------- speculators (the bridge, in one place)


def speculators_model(folder: Path, target):
    """speculators' DFlash2DraftModel from our flat folder: config keys mapped by hand (layer OUTPUT
    ids -> its "after k layers" ids: + 1), weights loaded under the same names, the frozen verifier
    parts copied from the target."""
    from loguru import logger
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig
    from transformers import Qwen3Config

    logger.disable("speculators")
    d = json.loads((folder / "config.json").read_text())
    ours_only = {"architectures", "auto_map", "block_size", "dflash_config", "num_target_layers", "sample_from_anchor",
                 "draft_vocab_size", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
                 "sliding_window_non_causal"}
    tl = Qwen3Config(**{k: v for k, v in d.items() if k not in ours_only})
    tl._attn_implementation = "eager"  # dense masks on CPU: the same math
    cfg = DFlash2SpeculatorConfig(
        transformer_layer_config=tl, draft_vocab_size=d["draft_vocab_size"], block_size=d["block_size"],
        aux_hidden_state_layer_ids=[i + 1 for i in d["dflash_config"]["target_layer_ids"]],
        mask_token_id=d["dflash_config"]["mask_token_id"], sample_from_anchor=d["sample_from_anchor"],
        sliding_window_non_causal=d["sliding_window_non_causal"], conv_kernel_size=d["conv_kernel_size"],
        conv_group_size=d["conv_group_size"], selector_rank=d["selector_rank"], selector_top_k=d["selector_top_k"])
    model = DFlash2DraftModel(cfg)
    return with_our_weights(model, folder, target, train=True)


def _features(target, ids):
    pre_norm = {}
    hook = target.model.layers[-1].register_forward_hook(lambda m, a, out: pre_norm.setdefault(
        "h", out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad():
            out = target(ids, output_hidden_states=True)
    finally:
        hook.remove()
    return out.hidden_states, pre_norm["h"], out.logits.argmax(-1)


def speculators_run(folder, target, T=24, anchors=4, seed=5):
    """speculators' training forward + backward (eager KL, gamma 4, selector alpha 1) on random tokens:
    ids, HF hidden states, the target argmax, its anchors, and what it computed (unary logits
    [n, K, V], candidates and their scores [n, K, k], the loss, the gradients by name)."""
    import speculators.models.dflash2.core as core
    from speculators.losses import eager

    theirs = speculators_model(folder, target)
    ids = torch.randint(0, MASK, (1, T), generator=torch.Generator().manual_seed(seed))
    hs, pre_norm, target_ids = _features(target, ids)
    feats = torch.cat([hs[k] for k in theirs.target_layer_ids], dim=-1)  # "after k layers"
    seen = {}
    real = core.compute_metrics

    def capture(**kw):
        seen.update(kw)
        return real(**kw)

    core.compute_metrics = capture
    args = (feats, ids, torch.ones(1, T), pre_norm, torch.zeros(1, T, dtype=torch.long))
    try:
        torch.manual_seed(0)
        _, loss, _ = theirs(*args, max_anchors=anchors, loss_config={"kl_div": (eager.kl_div_loss, 1.0)},
                            tv_loss_fn=eager.tv_loss, gamma=4.0, selector_loss_alpha=1.0)
    finally:
        core.compute_metrics = real
    loss.backward()
    grads = {n: p.grad for n, p in theirs.named_parameters() if p.requires_grad}
    torch.manual_seed(0)  # the same anchors again (select_anchors draws from the global RNG)
    with torch.no_grad():
        *_, index = theirs._backbone_forward(*args, max_anchors=anchors)
    n = anchors
    return SimpleNamespace(ids=ids, hs=hs, target_ids=target_ids, anchors=index[::K],
                           unary=seen["unary_logits"][0].detach().view(n, K, -1),
                           cand=seen["training_candidate_ids"][0].view(n, K, -1),
                           scores=seen["candidate_logits"][0].detach().view(n, K, -1), loss=loss.detach(), grads=grads)


def our_run(ours, ref, swap_predecessor=False):
    """Our training forward + loss + backward at speculators' anchors, on the same features:
    (unary logits [n, K, V], candidates and scores over the predicted rows, loss, gradients)."""
    from specforge.algorithms.dflash.blocks import rows_at, shifted_targets
    from specforge.algorithms.dflash.loss import build_block_ids
    from specforge.algorithms.dflash.propose import context_features
    from specforge.algorithms.dflash2.loss import dflash2_block_loss, training_candidates

    ours.zero_grad()
    ids, T, shift = ref.ids, ref.ids.shape[1], ours.config.shift
    ctx = context_features(ref.hs, ours.config.target_layer_ids)
    anchors, keep = ref.anchors.view(1, -1), torch.ones(1, ref.anchors.numel(), dtype=torch.bool)
    batch = SimpleNamespace(input_ids_BT=ids, last_hidden_BTH=ref.hs[-1], loss_mask_BT=torch.ones(1, T))
    labels, valid, prev_pos = shifted_targets(ids, ref.target_ids, batch.loss_mask_BT, anchors, keep, K, shift)
    hidden = ours(ctx, build_block_ids(ids, anchors, K, MASK), anchors, keep)
    # speculators divides each term by the counted rows (+ 1e-5), not by the decay weights' sum
    count = valid.sum().double() + 1e-5
    loss, _ = dflash2_block_loss(ours, hidden, batch, labels, valid, prev_pos, gamma=4.0, kl_weight=1.0,
                                 ce_weight=0.0, selector_weight=1.0, normalizer=count.float())
    loss.backward()
    assert int(valid.sum()) == ref.anchors.numel() * (K - 1 + shift)  # every predicting row counted on both sides
    with torch.no_grad():
        h = hidden[0, :, 1 - shift:]
        unary = ours.logits(h)
        prev = rows_at(ids, prev_pos)[0] if not swap_predecessor else rows_at(ids, (prev_pos + 1).clamp(max=T - 1))[0]
        cand, _, _ = training_candidates(unary.topk(TOPK, dim=-1).indices, labels[0, :, 1:])
        scores = ours.candidate_selector.scores(unary, h, prev, cand)
    grads = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    return SimpleNamespace(unary=ours.logits(hidden[0]).detach(), cand=cand, scores=scores, loss=loss.detach(),
                           grads=grads)


@pytest.mark.parametrize("anchor_first", [False, True])
def test_speculators_computes_our_logits_scores_loss_and_gradients(tiny, anchor_first):
    """Both block layouts: DFlash's (row 0 the anchor; speculators' DFlash2 default) and anchor-first."""
    target, drafts = tiny
    folder, ours = drafts[anchor_first]
    ref = speculators_run(folder, target)
    assert len(set(ref.anchors.tolist())) > 1
    mine = our_run(ours, ref)
    shift = int(anchor_first)
    assert _close(mine.unary, ref.unary, 1e-5)
    assert torch.equal(mine.cand, ref.cand[:, 1 - shift:])  # the same top-k, the label injected alike
    assert _close(mine.scores, ref.scores[:, 1 - shift:], 1e-5)
    torch.testing.assert_close(mine.loss, ref.loss, rtol=1e-5, atol=1e-6)
    assert set(mine.grads) == set(ref.grads)  # every trainable tensor, the same names
    for name, g in mine.grads.items():
        assert _close(g, ref.grads[name], 1e-4), name
    # each added part is a real part of the result (the comparison would catch one left out)
    assert any(mine.grads[f"layers.{i}.{c}.kernel_projection.weight"].abs().max() > 1e-3
               for i in range(2) for c in ("attention_conv", "mlp_conv"))
    assert (mine.scores - mine.unary[:, 1 - shift:].gather(-1, mine.cand)).abs().max() > 0.5


def test_the_comparison_fails_on_a_perturbed_tensor_or_a_swapped_convention(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    target, drafts = tiny
    folder, ours = drafts[False]
    for key in ("layers.1.mlp_conv.kernel_projection.weight", "candidate_selector.predecessor_codebook"):
        bad = tmp_path / key
        bad.mkdir()
        (bad / "config.json").write_text((folder / "config.json").read_text())
        weights = load_file(folder / "model.safetensors")
        weights[key] = weights[key] + 0.3 * torch.randn(weights[key].shape, generator=torch.Generator().manual_seed(1))
        save_file(weights, bad / "model.safetensors")
        ref = speculators_run(bad, target)
        mine = our_run(ours, ref)
        assert not _close(mine.scores, ref.scores[:, 1:], 1e-3), key
    # the selector fed the anchor-first layout's previous token (the row's own) instead of the one before
    ref = speculators_run(folder, target)
    swapped = our_run(ours, ref, swap_predecessor=True)
    assert not _close(swapped.scores, ref.scores[:, 1:], 1e-3)


# ---------------------------------------------------------------- the model, its folder, drafting


@torch.no_grad()
def test_a_fresh_draft_computes_dflash(tiny):
    """Identity convolutions at init (speculators' reset): the same weights give DFlash's hidden states."""
    from specforge.algorithms.dflash.loss import build_block_ids
    from specforge.algorithms.dflash.model import DFlashConfig, DFlashDraft
    from specforge.algorithms.dflash2.model import DFlash2Config, DFlash2Draft

    target, _ = tiny
    c2 = DFlash2Config.from_target(target.config.to_dict(), mask_token_id=MASK, num_hidden_layers=2,
                                   target_layer_ids=IDS, block_size=K, selector_rank=R, selector_top_k=TOPK)
    d2 = DFlash2Draft(c2)
    d1 = DFlashDraft(DFlashConfig.from_target(target.config.to_dict(), mask_token_id=MASK, num_hidden_layers=2,
                                              target_layer_ids=IDS, block_size=K))
    missing, unexpected = d1.load_state_dict(d2.state_dict(), strict=False)
    assert not missing and all(k.startswith(("candidate_selector.", "layers.")) and "conv" in k or
                               k.startswith("candidate_selector.") for k in unexpected)
    ids = torch.randint(0, MASK, (1, 20), generator=torch.Generator().manual_seed(2))
    ctx = torch.randn(1, 20, 3 * H)
    a = torch.tensor([[3, 9, 14]])
    blocks = build_block_ids(ids, a, K, MASK)
    torch.testing.assert_close(d2(ctx, blocks, a), d1(ctx, blocks, a), rtol=0, atol=1e-6)


@torch.no_grad()
def test_the_saved_folder_loads_back_to_the_same_logits(tiny, tmp_path):
    from specforge.algorithms.dflash.loss import build_block_ids
    from specforge.algorithms.dflash2.export import check_checkpoint, load_dflash2, save_dflash2

    target, drafts = tiny
    _, ours = drafts[False]
    folder = save_dflash2(ours, tmp_path / "again", torch.float32)
    assert check_checkpoint(folder)[0]["architectures"] == ["DFlash2DraftModel"]
    back = load_dflash2(folder, target.get_input_embeddings().weight, target.lm_head.weight).eval()
    ids = torch.randint(0, MASK, (1, 20), generator=torch.Generator().manual_seed(7))
    ctx, a = torch.randn(1, 20, 3 * H), torch.tensor([[2, 10]])
    blocks = build_block_ids(ids, a, K, MASK)
    assert torch.equal(back.logits(back(ctx, blocks, a)), ours.logits(ours(ctx, blocks, a)))


@torch.no_grad()
@pytest.mark.parametrize("anchor_first", [False, True])
def test_the_proposer_drafts_the_selector_chain(tiny, anchor_first):
    """Each drafted token is the best-scored unary top-k candidate given the token drafted before it
    (the anchor first), h from the training forward's block at the same anchor (so drafting's one
    block of n rows convolves as training's blocks do). Control: the teacher-forced chain (the data's
    previous tokens) or the unary argmax alone draft other tokens somewhere."""
    from specforge.algorithms.dflash.loss import build_block_ids
    from specforge.algorithms.dflash.model import ContextCache
    from specforge.algorithms.dflash.propose import context_features
    from specforge.algorithms.dflash2.propose import propose_block_dflash2

    target, drafts = tiny
    _, ours = drafts[anchor_first]
    shift = int(anchor_first)
    ids = torch.randint(0, MASK, (1, 24), generator=torch.Generator().manual_seed(3))
    hs = target(ids, output_hidden_states=True).hidden_states
    ctx = context_features(hs, IDS)
    unary_differs = 0
    for s in (6, 11, 17):
        got = propose_block_dflash2(ours, ContextCache().extend(ours, ctx[:, :s]), ids[:, s])
        assert got.shape == (1, K - 1 + shift)
        a = torch.tensor([[s]])
        h = ours(ctx, build_block_ids(ids, a, K, MASK), a)[0, 0]
        prev, want = ids[0, s], []
        for i in range(1 - shift, K):
            prev = ours.candidate_selector.pick(ours.logits(h[i]), h[i], prev)
            want.append(int(prev))
        assert got[0].tolist() == want
        unary_differs += ours.logits(h[1 - shift:]).argmax(-1).tolist() != want
    assert unary_differs


@torch.no_grad()
@pytest.mark.parametrize("anchor_first", [False, True])
def test_the_eval_proposes_from_the_whole_trained_block(tiny, anchor_first):
    """The eval's proposer runs the whole block and keeps the first k drafts; ``as_served`` runs the rows
    an engine runs for k drafts. Control: those shorter blocks draft other tokens at some anchors."""
    from specforge.algorithms.dflash.propose import context_features
    from specforge.algorithms.dflash2.propose import DFlash2Proposer, propose_block_dflash2
    from tests.helpers.dflash import rounds_against_the_whole_block

    target, drafts = tiny
    _, ours = drafts[anchor_first]
    ids = torch.randint(0, MASK, (1, 30), generator=torch.Generator().manual_seed(5))
    ctx = context_features(target(ids, output_hidden_states=True).hidden_states, IDS)
    differ = rounds_against_the_whole_block(lambda served: DFlash2Proposer(ours, as_served=served), ctx, ids,
                                            lambda cache, a: propose_block_dflash2(ours, cache, a), range(4, 30, 3))
    assert differ > 0


@torch.no_grad()
def test_spec_decoding_with_the_proposer_is_lossless(tiny):
    from specforge.algorithms.dflash.propose import greedy_decode, spec_decode_greedy
    from specforge.algorithms.dflash2.propose import propose_block_dflash2

    target, drafts = tiny
    for anchor_first in (False, True):
        _, ours = drafts[anchor_first]
        prompt = torch.randint(0, MASK, (1, 10), generator=torch.Generator().manual_seed(6))
        ids, accepted = spec_decode_greedy(target, ours, prompt, 20,
                                           proposer=lambda cache, a: propose_block_dflash2(ours, cache, a))
        assert torch.equal(ids, greedy_decode(target, prompt, 20)) and len(accepted) > 1
