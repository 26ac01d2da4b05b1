"""MTP (``specforge.algorithms.mtp``): one multi-token-prediction layer applied recursively, equal to
speculators 0.9.0's ``MTPDraftModel``.

* With the same weights and features, speculators' training forward gives our per-step logits, our
  loss (its per-batch per-step means: ``denominators`` None) and our gradients, in fp32 (measured:
  logits 3.4e-7 of the largest entry, loss 8e-8 relative, gradients 5.2e-7 of each tensor's largest
  entry; asserted: 1e-5 of the largest entry for logits, 1e-5 relative for the loss, 1e-4 of the
  largest entry for gradients). Negative controls: ``input_proj``'s halves swapped (the
  [embedding ; hidden] order), the tokens shifted by one, and a loss mask on the last tokens (where
  speculators' uniform truncation drops rows ours keeps) each break the comparison.
* The saved folder is speculators' format: its own ``MTPDraftModel.from_pretrained`` loads it (the
  frozen parts from the verifier folder it names) and computes our logits.
* Packed rows give their samples' padded loss, counters and gradients (fp64 1e-11, fp32 2e-5); the
  rows without their sample ids (control) give another loss.
* The proposer drafts the training forward's step 0 exactly (its cache holds step 0's keys).
"""


import json

import pytest
import torch

pytestmark = [pytest.mark.timeout(900)]

L, H, V, S, T = 6, 64, 128, 3, 24


def _close(got, want, rel):
    """``max |got - want| <= rel x max |want|`` (one scale per tensor)."""
    scale = want.abs().max()
    return bool(scale > 0) and bool((got - want).abs().max() <= rel * scale)


def _target():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    tc = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=L, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)
    return Qwen3ForCausalLM(tc).eval()


def _draft(target, seed=0):
    """A random MTP draft shaped after ``target``, its norms moved off 1 (so a wrong norm shows)."""
    from specforge.algorithms.mtp.model import MTPConfig, MTPDraft

    torch.manual_seed(seed)
    draft = MTPDraft(MTPConfig.from_target(target.config.to_dict(), num_speculative_steps=S))
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
            elif p.dim() == 2 and p.requires_grad:
                p.normal_(0.0, 0.08)
    model = target.model
    return draft.set_target_weights(model.embed_tokens.weight, target.lm_head.weight, model.norm.weight)


