"""train.pack_tokens for the block and parallel drafts: DFlash, DSpark, DFlash2, XPress, P-EAGLE.

As tests/test_packing.py does for EAGLE-3: the reference is the unpacked run (the same samples
right-padded, one per row). Through each algorithm's hooks (``normalizer``, ``loss``) the packed
rows give its loss, counters and gradients (fp64 to rounding, fp32 tightly), and the trainer's two
steps its metrics, gradients and weights (to tolerances derived from the sums they run, fp32).
DFlash's and DSpark's random anchors are a function of the sample (``dflash.loss.anchor_keys``):
each sample draws the same anchors packed and unpacked. Controls: a packed row without its doc ids
(treated as one sample) gives another loss."""

import dataclasses

import pytest
import torch

from specforge.algorithms.dflash.algorithm import DFlashOptions
from specforge.algorithms.dflash.loss import anchor_keys, sample_anchors
from specforge.algorithms.dflash.model import DFlashDraft
from specforge.algorithms.dflash2.algorithm import DFlash2Options
from specforge.algorithms.dflash2.model import DFlash2Config, DFlash2Draft
from specforge.algorithms.dspark.algorithm import DSparkOptions
from specforge.algorithms.dspark.model import DSparkConfig, DSparkDraft
from specforge.algorithms.peagle.algorithm import PEagleOptions
from specforge.algorithms.peagle.model import PEagleDraft, PEagleDraftConfig
from specforge.algorithms.xpress.algorithm import XPressOptions
from specforge.algorithms.xpress.model import XPressConfig, XPressDraft
from specforge.config import Config, TrainConfig, load_config
from specforge.models.features import TrainBatch
from specforge.registry import get_algorithm
from specforge.training.slicing import pack_micro_batches
from specforge.training.trainer import DraftTrainer
from tests.helpers.dflash import tiny_cfg
from tests.helpers.tolerance import assert_grads_close, assert_weights_close

LENGTHS = (13, 21, 9, 17)  # samples of uneven length (two micro-batches of two)
BUDGET = 40  # rows of 34 and 26 tokens
STEP = 3
PV, PN, PH = 300, 100, 64  # P-EAGLE: target vocab, draft vocab, hidden (the target's)
LR = 1e-2
# The longest chain of sums into a gradient entry (tests/helpers/tolerance.py): the padded rows (2 x 21
# and 2 x 17) and block rows (4 samples x 3 anchors x 4) summed into it; per pass of the 2 layers
# and the head (twice: XPress's refiner), forward and backward, the widest dot products of
# tests/helpers/dflash.py's sizes: fc's 3H, H, the MLP's I, a block's keys (21 + 4), the vocab's 97.
# P-EAGLE (3 parallel tokens) counts as the multi-rank harness (tests/helpers/ranks.py) at its sizes.
GRAD_TERMS = {"block": 2 * 21 + 2 * 17 + 4 * 3 * 4 + 2 * (2 + 2) * (3 * 32 + 32 + 64 + 21 + 4 + 97),
              "peagle": 2 * 21 * 3 + 2 * 3 * (3 * PH + PH + 128 + 3 * 21 + PN)}
ALGOS = ["dflash", "dflash_window", "dspark", "dflash2", "xpress", "peagle"]


