"""DFlash on the shared runtime: chosen by ``draft.algorithm``, trained by the same loop,
placements, feature sources, store and checkpoints as EAGLE-3, and evaluated losslessly beside it.

Multi-rank runs are checked against the single process (same global batch, same anchors: they are a
function of the seed, the step and each sample's tokens), as for EAGLE-3 in test_ray_train.py.
"""

import json
from pathlib import Path

import pytest
import torch

from specforge.config import load_config
from tests.helpers.ray_run import assert_same_weights, cfg_overrides

pytestmark = [pytest.mark.timeout(600)]
STEPS = 4
DFLASH = ["draft.algorithm=dflash", "draft.block_size=4", "draft.num_anchors=6", "draft.num_layers=2",
          f"train.max_steps={STEPS}"]


def dflash_cfg(assets, out, *extra):
    """The tiny run of test_ray_train without its EAGLE-3 keys, as a DFlash run."""
    base = [a for a in cfg_overrides(assets, out) if not a.startswith(("draft.", "train.max_steps"))]
    return load_config(None, base + DFLASH + list(extra))


def _losses(out, kind="train"):
    recs = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["kind"] == kind]


@pytest.fixture(scope="module")
def single(assets, tmp_path_factory):
    """The single-process reference: global batch 2 as 2 micro-batches, a periodic eval after step 2."""
    from specforge.train import run

    out = tmp_path_factory.mktemp("dflash-single")
    ckpt = run(dflash_cfg(assets, out, "train.num_workers=1", "train.grad_accum=2", "train.eval_every=2"))
    return out, ckpt


def test_the_algorithm_is_chosen_by_one_key_and_its_checkpoint_says_so(single):
    out, ckpt = single
    hf = json.loads((ckpt / "config.json").read_text())
    assert hf["architectures"] == ["DFlashDraftModel"] and hf["block_size"] == 4
    assert hf["dflash_config"]["target_layer_ids"] == [1, 3]  # 2 draft layers spread over [1, L-3] of 6 layers
    recs = _losses(out)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert recs[0]["loss"] > 0 and "acc_0" in recs[0] and "acc_2" in recs[0] and "acc_3" not in recs[0]
    assert [r["step"] for r in _losses(out, "eval")] == [2, 4]  # periodic held-out metrics, same seam


def test_training_lowers_the_block_loss(assets, tmp_path):
    """The block loss (labels: a random target's greedy tokens, ~log V at the start) falls over 40
    steps; the same run at a learning rate that moves nothing (the control) stays where it was."""
    from specforge.train import run

    ratios = {}
    for lr in ("1e-2", "1e-9"):
        out = tmp_path / lr
        run(dflash_cfg(assets, out, "train.num_workers=1", "train.max_steps=40", f"train.lr={lr}"))
        recs = _losses(out)
        ratios[lr] = sum(r["loss"] for r in recs[-4:]) / sum(r["loss"] for r in recs[:4])
    assert ratios["1e-2"] < 0.97 and ratios["1e-9"] > 0.98, ratios


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("mode, extra", [
    ("colocated", ()), ("disaggregated", ()),
    # ring SP 2 (one DP group, both micro-batches of the global batch on it): each rank its context share
    ("colocated", ("parallel.sp_ring=2", "train.grad_accum=2")),
    ("disaggregated", ("parallel.sp_ring=2", "train.grad_accum=2")),
    # packed (train.pack_tokens): one rank, the global batch's two samples in one row of the plan
    ("disaggregated", ("train.num_workers=1", "train.batch_size=2", "train.pack_tokens=128")),
], ids=["colocated-dp2", "disaggregated-dp2", "colocated-ring2", "disaggregated-ring2", "disaggregated-packed"])
def test_two_ranks_equal_the_single_process(assets, single, ray_session, tmp_path, mode, extra):
    """The block draft over two ranks (DP, ring SP) or one rank of packed rows, colocated and disaggregated,
    gives the single-process run's losses, eval and weights. Over 30 s beside the other pytest worker: a Ray
    run of two or three actors, ~5 CPU-s each to start, and the checkpoint gathered from FSDP2."""
    from specforge.ray_train import fit

    ref_out, ref_ckpt = single
    got_ckpt = Path(fit(dflash_cfg(assets, tmp_path, f"placement.mode={mode}", "train.eval_every=2", *extra)))
    want, got = _losses(ref_out), _losses(tmp_path)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(want, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), a["step"]
        assert b["valid_tokens"] == a["valid_tokens"]
    for a, b in zip(_losses(ref_out, "eval"), _losses(tmp_path, "eval")):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
    from specforge.training.checkpoint import load_draft_folder

    # ring attention and packed rows sum in other orders: weights within ray_run.weights_tol
    assert_same_weights(ref_ckpt, got_ckpt, load_draft_folder(got_ckpt)[1], load_draft_folder(ref_ckpt)[1])