def _batch(seed=1, tail=False):
    """(hidden [2, T, H], ids [2, T], loss mask [2, T]): random features and tokens; the loss mask is 0
    on the last S - 1 tokens unless ``tail`` (speculators' truncation drops those rows' step-0 targets)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, T, H, generator=g)
    ids = torch.randint(0, V, (2, T), generator=g)
    mask = (torch.rand(2, T, generator=g) < 0.8).long()
    mask[:, :3] = 0
    if not tail:
        mask[:, T - (S - 1):] = 0
    return hidden, ids, mask


# ---------------------------------------------------------------- speculators (the bridge, in one place)


def speculators_run(draft, hidden, ids, mask, weights):
    """speculators' MTPDraftModel with ``draft``'s weights, run on the same features: ``(model, per-step
    logits [B, T - S - 1, V], loss)``.

    Conventions bridged here and nowhere else: its config is a Qwen3 ``transformer_layer_config`` of the
    draft's sizes and ``speculative_tokens`` = our ``num_speculative_steps``; its weights are ours (the
    same names, ``mtp_layers.0.*``; the frozen embedding and lm_head copied from ours); its step k has
    T - S - 1 rows for every k (a uniform truncation for torch.compile), ours T - k - 1, so the first T - S - 1
    rows of each of our steps are compared (and its loss equals ours only where no counted target lies
    in the rows it drops: the last S - 1 tokens for step 0)."""
    from loguru import logger
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.mtp import MTPDraftModel, MTPSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    logger.disable("speculators")
    c = draft.config
    tl = Qwen3Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                     num_hidden_layers=L, num_attention_heads=c.num_attention_heads,
                     num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                     rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings)
    tl._attn_implementation = "eager"
    cfg = MTPSpeculatorConfig(transformer_layer_config=tl, speculators_config=SpeculatorsConfig(
        algorithm="mtp", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=c.num_speculative_steps)],
        default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None, architectures=[])))
    model = MTPDraftModel(cfg)
    state = draft.export_state_dict()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) == {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight"}
    with torch.no_grad():
        model.embed_tokens.weight.copy_(draft.embed_tokens.weight)
        model.lm_head.weight.copy_(draft.lm_head.weight)
    logits, loss, _ = model(input_ids=ids, hidden_states=hidden, loss_mask=mask, step_weights=list(weights))
    return model, logits, loss


def _ours(draft, hidden, ids, mask, weights):
    from specforge.algorithms.mtp.loss import mtp_loss

    loss, counts = mtp_loss(draft, hidden, ids, mask, weights)
    outs = draft(hidden, ids, steps=len(weights))
    n = T - S - 1
    return [draft.logits(o[:, :n]) for o in outs], loss, counts


@pytest.fixture(scope="module")
def target():
    return _target()


def test_forward_loss_and_gradients_equal_speculators(target):
    from specforge.algorithms.mtp.loss import step_weights

    draft = _draft(target)
    hidden, ids, mask = _batch()
    w = step_weights(0.6, S)
    ours, loss, counts = _ours(draft, hidden, ids, mask, w)
    loss.backward()
    model, theirs, their_loss = speculators_run(draft, hidden, ids, mask, w)
    their_loss.backward()
    assert len(theirs) == S and counts[:, 2].min() > 0
    for k in range(S):
        assert _close(ours[k], theirs[k], 1e-5), (k, (ours[k] - theirs[k]).abs().max())
    assert their_loss.item() == pytest.approx(loss.item(), rel=1e-5)
    theirs_p = dict(model.named_parameters())
    for name, p in draft.named_parameters():
        if p.requires_grad:
            g = theirs_p[name].grad
            assert _close(p.grad, g, 1e-4), (name, (p.grad - g).abs().max(), g.abs().max())


def test_negative_controls_break_the_comparison(target):
    from specforge.algorithms.mtp.loss import step_weights

    w = step_weights(0.6, S)
    hidden, ids, mask = _batch()
    draft = _draft(target)
    _, theirs, their_loss = speculators_run(draft, hidden, ids, mask, w)
    swapped = _draft(target)
    with torch.no_grad():  # [hidden ; embedding] instead of [embedding ; hidden]
        w_in = swapped.mtp_layers[0].input_proj.weight
        w_in.copy_(torch.cat(w_in.chunk(2, dim=1)[::-1], dim=1))
    ours, loss, _ = _ours(swapped, hidden, ids, mask, w)
    assert not _close(ours[0], theirs[0], 1e-3) and loss.item() != pytest.approx(their_loss.item(), rel=1e-3)
    shifted, loss, _ = _ours(draft, hidden, ids.roll(1, dims=1), mask, w)
    assert not _close(shifted[0], theirs[0], 1e-3) and loss.item() != pytest.approx(their_loss.item(), rel=1e-3)
    hidden, ids, mask = _batch(tail=True)  # counted targets in the rows speculators drops
    _, _, their_loss = speculators_run(draft, hidden, ids, mask, w)
    _, loss, _ = _ours(draft, hidden, ids, mask, w)
    assert loss.item() != pytest.approx(their_loss.item(), rel=1e-4)


# ---------------------------------------------------------------- packing: a packed row == its samples padded

LENGTHS, BUDGET = (13, 21, 9, 17), 40


def _samples(dtype, seed=2):
    """Per-sample fields: an assistant span reaching the sample's end (where a shifted target would
    cross into the next sample), a user gap in the longer ones."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in LENGTHS:
        mask = torch.zeros(n, dtype=torch.long)
        mask[3:] = 1
        if n > 15:
            mask[9:11] = 0
        out.append({"input_ids_BT": torch.randint(0, V, (n,), generator=g), "loss_mask_BT": mask,
                    "aux_hidden_BTKH": torch.randn(n, H, generator=g, dtype=dtype),
                    "last_hidden_BTH": torch.randn(n, H, generator=g, dtype=dtype),
                    "target_ids_BT": torch.randint(0, V, (n,), generator=g)})
    return out


def _padded(samples, pad_id=5):
    from specforge.models.features import TrainBatch

    T = max(s["input_ids_BT"].shape[0] for s in samples)
    fields = {}
    for name, first in samples[0].items():
        out = torch.full((len(samples), T, *first.shape[1:]), pad_id if name == "input_ids_BT" else 0,
                         dtype=first.dtype)
        for b, s in enumerate(samples):
            out[b, : s[name].shape[0]] = s[name]
        fields[name] = out
    return TrainBatch(**fields, length_B=torch.tensor([s["input_ids_BT"].shape[0] for s in samples]))


def _step(algo, draft, batches):
    """The loss over ``batches`` as the trainer computes it (the global per-step normalizer first)."""
    shares = [algo.normalizer(draft, b, 0, training=True) for b in batches]
    total = sum(shares)
    losses, counts = zip(*(algo.loss(draft, b, None, 0, total, training=True) for b in batches))
    loss = sum(losses)
    return loss, sum(counts), torch.autograd.grad(loss, [p for p in draft.parameters() if p.requires_grad])


