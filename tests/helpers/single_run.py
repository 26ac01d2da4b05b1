"""The single-process run each algorithm's ``tests/test_<name>_train.py`` (and the GPU suite) drives
through ``python -m specforge.train``: its command line on the tiny target, its per-step losses, and
a run stopped between two steps as a SIGKILL would stop it."""

import contextlib
import math

import pytest

from tests.helpers.ray_run import losses as train_rows

STEPS, KILL_AFTER = 6, 3


def run_args(assets, out, keys, *extra, device="cpu", dtype="float32", precision="fp32", threads=1,
             timeout_s=90):
    """The tiny run as ``algorithm`` (``keys``: its ``draft.*`` overrides, ``draft.algorithm`` first): STEPS
    steps of 2 rows, a checkpoint every KILL_AFTER steps, resuming from the newest."""
    return [f"model.target_path={assets / 'target'}", f"model.dtype={dtype}", f"model.device={device}",
            f"model.cache_dir={assets / 'cache'}", f"data.path={assets / 'data.jsonl'}", "data.max_length=64",
            "data.num_eval=2", *keys, "train.lr=1e-2", "train.warmup_steps=0", "train.batch_size=2",
            f"train.max_steps={STEPS}", f"train.precision={precision}", f"train.num_threads={threads}",
            "train.num_workers=1", "train.log_every=1", "train.eval_every=0", f"train.output_dir={out}",
            "tracking.wandb=false", f"checkpoint.every_steps={KILL_AFTER}", "checkpoint.keep_last=0",
            "checkpoint.resume=true", f"parallel.timeout_s={timeout_s}", *extra]


def step_losses(out) -> dict:
    """``{step: loss}`` of the run written to ``out``."""
    return {r["step"]: r["loss"] for r in train_rows(out)}


class Killed(BaseException):
    """Ends a run between two steps as a SIGKILL would: no cleanup, no save on the way out."""


@contextlib.contextmanager
def killed_after(monkeypatch, step: int = KILL_AFTER):
    """Within it, a train step after ``step`` optimizer steps raises ``Killed`` and nothing saves on the way out."""
    from specforge.runtime.loop import LocalCluster
    from specforge.training.trainer import DraftTrainer

    real_step = DraftTrainer.step

    def stopped(self, micro_batches):
        if self.step_count == step:
            raise Killed
        return real_step(self, micro_batches)

    with monkeypatch.context() as m:
        m.setattr(DraftTrainer, "step", stopped)
        m.setattr(LocalCluster, "save", lambda self: None)
        yield


def kill_and_resume(args, out, monkeypatch) -> dict:
    """``python -m specforge.train args`` killed after its step-KILL_AFTER checkpoint, then the same command
    again: the resumed run's ``{step: loss}`` (``args`` write to ``out``)."""
    from specforge import train as local

    with killed_after(monkeypatch), pytest.raises(Killed):
        local.main(args)
    assert (out / "checkpoints" / f"step-{KILL_AFTER:06d}").is_dir()
    assert not (out / "checkpoints" / f"step-{STEPS:06d}").exists()
    assert local.main(args) == 0  # the same command again resumes
    return step_losses(out)


def assert_resumed_exactly(want: dict, got: dict) -> None:
    """Every step of the uninterrupted run, each loss as it was (fp32, the same sums in the same order)."""
    assert sorted(want) == list(range(1, STEPS + 1)) and all(math.isfinite(v) and v > 0 for v in want.values())
    assert sorted(got) == sorted(want)
    for s in want:
        assert got[s] == pytest.approx(want[s], rel=1e-5, abs=1e-7), (s, got[s], want[s])


def assert_training_lowers_the_loss(make_args, tmp_path) -> None:
    """30 steps of one row at lr 1e-2 end with the mean of the last 4 losses below 0.9 of the first 4's; the
    same run at an lr that moves nothing (1e-9: the control) stays within 5%. ``make_args(out, *extra)``."""
    from specforge import train as local

    ratios = {}
    for lr in ("1e-2", "1e-9"):
        out = tmp_path / lr
        assert local.main(make_args(out, "train.max_steps=30", f"train.lr={lr}", "checkpoint.every_steps=0",
                                    "train.batch_size=1")) == 0
        recs = [v for _, v in sorted(step_losses(out).items())]
        assert all(math.isfinite(v) for v in recs)
        ratios[lr] = sum(recs[-4:]) / sum(recs[:4])
    print(ratios)
    assert ratios["1e-2"] < 0.9 and ratios["1e-9"] > 0.95, ratios
