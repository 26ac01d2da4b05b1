"""The tiny Ray run (from tests/test_ray_train.py): its config, its metrics and the checks that
compare two runs. Its target + tokenizer folder and data file are the ``assets`` fixture, its
single-process run the ``reference`` fixture (tests/conftest.py)."""

import json
from pathlib import Path

import pytest

from specforge.config import load_config

STEPS = 3


def make_cfg(assets, out, *overrides):
    return load_config(None, cfg_overrides(assets, out, *overrides))


def cfg_overrides(assets, out, *overrides):
    """The tiny run's dotted overrides (also the command line of ``python -m specforge.ray_train``)."""
    base = [
        f"model.target_path={assets / 'target'}", "model.dtype=float32", "model.device=cpu",
        f"model.cache_dir={assets / 'cache'}", f"data.path={assets / 'data.jsonl'}", "data.max_length=64",
        "data.num_eval=2", "draft.vocab_size=64", "draft.ttt_length=3", "train.lr=1e-2", "train.warmup_steps=0",
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


def assert_same_weights(ref_dir: Path, got_dir: Path, got: dict, want: dict, atol: float = 1e-5) -> None:
    """The fp32 master weights (training_state.pt) match at fp32 tolerance (``atol``); the served file
    is those weights rounded to its torch_dtype (bf16), where a 1e-7 difference may flip one rounding step."""
    import torch

    ref_m = torch.load(ref_dir / "training_state.pt", weights_only=False)["model"]
    got_m = torch.load(got_dir / "training_state.pt", weights_only=False)["model"]
    assert set(ref_m) == set(got_m)
    for k in ref_m:
        torch.testing.assert_close(got_m[k], ref_m[k], rtol=1e-4, atol=atol)
    for k in want:
        if want[k].is_floating_point():
            torch.testing.assert_close(got[k].float(), want[k].float(), rtol=1e-2, atol=1e-3)
        else:
            assert torch.equal(got[k], want[k]), k
