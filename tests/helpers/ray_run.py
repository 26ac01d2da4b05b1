"""The tiny Ray run (from tests/test_ray_train.py): its config, its metrics and the checks that
compare two runs. Its target + tokenizer folder and data file are the ``assets`` fixture, its
single-process run the ``reference`` fixture (tests/conftest.py)."""

import json
from pathlib import Path

import pytest

from specforge.config import load_config
from tests.helpers.tolerance import adamw_tol, close_tol, step_terms

STEPS = 3
# The tiny run's longest chain of sums into a gradient entry (tests/helpers/tolerance.py): a step's
# 2 rows of up to 64 tokens x 4 summed into it; up to 4 chained passes (EAGLE-3's 3 TTT steps, the
# block drafts' 2 layers run twice), forward and backward, each through the widest dot products at
# the tiny target's sizes (H 48, I 96): fc's 3H, H, I, 2 x 64 keys and a softmax over its ~400 tokens.
TINY_TERMS = 2 * 64 * 4 + 2 * 4 * (3 * 48 + 48 + 96 + 2 * 64 + 400)


def make_cfg(assets, out, *overrides):
    return load_config(None, cfg_overrides(assets, out, *overrides))


def cfg_overrides(assets, out, *overrides):
    """The tiny run's dotted overrides (also the command line of ``python -m specforge.ray_train``)."""
    base = [
        f"model.target_path={assets / 'target'}", "model.dtype=float32", "model.device=cpu",
        f"model.cache_dir={assets / 'cache'}", f"data.path={assets / 'data.jsonl'}", "data.max_length=64",
        # adam_eps = lr: a step moves a weight at most twice its gradient's rounding (assert_same_weights)
        "data.num_eval=2", "draft.vocab_size=64", "draft.ttt_length=3", "train.lr=1e-2", "train.adam_eps=1e-2",
        "train.warmup_steps=0",
        "train.batch_size=1", f"train.max_steps={STEPS}", "train.precision=fp32", "train.num_threads=1",
        "train.num_workers=2", "train.log_every=1", "train.eval_every=0", f"train.output_dir={out}",
        "tracking.wandb=false", "checkpoint.every_steps=0", "checkpoint.keep_last=1", "checkpoint.resume=false",
        "parallel.timeout_s=90", "placement.max_inflight_mb=1",
    ]
    return base + list(overrides)


def losses(out, kind="train"):
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["kind"] == kind]


def assert_same_losses(ref_out, out):
    ref, got = losses(ref_out), losses(out)
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, STEPS + 1))
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (out.name, a["step"])
        assert b["acc_0"] == pytest.approx(a["acc_0"], abs=1e-6)
        assert b["valid_tokens"] == a["valid_tokens"]


def weights_tol(state: dict, name: str, n_terms: int = TINY_TERMS) -> float:
    """How far the fp32 master weight ``name`` of a run whose checkpoint state (training_state.pt) is
    ``state`` may be from another run's that summed in other orders (tests/helpers/tolerance.py)."""
    import torch

    opt, f32 = state["optimizer"], torch.float32
    group = next(g for g in opt["param_groups"] if name in g["params"])
    lr, eps, (_, b2) = group["initial_lr"], group["eps"], group["betas"]  # lr: the schedule's peak
    st = opt["state"][name]
    steps = int(st["step"])
    # every step's gradient entry: v = (1 - b2) sum_k b2^(steps - k) g_k^2 >= (1 - b2) b2^(steps - 1) g_k^2
    g_max = (st["exp_avg_sq"].max() / ((1 - b2) * b2 ** (steps - 1))).sqrt().item()
    # clipping scales a step's gradients by one factor: 1 / their norm, each tensor's norm then the norm
    # of those (clip_grad_norm_), rounded to 2 gamma_(largest tensor + tensors) relative; m and sqrt(v)
    # move by that fraction, the step by twice it (at most 2 lr)
    sizes = [s["exp_avg_sq"].numel() for s in opt["state"].values()]
    clip = 2 * lr * close_tol(f32, max(sizes) + len(sizes), 1.0)
    # each step's gradient rounding, moved at most 2 lr / eps times, and the weight's own rounding at every step
    grad_tols = [close_tol(f32, step_terms(s, n_terms), g_max) for s in range(steps)]
    return adamw_tol([lr] * steps, grad_tols, eps, f32, state["model"][name].abs().max().item()) + steps * clip


def assert_same_weights(ref_dir: Path, got_dir: Path, got: dict, want: dict, n_terms: int = TINY_TERMS) -> None:
    """The fp32 master weights (training_state.pt) match within ``weights_tol`` of the reference's; the
    served file is those weights rounded to its torch_dtype (bf16): one rounding step apart at most more."""
    import torch

    ref_s = torch.load(ref_dir / "training_state.pt", weights_only=False)
    ref_m, got_m = ref_s["model"], torch.load(got_dir / "training_state.pt", weights_only=False)["model"]
    assert set(ref_m) == set(got_m)
    tols = {}
    for k in ref_m:
        if k not in ref_s["optimizer"]["state"]:  # not trained (the vocab maps): bit for bit
            assert torch.equal(got_m[k], ref_m[k]), k
            continue
        tols[k] = weights_tol(ref_s, k, n_terms)
        torch.testing.assert_close(got_m[k], ref_m[k], rtol=0, atol=tols[k], msg=lambda m, k=k: f"{k}: {m}")
    for k in want:
        if want[k].is_floating_point():
            torch.testing.assert_close(got[k].float(), want[k].float(), rtol=torch.finfo(want[k].dtype).eps,
                                       atol=tols.get(k, 0.0), msg=lambda m, k=k: f"served {k}: {m}")
        else:
            assert torch.equal(got[k], want[k]), k