def _cfg(name, opts=None, **train):
    """The algorithm, its config (few anchors: a sample's anchors are a random subset of its candidates);
    ``opts``: more ``draft.*`` options."""
    if name == "dflash2":
        d = DFlash2Options(algorithm="dflash2", block_size=4, num_anchors=3, num_layers=2, selector_rank=8,
                           selector_top_k=8, ce_weight=0.5)
    elif name == "xpress":
        d = XPressOptions(algorithm="xpress", block_size=4, num_anchors=3, num_layers=2, refiner_rank=8,
                          consistency_passes=2, kl_weight=0.2, anchor_full_weight=True)
    elif name.startswith("dflash"):
        window = 5 if name == "dflash_window" else None
        d = DFlashOptions(algorithm="dflash", block_size=4, num_anchors=3, num_layers=2, sliding_window=window)
    elif name == "dspark":
        d = DSparkOptions(algorithm="dspark", block_size=4, num_anchors=3, num_layers=2, markov_rank=8, ce_weight=0.5)
    else:
        d = PEagleOptions(algorithm="peagle", parallel_tokens=3)
    d = dataclasses.replace(d, **(opts or {}))
    # adam_eps = lr: a step moves a weight at most twice its gradient's gap (tolerance.adamw_tol)
    cfg = Config(draft=d, train=TrainConfig(precision="fp32", lr=LR, warmup_steps=0, max_grad_norm=10.0, adam_eps=LR,
                                            **train))
    return get_algorithm(d.algorithm).bind(cfg), cfg


def _draft(name, dtype):
    """(draft, the loss's state: P-EAGLE's teacher, else None), built under seed 0."""
    torch.manual_seed(0)
    if name == "peagle":
        cfg = PEagleDraftConfig(hidden_size=PH, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=16, vocab_size=PV, draft_vocab_size=PN, mask_token_id=PV - 1,
                                parallel_tokens=3)
        d = PEagleDraft(cfg).to(dtype)
        d.reset_parameters(std=0.1)
        d.set_vocab(torch.sort(torch.randperm(PV)[:PN]).values - torch.arange(PN))
        return d, torch.randn(PN, PH, dtype=dtype) * 0.5
    window = 5 if name == "dflash_window" else None
    if name == "dspark":
        base = tiny_cfg()
        d = DSparkDraft(DSparkConfig(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
                                     markov_rank=8))
    elif name == "dflash2":
        base = tiny_cfg()
        d = DFlash2Draft(DFlash2Config(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
                                       selector_rank=8, selector_top_k=8))
        with torch.no_grad():  # convolutions away from identity: rows of a block mix
            for pname, p in d.named_parameters():
                if "_conv." in pname:
                    p.add_(0.1 * torch.randn_like(p))
    elif name == "xpress":
        base = tiny_cfg()
        d = XPressDraft(XPressConfig(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
                                     refiner_rank=8))
        with torch.no_grad():  # a causal mix away from 0: rows of a block mix
            d.refiner_head.mix_l.normal_(0.0, 0.3)
    else:
        d = DFlashDraft(tiny_cfg(sliding_window=window))
    with torch.no_grad():  # non-trivial norms and a lm_head that is not near uniform
        for pname, p in d.named_parameters():
            if pname.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        d.embed_tokens.weight.normal_()
        d.lm_head.weight.normal_(std=2.0)
    return d.to(dtype), None


def _counted(name: str) -> int:
    """The counters' column of counted rows (EAGLE-3's first, DFlash's second)."""
    return 0 if name == "peagle" else 1


def _samples(name, dtype, lengths=LENGTHS, seed=1, draft=None):
    """Per-sample fields (no padding): an assistant span reaching the sample's end (where a block or
    a shifted target would cross into the next sample) with a user gap in the longer ones; P-EAGLE's
    targets mostly in ``draft``'s vocab."""
    g = torch.Generator().manual_seed(seed)
    if name == "peagle":
        V, F, H = PV, 3 * PH, PH
    else:
        c = tiny_cfg()
        V, F, H = c.vocab_size - 1, c.context_width, c.hidden_size  # ids below the mask token
    out = []
    for n in lengths:
        mask = torch.zeros(n, dtype=torch.long)
        mask[3:] = 1
        if n > 15:
            mask[9:11] = 0
        tgt = torch.randint(0, V, (n,), generator=g)
        if draft is not None:
            inv = draft.draft_to_target_ids()
            tgt = torch.where(torch.rand(n, generator=g) < 0.8, inv[torch.randint(0, PN, (n,), generator=g)], tgt)
        out.append({"input_ids_BT": torch.randint(0, V, (n,), generator=g), "loss_mask_BT": mask,
                    "aux_hidden_BTKH": torch.randn(n, F, generator=g, dtype=dtype),
                    "last_hidden_BTH": torch.randn(n, H, generator=g, dtype=dtype), "target_ids_BT": tgt})
    return out