def _bound(**train):
    from specforge.algorithms.mtp.algorithm import MTPOptions
    from specforge.config import Config, TrainConfig
    from specforge.registry import get_algorithm

    cfg = Config(draft=MTPOptions(algorithm="mtp", num_speculative_steps=S),
                 train=TrainConfig(precision="fp32", **train))
    return get_algorithm("mtp").bind(cfg)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-11), (torch.float32, 2e-5)])
def test_packed_rows_equal_their_samples_padded(target, dtype, tol):
    from specforge.training.slicing import pack_micro_batches

    algo, draft = _bound(), _draft(target).to(dtype)
    s = _samples(dtype)
    padded = [_padded(s[:2]), _padded(s[2:])]
    packed = pack_micro_batches(padded, BUDGET)
    assert [p.input_ids_BT.shape[1] for p in packed] == [34, 26]
    l0, c0, g0 = _step(algo, draft, padded)
    l1, c1, g1 = _step(algo, draft, packed)
    assert c0[:, 2].min() > 0 and torch.equal(c1[:, 2], c0[:, 2])
    torch.testing.assert_close(l1, l0, rtol=tol, atol=tol)
    torch.testing.assert_close(c1, c0, rtol=tol, atol=tol)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=tol * 10, atol=tol)
    # control: the packed rows without their sample ids (one sample a row) train another loss
    from specforge.models.features import TrainBatch

    no_doc = [TrainBatch(p.input_ids_BT, p.loss_mask_BT, p.aux_hidden_BTKH, p.last_hidden_BTH, p.target_ids_BT)
              for p in packed]
    for b, p in zip(no_doc, packed):
        object.__setattr__(b, "position_ids_BT", p.position_ids_BT)
    assert (_step(algo, draft, no_doc)[0] - l0).abs() > 1e-4 * l0.abs()  # ~1e-3: a few rows cross samples


# ---------------------------------------------------------------- drafting and the saved folder


def test_the_proposer_drafts_the_training_forwards_step_zero(target):
    """Fed the target's last layer outputs, the proposer's first draft of every round is the training
    forward's step-0 argmax at the last position (the cache holds step 0's keys exactly)."""
    from specforge.algorithms.mtp.propose import MTPProposer
    from specforge.models.target import TargetModel, forward_aux

    draft = _draft(target).eval()
    tm = TargetModel(model=target, tokenizer=None, aux_layer_ids=[L - 1], device=torch.device("cpu"))
    ids = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        aux, last, _ = forward_aux(tm, ids)
        torch.testing.assert_close(draft.target_norm(aux), last, rtol=1e-5, atol=1e-5)
        prop = MTPProposer(draft)
        prop.start(ids[0].tolist(), aux[0, :-1])
        h0 = draft(last, ids, steps=1)[0]  # rows 0 .. T-2: step 0 at row t reads x[t+1]
        first = prop.propose(2)
        assert first[0] == int(draft.logits(h0[0, -1]).argmax())
        want = draft.draft_step(prop.cache, last[:, -2:-1], ids[:, -1:])
        torch.testing.assert_close(want, h0[:, -1:], rtol=1e-5, atol=1e-5)
        prop.accept([int(ids[0, -1]) + 0, 7], aux[0, -1:].repeat(2, 1))  # the cache grows by the accepted rows
        assert prop.cache.length == 12


def test_speculators_loads_the_saved_folder(target, tmp_path):
    """Our folder + the verifier named = a folder speculators' ``MTPDraftModel.from_pretrained`` loads
    (the frozen embedding and lm_head from the verifier); its forward gives our logits."""
    from loguru import logger
    from speculators.models.mtp import MTPDraftModel

    from specforge.algorithms.mtp.export import check_checkpoint, save_mtp

    logger.disable("speculators")
    verifier = tmp_path / "verifier"
    target.save_pretrained(verifier)
    draft = _draft(target)
    folder = save_mtp(draft, tmp_path / "draft", torch.float32)
    check_checkpoint(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["speculators_config"]["verifier"] = {"name_or_path": str(verifier), "architectures": ["Qwen3ForCausalLM"]}
    (folder / "config.json").write_text(json.dumps(cfg))
    model = MTPDraftModel.from_pretrained(str(folder)).float().eval()
    hidden, ids, mask = _batch()
    with torch.no_grad():
        theirs, _, _ = model(input_ids=ids, hidden_states=hidden, loss_mask=mask)
        ours = [draft.logits(o[:, :T - S - 1]) for o in draft(hidden, ids)]
    assert all(_close(a, b, 1e-5) for a, b in zip(ours, theirs))
