"""train.pack_tokens: samples end to end in rows, each keeping its positions, attention and loss.

The reference is the unpacked run: the same samples right-padded, one per batch row. Packed must
equal it (fp64 to rounding, fp32 tightly), in the attention cores, the TTT loss (EAGLE-3, EAGLE-3.1)
and the trainer's step; a control shows what the doc masks prevent (without them the losses differ)."""

import dataclasses
from pathlib import Path

import pytest
import torch

from specforge.algorithms.eagle3.attention import ttt_attention_eager, ttt_attention_fast
from specforge.algorithms.eagle3.loss import ttt_loss, ttt_loss_reference, valid_rows
from specforge.algorithms.eagle3.model import Eagle3Draft, Eagle3DraftConfig
from specforge.config import load_config
from specforge.data.packing import pack_rows
from specforge.data.vocab import DraftVocab
from specforge.models.features import TrainBatch
from specforge.registry import get_algorithm
from specforge.training.slicing import PackedBatch, pack_micro_batches
from specforge.training.trainer import DraftTrainer
from tests.helpers.tolerance import assert_grads_close, assert_weights_close
from tests.helpers.trainer import feature_batch, setup_trainer, trainable_params

V, N, HT = 300, 100, 48
CONFIGS = Path(__file__).parent.parent / "configs"
LENGTHS = (13, 21, 9, 17)  # samples of uneven length (two micro-batches of two)


def _draft(dtype=torch.float64):
    cfg = Eagle3DraftConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, vocab_size=V, draft_vocab_size=N, target_hidden_size=HT)
    torch.manual_seed(0)
    d = Eagle3Draft(cfg).to(dtype)
    d.reset_parameters(std=0.1)
    d.set_vocab(torch.sort(torch.randperm(V)[:N]).values - torch.arange(N))
    return d


def _samples(draft, dtype=torch.float64, lengths=LENGTHS, seed=1):
    """Per-sample fields (no padding): ids, a loss mask with an assistant span reaching the end (the
    case where a shifted target would cross into the next sample), features, targets mostly in vocab."""
    g = torch.Generator().manual_seed(seed)
    inv = draft.draft_to_target_ids()
    out = []
    for n in lengths:
        mask = torch.zeros(n, dtype=torch.long)
        mask[3:] = 1
        tgt = torch.where(torch.rand(n, generator=g) < 0.8, inv[torch.randint(0, N, (n,), generator=g)],
                          torch.randint(0, V, (n,), generator=g))
        out.append({"input_ids_BT": torch.randint(0, V, (n,), generator=g), "loss_mask_BT": mask,
                    "aux_hidden_BTKH": torch.randn(n, 3 * HT, generator=g, dtype=dtype),
                    "last_hidden_BTH": torch.randn(n, HT, generator=g, dtype=dtype), "target_ids_BT": tgt})
    return out


def _padded(samples) -> TrainBatch:
    """The samples right-padded into one batch (pad id 0, mask 0, zero features), lengths recorded."""
    T = max(s["input_ids_BT"].shape[0] for s in samples)
    fields = {}
    for name, first in samples[0].items():
        out = torch.zeros((len(samples), T, *first.shape[1:]), dtype=first.dtype)
        for b, s in enumerate(samples):
            out[b, : s[name].shape[0]] = s[name]
        fields[name] = out
    return TrainBatch(**fields, length_B=torch.tensor([s["input_ids_BT"].shape[0] for s in samples]))


# ---------------------------------------------------------------- the packing itself


def test_rows_in_order_within_the_budget():
    assert pack_rows([5, 4, 3, 6, 2], 9) == [[0, 1], [2, 3], [4]]
    assert pack_rows([9, 9], 9) == [[0], [1]]
    with pytest.raises(ValueError, match="train.pack_tokens.*does not fit"):
        pack_rows([4, 10], 9)