def _padded(samples, pad_id=5) -> TrainBatch:
    """The samples right-padded into one batch (a pad id that is a real token, mask 0, zero
    features), lengths recorded."""
    T = max(s["input_ids_BT"].shape[0] for s in samples)
    fields = {}
    for name, first in samples[0].items():
        out = torch.full((len(samples), T, *first.shape[1:]), pad_id if name == "input_ids_BT" else 0,
                         dtype=first.dtype)
        for b, s in enumerate(samples):
            out[b, : s[name].shape[0]] = s[name]
        fields[name] = out
    return TrainBatch(**fields, length_B=torch.tensor([s["input_ids_BT"].shape[0] for s in samples]))


def _micro_batches(name, dtype, draft=None):
    s = _samples(name, dtype, draft=draft if name == "peagle" else None)
    mbs = [_padded(s[:2]), _padded(s[2:])]
    return mbs, pack_micro_batches(mbs, BUDGET)


def _loss_counts_grads(algo, cfg, draft, state, batches):
    """The step's loss over ``batches`` as the trainer computes it (the global normalizer first)."""
    total = sum(algo.normalizer(draft, b, STEP, training=True) for b in batches)
    losses, counts = zip(*(algo.loss(draft, b, state, STEP, total, training=True) for b in batches))
    loss = sum(losses)
    return loss, sum(counts), torch.autograd.grad(loss, [p for p in draft.parameters() if p.requires_grad])


# ---------------------------------------------------------------- the anchors: a function of the sample


def test_each_sample_draws_its_anchors_packed_or_padded():
    """The same (sample, position) anchors from a packed row as from the padded rows (another pad id
    too), up to num_anchors per sample; a changed assistant token draws others."""
    algo, cfg = _cfg("dflash")
    mbs, packed = _micro_batches("dflash", torch.float64)

    def per_sample(batches):
        out = []
        for b in batches:
            anchors, keep, _ = algo._anchors(None, b, STEP, True)
            doc = getattr(b, "doc_ids_BT", None)
            pos = getattr(b, "position_ids_BT", None)
            for r in range(anchors.shape[0]):
                a = anchors[r][keep[r]]
                d = torch.zeros_like(a) if doc is None else doc[r, a]
                local = a if pos is None else pos[r, a]
                for i in range(int(d.max()) + 1 if a.numel() else 0):
                    out.append(local[d == i].tolist())
        return out

    want = per_sample(mbs)
    assert [len(a) for a in want] == [3, 3, 3, 3]
    assert per_sample(packed) == want
    assert per_sample([_padded(_samples("dflash", torch.float64)[:2], pad_id=0)]) == want[:2]
    s = _samples("dflash", torch.float64)
    s[0]["input_ids_BT"][5] += 1
    assert per_sample([_padded(s[:2])])[0] != want[0]


def test_anchors_are_uniform_over_a_samples_candidates():
    """Over many steps every candidate of a sample is drawn about equally often (the keys are a hash,
    not a generator: check they carry no visible bias)."""
    mask = torch.zeros(1, 30, dtype=torch.long)
    mask[0, 4:24] = 1  # candidates 4..22
    ids = torch.randint(0, 90, (1, 30), generator=torch.Generator().manual_seed(0))
    seen = torch.zeros(30)
    for step in range(400):
        a, k = sample_anchors(mask, 5, keys_BT=anchor_keys(ids, mask, hash((0, step)) & 0xFFFFFFFF))
        assert int(k.sum()) == 5
        seen[a[k]] += 1
    assert seen[:4].sum() == 0 and seen[23:].sum() == 0
    freq = seen[4:23] / (400 * 5 / 19)
    assert freq.min() > 0.7 and freq.max() < 1.3, freq


