"""DFlash2, XPress and MTP in every placement (issue 45), as tests/test_dflash_train.py does for DFlash:
colocated and disaggregated Ray runs with two data-parallel ranks, a disaggregated packed run
(``train.pack_tokens``), each against one single-process reference per algorithm (same global batch:
2 micro-batches; the same losses, valid tokens, eval losses and weights), and an offline run from a
store written by ``capture_store`` against the online run on the same (bf16) features.

The single-process entry points (train, kill and resume, eval, export) are each algorithm's own
``tests/test_<name>_train.py``.
"""

from pathlib import Path

import pytest

from specforge.config import load_config
from specforge.registry import get_algorithm
from tests.helpers.ray_run import assert_same_weights, cfg_overrides
from tests.helpers.ray_run import losses as rows_of

pytestmark = [pytest.mark.timeout(600)]
STEPS = 4
# each algorithm's tiny draft, as in its tests/test_<name>_train.py
ALGORITHMS = {
    "dflash2": ["draft.block_size=4", "draft.num_anchors=6", "draft.num_layers=2", "draft.selector_rank=8",
                "draft.selector_top_k=8"],
    "xpress": ["draft.block_size=4", "draft.num_anchors=6", "draft.num_layers=2", "draft.refiner_rank=8",
               "draft.jacobi_passes=2", "draft.consistency_passes=2"],
    "mtp": ["draft.num_speculative_steps=3", "draft.step_weight_beta=0.6"],
}
# the target layers (of the tiny 6) its store holds: DFlash's spread for the block drafts, the last for MTP
STORE_LAYERS = {"dflash2": (1, 3), "xpress": (1, 3), "mtp": (5,)}
PACKED = ("train.num_workers=1", "train.batch_size=2", "train.pack_tokens=128")


def make(assets, out, algorithm, *extra):
    """The tiny run of test_ray_train (global batch 2) without its EAGLE-3 keys, as ``algorithm``."""
    base = [a for a in cfg_overrides(assets, out) if not a.startswith(("draft.", "train.max_steps"))]
    return load_config(None, base + [f"draft.algorithm={algorithm}", *ALGORITHMS[algorithm],
                                     f"train.max_steps={STEPS}", *extra])


@pytest.fixture(scope="module")
def single(assets, tmp_path_factory):
    """The single-process reference of each algorithm (made on first use, then shared): global batch 2 as
    2 micro-batches, a periodic eval after step 2."""
    from specforge.train import run

    made = {}

    def reference(algorithm):
        if algorithm not in made:
            out = tmp_path_factory.mktemp(f"{algorithm}-single")
            ckpt = run(make(assets, out, algorithm, "train.num_workers=1", "train.grad_accum=2", "train.eval_every=2"))
            rows = rows_of(out)
            assert [r["step"] for r in rows] == list(range(1, STEPS + 1)) and all(r["loss"] > 0 for r in rows)
            assert [r["step"] for r in rows_of(out, "eval")] == [2, 4]
            made[algorithm] = out, Path(ckpt)
        return made[algorithm]

    return reference


def assert_same_run(ref_out, out, rel):
    for kind in ("train", "eval"):
        want, got = rows_of(ref_out, kind), rows_of(out, kind)
        assert [r["step"] for r in got] == [r["step"] for r in want], kind
        for a, b in zip(want, got):
            assert b["loss"] == pytest.approx(a["loss"], rel=rel), (kind, a["step"], b["loss"], a["loss"])
            assert b["valid_tokens"] == a["valid_tokens"], (kind, a["step"])


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("mode, extra", [
    ("colocated", ()), ("disaggregated", ()),
    # packed: one rank, the global batch's two samples in one row of the plan
    ("disaggregated", PACKED),
], ids=["colocated-dp2", "disaggregated-dp2", "disaggregated-packed"])
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_ray_placements_equal_the_single_process(assets, single, ray_session, tmp_path, algorithm, mode, extra):
    """Each algorithm's Ray placements (colocated and disaggregated over two train ranks, packed rows where it
    packs) give its single-process run's losses, eval and weights. Over 30 s for some: a Ray run of two or
    three actors (~5 CPU-s each to start), and an algorithm's first case trains its single-process reference."""
    from specforge.ray_train import fit
    from specforge.training.checkpoint import load_draft_folder

    if extra == PACKED and not get_algorithm(algorithm).packs:
        with pytest.raises(ValueError, match=rf"'train\.pack_tokens' is refused for draft\.algorithm={algorithm}"):
            make(assets, tmp_path, algorithm, f"placement.mode={mode}", *extra)
        return
    ref_out, ref_ckpt = single(algorithm)
    got_ckpt = Path(fit(make(assets, tmp_path, algorithm, f"placement.mode={mode}", "train.eval_every=2", *extra)))
    assert_same_run(ref_out, tmp_path, rel=1e-4)
    # a packed row's sums run in another order: weights within ray_run.weights_tol
    assert_same_weights(ref_ckpt, got_ckpt, load_draft_folder(got_ckpt)[1], load_draft_folder(ref_ckpt)[1])


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_offline_from_a_captured_store_equals_online(assets, tmp_path, algorithm):
    from specforge.capture import capture_store
    from specforge.data.store import FeatureStore
    from specforge.train import run

    store = tmp_path / "features"
    common = ("model.dtype=bfloat16", "train.num_workers=1", "train.grad_accum=2", f"store.dir={store}")
    online = make(assets, tmp_path / "online", algorithm, *common)
    capture_store(online, progress=False)
    assert FeatureStore(store).meta.aux_layer_ids == STORE_LAYERS[algorithm]  # the layers this draft reads
    run(online)
    run(make(assets, tmp_path / "offline", algorithm, *common, "placement.mode=offline"))
    want, got = rows_of(tmp_path / "online"), rows_of(tmp_path / "offline")
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for a, b in zip(want, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a["step"], b["loss"], a["loss"])
        assert b["valid_tokens"] == a["valid_tokens"]