def test_packed_rows_keep_every_token_and_restart_positions():
    d = _draft()
    s = _samples(d)
    mbs = [_padded(s[:2]), _padded(s[2:])]
    packed = pack_micro_batches(mbs, budget=40)
    assert [p.input_ids_BT.shape for p in packed] == [torch.Size([1, 34]), torch.Size([1, 26])]
    assert all(isinstance(p, PackedBatch) for p in packed)
    first = packed[0]
    assert first.position_ids_BT[0].tolist() == list(range(13)) + list(range(21))
    assert first.doc_ids_BT[0].tolist() == [0] * 13 + [1] * 21
    assert torch.equal(first.aux_hidden_BTKH[0, 13:], s[1]["aux_hidden_BTKH"])
    assert int(first.length_B) == 34 and first.to(torch.device("cpu")).doc_ids_BT is not None


# ---------------------------------------------------------------- attention: no query sees another sample


def _split_qkv(T_list, Hq=4, Hkv=2, D=8, n=2, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(T_list)
    q = torch.randn(1, Hq, T, D, generator=g, dtype=dtype, requires_grad=True)
    keys = [torch.randn(1, Hkv, T, D, generator=g, dtype=dtype, requires_grad=True) for _ in range(n + 1)]
    values = [torch.randn(1, Hkv, T, D, generator=g, dtype=dtype, requires_grad=True) for _ in range(n + 1)]
    doc = torch.cat([torch.full((t,), i) for i, t in enumerate(T_list)])[None]
    return q, keys, values, doc


def test_fast_core_reads_the_sample_starts_once_per_unroll(monkeypatch):
    """The fast core's chunk skip (keys before a chunk's samples) reads the sample starts from the
    device once per doc tensor: a TTT unroll's steps (fewer rows each) reuse it, equal to the eager
    core at every step; a new doc tensor (the next micro-batch) reads again."""
    import specforge.algorithms.eagle3.attention as attention

    calls = []
    real = attention._chunk_firsts
    monkeypatch.setattr(attention, "_chunk_firsts", lambda *a: (calls.append(a[1:]), real(*a))[1])
    q, keys, values, doc = _split_qkv([7, 12, 5])
    for T in (24, 21, 18):  # the steps of one unroll: the same step-0 keys and doc, fewer query rows
        cut = [keys[0]] + [k[:, :, :T] for k in keys[1:]], [values[0]] + [v[:, :, :T] for v in values[1:]]
        out = ttt_attention_fast(q[:, :, :T], *cut, chunk=4, doc_ids_BT=doc)
        torch.testing.assert_close(out, ttt_attention_eager(q[:, :, :T], *cut, doc_ids_BT=doc), rtol=1e-10, atol=1e-12)
    assert calls == [(0, 4)]
    ttt_attention_fast(q, keys, values, chunk=4, doc_ids_BT=doc.clone())
    assert calls == [(0, 4), (0, 4)]


@pytest.mark.parametrize("window", [None, 6])
def test_packed_attention_is_each_samples_own(window):
    """Each sample's rows of the packed attention equal the attention of that sample alone (eager
    reference and the fast core, forward and every gradient)."""
    T_list = [7, 12, 5]
    q, keys, values, doc = _split_qkv(T_list)
    for core in (ttt_attention_eager, lambda *a, **k: ttt_attention_fast(*a, chunk=4, **k)):
        out = core(q, keys, values, window=window, doc_ids_BT=doc)
        alone, start = [], 0
        for t in T_list:
            cut = lambda xs: [x[:, :, start : start + t] for x in xs]  # noqa: E731
            alone.append(ttt_attention_eager(q[:, :, start : start + t], cut(keys), cut(values), window=window))
            start += t
        torch.testing.assert_close(out, torch.cat(alone, dim=2), rtol=1e-12, atol=1e-12)
        w = torch.randn_like(out)
        grads = torch.autograd.grad((out * w).sum(), [q, *keys, *values])
        ref = torch.autograd.grad((torch.cat(alone, dim=2) * w).sum(), [q, *keys, *values])
        for a, b in zip(grads, ref):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_the_doc_mask_is_what_keeps_samples_apart():
    """Control: the same packed row without its doc ids mixes the samples."""
    T_list = [7, 12]
    q, keys, values, doc = _split_qkv(T_list)
    with_doc = ttt_attention_fast(q, keys, values, doc_ids_BT=doc)
    without = ttt_attention_fast(q, keys, values)
    assert torch.equal(with_doc[:, :, :7], without[:, :, :7])  # the first sample sees nothing before it
    assert not torch.allclose(with_doc[:, :, 7:], without[:, :, 7:])


def test_no_counted_row_predicts_across_a_boundary():
    mask = torch.ones(1, 8, dtype=torch.long)
    doc = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])
    v = valid_rows(mask, torch.zeros(1, 8, dtype=torch.long), torch.ones(4, dtype=torch.bool), 2, doc)
    # step i, row t predicts x_{t+2+i}: in its own sample only
    assert v[0, 0].nonzero().flatten().tolist() == [0, 1, 4, 5]
    assert v[1, 0].nonzero().flatten().tolist() == [0, 4]
    unpacked = valid_rows(mask, torch.zeros(1, 8, dtype=torch.long), torch.ones(4, dtype=torch.bool), 2)
    assert unpacked[0, 0].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5]  # control: rows 2, 3 would count


