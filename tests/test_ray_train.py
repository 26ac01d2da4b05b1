"""The Ray orchestrator end to end on a tiny random Llama target and a tiny ChatML tokenizer.

Same seed, same samples per step: the single-process trainer (global batch = 2 micro-batches),
colocated (2 train workers) and disaggregated (1 rollout worker feeding 2 DP train ranks over
gloo p2p) must give the same per-step losses. Each run writes its own metrics.jsonl.
"""

from pathlib import Path

import pytest

from specforge.contracts import assert_no_tensors
from tests.helpers.plan import planner
from tests.helpers.ray_run import STEPS, assert_same_losses, assert_same_weights, losses, make_cfg

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
# fixtures ray_session, assets and reference (the tiny run in one process): tests/conftest.py


@pytest.fixture(scope="module")
def disaggregated(assets, tmp_path_factory, ray_session):
    """The disaggregated run, recording everything the driver received."""
    import specforge.ray_train as rt

    out = tmp_path_factory.mktemp("disagg")
    received = []
    real = rt.gather

    def recording_gather(refs, labels, timeout_s, what="call"):
        results = real(refs, labels, timeout_s, what=what)
        received.extend(results)
        return results

    rt.gather = recording_gather
    try:
        path = rt.fit(make_cfg(assets, out, "placement.mode=disaggregated", "rollout.num_workers=1",
                               "train.eval_every=2"))
    finally:
        rt.gather = real
    return out, path, received


