"""XPress (``specforge.algorithms.xpress``): DFlash's block draft + a causal refiner head, equal to
speculators 0.9.0's ``XPressDraftModel``.

* With the same weights (our saved folder loaded into speculators' model by hand: it cannot
  ``from_pretrained`` the flat format) and the same features, speculators' training forward gives
  our teacher-forced refined logits, each free-running pass's logits, our loss (given its row-count
  normaliser) and our gradients, for both block layouts and two loss mixes (speculators' default
  0.1 CE + 0.9 TV with a decayed anchor term; CE on the data tokens + TV + KL with an undecayed
  anchor term), on one sequence and on a packed row of two samples (the token before an anchor at a
  sample's start is the anchor), in fp32 (measured: logits 1.1e-6 of each tensor's largest entry, the
  loss 4.8e-7 relative, gradients 5.7e-6 of the largest entry; asserted: 1e-5 for logits, 1e-5
  relative for the loss, 1e-4 for gradients).
  Negative controls: a perturbed refiner tensor, target features read at speculators' own layer ids
  (no +1 offset), or the refiner fed each row's own token as its previous one, each break it.
* The saved folder loads back to the same logits; the proposer drafts the Jacobi recurrence from the
  training forward's rows; spec decoding with it is lossless.
"""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.dflash import both_layouts, qwen3_target, with_our_weights

pytestmark = [pytest.mark.timeout(900)]

L, H, V, MASK, IDS, K, RANK = 6, 64, 128, 127, [1, 3, 4], 4, 16
DEFAULT_MIX = dict(ce_weight=0.1, tv_weight=0.9, kl_weight=0.0, consistency_weight=0.3, consistency_passes=3,
                   anchor_weight=0.6, anchor_full_weight=False, ce_from_data=False)
OTHER_MIX = dict(ce_weight=0.2, tv_weight=0.5, kl_weight=0.3, consistency_weight=0.5, consistency_passes=2,
                 anchor_weight=0.4, anchor_full_weight=True, ce_from_data=True)


def _close(got, want, rel):
    """fp32 sums taken in other orders: ``max |got - want| <= rel x max |want|``."""
    scale = want.abs().max()
    return bool(scale > 0) and bool((got - want).abs().max() <= rel * scale)


