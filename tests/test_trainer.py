"""The shared train step and checkpoints, on a tiny random target."""

import copy

import pytest
import torch

from specforge.algorithms.eagle3 import ALGORITHM as EAGLE3
from specforge.algorithms.eagle3.loss import ttt_logits
from specforge.registry import load_draft
from specforge.training.batch import global_batch_ids, split_for_ranks
from specforge.training.checkpoint import CheckpointManager, latest_checkpoint, save_checkpoint
from tests.helpers.trainer import feature_batch, setup_trainer, trainable_params


def test_loss_decreases_on_a_fixed_batch():
    target, rows, trainer = setup_trainer()
    batch = feature_batch(target, rows)
    ms = [trainer.step([batch]) for _ in range(15)]
    losses = [m["loss"] for m in ms]
    assert losses[-1] < 0.7 * losses[0], losses
    assert ms[-1]["acc_0"] > ms[0]["acc_0"] + 0.2
    assert trainer.draft.embed_tokens.weight.grad is None  # the frozen target embedding


def test_grad_accumulation_equals_one_big_batch():
    """Loss is normalized by the valid count of the whole step, so splitting changes nothing."""
    target, rows, a = setup_trainer()
    _, _, b = setup_trainer()
    ma = a.step([feature_batch(target, rows)])
    mb = b.step([feature_batch(target, rows[:1]), feature_batch(target, rows[1:3]), feature_batch(target, rows[3:])])
    assert abs(ma["loss"] - mb["loss"]) < 1e-5 * abs(ma["loss"])
    assert ma["valid_tokens"] == mb["valid_tokens"] > 0
    # gradients (left in .grad by the step) match; AdamW's first update is ~sign(g), too touchy to compare
    for (na, pa), (nb, pb) in zip(a.draft.named_parameters(), b.draft.named_parameters()):
        assert na == nb
        if pa.requires_grad:
            torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-4, atol=1e-6)


def test_the_trainer_runs_the_algorithm_it_is_given_and_refuses_another():
    """DraftTrainer takes its algorithm bound to the run; one that is not the config's draft.algorithm
    is refused (the step would otherwise run one algorithm's loss on another's draft), and so is the
    registry's unbound object (its hooks would have no options)."""
    from specforge.registry import get_algorithm
    from specforge.training.trainer import DraftTrainer

    _, _, trainer = setup_trainer()
    # the one it was given, bound to the run (the control: the config's own is accepted)
    assert type(trainer.algorithm) is type(EAGLE3) and trainer.algorithm.opt is trainer.cfg.draft
    with pytest.raises(ValueError, match="DraftTrainer got algorithm 'dflash'.*draft.algorithm is 'eagle3'"):
        DraftTrainer(get_algorithm("dflash").bind(trainer.cfg), trainer.draft, trainer.state, trainer.cfg,
                     torch.device("cpu"))
    with pytest.raises(ValueError, match="DraftTrainer got algorithm 'eagle3' unbound.*bound_algorithm"):
        DraftTrainer(EAGLE3, trainer.draft, trainer.state, trainer.cfg, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="unbound algorithm; bind it"):
        EAGLE3.loss(trainer.draft, None, trainer.state, 0, None, training=True)


def test_checkpoint_reloads_to_identical_logits_and_resumes_exactly(tmp_path):
    target, rows, trainer = setup_trainer()
    batch = feature_batch(target, rows)
    for _ in range(2):
        trainer.step([batch])
    d = trainer.draft
    path = CheckpointManager(tmp_path, keep_last=1).save(trainer)
    assert latest_checkpoint(tmp_path) == path and (tmp_path / "latest").resolve() == path.resolve()
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())
    reloaded = load_draft(path, target)
    served = copy.deepcopy(d).eval()  # the served file holds the trained weights in config.json's torch_dtype
    with torch.no_grad():
        for p in served.parameters():
            if p.requires_grad:
                p.copy_(p.to(getattr(torch, d.config.torch_dtype)).float())
        want = ttt_logits(served, batch, 3)
        got = ttt_logits(reloaded, batch, 3)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    # resume: two more steps from the checkpoint == two more steps straight through
    _, _, resumed = setup_trainer(seed=123)
    assert CheckpointManager(tmp_path).load(resumed) == 2
    for _ in range(2):
        trainer.step([batch])
        resumed.step([batch])
    assert resumed.step_count == trainer.step_count == 4
    for k, v in trainable_params(trainer).items():
        torch.testing.assert_close(trainable_params(resumed)[k], v, rtol=0, atol=0)


def test_keep_last_prunes_old_checkpoints(tmp_path):
    w = {"x": torch.zeros(2)}
    for s in (1, 2, 3):
        save_checkpoint(tmp_path, s, {"a": 1}, w, keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000002", "step-000003"]
    # latest = the last save, even when an older run left higher steps behind
    save_checkpoint(tmp_path, 1, {"a": 1}, w, keep_last=2)
    assert latest_checkpoint(tmp_path).name == "step-000001" and (tmp_path / "step-000001").is_dir()
    (tmp_path / "step-000001" / "model.safetensors").unlink()  # an incomplete target: the newest complete one
    assert latest_checkpoint(tmp_path).name == "step-000003"


def test_data_order_is_a_pure_function_of_seed_and_step():
    a = [global_batch_ids(10, 4, seed=3, step=s) for s in range(6)]
    b = [global_batch_ids(10, 4, seed=3, step=s) for s in range(6)]
    assert a == b
    flat = [i for ids in a for i in ids]
    assert sorted(flat[:10]) == list(range(10))  # the first epoch visits every sample once
    assert global_batch_ids(10, 4, seed=4, step=0) != a[0]
    assert all(len(set(global_batch_ids(10, 4, seed=3, step=s))) == 4 for s in range(100))  # no repeat at rollovers
    assert split_for_ranks([1, 2, 3, 4, 5, 6, 7, 8], 2, 2) == [[[1, 2], [3, 4]], [[5, 6], [7, 8]]]


def test_ttt_warmup_trains_step_0_alone_then_the_full_unroll():
    """draft.ttt_warmup_steps=1: step 1 is exactly a ttt_length=1 step, step 2 unrolls draft.ttt_length."""
    target, rows, warm = setup_trainer(ttt_warmup_steps=1)
    _, _, short = setup_trainer()
    short.cfg.draft.ttt_length = 1
    batch = feature_batch(target, rows)
    assert warm.algorithm.unroll_length(warm.step_count, training=True) == 1
    w1, s1 = warm.step([batch]), short.step([batch])
    assert w1["loss"] == s1["loss"]
    for k, v in trainable_params(warm).items():
        torch.testing.assert_close(v, trainable_params(short)[k], rtol=0, atol=0)
    assert warm.algorithm.unroll_length(warm.step_count, training=True) == 3
    w2, s2 = warm.step([batch]), short.step([batch])
    assert w2["loss"] > s2["loss"] * 1.2  # steps 1 and 2 add their (decayed) losses
    assert warm.evaluate([batch])["loss_2"] > 0  # evaluation always unrolls the full length