def test_modes_give_the_same_losses(assets, reference, disaggregated, ray_session, tmp_path):
    """Colocated and disaggregated Ray runs give the single-process run's losses, counters, periodic eval
    and checkpoint. Over 30 s: the module's first test, so its setup trains the single-process reference and
    the disaggregated run (three Ray actors); the call adds the colocated run (two)."""
    from specforge.ray_train import fit
    from specforge.training.checkpoint import load_draft_folder

    colocated = tmp_path / "colocated"
    fit(make_cfg(assets, colocated, "placement.mode=colocated"))
    ref = losses(reference)
    assert [r["step"] for r in ref] == list(range(1, STEPS + 1))
    assert ref[0]["loss"] > 0 and ref[-1]["loss"] != ref[0]["loss"]  # it trained
    for out in (colocated, disaggregated[0]):
        got = losses(out)
        assert [r["step"] for r in got] == [r["step"] for r in ref]
        for a, b in zip(ref, got):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (out.name, a["step"])
            assert b["acc_0"] == pytest.approx(a["acc_0"], abs=1e-6)
            assert b["valid_tokens"] == a["valid_tokens"]
    # periodic eval runs in every placement (here over the data plane), on the same held-out samples
    ref_eval, got_eval = losses(reference, "eval"), losses(disaggregated[0], "eval")
    assert [r["step"] for r in ref_eval] == [r["step"] for r in got_eval] == [2]
    for key in ("loss", "acc_0", "tau", "valid_tokens"):
        assert got_eval[0][key] == pytest.approx(ref_eval[0][key], rel=1e-4, abs=1e-6), key
    # the gathered FSDP2 checkpoint = the single-process one
    _, want = load_draft_folder(reference / "checkpoints" / f"step-{STEPS:06d}")
    hf, got = load_draft_folder(disaggregated[1])
    assert hf["architectures"] == ["LlamaForCausalLMEagle3"]
    assert set(got) == set(want) and {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= set(got)
    assert_same_weights(reference / "checkpoints" / f"step-{STEPS:06d}", Path(disaggregated[1]), got, want)


def test_driver_received_no_tensors_and_one_forward_per_step(disaggregated):
    out, _, received = disaggregated
    assert len(received) >= 3 * STEPS  # setup + rollout + train reports
    for record in received:
        assert_no_tensors(record)
    recs = losses(out)
    # 1 rollout worker serves 2 DP groups with ONE batched forward per step (counted by the target where its
    # forwards run: tests/test_packing_capture.py shows the count follows the forwards made)
    assert [r["rollout_forwards"] for r in recs] == [1.0] * STEPS
    assert all(r["transfer_bytes"] > 0 and r["recv_bytes"] == r["transfer_bytes"] for r in recs)
    for key in ("loss_0", "acc_0", "tau", "lr", "grad_norm", "tokens_per_s", "rollout_forward_ms", "transfer_ms",
                "train_ms", "train_wait_ms", "inflight_bytes"):
        assert key in recs[-1], key


def test_worker_error_names_the_worker(assets, ray_session, tmp_path):
    """A rollout worker that cannot load its weights fails the run fast, naming itself."""
    import shutil

    from specforge.ray_train import fit
    from specforge.runtime.actors import WorkerError

    broken = tmp_path / "broken"
    shutil.copytree(assets / "target", broken)
    (broken / "model.safetensors").unlink()  # the driver needs only config + tokenizer
    cfg = make_cfg(assets, tmp_path / "out", "placement.mode=disaggregated", "train.num_workers=1",
                   f"model.target_path={broken}")
    with pytest.raises(WorkerError, match=r"(?s)setup failed on (rollout|train)\[0\].*(safetensors|weights|file)"):
        fit(cfg)
    assert ray_session.is_initialized()  # the caller's Ray session is left alone


def test_main_reports_bad_config(capsys):
    from specforge.ray_train import main

    assert main(["rollout.tp_size=2"]) == 1
    assert "rollout.tp_size" in capsys.readouterr().err
    # offline mode without a filled store: one line naming the store and how to fill it
    assert main(["placement.mode=offline", "train.output_dir=/nonexistent/run"]) == 1
    err = capsys.readouterr().err
    assert "no feature store" in err and "specforge.capture" in err and "Traceback" not in err


@pytest.mark.slow
def test_resume_continues_exactly(assets, reference, ray_session, tmp_path):
    """Periodic FSDP2 checkpoint at step 2 (full weights + full optimizer state); drop the final
    one and resume: the redone step 3 matches the uninterrupted single-process run. (Stopping via
    a smaller max_steps would change the LR schedule, which spans max_steps.) Over 30 s beside the other
    pytest worker (29.8-35.8 s in the suite's runs of 2026-11-29 and 11-30): two Ray fits, the run and its
    resume, each starting its two train workers (~2.6 CPU-s an actor) and saving FSDP2 checkpoints."""
    import shutil

    from specforge.ray_train import fit

    out = tmp_path / "resumed"
    cfg = make_cfg(assets, out, "placement.mode=colocated", "checkpoint.every_steps=2", "checkpoint.keep_last=0",
                   "checkpoint.resume=true")
    fit(cfg)
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-000002", "step-000003"]
    shutil.rmtree(out / "checkpoints" / "step-000003")
    path = fit(cfg)
    assert path.endswith(f"step-{STEPS:06d}")
    got = losses(out)
    assert [r["step"] for r in got] == [1, 2, 3, 3]  # the second run logged only step 3
    assert got[-1]["loss"] == pytest.approx(losses(reference)[-1]["loss"], rel=1e-4)


def _odd_lengths_are_trained(cfg):
    """The run's samples (and so some micro-batch padded lengths) are not all divisible by 2."""
    from specforge.ray_train import Planner, prepare
    from specforge.runtime.workers import Layout

    data = prepare(cfg, use_gpu=False)  # a cache hit
    layout = Layout(cfg.placement.mode, (0,) if cfg.placement.mode == "disaggregated" else (),
                    (1, 2) if cfg.placement.mode == "disaggregated" else (0, 1), data.vocab_path)
    plan = Planner(cfg, data, layout)
    trained = [n for step in range(STEPS) for _, n in plan(step).lengths]
    assert any(n % 2 for n in trained), trained
    return plan


@pytest.mark.slow
def test_sequence_parallel_colocated_matches_single_process(assets, reference, ray_session, tmp_path):
    """2 train workers = 1 DP group of Ulysses SP 2: each captures half the micro-batches and
    sends the other its slices (tests/test_capture_sp.py); the losses are the single-process ones."""
    from specforge.ray_train import fit

    out = tmp_path / "sp-colocated"
    cfg = make_cfg(assets, out, "placement.mode=colocated", "parallel.sp_ulysses=2", "train.grad_accum=2")
    _odd_lengths_are_trained(cfg)
    fit(cfg)
    assert_same_losses(reference, out)


@pytest.mark.slow
def test_sequence_parallel_disaggregated_matches_single_process(assets, reference, ray_session, tmp_path):
    """1 rollout worker -> 2 train workers = 1 DP group of ring SP 2, micro-batches of 2 samples:
    each train rank receives only its slice + halo of each sample; same losses and checkpoint. Over 30 s
    beside the other pytest worker (36.8 s at 767b251): three Ray actors, ~5 CPU-s each to start."""

    from specforge.ray_train import fit
    from specforge.training.checkpoint import load_draft_folder

    out = tmp_path / "sp-disagg"
    cfg = make_cfg(assets, out, "placement.mode=disaggregated", "rollout.num_workers=1", "parallel.sp_ring=2",
                   "train.batch_size=2", "train.grad_accum=1")
    plan = _odd_lengths_are_trained(cfg)
    p = plan(0)
    full = sum(n for _, n in p.lengths) * p.feature_spec.bytes_per_token()
    assert {t.dst_rank for t in p.transfers} == {1, 2}
    assert plan.step_bytes(0) < 2 * full  # slices + halos, not every sample to both SP ranks
    path = fit(cfg)
    assert_same_losses(reference, out)
    _, want = load_draft_folder(reference / "checkpoints" / f"step-{STEPS:06d}")
    _, got = load_draft_folder(path)
    assert set(got) == set(want)
    assert_same_weights(reference / "checkpoints" / f"step-{STEPS:06d}", Path(path), got, want)


def test_check_rejects_indivisible_sp_and_a_target_split_on_cpu(tmp_path):
    from specforge.runtime.loop import check  # what no placement runs yet (preflight.check_placement calls it first)

    with pytest.raises(ValueError, match=r"multiple of the sequence-parallel degree 4"):
        check(make_cfg(tmp_path, tmp_path / "o", "train.num_workers=2", "parallel.sp_ulysses=2", "parallel.sp_ring=2"))
    with pytest.raises(ValueError, match=r"model.num_gpus"):
        check(make_cfg(tmp_path, tmp_path / "o", "model.num_gpus=2", "model.device=cpu"))
    check(make_cfg(tmp_path, tmp_path / "o", "train.num_workers=4", "parallel.sp_ring=2"))  # dp = 2


@pytest.mark.parametrize("mode, sp", [("single", None), ("colocated", None), ("disaggregated", None),
                                      ("colocated", "sp_ulysses"), ("disaggregated", "sp_ring")])
def test_packed_rows_give_the_unpacked_losses(assets, reference, ray_session, tmp_path, mode, sp):
    """train.pack_tokens: a rank's two samples of a step in one packed row (batch 2, rows of up to
    128 tokens, data.max_length 64) train as the reference's two unpacked micro-batches do: the same
    global batch, the same per-step losses, in one process and in both Ray placements; with SP 2 the
    packed row is sliced over the group's two ranks (Ulysses colocated, ring disaggregated). Over 30 s for the
    Ray cases beside the other pytest worker: a placement of two or three actors, ~5 CPU-s each to start."""
    from specforge.ray_train import fit
    from specforge.train import run

    packed = ("train.batch_size=2", "train.grad_accum=1", "train.pack_tokens=128")
    workers = "train.num_workers=1" if sp is None else "train.num_workers=2"  # one DP group either way
    out = tmp_path / f"{mode}-{sp}"
    if mode == "single":
        run(make_cfg(assets, out, *packed, workers))
    else:
        cfg = make_cfg(assets, out, *packed, workers, f"placement.mode={mode}", "rollout.num_workers=1",
                       *(() if sp is None else (f"parallel.{sp}=2",)))
        plan = planner(cfg, train_ranks=(1, 2) if sp else (1,))(0)
        assert plan.packed and all(len(mb) == 1 for mb in plan.micro_batches)  # one row per DP group
        fit(cfg)
    assert_same_losses(reference, out)
