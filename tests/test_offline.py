"""Offline training: the feature store is a third feature source of the same loop and train step.

Same samples, same seed: training from a bf16 store gives the per-step losses of online training
whose target computes the same bf16 features (single process and 2 DP ranks on Ray), several
epochs run from it, ring sequence parallelism over it trains like one process, and a store made
by another target or max_length is refused by name.
"""

import json
import re

import pytest

from specforge.config import load_config
from tests.helpers.ray_run import STEPS, cfg_overrides, make_cfg

pytestmark = [pytest.mark.timeout(600)]


def _losses(out, kind="train"):
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["kind"] == kind]


@pytest.fixture(scope="module")
def store(assets, tmp_path_factory):
    from specforge.capture import capture_store

    root = tmp_path_factory.mktemp("store")
    capture_store(make_cfg(assets, root, "model.dtype=bfloat16", f"store.dir={root / 'features'}"), progress=False)
    return root / "features"


def _offline(assets, out, store, *extra):
    return make_cfg(assets, out, "model.dtype=bfloat16", "placement.mode=offline", f"store.dir={store}", *extra)


def test_store_training_equals_online_training(assets, store, tmp_path):
    from specforge.train import run

    online, offline = tmp_path / "online", tmp_path / "offline"
    run(make_cfg(assets, online, "model.dtype=bfloat16", "train.grad_accum=2", "train.num_workers=1"))
    run(_offline(assets, offline, store, "train.grad_accum=2", "train.num_workers=1"))
    want, got = _losses(online), _losses(offline)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert want[0]["loss"] > 0
    for a, b in zip(want, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), a["step"]
        assert b["valid_tokens"] == a["valid_tokens"]


@pytest.mark.ray
def test_store_on_two_dp_ranks_for_several_epochs(assets, store, ray_session, tmp_path):
    """Two DP ranks read the store for two epochs (12 steps) with one process's losses. 5.8 s alone
    (serial, e3d4ebf); over 30 s beside the other pytest worker: the two train ranks meet in an
    all-reduce at each of the 12 steps and each waits for the other's turn on the shared cores."""
    from specforge.ray_train import fit
    from specforge.train import run

    # 12 train samples, global batch 2: 2 epochs = 12 steps; the Ray run (2 DP ranks) == one process
    common = ("train.max_steps=null", "train.epochs=2")
    run(_offline(assets, tmp_path / "one", store, "train.grad_accum=2", "train.num_workers=1", *common))
    fit(_offline(assets, tmp_path / "ray", store, *common))
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "ray")
    assert [r["step"] for r in one] == [r["step"] for r in two] == list(range(1, 13))
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), a["step"]



@pytest.mark.ray
def test_store_with_ring_sequence_parallelism_equals_one_process(assets, store, ray_session, tmp_path):
    """Offline x ring SP 2 (2 train ranks = 1 DP group, micro-batches of 2 samples): each rank reads
    whole samples from the store and keeps its slice + halo, the step-0 K/V pass around the ring;
    same losses as the single process over the same store. Over 30 s: two Ray runs of two train actors each
    (unpacked, then packed rows), ~2.6 CPU-s an actor to start, beside the single-process reference."""
    from specforge.ray_train import fit
    from specforge.train import run
    from tests.helpers.ray_run import assert_same_losses

    one, ring = tmp_path / "one", tmp_path / "ring"
    run(_offline(assets, one, store, "train.grad_accum=2", "train.num_workers=1"))
    fit(_offline(assets, ring, store, "parallel.sp_ring=2", "train.batch_size=2", "train.grad_accum=1"))
    assert_same_losses(one, ring)
    packed = tmp_path / "packed-ring"  # the two samples in one packed row, cut over the ring
    fit(_offline(assets, packed, store, "parallel.sp_ring=2", "train.batch_size=2", "train.grad_accum=1",
                 "train.pack_tokens=128"))
    assert_same_losses(one, packed)