def test_a_packed_run_equals_the_single_process(assets, single, tmp_path):
    """train.pack_tokens in one process: the global batch's two samples in one packed row train (and
    evaluate) as the reference's two padded micro-batches: the same losses and weights."""
    from specforge.train import run
    from specforge.training.checkpoint import load_draft_folder

    ref_out, ref_ckpt = single
    got_ckpt = Path(run(dflash_cfg(assets, tmp_path, "train.num_workers=1", "train.batch_size=2",
                                   "train.pack_tokens=128", "train.eval_every=2")))
    for kind in ("train", "eval"):
        want, got = _losses(ref_out, kind), _losses(tmp_path, kind)
        assert [r["step"] for r in got] == [r["step"] for r in want]
        for a, b in zip(want, got):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (kind, a["step"])
            assert b["valid_tokens"] == a["valid_tokens"]
    # a packed row's sums run in another order: weights within ray_run.weights_tol
    assert_same_weights(ref_ckpt, got_ckpt, load_draft_folder(got_ckpt)[1], load_draft_folder(ref_ckpt)[1])


def test_offline_from_a_store_that_holds_its_layers(assets, tmp_path):
    from specforge.capture import capture_store
    from specforge.data.store import FeatureStore
    from specforge.train import run

    store = tmp_path / "features"
    online = dflash_cfg(assets, tmp_path / "online", "model.dtype=bfloat16", "train.num_workers=1",
                        "train.grad_accum=2", f"store.dir={store}")
    capture_store(online, progress=False)
    assert FeatureStore(store).meta.aux_layer_ids == (1, 3)  # the store records the layers it holds
    run(online)
    run(dflash_cfg(assets, tmp_path / "offline", "model.dtype=bfloat16", "train.num_workers=1", "train.grad_accum=2",
                   "placement.mode=offline", f"store.dir={store}"))
    for a, b in zip(_losses(tmp_path / "online"), _losses(tmp_path / "offline")):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), a["step"]
    # a run that needs other layers (here EAGLE-3's default three) is refused, naming the key
    eagle = [a for a in cfg_overrides(assets, tmp_path / "e") if a != "train.num_workers=2"]
    with pytest.raises(ValueError, match=r"captured with model\.aux_layer_ids=\(1, 3\)"):
        run(load_config(None, eagle + ["train.num_workers=1", "placement.mode=offline", f"store.dir={store}",
                                       "model.dtype=bfloat16"]))


@pytest.mark.parametrize("overrides, pattern", [
    (["parallel.sp_ulysses=2"], r"DFlash has no Ulysses sequence parallelism, only ring \(parallel\.sp_ring\)"),
    (["draft.mask_token_id=5000"], r"'draft\.mask_token_id'=5000 is not a token of the target"),
])
def test_what_dflash_cannot_run_is_refused_before_anything_loads(assets, tmp_path, overrides, pattern):
    from specforge.preflight import check_run

    with pytest.raises(ValueError, match=pattern):
        check_run(dflash_cfg(assets, tmp_path, *overrides))


@pytest.mark.parametrize("overrides, key", [
    (["draft.algorithm=dflash", "draft.ttt_length=3"], "draft.ttt_length"),
    (["draft.algorithm=dflash", "draft.ttt_warmup_steps=10"], "draft.ttt_warmup_steps"),
    (["draft.algorithm=dflash", "draft.vocab_size=8192"], "draft.vocab_size"),
    (["draft.block_size=8"], "draft.block_size"),
    (["draft.num_anchors=32"], "draft.num_anchors"),
])
def test_a_key_of_the_other_algorithm_is_an_error_naming_it(overrides, key):
    with pytest.raises(ValueError, match=rf"config key '{key}'=.* applies to draft\.algorithm=\w+, not \w+"):
        load_config(None, overrides)
    load_config(None, ["draft.algorithm=dflash", "draft.block_size=8", "model.aux_layer_ids=[1,2,3,4]"])  # control