# ---------------------------------------------------------------- the TTT loss and the train step


def _loss_and_grads(draft, batches, W, loss_fn=ttt_loss, L=4):
    params = [p for p in draft.parameters() if p.requires_grad]
    total = sum(float(valid_rows(b.loss_mask_BT, b.target_ids_BT, draft.t2d, 1,
                                 getattr(b, "doc_ids_BT", None))[0].sum())
                for b in batches)
    losses, counts = zip(*(loss_fn(draft, b, W, ttt_length=L, num_valid_global=total) for b in batches))
    loss = sum(losses)
    return loss, sum(counts), torch.autograd.grad(loss, params)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-11), (torch.float32, 2e-5)])
def test_packed_ttt_loss_equals_unpacked(dtype, tol):
    d = _draft(dtype)
    s = _samples(d, dtype)
    W = torch.randn(N, HT, dtype=dtype, generator=torch.Generator().manual_seed(5))
    mbs = [_padded(s[:2]), _padded(s[2:])]
    l0, c0, g0 = _loss_and_grads(d, mbs, W)
    packed = pack_micro_batches(mbs, budget=40)
    l1, c1, g1 = _loss_and_grads(d, packed, W)
    torch.testing.assert_close(l1, l0, rtol=tol, atol=tol)
    assert torch.equal(c1[:, 0], c0[:, 0])  # the same rows count at every step
    torch.testing.assert_close(c1, c0, rtol=tol, atol=tol)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=tol * 10, atol=tol)
    if dtype == torch.float64:  # the reference (eager attention, all rows) agrees on the packed rows
        l2, c2, _ = _loss_and_grads(d, packed, W, ttt_loss_reference)
        torch.testing.assert_close(l2, l0, rtol=1e-11, atol=1e-11)