def _tiny_draft(target_config, sample_from_anchor=False, seed=0):
    """A random XPress draft whose every part matters: sharp context attention (q/k norm weights 3)
    and a refiner whose bias is as large as the base logits (a random causal mix, larger weights)."""
    from specforge.algorithms.xpress.model import XPressConfig, XPressDraft

    torch.manual_seed(seed)
    cfg = XPressConfig.from_target(target_config, mask_token_id=MASK, num_hidden_layers=2, target_layer_ids=IDS,
                                   block_size=K, refiner_rank=RANK, refiner_mlp_ratio=2, jacobi_passes=3,
                                   sample_from_anchor=sample_from_anchor)
    draft = XPressDraft(cfg)
    with torch.no_grad():
        for layer in draft.layers:
            layer.self_attn.q_norm.weight.fill_(3.0)
            layer.self_attn.k_norm.weight.fill_(3.0)
        head = draft.refiner_head
        head.mix_l.normal_(0.0, 0.5)
        head.token_embed.weight.normal_(0.0, 1.0)
        for lin in (head.down_h, head.down_g, head.in_proj, head.mlp_gate, head.mlp_up, head.mlp_down):
            lin.weight.normal_(0.0, 0.3)
        head.readout.weight.normal_(0.0, 1.0)
    return draft


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF Qwen3 target fp32 (6 layers, random), {layout: (our folder, our draft loaded from it)})."""
    from specforge.algorithms.xpress.export import load_xpress, save_xpress

    root = tmp_path_factory.mktemp("xpress")
    target = qwen3_target(V, H, L)
    drafts = both_layouts(root, target, _tiny_draft, save_xpress, load_xpress)
    return target, drafts


# ---------------------------------------------------------------- speculators (the bridge, in one place)


def speculators_model(folder: Path, target, layer_offset: int = 1):
    """speculators' XPressDraftModel from our flat folder: config keys mapped by hand (layer OUTPUT
    ids -> its "after k layers" ids: + ``layer_offset``, 1; our refiner keys are its xpress_* keys),
    weights loaded under the same names, the frozen verifier parts copied from the target."""
    from loguru import logger
    from speculators.models.xpress import XPressDraftModel, XPressSpeculatorConfig
    from transformers import Qwen3Config

    logger.disable("speculators")
    d = json.loads((folder / "config.json").read_text())
    ours_only = {"architectures", "auto_map", "block_size", "dflash_config", "num_target_layers", "sample_from_anchor",
                 "draft_vocab_size", "xpress_rank", "xpress_mlp_ratio", "num_jacobi_passes"}
    tl = Qwen3Config(**{k: v for k, v in d.items() if k not in ours_only})
    tl._attn_implementation = "eager"  # dense masks on CPU: the same math
    cfg = XPressSpeculatorConfig(
        transformer_layer_config=tl, draft_vocab_size=d["draft_vocab_size"], block_size=d["block_size"],
        aux_hidden_state_layer_ids=[i + layer_offset for i in d["dflash_config"]["target_layer_ids"]],
        mask_token_id=d["dflash_config"]["mask_token_id"], sample_from_anchor=d["sample_from_anchor"],
        xpress_rank=d["xpress_rank"], xpress_mlp_ratio=d["xpress_mlp_ratio"],
        num_jacobi_passes=d["num_jacobi_passes"])
    model = XPressDraftModel(cfg)
    return with_our_weights(model, folder, target, train=True)


def _features(target, ids, doc_ids):
    """HF hidden states, the last layer's output before the final norm and the target argmax, each
    sample of a packed row run on its own (positions restart), concatenated."""
    hs, pre, am = [], [], []
    for doc in doc_ids[0].unique():
        part = ids[:, doc_ids[0] == doc]
        seen = {}
        hook = target.model.layers[-1].register_forward_hook(lambda m, a, out: seen.setdefault(
            "h", out[0] if isinstance(out, tuple) else out))
        try:
            with torch.no_grad():
                out = target(part, output_hidden_states=True)
        finally:
            hook.remove()
        hs.append(out.hidden_states)
        pre.append(seen["h"])
        am.append(out.logits.argmax(-1))
    return (tuple(torch.cat(x, 1) for x in zip(*hs)), torch.cat(pre, 1), torch.cat(am, 1))


def _layout(T, packed):
    """(loss mask, doc ids, position ids): one sequence, or a row of two samples of T/2 whose counted
    tokens keep every block inside its sample (speculators' mask does not cut at a sample's end)."""
    if not packed:
        return torch.ones(1, T), torch.zeros(1, T, dtype=torch.long), torch.arange(T).unsqueeze(0)
    half = T // 2
    mask = torch.zeros(1, T)
    mask[0, 3:7] = 1
    mask[0, half:half + 6] = 1
    doc = (torch.arange(T) >= half).long().unsqueeze(0)
    pos = torch.cat([torch.arange(half), torch.arange(T - half)]).unsqueeze(0)
    return mask, doc, pos


def speculators_run(folder, target, mix, T=24, anchors=4, seed=5, packed=False, layer_offset=1, anchor_seed=0):
    """speculators' training forward + backward (eager losses, gamma 4) on random tokens: ids, HF
    hidden states, the target argmax, the layout, its anchors, and what it computed (teacher-forced
    refined logits and each pass's [n, K, V], the loss, the gradients by name)."""
    import speculators.models.xpress.core as core
    from speculators.losses import eager

    theirs = speculators_model(folder, target, layer_offset)
    ids = torch.randint(0, MASK, (1, T), generator=torch.Generator().manual_seed(seed))
    mask, doc, pos = _layout(T, packed)
    hs, pre_norm, target_ids = _features(target, ids, doc)
    feats = torch.cat([hs[k] for k in theirs.target_layer_ids], dim=-1)  # "after k layers"
    seen = {}
    real = core.compute_metrics

    def capture(*a, **kw):
        seen["tf"], seen["rounds"], seen["base"] = a[0], a[1], a[2]
        return real(*a, **kw)

    core.compute_metrics = capture
    fns = {"ce": eager.ce_loss, "tv": eager.tv_loss, "kl_div": eager.kl_div_loss}
    weights = {"ce": mix["ce_weight"], "tv": mix["tv_weight"], "kl_div": mix["kl_weight"]}
    loss_config = {k: (fns[k], w) for k, w in weights.items() if w}
    args = (feats, ids, mask, pre_norm, doc, pos)
    try:
        torch.manual_seed(anchor_seed)
        _, loss, _ = theirs(*args, max_anchors=anchors, loss_config=loss_config, gamma=4.0,
                            consistency_weight=mix["consistency_weight"], consistency_passes=mix["consistency_passes"],
                            base_anchor_weight=mix["anchor_weight"], base_anchor_full_weight=mix["anchor_full_weight"],
                            ce_from_data=mix["ce_from_data"])
    finally:
        core.compute_metrics = real
    loss.backward()
    grads = {n: p.grad for n, p in theirs.named_parameters() if p.requires_grad}
    torch.manual_seed(anchor_seed)  # the same anchors again (select_anchors draws from the global RNG)
    with torch.no_grad():
        *_, index = theirs._backbone_forward(*args, max_anchors=anchors)
    n = anchors

    def blocks(x):
        return x[0].detach().view(n, K, -1)

    return SimpleNamespace(ids=ids, hs=hs, target_ids=target_ids, mask=mask, doc=doc, pos=pos, anchors=index[::K],
                           tf=blocks(seen["tf"]), rounds=[blocks(r) for r in seen["rounds"]], loss=loss.detach(),
                           grads=grads)


def our_run(ours, ref, mix, own_token_prev=False):
    """Our training forward + loss + backward at speculators' anchors, on the same features:
    (teacher-forced refined logits [n, K, V], each pass's, loss, gradients, counted rows)."""
    from specforge.algorithms.dflash.blocks import shifted_targets
    from specforge.algorithms.dflash.loss import build_block_ids
    from specforge.algorithms.dflash.propose import context_features
    from specforge.algorithms.xpress.loss import LossMix, teacher_prev, xpress_block_loss
    from specforge.algorithms.xpress.model import jacobi_prev

    ours.zero_grad()
    c, ids = ours.config, ref.ids
    packed = bool(ref.doc.any())
    doc = ref.doc if packed else None
    ctx = context_features(ref.hs, c.target_layer_ids)
    anchors, keep = ref.anchors.view(1, -1), torch.ones(1, ref.anchors.numel(), dtype=torch.bool)
    batch = SimpleNamespace(input_ids_BT=ids, last_hidden_BTH=ref.hs[-1], loss_mask_BT=ref.mask)
    labels, valid, prev_pos = shifted_targets(ids, ref.target_ids, ref.mask, anchors, keep, K, c.shift, doc)
    data_labels = shifted_targets(ids, None, ref.mask, anchors, keep, K, c.shift, doc)[0]
    prev = teacher_prev(ids, anchors, K, c.shift, doc)
    if own_token_prev:  # the convention a refiner must not use: each row fed its own token
        prev = teacher_prev(ids, anchors, K, 1, doc) if not c.shift else torch.cat(
            [prev[..., 1:], prev[..., -1:]], -1)
    hidden = ours(ctx, build_block_ids(ids, anchors, K, MASK), anchors, keep, ref.pos if packed else None, doc)
    count = valid[..., 1:].sum().double() + 1e-5  # speculators divides each term by the counted rows (+ 1e-5)
    m = LossMix(**{k: v for k, v in mix.items() if k != "ce_from_data"})
    loss, _ = xpress_block_loss(ours, hidden, batch, labels, valid, prev_pos, prev, gamma=4.0, mix=m,
                                ce_labels_BNR=data_labels if mix["ce_from_data"] else None,
                                normalizer=count.float())
    loss.backward()
    grads = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    with torch.no_grad():
        h = hidden[0]
        base = ours.logits(h)
        cx = ours.refiner_head.context(h)
        tf = base + ours.refiner_head.bias(cx, prev[0])
        pred, rounds = base.argmax(-1), []
        for _ in range(mix["consistency_passes"] if mix["consistency_weight"] else 0):
            z = base + ours.refiner_head.bias(cx, jacobi_prev(prev[0, :, 0], prev[0, :, 1 - c.shift], pred, c.shift))
            rounds.append(z)
            pred = z.argmax(-1)
    return SimpleNamespace(tf=tf, rounds=rounds, loss=loss.detach(), grads=grads, counted=int(valid.sum()))


CASES = [(False, DEFAULT_MIX, False), (True, DEFAULT_MIX, False), (False, OTHER_MIX, False),
         (True, OTHER_MIX, False), (False, DEFAULT_MIX, True)]


@pytest.mark.parametrize("anchor_first, mix, packed", CASES,
                         ids=["fill-in", "anchor-first", "fill-in-other-mix", "anchor-first-other-mix", "packed"])
def test_speculators_computes_our_logits_loss_and_gradients(tiny, anchor_first, mix, packed):
    target, drafts = tiny
    folder, ours = drafts[anchor_first]
    ref = speculators_run(folder, target, mix, packed=packed, anchors=6 if packed else 4, anchor_seed=7 * packed)
    assert len(set(ref.anchors.tolist())) > 1
    if packed:  # an anchor at the second sample's start: its row 0 reads the anchor, not the token before
        assert 12 in ref.anchors.tolist(), ref.anchors
    mine = our_run(ours, ref, mix)
    assert _close(mine.tf, ref.tf, 1e-5)
    assert len(mine.rounds) == len(ref.rounds) == (mix["consistency_passes"])
    for got, want in zip(mine.rounds, ref.rounds):
        assert _close(got, want, 1e-5)
    torch.testing.assert_close(mine.loss, ref.loss, rtol=1e-5, atol=1e-6)
    assert set(mine.grads) == set(ref.grads)  # every trainable tensor, the same names
    for name, g in mine.grads.items():
        assert _close(g, ref.grads[name], 1e-4), name
    assert mine.grads["refiner_head.mix_l"].abs().max() > 1e-4  # the causal mix is a real part of the result


def test_the_comparison_fails_on_a_perturbed_tensor_a_layer_offset_or_a_previous_token(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    target, drafts = tiny
    folder, ours = drafts[False]
    for key in ("refiner_head.mix_l", "refiner_head.token_embed.weight"):
        bad = tmp_path / key
        bad.mkdir()
        (bad / "config.json").write_text((folder / "config.json").read_text())
        weights = load_file(folder / "model.safetensors")
        weights[key] = weights[key] + 0.3 * torch.randn(weights[key].shape, generator=torch.Generator().manual_seed(1))
        save_file(weights, bad / "model.safetensors")
        ref = speculators_run(bad, target, DEFAULT_MIX)
        assert not _close(our_run(ours, ref, DEFAULT_MIX).tf, ref.tf, 1e-3), key
    # speculators' layer ids taken as ours (no "after k layers" + 1): other features, other logits
    ref = speculators_run(folder, target, DEFAULT_MIX, layer_offset=0)
    assert not _close(our_run(ours, ref, DEFAULT_MIX).tf, ref.tf, 1e-3)
    # the refiner fed each row's own token instead of the one before it
    ref = speculators_run(folder, target, DEFAULT_MIX)
    assert not _close(our_run(ours, ref, DEFAULT_MIX, own_token_prev=True).tf, ref.tf, 1e-3)


# ---------------------------------------------------------------- the model, its folder, drafting


@torch.no_grad()
def test_the_saved_folder_loads_back_to_the_same_logits(tiny, tmp_path):
    from specforge.algorithms.dflash.loss import build_block_ids
    from specforge.algorithms.xpress.export import check_checkpoint, load_xpress, save_xpress

    target, drafts = tiny
    _, ours = drafts[False]
    folder = save_xpress(ours, tmp_path / "again", torch.float32)
    assert check_checkpoint(folder)[0]["architectures"] == ["XPressDraftModel"]
    back = load_xpress(folder, target.get_input_embeddings().weight, target.lm_head.weight).eval()
    ids = torch.randint(0, MASK, (1, 20), generator=torch.Generator().manual_seed(7))
    ctx, a = torch.randn(1, 20, 3 * H), torch.tensor([[2, 10]])
    blocks = build_block_ids(ids, a, K, MASK)
    h1, h2 = back(ctx, blocks, a), ours(ctx, blocks, a)
    assert torch.equal(back.logits(h1), ours.logits(h2))
    first, anchor = ids[0, a[0] - 1], ids[0, a[0]]
    assert torch.equal(back.jacobi(h1[0], first, anchor), ours.jacobi(h2[0], first, anchor))


@torch.no_grad()
@pytest.mark.parametrize("anchor_first", [False, True])
def test_the_proposer_drafts_the_jacobi_recurrence(tiny, anchor_first):
    """Drafting's block (one forward after the cached context) has the training forward's rows at the
    same anchor; the drafts are the base argmax refined ``jacobi_passes`` times, row k fed row k-1's
    token of the pass before. Control: the base argmax alone (0 passes) drafts other tokens somewhere."""
    from specforge.algorithms.dflash.loss import build_block_ids
    from specforge.algorithms.dflash.model import ContextCache
    from specforge.algorithms.dflash.propose import context_features
    from specforge.algorithms.xpress.propose import propose_block_xpress

    target, drafts = tiny
    _, ours = drafts[anchor_first]
    shift = int(anchor_first)
    ids = torch.randint(0, MASK, (1, 24), generator=torch.Generator().manual_seed(3))
    ctx = context_features(target(ids, output_hidden_states=True).hidden_states, IDS)
    base_differs = 0
    for s in (6, 11, 17):
        got = propose_block_xpress(ours, ContextCache().extend(ours, ctx[:, :s]), ids[:, s], ids[:, s - 1])
        assert got.shape == (1, K - 1 + shift)
        a = torch.tensor([[s]])
        h = ours(ctx, build_block_ids(ids, a, K, MASK), a)[0, 0]
        base = ours.logits(h)
        pred = base.argmax(-1)
        for _ in range(ours.config.jacobi_passes):
            prev = [int(ids[0, s - 1 + shift])] + ([int(ids[0, s])] if not shift else []) + pred[1 - shift:-1].tolist()
            pred = (base + ours.refiner_head.bias(ours.refiner_head.context(h), torch.tensor(prev))).argmax(-1)
        torch.testing.assert_close(got[0], pred[1 - shift:], rtol=0, atol=0)
        base_differs += base.argmax(-1)[1 - shift:].tolist() != got[0].tolist()
    assert base_differs


@torch.no_grad()
def test_spec_decoding_with_the_proposer_is_lossless(tiny):
    """The eval's loop (``specforge.eval.speculative_decode``'s order of start / propose / accept) with
    the proposer against the target's greedy decoding."""
    from specforge.algorithms.dflash.propose import context_features, greedy_decode
    from specforge.algorithms.xpress.propose import XPressProposer

    target, drafts = tiny
    for anchor_first in (False, True):
        _, ours = drafts[anchor_first]
        prompt = torch.randint(0, MASK, (1, 10), generator=torch.Generator().manual_seed(6))
        want = greedy_decode(target, prompt, 20)[0].tolist()
        proposer = XPressProposer(ours)
        out = target(prompt, output_hidden_states=True)
        ids = prompt[0].tolist() + [int(out.logits[0, -1].argmax())]
        proposer.start(ids, context_features(out.hidden_states, IDS)[0])
        rounds = 0
        while len(ids) < len(want):
            drafted = proposer.propose(K)
            s = len(ids) - 1
            out = target(torch.tensor([ids + drafted]), output_hidden_states=True)
            verdict = out.logits[0, s:].argmax(-1).tolist()
            n = 0
            while n < len(drafted) and drafted[n] == verdict[n]:
                n += 1
            new = drafted[:n] + [verdict[n]]
            proposer.accept(new, context_features(out.hidden_states, IDS)[0, s:s + n + 1])
            ids += new
            rounds += 1
        assert ids[:len(want)] == want and rounds > 1
