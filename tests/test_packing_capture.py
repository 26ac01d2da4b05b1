"""Packed target forwards (``rollout.pack_tokens``): a batch's samples end to end in one row, position
ids restarting at 0 per sample, no padding; HF's masks keep the samples apart. The features that come
back per sample equal the right-padded capture's (fp32, tiny random targets) at every caller: the
rollout worker, the store capture (and ``python -m specforge.capture``), ``local_batches``."""

import collections
import dataclasses
import functools
import types

import pytest
import torch

import specforge.runtime.workers as workers
from specforge.capture import iter_features, main, plan_batches
from specforge.config import load_config
from specforge.contracts import FeatureField, FeatureSpec
from specforge.data.packing import target_packs
from specforge.data.store import FeatureStore
from specforge.models.target import TargetModel, capture, forward_aux
from specforge.runtime.dataplane import SendHandle, SendWindow
from specforge.runtime.workers import RolloutWorker
from specforge.targets import FAMILIES, check_packing
from specforge.training.batch import collate
from specforge.training.trainer import local_batches
from tests.helpers.models import tiny_target
from tests.helpers.targets import NAMES, build_family, overrides, target_folder

LENGTHS = [7, 12, 3, 9, 1, 15]
K, H = 3, 48  # aux layers, tiny target hidden
FIELDS = ("aux_hidden_BTKH", "last_hidden_BTH", "target_ids_BT")


@pytest.fixture(scope="module")
def target():
    return TargetModel(model=tiny_target(), tokenizer=types.SimpleNamespace(pad_token_id=0),
                       aux_layer_ids=[1, 2, 3], device=torch.device("cpu"))


@pytest.fixture(scope="module")
def rows():
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(3, 320, (n,), generator=g).tolist(), "loss_mask": [0] + [1] * (n - 1)}
            for n in LENGTHS]


def assert_same_samples(a, b, lengths, tol=1e-5):
    """Equal features at every sample's tokens (fp32 rounding apart), argmax ids exactly."""
    for j, n in enumerate(lengths):
        torch.testing.assert_close(a.aux_hidden_BTKH[j, :n], b.aux_hidden_BTKH[j, :n], atol=tol, rtol=tol)
        torch.testing.assert_close(a.last_hidden_BTH[j, :n], b.last_hidden_BTH[j, :n], atol=tol, rtol=tol)
        assert torch.equal(a.target_ids_BT[j, :n], b.target_ids_BT[j, :n])


@pytest.mark.parametrize("pack_tokens", [15, 24, 100])  # one sample per row up to all in one row
def test_packed_capture_equals_the_padded_one(target, rows, pack_tokens):
    ids, _, attn = collate(rows, 0)
    padded = capture(target, ids, attn)
    packed = capture(target, ids, attn, packs=target_packs(attn, pack_tokens))
    assert_same_samples(packed, padded, LENGTHS)
    for name in FIELDS:  # the padded layout, zeros where the padding is
        got = getattr(packed, name)
        assert got.shape == getattr(padded, name).shape
        assert all(not got[j, n:].any() for j, n in enumerate(LENGTHS))


def test_target_packs_keep_order_and_refuse_a_sample_longer_than_a_row(rows):
    _, _, attn = collate(rows, 0)
    assert target_packs(attn, None) is None
    assert target_packs(attn, 24) == [[0, 1, 2], [3, 4], [5]]
    assert target_packs(attn, 100) == [list(range(6))]
    with pytest.raises(ValueError, match=r"'rollout\.pack_tokens'=14: a sample of 15 tokens"):
        target_packs(attn, 14)


def test_negative_control_one_position_run_lets_samples_see_each_other(target, rows):
    """The same packed row with positions 0..N-1 (no restart) is one sequence: features differ."""
    ids_1N = torch.cat([torch.tensor(r["input_ids"]) for r in rows])[None]
    alone = [forward_aux(target, torch.tensor([r["input_ids"]]))[1][0] for r in rows]
    restart = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    for pos, same in ((restart, True), (torch.arange(sum(LENGTHS))[None], False), (None, False)):
        got = forward_aux(target, ids_1N, position_ids_BT=pos)[1][0].split(LENGTHS)
        close = [torch.allclose(a, b, atol=1e-4) for a, b in zip(got[1:], alone[1:])]  # the first sees no other
        assert all(close) if same else not any(close)