def test_a_packed_row_without_its_doc_ids_gives_another_loss():
    """Control: the packing alone (positions restarting) is not enough; the doc masks matter."""
    d = _draft()
    s = _samples(d)
    W = torch.randn(N, HT, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    mbs = [_padded(s[:2]), _padded(s[2:])]
    l0, _, _ = _loss_and_grads(d, mbs, W)
    packed = pack_micro_batches(mbs, budget=40)
    no_doc = [{"input_ids_BT": p.input_ids_BT, "loss_mask_BT": p.loss_mask_BT, "aux_hidden_BTKH": p.aux_hidden_BTKH,
               "last_hidden_BTH": p.last_hidden_BTH, "target_ids_BT": p.target_ids_BT,
               "position_ids_BT": p.position_ids_BT} for p in packed]
    total = sum(float(valid_rows(b["loss_mask_BT"], b["target_ids_BT"], d.t2d, 1)[0].sum()) for b in no_doc)
    l1 = sum(ttt_loss(d, b, W, ttt_length=4, num_valid_global=total)[0] for b in no_doc)
    assert not torch.allclose(l1 / l0, torch.ones((), dtype=l0.dtype), rtol=1e-3)


@pytest.mark.parametrize("algorithm", ["eagle3", "eagle31"])
def test_trainer_step_packed_equals_unpacked(algorithm):
    """Two optimizer steps of the trainer, packed and unpacked, on the same micro-batches: the same
    losses, counters, gradients at each step and weights (fp32)."""
    runs = {}
    for budget in (None, 64):
        # adam_eps = lr (1e-2): a step moves a weight at most twice its gradient's gap (tolerance.adamw_tol)
        target, rows, trainer = setup_trainer(seed=0, pack_tokens=budget, adam_eps=1e-2)
        if algorithm != "eagle3":
            algo = get_algorithm(algorithm)
            cfg = dataclasses.replace(trainer.cfg, draft=algo.options(
                **{f.name: getattr(trainer.cfg.draft, f.name) for f in dataclasses.fields(trainer.cfg.draft)
                   if f.name != "algorithm"}, algorithm="eagle31", norm_output=True))
            algo = algo.bind(cfg)
            draft = algo.build_draft(target, _vocab_of(trainer))
            trainer = DraftTrainer(algo, draft, algo.train_state(target, _vocab_of(trainer)), cfg,
                                   torch.device("cpu"))
        mbs = [feature_batch(target, rows[:2]), feature_batch(target, rows[2:])]
        mbs = mbs if budget is None else pack_micro_batches(mbs, budget)  # as a packed plan's source hands them
        metrics, grads = [], []
        for _ in range(2):
            metrics.append(trainer.step(mbs))
            grads.append({k: p.grad.clone() for k, p in trainer.draft.named_parameters() if p.grad is not None})
        runs[budget] = (metrics, grads, trainable_params(trainer))
    (m0, g0, p0), (m1, g1, p1) = runs[None], runs[64]
    for a, b in zip(m0, m1):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["valid_tokens"] == a["valid_tokens"]
        assert b["useful_tokens"] == a["useful_tokens"] == sum(len(r["input_ids"]) for r in rows)
        assert b["tokens"] < a["tokens"]  # no padding when packed
    # the longest chain of sums into a gradient entry (tests/helpers/tolerance.py): 4 rows of up to 33
    # tokens x 3 TTT steps summed into it; per step, forward and backward, the widest dot products of
    # the tiny target's sizes (H 48, I 96): fc's 3H, H, I, the keys (33 per step so far), the vocab's 48
    n = 4 * 33 * 3 + 2 * 3 * (3 * 48 + 48 + 96 + 3 * 33 + 48)
    for step, (a, b) in enumerate(zip(g0, g1)):
        assert_grads_close(step, b, a, n)
    assert_weights_close(p1, p0, g0, 1e-2, 1e-2, n)


def _vocab_of(trainer):
    return DraftVocab(trainer.draft.d2t, trainer.draft.t2d)


# ---------------------------------------------------------------- what is refused


@pytest.mark.parametrize("overrides, match", [
    (["train.pack_tokens=100"], "below data.max_length=512"),
    # every shipped algorithm packs; the block and parallel drafts not with SP (tests/test_packing_blocks.py)
    (["train.pack_tokens=4096", "draft.algorithm=dflash", "parallel.sp_ring=2", "train.num_workers=2"],
     "refused for draft.algorithm=dflash with sequence parallelism"),
])
def test_what_cannot_pack_is_refused_in_one_line(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, ["data.max_length=512", *overrides])
    load_config(None, ["data.max_length=512", "train.pack_tokens=4096"])  # control: EAGLE-3 packs
    load_config(None, ["data.max_length=512", "train.pack_tokens=4096", "parallel.sp_ulysses=2",
                       "train.num_workers=2"])  # with SP too (tests/test_packing_sp.py)


def test_packed_flex_attention_is_each_samples_own(monkeypatch):
    """The flex core (draft.attention=flex) on packed rows: its per-call block mask keeps the samples
    apart (the CPU backward guard lifted, as tests/test_attention_flex.py does)."""
    import torch.nn.attention.flex_attention as flex_module

    from specforge.algorithms.eagle3.attention import ttt_attention_flex

    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)
    T_list = [7, 12, 5]
    q, keys, values, doc = _split_qkv(T_list)
    out = ttt_attention_flex(q, keys, values, window=6, doc_ids_BT=doc)
    ref = ttt_attention_eager(q, keys, values, window=6, doc_ids_BT=doc)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    w = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad((out * w).sum(), [q, *keys, *values]),
                    torch.autograd.grad((ref * w).sum(), [q, *keys, *values])):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)
    without = ttt_attention_flex(q, keys, values, window=6)  # control: no doc ids, the samples mix
    assert not torch.allclose(out[:, :, 7:], without[:, :, 7:])