# ---------------------------------------------------------------- the loss: packed equals unpacked


@pytest.mark.parametrize("name", ALGOS)
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-11), (torch.float32, 2e-5)])
def test_packed_loss_equals_unpacked(name, dtype, tol):
    algo, cfg = _cfg(name)
    draft, state = _draft(name, dtype)
    mbs, packed = _micro_batches(name, dtype, draft)
    assert [p.input_ids_BT.shape[1] for p in packed] == [34, 26]
    l0, c0, g0 = _loss_counts_grads(algo, cfg, draft, state, mbs)
    l1, c1, g1 = _loss_counts_grads(algo, cfg, draft, state, packed)
    col = _counted(name)
    assert c0[int(col == 1):, col].min() > 0  # something counts at every depth / drafted block row
    torch.testing.assert_close(l1, l0, rtol=tol, atol=tol)
    assert torch.equal(c1[:, col], c0[:, col])  # the same rows count at every block position / depth
    torch.testing.assert_close(c1, c0, rtol=tol, atol=tol)
    assert algo.metrics(c1.double()).keys() == algo.metrics(c0.double()).keys()
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=tol * 10, atol=tol)


@pytest.mark.parametrize("name", ALGOS)
def test_a_packed_row_without_its_doc_ids_gives_another_loss(name):
    """Control: the packed rows as one sample each (positions restarting, no doc ids) train another loss."""
    algo, cfg = _cfg(name)
    draft, state = _draft(name, torch.float64)
    mbs, packed = _micro_batches(name, torch.float64, draft)
    l0 = _loss_counts_grads(algo, cfg, draft, state, mbs)[0]
    no_doc = [TrainBatch(p.input_ids_BT, p.loss_mask_BT, p.aux_hidden_BTKH, p.last_hidden_BTH, p.target_ids_BT)
              for p in packed]
    for b, p in zip(no_doc, packed):
        object.__setattr__(b, "position_ids_BT", p.position_ids_BT)
    l1 = _loss_counts_grads(algo, cfg, draft, state, no_doc)[0]
    assert not torch.allclose(l1, l0, rtol=1e-3)


# ---------------------------------------------------------------- D-PACE (draft.loss_weighting=dpace)


def test_dpace_weights_equal_speculators():
    """``dpace_weights`` equals speculators 0.9.0's ``dpace_loss_decay`` (blocks flattened, its CE as
    exp(-CE) confidences) on random confidences and masks, gaps included, for two smoothings.
    Control: a mask shifted by one row gives other weights."""
    utils = pytest.importorskip("speculators.losses.utils")
    from specforge.algorithms.dflash.loss import dpace_weights

    g = torch.Generator().manual_seed(0)
    N, K = 6, 5
    ce = torch.rand(N, K, generator=g, dtype=torch.float64) * 3
    mask = torch.rand(N, K, generator=g) < 0.75
    for alpha in (0.5, 0.2):
        want = utils.dpace_loss_decay(None, loss_mask=mask.reshape(1, -1), block_size=K, dpace_alpha=alpha,
                                      elementwise_loss=(ce * mask).reshape(1, -1)).reshape(N, K)
        got = dpace_weights(torch.exp(-ce), mask, alpha)
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-6, atol=1e-6)
        assert not torch.allclose(dpace_weights(torch.exp(-ce), mask.roll(1, -1), alpha).double(), want.double())


