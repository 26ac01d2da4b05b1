"""Replaying a reference feature store beside the run's own (``store.replay_dir`` / ``replay_share``).

The replayed share is what the key says over a run's steps, data order stays a function of
(seed, step) (two planners agree, a planner started at step s agrees with one that ran up to it),
the reference's held-out samples are never trained on, share 0 replays nothing, a reference of
another setup and bad keys are refused by one line, an offline run with replay trains (one process
and 2 DP ranks on Ray alike), and ``append_samples`` adds to a complete store, skipping duplicates.
"""

import json
import math

import pytest
import torch

from tests.helpers.data import WORDS, rec, write_jsonl
from tests.helpers.ray_run import cfg_overrides, make_cfg
from tests.helpers.tables import one_error_line

pytestmark = [pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def stores(assets, tmp_path_factory):
    """The run's store (the 14 tiny rows), a reference store of 30 other rows, and a reference of
    other aux layers (same rows)."""
    from specforge.capture import capture_store

    root = tmp_path_factory.mktemp("stores")
    other = write_jsonl(root / "other.jsonl", [rec(" ".join(WORDS[(3 * i + j) % 7] for j in range(2 + i % 3)),
                                                   " ".join(WORDS[(5 * i + j) % 7] for j in range(4 + i % 6)))
                                               for i in range(30)])
    for name, extra in (("own", ()), ("ref", (f"data.path={other}",)),
                        ("ref_aux", (f"data.path={other}", "model.aux_layer_ids=[0,2,3]"))):
        capture_store(make_cfg(assets, root, "model.dtype=bfloat16", f"store.dir={root / name}", *extra),
                      progress=False)
    return root


def _cfg(assets, out, stores, *extra):
    return make_cfg(assets, out, "model.dtype=bfloat16", "placement.mode=offline", f"store.dir={stores / 'own'}",
                    f"store.replay_dir={stores / 'ref'}", *extra)


def _planner(cfg):
    from specforge.contracts import Layout
    from specforge.runtime.plan import Planner, prepare

    data = prepare(cfg, use_gpu=False)
    return Planner(cfg, data, Layout("offline", (), tuple(range(cfg.train.num_workers)), data.vocab_path))


def _train_ids(plan):
    return [i for group in plan.micro_batches for micro in group for i in micro]


@pytest.mark.parametrize("share", [0.25, 0.4])
def test_replayed_share_follows_the_key_and_order_is_a_function_of_seed_and_step(assets, stores, tmp_path, share):
    K = 40
    cfg = _cfg(assets, tmp_path, stores, "train.grad_accum=4", f"train.max_steps={K}", f"store.replay_share={share}")
    p = _planner(cfg)
    n_own = len(p.data.lengths) - p.data.num_replay
    assert p.data.num_replay > 0 and n_own > 0
    steps = [_train_ids(p(s)) for s in range(K)]
    replayed = sum(i >= n_own for ids in steps for i in ids)
    assert replayed == math.floor(share * p.global_batch * K)  # the key's share, to the sample
    assert all(len(set(ids)) == len(ids) == p.global_batch for ids in steps)
    again = _planner(cfg)
    assert [_train_ids(again(s)) for s in range(K)] == steps
    resumed = _planner(cfg)  # a run resumed at step 17 plans what the continuous one did
    assert [resumed(s) for s in range(17, K)] == [p(s) for s in range(17, K)]
    other_seed = _planner(_cfg(assets, tmp_path, stores, "train.grad_accum=4", f"train.max_steps={K}",
                               f"store.replay_share={share}", "train.seed=1"))
    assert [_train_ids(other_seed(s)) for s in range(K)] != steps  # the seed matters (negative control)


def test_held_out_samples_of_either_store_are_never_trained(assets, stores, tmp_path):
    from specforge.data.store import FeatureStore
    from specforge.runtime.plan import ReplayStores, store_split

    cfg = _cfg(assets, tmp_path, stores, "train.grad_accum=4", "train.num_workers=1", "train.max_steps=60",
               "train.eval_every=5", "store.replay_share=0.5")
    own, ref = FeatureStore(stores / "own"), FeatureStore(stores / "ref")
    both = ReplayStores(own, ref)
    split = store_split(both, cfg)
    p = _planner(cfg)
    trained = {split["train"][i] for s in range(60) for i in _train_ids(p(s))}
    ref_trained = {both.replayed[i - both.offset] for i in trained if i >= both.offset}
    held = ref.ids[len(ref.ids) - min(8, len(ref.ids) // 10):]
    assert held and not ref_trained & set(held)
    assert len(ref_trained) == len(ref.ids) - len(held)  # 60 steps go round the reference: all the rest is used
    assert split["eval"] and not trained & set(split["eval"])
    sample = both.read(both.offset)  # a replayed sample reads as the reference store's sample
    assert torch.equal(sample["input_ids"], ref.read(both.replayed[0])["input_ids"])


def test_share_zero_replays_nothing(assets, stores, tmp_path):
    p = _planner(_cfg(assets, tmp_path, stores, "train.grad_accum=4", "store.replay_share=0", "train.max_steps=30"))
    n_own = len(p.data.lengths) - p.data.num_replay
    assert p.data.num_replay > 0
    assert all(i < n_own for s in range(30) for i in _train_ids(p(s)))


def test_epochs_count_the_runs_own_samples(assets, stores, tmp_path):
    p = _planner(_cfg(assets, tmp_path, stores, "train.grad_accum=4", "train.max_steps=null", "train.epochs=2",
                      "store.replay_share=0.25"))
    n_own = len(p.data.lengths) - p.data.num_replay
    assert p.total_steps == math.ceil(2 * n_own / (p.global_batch * 0.75))


def test_reference_of_another_setup_is_refused_naming_the_field(assets, stores, tmp_path):
    from specforge.preflight import check_run

    cfg = _cfg(assets, tmp_path, stores, f"store.replay_dir={stores / 'ref_aux'}")
    with pytest.raises(ValueError) as e:
        check_run(cfg)
    msg = str(e.value)
    assert "aux_layer_ids" in msg and str(stores / "own") in msg and str(stores / "ref_aux") in msg
    assert "source" not in msg  # other samples are the point of a reference store
    check_run(_cfg(assets, tmp_path, stores))  # the same setup passes



@pytest.mark.parametrize("case", ["share 1", "share negative", "not offline", "not a store", "own store"])
def test_bad_replay_keys_are_one_error_line_before_anything_loads(assets, stores, tmp_path, capsys, monkeypatch, case):
    from specforge import train as local
    from specforge.cli import run_cli

    monkeypatch.setattr("specforge.runtime.plan.prepare", lambda *a, **k: pytest.fail("data prepared"))
    extra, needles = {
        "share 1": (["store.replay_share=1.0"], ["store.replay_share", "[0, 1)"]),
        "share negative": (["store.replay_share=-0.1"], ["store.replay_share", "[0, 1)"]),
        "not offline": (["placement.mode=colocated"], ["store.replay_dir", "placement.mode=offline"]),
        "not a store": ([f"store.replay_dir={tmp_path}"], ["store.replay_dir", "index.json"]),
        "own store": ([f"store.replay_dir={stores / 'own'}"], ["store.replay_dir", "own store"]),
    }[case]
    argv = cfg_overrides(assets, tmp_path / "run", "model.dtype=bfloat16", "placement.mode=offline",
                         f"store.dir={stores / 'own'}", f"store.replay_dir={stores / 'ref'}", *extra)
    assert run_cli(lambda: local.main(argv)) == 1
    one_error_line(capsys.readouterr().err, *needles)


def test_single_process_run_with_replay_trains_and_says_what_it_replays(assets, stores, tmp_path, capsys):
    from specforge.train import run

    run(_cfg(assets, tmp_path, stores, "train.grad_accum=2", "train.num_workers=1"))
    out = capsys.readouterr().out
    assert f"of {stores / 'ref'} as 0.25 of each step" in out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert train and all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in train)
    # global batch 2 at share 0.25: one replayed sample every other step, own samples in the epochs
    assert [r["replay_share"] for r in train] == [0.0, 0.25, 1 / 6]
    assert train[2]["epoch"] == pytest.approx((3 * 2 - 1) / 12)


@pytest.mark.ray
def test_two_dp_ranks_with_replay_equal_one_process(assets, stores, ray_session, tmp_path):
    from specforge.ray_train import fit
    from specforge.train import run

    common = ("train.max_steps=6", "store.replay_share=0.5")
    run(_cfg(assets, tmp_path / "one", stores, "train.grad_accum=2", "train.num_workers=1", *common))
    fit(_cfg(assets, tmp_path / "ray", stores, *common))
    one, two = ([json.loads(line) for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
                for d in ("one", "ray"))
    one, two = ([r for r in rows if r["kind"] == "train"] for rows in (one, two))
    assert [r["step"] for r in one] == [r["step"] for r in two] == list(range(1, 7))
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), a["step"]


# ---------------------------------------------------------------- appending to a store


def _sample(i: int, n: int = 6, H: int = 8) -> dict:
    g = torch.Generator().manual_seed(i)
    return {"input_ids": torch.randint(0, 50, (n,), generator=g), "loss_mask": torch.ones(n, dtype=torch.long),
            "aux_hidden": torch.randn(n, 3 * H, generator=g).bfloat16(),
            "last_hidden": torch.randn(n, H, generator=g).bfloat16(),
            "target_ids": torch.randint(0, 50, (n,), generator=g)}


def test_append_adds_new_samples_and_skips_existing_ones(tmp_path):
    from specforge.data.store import FeatureStore, FeatureStoreWriter, StoreMeta, append_samples

    meta = StoreMeta(target="t", tokenizer="k", vocab_size=50, aux_layer_ids=(1, 2, 3), hidden_size=8,
                     max_length=16, source="rows")
    root = tmp_path / "store"
    with FeatureStoreWriter(root, meta, shard_mb=0.0005) as w:
        for i in range(5):
            w.add(i, *(_sample(i)[k] for k in ("input_ids", "loss_mask", "aux_hidden", "last_hidden", "target_ids")))
    old_index = (root / "index.json").read_bytes()

    def dies_after_two():  # a killed append: two new samples (shards written), then the process dies
        yield from ((i, _sample(i)) for i in (10, 11))
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        append_samples(root, dies_after_two(), shard_mb=0.0005)
    assert (root / "index.json").read_bytes() == old_index  # the old store as it was, still complete
    assert FeatureStore(root).ids == list(range(5))

    added, skipped = append_samples(root, [(i, _sample(i)) for i in (3, 10, 11, 12, 10)], shard_mb=0.0005)
    assert (added, skipped) == (3, 2)  # 3 was in the store, 10 twice in the call
    store = FeatureStore(root)
    assert store.complete and store.ids == [0, 1, 2, 3, 4, 10, 11, 12]
    for i in store.ids:
        got, want = store.read(i), _sample(i)
        for k in want:
            assert torch.equal(got[k].to(want[k].dtype), want[k]), (i, k)
    assert append_samples(root, [(12, _sample(12))]) == (0, 1)


class _IdsOnly:
    """A shard handle that serves the token columns and refuses every other tensor (the features)."""

    def __init__(self, handle, seen):
        self._h, self._seen = handle, seen

    def keys(self):
        return self._h.keys()

    def get_slice(self, name):
        self._seen.add(name)
        if name not in ("input_ids", "loss_mask"):
            raise AssertionError(f"the driver read the store's {name!r}")
        return self._h.get_slice(name)

    def get_tensor(self, name):
        self._seen.add(name)
        raise AssertionError(f"the driver read the store's {name!r}")


def test_the_drivers_preparation_reads_ids_and_masks_not_features(assets, stores, tmp_path, monkeypatch):
    """prepare() of an offline run (the driver's, before any worker starts) builds the draft vocab from
    every train sample of the run's store and the replayed reference: it reads their ids and loss masks
    only. The vocab equals the one counted from full reads; a full read under the same guard raises
    (the control: the guard sees a feature read)."""
    from specforge.data.store import FeatureStore
    from specforge.data.vocab import build_draft_vocab, load_draft_vocab
    from specforge.runtime.plan import open_offline_store, prepare

    cfg = _cfg(assets, tmp_path, stores, f"model.cache_dir={tmp_path / 'cache'}", "store.replay_share=0.5")
    opened = FeatureStore._handle
    seen: set[str] = set()
    monkeypatch.setattr(FeatureStore, "_handle", lambda self, shard: _IdsOnly(opened(self, shard), seen))
    data = prepare(cfg, use_gpu=False)
    assert seen == {"input_ids", "loss_mask"}, seen
    store = open_offline_store(cfg)
    with pytest.raises(AssertionError, match="the driver read"):
        store.read(store.ids[0])
    monkeypatch.setattr(FeatureStore, "_handle", opened)
    counts = torch.zeros(store.meta.vocab_size, dtype=torch.long)
    for i in store.split(cfg)["train"]:
        s = store.read(i)
        counts += torch.bincount(s["input_ids"][s["loss_mask"].bool()], minlength=store.meta.vocab_size)
    vocab = load_draft_vocab(data.vocab_path)
    assert torch.equal(vocab.d2t, build_draft_vocab(counts, store.meta.vocab_size, vocab.draft_vocab_size).d2t)