def test_the_memory_model_and_the_dry_run_count_packed_rows(capsys):
    """One packed row of train.pack_tokens per micro-batch, plus the packed copy of the samples."""
    from specforge.dryrun import dry_run, memory_plan

    base = ["data.max_length=512", "train.batch_size=4"]
    plain = memory_plan(load_config(CONFIGS / "smollm2-135m-cpu.yaml", base))[0]
    packed_cfg = load_config(CONFIGS / "smollm2-135m-cpu.yaml", [*base, "train.pack_tokens=4096"])
    packed = memory_plan(packed_cfg)[0]
    names = [t.name for t in packed.held + [t for ts in packed.phases.values() for t in ts]]
    assert any(n.startswith("packed rows") for n in names)
    assert not any(n.startswith("packed rows") for n in [t.name for t in plain.held])
    assert packed.peak > plain.peak  # a 4096-token row against 4 x 512 padded: the attention grows with the row
    dry_run(packed_cfg, None, single_process=True)
    assert "packed (train.pack_tokens)" in capsys.readouterr().out


def test_a_packed_run_resumes_exactly(assets, tmp_path, monkeypatch):
    """Exact resume with packing: a packed run that fails in step 4 (checkpoints every 2 steps, and
    the one a failing run saves on its way out) and is rerun with the same command trains only the
    steps after its checkpoint, on the same packed rows: every logged loss equals the uninterrupted run's."""
    from specforge.train import run
    from tests.helpers.ray_run import losses, make_cfg

    common = ("train.batch_size=2", "train.grad_accum=1", "train.num_workers=1", "train.pack_tokens=128",
              "train.max_steps=4", "checkpoint.every_steps=2", "checkpoint.keep_last=0", "checkpoint.resume=true")
    run(make_cfg(assets, tmp_path / "straight", *common))
    real = DraftTrainer.step

    def stop_at_step_3(self, micro_batches):
        if self.step_count == 3:
            raise RuntimeError("stopped in step 4")
        return real(self, micro_batches)

    monkeypatch.setattr(DraftTrainer, "step", stop_at_step_3)
    with pytest.raises(RuntimeError, match="stopped in step 4"):
        run(make_cfg(assets, tmp_path / "cut", *common))
    trained = []
    monkeypatch.setattr(DraftTrainer, "step", lambda self, mbs: (trained.append(self.step_count), real(self, mbs))[1])
    run(make_cfg(assets, tmp_path / "cut", *common))  # the same command resumes
    assert trained and trained[0] >= 2 and trained == list(range(trained[0], 4))  # resumed, not retrained
    want = {r["step"]: r["loss"] for r in losses(tmp_path / "straight")}
    got = losses(tmp_path / "cut")
    assert sorted({r["step"] for r in got}) == [1, 2, 3, 4]
    assert all(r["loss"] == want[r["step"]] for r in got), (got, want)