def test_eval_runs_dflash_and_eagle3_drafts_losslessly_in_one_table(assets, single, tmp_path, capsys):
    import specforge.eval as ev
    from specforge.cli import run_cli
    from specforge.train import run

    _, dflash = single
    eagle = run(load_config(None, [a for a in cfg_overrides(assets, tmp_path / "eagle") if a != "train.num_workers=2"]
                            + ["train.num_workers=1"]))
    base = [f"model.target_path={assets / 'target'}", "model.device=cpu", "model.dtype=float32",
            f"model.cache_dir={assets / 'cache'}", f"data.path={assets / 'data.jsonl'}", "data.max_length=64",
            "data.num_eval=2"]
    out_json = tmp_path / "eval.json"
    assert run_cli(lambda: ev.main(["--draft", str(dflash), "--draft", str(eagle), "--num-prompts", "2",
                                    "--max-new-tokens", "12", "--chain", "3", "--json", str(out_json), *base])) == 0
    rows = json.loads(out_json.read_text())["rows"]  # every row's output was checked against greedy decoding
    assert [(r["draft"], r["setting"]) for r in rows] == [
        (str(dflash), "chain 3 fixed"), (str(eagle), "chain 3 fixed"), (str(eagle), "dynamic <=3")]
    assert all(r["ties"] == 0 and r["new_tokens"] > 0 and r["acceptance_length"] >= 1 for r in rows)
    assert rows[0]["drafted_per_round"] == 3  # a block of 4 drafts 3 tokens in one forward
    assert run_cli(lambda: ev.main(["--draft", str(dflash), "--num-prompts", "2", "--max-new-tokens", "12",
                                    "--chain", "2", "--as-served", "--json", str(out_json), *base])) == 0
    rows = json.loads(out_json.read_text())["rows"]  # 3-row blocks, as an engine runs them for 2 drafts
    assert [r["setting"] for r in rows] == ["chain 2 fixed, block as served"] and rows[0]["drafted_per_round"] == 2


def test_the_eval_proposes_from_the_whole_trained_block(assets, single):
    """A round of the eval runs the whole block (``block_size`` rows, as training does: its rows attend
    each other both ways) and keeps the first k drafts; ``as_served`` runs k + 1 rows, as vLLM and
    llama.cpp do for k drafts. At k = block_size - 1 they are the same block. Control: on the trained
    draft, the shorter blocks draft other tokens at some anchors (21 of 72 rounds here)."""
    from specforge.algorithms.dflash.propose import DFlashProposer, propose_block
    from specforge.models.target import forward_aux, load_target
    from specforge.registry import load_draft
    from tests.helpers.dflash import rounds_against_the_whole_block

    _, ckpt = single
    cfg = dflash_cfg(assets, assets / "unused")
    target = load_target(cfg.model, torch.device("cpu"), layers=lambda n: [1, 3])
    draft = load_draft(ckpt, target).double()
    ids = torch.randint(0, 297, (1, 40), generator=torch.Generator().manual_seed(0))
    aux = forward_aux(target, ids)[0].double()
    differ = rounds_against_the_whole_block(lambda served: DFlashProposer(draft, as_served=served), aux, ids,
                                            lambda cache, a: propose_block(draft, cache, a), range(4, 40))
    assert differ > 0


def test_the_dflash_proposer_drafts_what_the_training_forward_predicts(assets, single):
    """The eval's proposer (one block after a cached context) and the training forward (all blocks in
    one pass, block mask) give the same drafts at the same anchor: the eval measures what was trained."""
    from specforge.algorithms.dflash import ContextCache
    from specforge.algorithms.dflash.loss import build_block_ids
    from specforge.algorithms.dflash.propose import propose_block
    from specforge.models.target import forward_aux, load_target
    from specforge.registry import load_draft

    _, ckpt = single
    cfg = dflash_cfg(assets, assets / "unused")
    target = load_target(cfg.model, torch.device("cpu"), layers=lambda n: [1, 3])
    draft = load_draft(ckpt, target).double()
    ids = torch.randint(0, 297, (1, 20), generator=torch.Generator().manual_seed(0))
    aux, _, _ = forward_aux(target, ids)
    aux = aux.double()
    a = 11
    want = propose_block(draft, ContextCache().extend(draft, aux[:, :a]), ids[:, a])
    anchors = torch.tensor([[a]])
    hidden = draft(aux, build_block_ids(ids, anchors, 4, draft.config.mask_token_id), anchors)
    assert torch.equal(draft.logits(hidden[0, 0, 1:]).argmax(-1), want[0])