def test_dflash_dpace_loss_is_the_weighted_ce_over_counted_rows():
    """DFlash's block loss under D-PACE: sum of w * CE over the counted rows' number, the weights from the
    draft's own detached CE (no gradient through them): loss and gradient against that written out."""
    import torch.nn.functional as F

    from specforge.algorithms.dflash.loss import block_loss, dpace_weights

    g = torch.Generator().manual_seed(1)
    B, N, K, H, V = 2, 3, 4, 8, 11
    hidden = torch.randn(B, N, K, H, generator=g, dtype=torch.float64)
    W = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (B, N, K), generator=g)
    valid = torch.ones(B, N, K, dtype=torch.bool)
    valid[..., 0] = False
    valid[0, 1, 2:] = False
    loss, counts = block_loss(lambda h: h @ W.t(), hidden, labels, valid, 7.0, dpace_alpha=0.5)
    logits = (hidden @ W.t()).float()  # as the block loss computes its CE: in fp32
    ce = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="none").view_as(labels) * valid
    want = (dpace_weights(torch.exp(-ce.detach()), valid, 0.5) * ce).sum() / valid.sum()
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.autograd.grad(loss, W)[0], torch.autograd.grad(want, W)[0], rtol=1e-5, atol=1e-6)
    decayed, _ = block_loss(lambda h: h @ W.t(), hidden, labels, valid, 7.0)
    assert not torch.allclose(decayed, loss)  # control: the decay weighs the rows otherwise


@pytest.mark.parametrize("name", ["dflash", "dspark", "dflash2", "xpress"])
def test_dpace_packed_loss_equals_unpacked(name):
    """Each block draft under D-PACE: packed rows give the unpacked loss, counters and gradients (fp64), the
    denominator the counted rows of every micro-batch (the trainer's global normalizer); the control: the
    decay's loss differs."""
    algo, cfg = _cfg(name, {"loss_weighting": "dpace", "dpace_alpha": 0.4})
    assert algo.dpace_alpha == 0.4 and algo.decay_gamma is None
    draft, state = _draft(name, torch.float64)
    mbs, packed = _micro_batches(name, torch.float64, draft)
    total = sum(algo.normalizer(draft, b, STEP, training=True) for b in mbs)
    counts = sum(algo.loss(draft, b, state, STEP, total, training=True)[1] for b in mbs)
    assert total == counts[:, 1].sum() > 0  # the counted rows, as the counters count them
    l0, c0, g0 = _loss_counts_grads(algo, cfg, draft, state, mbs)
    l1, c1, g1 = _loss_counts_grads(algo, cfg, draft, state, packed)
    torch.testing.assert_close(l1, l0, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(c1, c0, rtol=1e-11, atol=1e-11)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-11)
    decay_algo, _ = _cfg(name)
    assert not torch.allclose(_loss_counts_grads(decay_algo, cfg, draft, state, mbs)[0], l0, rtol=1e-3)


def test_dpace_config():
    """``draft.loss_weighting`` and ``draft.dpace_alpha`` are the block drafts' keys, checked before anything loads."""
    for algo in ("dflash", "dspark", "dflash2", "xpress"):
        assert load_config(None, [f"draft.algorithm={algo}", "draft.loss_weighting=dpace"]).draft.dpace_alpha == 0.5
        with pytest.raises(ValueError, match=r"'draft\.dpace_alpha'=0\.0 must be in \(0, 1\]"):
            load_config(None, [f"draft.algorithm={algo}", "draft.dpace_alpha=0"])
    with pytest.raises(ValueError, match=r"'draft\.loss_weighting': got 'pace'.*'decay', 'dpace'"):
        load_config(None, ["draft.algorithm=dflash", "draft.loss_weighting=pace"])
    with pytest.raises(ValueError, match=r"draft\.loss_weighting"):
        load_config(None, ["draft.loss_weighting=dpace"])  # EAGLE-3 has no such key


# ---------------------------------------------------------------- the trainer's step