# ---------------------------------------------------------------- families

built = functools.lru_cache(maxsize=None)(build_family)


@pytest.mark.parametrize("name", NAMES)
def test_family_packs_exactly_where_the_table_says(name):
    """Every family without ``no_pack_reason`` packs to the padded features; every family with one
    would mix samples (so the table's refusal is needed) and is refused naming the key."""
    fam = next(f for f in FAMILIES if f.name == name)
    t = built(name)
    g = torch.Generator().manual_seed(2)
    lengths = [6, 11, 4]
    ids, _, attn = collate([{"input_ids": torch.randint(3, 200, (n,), generator=g).tolist(),
                             "loss_mask": [1] * n} for n in lengths], 0)
    padded = capture(t, ids, attn)
    if not fam.no_pack_reason:
        # 1e-4: deeper stacks (MoE, 4 norms per layer) round differently over other matmul shapes
        assert_same_samples(capture(t, ids, attn, packs=target_packs(attn, 64)), padded, lengths, tol=1e-4)
        return
    with pytest.raises(ValueError, match=r"'rollout\.pack_tokens' is refused for a " + name):
        capture(t, ids, attn, packs=target_packs(attn, 64))
    ids_1N = torch.cat([ids[j, :n] for j, n in enumerate(lengths)])[None]
    pos_1N = torch.cat([torch.arange(n) for n in lengths])[None]
    raw = forward_aux(t, ids_1N, position_ids_BT=pos_1N)[1][0].split(lengths)
    assert not all(torch.allclose(raw[j], padded.last_hidden_BTH[j, :n], atol=1e-4) for j, n in enumerate(lengths))


def test_check_packing_names_the_key_and_the_fix():
    from specforge.targets import tiny

    check_packing(tiny.llama())
    with pytest.raises(ValueError, match=r"rollout\.pack_tokens.*qwen3_next.*recurrent state.*unset rollout"):
        check_packing(tiny.qwen3_next())


# ---------------------------------------------------------------- config


def test_config_refuses_a_row_shorter_than_the_longest_sample():
    assert load_config(None, ["rollout.pack_tokens=64", "data.max_length=64"]).rollout.pack_tokens == 64
    assert load_config(None, []).rollout.pack_tokens is None  # off by default
    with pytest.raises(ValueError, match=r"'rollout\.pack_tokens'=32 is below data\.max_length=64.*"
                                         r"set rollout\.pack_tokens to at least 64"):
        load_config(None, ["rollout.pack_tokens=32", "data.max_length=64"])


# ---------------------------------------------------------------- callers