def test_store_from_another_target_or_max_length_is_refused(assets, store, tmp_path):
    from specforge.train import run

    with pytest.raises(ValueError, match="max_length"):
        run(_offline(assets, tmp_path / "a", store, "data.max_length=48"))
    with pytest.raises(ValueError, match="aux_layer_ids"):
        run(_offline(assets, tmp_path / "b", store, "model.aux_layer_ids=[0,2,3]"))


def test_offline_mode_without_a_store_names_the_fix(assets, tmp_path):
    from specforge.train import run

    with pytest.raises(ValueError, match="store"):
        run(_offline(assets, tmp_path / "c", tmp_path / "missing"))
    assert load_config(None, ["placement.mode=offline"]).placement.mode == "offline"


def test_packed_store_training_equals_online_training(assets, store, tmp_path):
    """train.pack_tokens over the store: each step's two samples in one packed row train as the
    online run's two unpacked micro-batches do."""
    from specforge.train import run

    online, packed = tmp_path / "online", tmp_path / "packed"
    run(make_cfg(assets, online, "model.dtype=bfloat16", "train.grad_accum=2", "train.num_workers=1"))
    run(_offline(assets, packed, store, "train.batch_size=2", "train.num_workers=1", "train.pack_tokens=128"))
    want, got = _losses(online), _losses(packed)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(want, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), a["step"]
        assert b["valid_tokens"] == a["valid_tokens"]


def _corrupted_copy(store, to):
    """A copy of ``store`` with one byte of its first shard's tensor data flipped (the size unchanged)."""
    import shutil

    shutil.copytree(store, to)
    first = to / json.loads((to / "index.json").read_text())["shards"][0]["file"]
    data = bytearray(first.read_bytes())
    data[-3] ^= 0xFF
    first.write_bytes(bytes(data))
    return first


@pytest.mark.parametrize("reader", ["driver", "train-rank"])
def test_a_shard_corrupted_after_capture_stops_the_run_naming_it(assets, store, tmp_path, reader, request):
    """Bytes of a shard flipped after the index named it (the size unchanged): the run never trains on it.
    Its sha256 is checked at the shard's first open in each process and the run ends naming the shard and
    the capture command that redoes its samples, with nothing trained. ``driver``: a Ray run's driver counts
    the store's tokens for the draft vocab (not cached yet) and refuses before any worker starts;
    ``train-rank``: the vocab cached, the first read is a train rank's (one process). Control: the intact
    store trains every step (and caches the vocab the train-rank case reads)."""
    from specforge.ray_train import fit
    from specforge.train import run

    cache = f"model.cache_dir={tmp_path / 'cache'}"
    run(_offline(assets, tmp_path / "ok", store, "train.grad_accum=2", "train.num_workers=1", cache))
    assert [r["step"] for r in _losses(tmp_path / "ok")] == list(range(1, STEPS + 1))
    bad = _corrupted_copy(store, tmp_path / "features")
    corrupt = rf"{bad.name} is corrupt \(sha256 differs.*rerun the python -m specforge\.capture command"
    out = tmp_path / "out"
    if reader == "driver":
        request.getfixturevalue("ray_session")
        with pytest.raises(ValueError, match=corrupt):
            fit(_offline(assets, out, tmp_path / "features", f"model.cache_dir={tmp_path / 'fresh'}"))
    else:  # through the entry point: one error line, exit 1
        from specforge.cli import run_cli
        from specforge.train import main

        args = [*cfg_overrides(assets, out, "model.dtype=bfloat16", "placement.mode=offline", "train.grad_accum=2",
                               f"store.dir={tmp_path / 'features'}", "train.num_workers=1", cache,
                               "checkpoint.every_steps=1")]
        capsys = request.getfixturevalue("capsys")
        capsys.readouterr()
        assert run_cli(lambda: main(args)) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert re.search(corrupt, err[-1]) and err[-1].startswith("error: "), err[-3:]
    # the first shard holds step 1's samples: nothing trained (a final save may keep step 0 alone)
    assert {p.name for p in out.glob("checkpoints/step-*")} <= {"step-000000"}