@pytest.mark.parametrize("name", ["dflash", "dspark", "dflash2", "xpress", "peagle"])
def test_trainer_steps_packed_equal_unpacked(name):
    """Two optimizer steps of the trainer, packed and unpacked, on the same micro-batches: the same
    metrics, gradients at each step and weights (fp32)."""
    runs = {}
    for budget in (None, BUDGET):
        algo, cfg = _cfg(name, pack_tokens=budget)
        draft, state = _draft(name, torch.float32)
        trainer = DraftTrainer(algo, draft, state, cfg, torch.device("cpu"))
        mbs = _micro_batches(name, torch.float32, draft)[0 if budget is None else 1]  # packed: as a source hands them
        metrics, grads = [], []
        for _ in range(2):
            metrics.append(trainer.step(mbs))
            grads.append({k: v.grad.clone() for k, v in draft.named_parameters() if v.grad is not None})
        runs[budget] = metrics, grads, {k: v.detach().clone() for k, v in draft.named_parameters() if v.requires_grad}
    (m0, g0, p0), (m1, g1, p1) = runs[None], runs[BUDGET]
    for a, b in zip(m0, m1):
        assert b["valid_tokens"] == a["valid_tokens"] > 0
        assert b["tokens"] < a["tokens"]  # no padding when packed
        for key in a:
            if key not in ("tokens", "train_ms", "lr") and a[key] == a[key]:  # nan: a position nothing reached
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
    n = GRAD_TERMS["peagle" if name == "peagle" else "block"]
    for step, (a, b) in enumerate(zip(g0, g1)):
        assert_grads_close(step, b, a, n)
    assert_weights_close(p1, p0, g0, LR, LR, n)


# ---------------------------------------------------------------- the memory model


def test_a_packed_row_counts_the_anchors_of_all_its_samples():
    """A packed row draws num_anchors per sample (up to the rank's samples of a step), never more
    than its tokens allow. In the dry run a row of 4 samples holds as many block rows as 4 padded
    rows, and a block mask 4 times theirs (every block of the row against every other)."""
    from pathlib import Path

    from specforge.algorithms.dflash.memory import anchors_per_row
    from specforge.dryrun import memory_plan
    from specforge.seam import RunFacts

    def cfg(*over):
        return load_config(None, ["draft.algorithm=dflash", "draft.num_anchors=64", "data.max_length=512", *over])

    def anchors(c, T):
        facts = RunFacts.of(c)
        return anchors_per_row(facts.draft.num_anchors, facts.samples_per_row, T)

    assert anchors(cfg(), 512) == 64 and anchors(cfg(), 40) == 39  # one sample a row
    packed = cfg("train.pack_tokens=4096", "train.batch_size=4", "train.grad_accum=2")
    assert anchors(packed, 4096) == 8 * 64
    assert anchors(cfg("draft.num_anchors=3", "train.pack_tokens=512", "train.batch_size=64"), 10) == 7
    configs = Path(__file__).parent.parent / "configs"
    base = ["data.max_length=512", "train.batch_size=4"]
    plain = memory_plan(load_config(configs / "smollm2-135m-dflash-cpu.yaml", base))[0]
    rows = memory_plan(load_config(configs / "smollm2-135m-dflash-cpu.yaml", [*base, "train.pack_tokens=2048"]))[0]

    def term(plan, name):
        return max(t.nbytes for ts in plan.phases.values() for t in ts if t.name.startswith(name))

    assert term(rows, "activations: block rows") == term(plain, "activations: block rows")
    assert term(rows, "block mask") == pytest.approx(4 * term(plain, "block mask"), rel=0.05)


# ---------------------------------------------------------------- what is refused


@pytest.mark.parametrize("algorithm", ["dflash", "dspark", "dflash2", "xpress", "peagle"])
def test_block_and_parallel_drafts_pack_but_not_with_sp(algorithm):
    base = ["data.max_length=512", "train.pack_tokens=4096", f"draft.algorithm={algorithm}"]
    load_config(None, base)
    with pytest.raises(ValueError, match="refused for draft.algorithm=.*with sequence parallelism"):
        load_config(None, [*base, "parallel.sp_ring=2", "train.num_workers=2"])