def test_store_capture_features_equal(target, rows):
    batches = plan_batches(LENGTHS, 2, 40)
    padded = dict(iter_features(target, rows, batches, 1024))
    packed = dict(iter_features(target, rows, batches, 1024, pack_tokens=20))
    assert padded.keys() == packed.keys() == set(range(len(rows)))
    for sid, want in padded.items():
        got = packed[sid]
        assert (torch.equal(got["input_ids_T"], want["input_ids_T"])
                and torch.equal(got["loss_mask_T"], want["loss_mask_T"]))
        torch.testing.assert_close(got["aux_hidden_TKH"], want["aux_hidden_TKH"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["last_hidden_TH"], want["last_hidden_TH"], atol=1e-5, rtol=1e-5)
        assert torch.equal(got["target_ids_T"], want["target_ids_T"])


def test_local_batches_equal(target, rows):
    padded = local_batches(target, rows, 4, 1024)
    packed = local_batches(target, rows, 4, 1024, pack_tokens=20)
    assert len(padded) == len(packed) == 2
    for a, b in zip(packed, padded):
        assert torch.equal(a.input_ids_BT, b.input_ids_BT) and torch.equal(a.loss_mask_BT, b.loss_mask_BT)
        assert torch.equal(a.length_B, b.length_B)
        assert_same_samples(a, b, b.length_B.tolist())


class _Split:
    def __init__(self, rows):
        self.rows = rows

    def __getitem__(self, ids):
        return {k: [self.rows[i][k] for i in ids] for k in ("input_ids", "loss_mask")}


SPEC = FeatureSpec((FeatureField("aux_hidden", K * H, "float32"), FeatureField("last_hidden", H, "float32"),
                    FeatureField("target_ids", 1, "int64"), FeatureField("input_ids", 1, "int64"),
                    FeatureField("loss_mask", 1, "int64")))
PLAN = types.SimpleNamespace(batch_of=lambda rank: (5, 0, 3, 2), split="train", feature_spec=SPEC, step=0)


def _rollout_worker(target, rows, pack_tokens):
    """A rollout worker whose sends are kept here (no process group, no transport): ``(worker, sent)``."""
    w = RolloutWorker.__new__(RolloutWorker)
    w.rank, w.target, w.data, w.device = 0, target, types.SimpleNamespace(train=_Split(rows)), torch.device("cpu")
    w.cfg = load_config(None, ["data.max_length=16"] + ([f"rollout.pack_tokens={pack_tokens}"] if pack_tokens else []))
    sent: dict = {}
    keep = lambda plan, feats, my_rank: sent.update(feats) or SendHandle(None, 0)  # noqa: E731
    w.transport = types.SimpleNamespace(device=torch.device("cpu"), send_step=keep)
    w.window = SendWindow(1 << 30)
    return w, sent


def test_rollout_worker_features_equal(target, rows):
    plan = PLAN

    def forward(pack_tokens):
        """The rollout step: its features and the forwards it reports."""
        w, sent = _rollout_worker(target, rows, pack_tokens)
        return sent, w.rollout_step(plan).metrics["forwards"]

    (padded, one), (packed, three) = forward(None), forward(16)
    # forwards are counted where they run: one batched forward, or one per packed row ((15) (7 + 9) (3))
    assert (one, three) == (1, 3)
    assert list(packed) == list(padded) == [5, 0, 3, 2]
    for sid, want in padded.items():
        got = packed[sid]
        assert got["aux_hidden"].shape == (LENGTHS[sid], K * H)
        for name in ("target_ids", "input_ids", "loss_mask"):
            assert torch.equal(got[name], want[name])
        torch.testing.assert_close(got["aux_hidden"], want["aux_hidden"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["last_hidden"], want["last_hidden"], atol=1e-5, rtol=1e-5)


def _syncs_by_function(s) -> dict:
    got = collections.Counter()
    for where, n in s.where.items():  # "file:line function"
        file, fn = where.split(" ", 1)
        got[f"{file.split(':')[0]} {fn}"] += n
    return dict(got)


def test_a_rollout_step_reads_nothing_from_the_device(target, rows, monkeypatch):
    """The host syncs of a rollout worker's step (benchmarks/syncs.py's counter; docs/ARCHITECTURE.md,
    "Host syncs"): none. The capture, the collate and the sends read nothing; the features are checked
    by the train ranks that receive them (``test_a_train_step_checks_its_features_in_its_one_read``).
    Packed rows add transformers' own reads of the position ids (``find_packed_sequence_indices``), one
    per packed row's forward. Control: the feature check read at once (as the store writer reads it) is
    one read, which the counter sees."""
    from benchmarks.syncs import HostSyncs
    from specforge.models.features import feature_flags

    waits = []  # device.synchronize, which the counter does not see: none either (the timer is a StageClock)
    monkeypatch.setattr(workers, "synchronize", lambda device: waits.append(device))
    for pack_tokens, want in ((None, {}), (16, {"masking_utils.py find_packed_sequence_indices": 3})):
        w, sent = _rollout_worker(target, rows, pack_tokens)
        w.rollout_step(PLAN)  # first calls build what later ones reuse
        with HostSyncs() as s:
            report = w.rollout_step(PLAN)
        assert _syncs_by_function(s) == want, (pack_tokens, s.where)
        assert report.timings_ms["forward"] > 0
    assert waits == []
    with HostSyncs() as s:
        feature_flags(torch.randn(2, 3, K * H), None, K).tolist()
    assert _syncs_by_function(s) == {"test_packing_capture.py test_a_rollout_step_reads_nothing_from_the_device": 1}, \
        s.where


def _train_worker(batches, layer_ids):
    """A train rank's ``_features`` over ``batches`` (no process group: the all-reduce is the identity)."""
    from specforge.runtime.workers import TrainWorker

    w = TrainWorker.__new__(TrainWorker)
    w.rank, w.lost, w.layer_ids = 0, None, list(layer_ids)
    w.trainer = types.SimpleNamespace(device=torch.device("cpu"), reduce_sum=lambda x: x)
    w.source = types.SimpleNamespace(next_batches=lambda plan, upcoming: batches)
    return w


def test_a_train_step_checks_its_features_in_its_one_read(target, rows):
    """Every train rank checks the features it is about to train on (NaN or inf, a captured layer all
    zeros) inside the all-reduce it makes anyway: one host read per step however many micro-batches,
    and a refusal (``FeaturesRefused``, naming the layer and the step) for this plan and every later one.
    Real tokens are ``length_B``'s: NaN or zeros in a padded capture's padding are not refused."""
    from benchmarks.syncs import HostSyncs
    from specforge.runtime.workers import FeaturesLost, FeaturesRefused

    good = local_batches(target, rows, 2, 1024)  # 3 micro-batches of the tiny target's padded capture
    assert len(good) == 3 and all(b.length_B is not None for b in good)
    ids = target.aux_layer_ids
    w = _train_worker(good, ids)
    with HostSyncs() as s:
        assert w._features(PLAN, ()) is good
    assert _syncs_by_function(s) == {"workers.py _features": 1}, s.where

    def poisoned(fill, layer, where):
        """The step's batches with ``fill`` in captured layer ``layer``: NaN or inf at one real token (or
        one padding token), zeros at every token of every batch (or only in the padding)."""
        bad = [dataclasses.replace(b, aux_hidden_BTKH=b.aux_hidden_BTKH.clone()) for b in good]
        for i, b in enumerate(bad):
            aux = b.aux_hidden_BTKH.view(*b.aux_hidden_BTKH.shape[:2], K, H)
            n = int(b.length_B[0])  # row 0 is the shorter one of each batch: padding from n on
            if where == "pad":
                aux[0, n:, layer] = fill
            elif fill == 0:
                aux[:, :, layer] = 0
            elif i == 1:
                aux[0, n - 1, layer, 1] = fill
        return bad

    assert all(int(b.length_B[0]) < b.aux_hidden_BTKH.shape[1] for b in good)  # row 0 of each batch has padding
    for fill in (float("nan"), float("inf"), 0.0):
        w = _train_worker(poisoned(fill, 1, "pad"), ids)
        w._features(PLAN, ())  # only the padding: accepted
        w = _train_worker(poisoned(fill, 1, "real"), ids)
        what = "is all zeros" if fill == 0 else "holds NaN or inf"
        with pytest.raises(FeaturesRefused, match=f"train step 0: captured target layer {ids[1]} .*{what}"):
            w._features(PLAN, ())
        with pytest.raises(FeaturesLost, match="refused"):  # and every later plan, with no collective
            w._features(PLAN, ())


def test_capture_cli_writes_equal_stores(tmp_path):
    """``python -m specforge.capture`` with and without ``rollout.pack_tokens``: the same samples,
    ids and argmax, features equal up to the store's bf16 rounding."""
    target_folder("llama", tmp_path)
    base = overrides(tmp_path) + ["data.max_samples=8"]
    assert main(["--no-progress", *base, f"store.dir={tmp_path / 'padded'}"]) == 0
    assert main(["--no-progress", *base, f"store.dir={tmp_path / 'packed'}", "rollout.pack_tokens=64"]) == 0
    a, b = FeatureStore(tmp_path / "padded"), FeatureStore(tmp_path / "packed")
    assert len(a) == len(b) > 0 and a.lengths == b.lengths
    for sid in range(len(a)):
        x, y = a.read(sid), b.read(sid)
        for name in ("input_ids", "loss_mask", "target_ids"):
            assert torch.equal(x[name], y[name]), name
        for name in ("aux_hidden", "last_hidden"):
            torch.testing.assert_close(x[name].float(), y[name].float(), atol=2e-2, rtol=1e-2)


def test_memory_model_counts_a_packed_target_forward():
    """The memory model's capture phase with rollout.pack_tokens: one packed row's forward (its
    sample mask is row x row, not batch x T x T) plus the batch's features in the padded layout;
    without the key, the padded forward as before."""
    from specforge.memory import TargetDims, capture_terms, forward_terms

    t = TargetDims(H=4096, I=14336, Hq=32, Hkv=8, D=128, V=128256, dtype_bytes=2, eager=False, sliding=False)
    B, T, layers = 8, 4096, 3  # argmax chunks of 16 rows: the forward, not the logits, is the peak
    assert forward_terms(t, B, T, layers, 16, None) == capture_terms(t, B, T, layers, 16)
    packed = {x.name: x.nbytes for x in forward_terms(t, B, T, layers, 16, 8192)}
    padded = {x.name: x.nbytes for x in capture_terms(t, B, T, layers, 16)}
    assert packed["capture: attention masks (4D), one packed row of 8,192 tokens"] == 8192**2  # bool, B = 1
    assert padded["capture: attention masks (4D)"] == B * T * T
    assert (packed["capture: the batch's features in the padded layout (rollout.pack_tokens)"]
            == B * T * (4 * 4096 * 2 + 8))
    # a row never holds more than the batch's tokens
    assert "capture: attention masks (4D), one packed row of 4,096 tokens" in {
        x.name for x in forward_terms(t, 1, T, layers, 16, 65536)}


def test_the_dry_run_names_packed_target_forwards(capsys):
    """The dry run says the target forward is packed and its memory is one packed row's forward."""
    from pathlib import Path

    from specforge.config import load_config
    from specforge.dryrun import dry_run, memory_plan

    cfg = load_config(Path(__file__).parent.parent / "configs" / "smollm2-135m-cpu.yaml",
                      ["data.max_length=512", "train.batch_size=4", "rollout.pack_tokens=2048",
                       "placement.mode=colocated"])
    names = [t.name for d in memory_plan(cfg) for ts in d.phases.values() for t in ts]
    assert any("one packed row of 2,048 tokens" in n for n in names)
    dry_run(cfg, None, single_process=True)
    assert "packed target forwards (rollout.pack_tokens)" in capsys.readouterr().out


def test_packed_forwards_pick_an_attention_that_skips_cross_sample_scores(monkeypatch):
    """rollout.pack_tokens on CUDA: flash-attention 2 (variable length, from the restarting position
    ids) where flash-attn is installed and the dtype is 16-bit, else flex attention; SDPA (masked, every
    score of the row computed) stays for padded captures and on the CPU. Decided from the class, no GPU
    needed."""
    import importlib.util

    from specforge.models.target import capture_attention

    llama = next(f for f in FAMILIES if f.name == "llama")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn" else real(name, *a))
    assert capture_attention(llama, cuda, packed=True, dtype=torch.bfloat16) == "flex_attention"
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "flash_attn" else real(name, *a))
    assert capture_attention(llama, cuda, packed=True, dtype=torch.bfloat16) == "flash_attention_2"
    assert capture_attention(llama, cuda, packed=True, dtype=torch.float32) == "flex_attention"  # flash: 16-bit only
    assert capture_attention(llama, cuda, packed=False, dtype=torch.bfloat16) == "default"  # control: padded
    assert capture_attention(llama, cpu, packed=True, dtype=torch.bfloat16) == "default"  # the CPU keeps SDPA
