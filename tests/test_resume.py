"""Exact resume: what a checkpoint carries, what it refuses, and a hard-killed driver.

* The saved draft folder is what a server running as another user can load: world-readable
  (umask applied), floats stored in the dtype config.json declares; the fp32 master weights stay
  in the training state, so a resume continues bit for bit.
* A checkpoint of another run (other target weights, vocab mapping, data, or a config key that
  changes the math) is refused with a message naming every difference.
* Train ranks that resumed at different steps are refused, not reconciled.
* ``python -m specforge.ray_train`` stopped at fixed moments (the driver SIGKILLed mid-step, during a
  save, during an eval; the Ray head killed), nothing of it left behind each time, rerun unchanged after
  each and then resumed to its end, logs per-step losses and evals equal to an uninterrupted run's.
* A driver that dies after the workers saved a step but before it logged that step's rows: the
  checkpoint carries them and the resumed run logs them (marked ``restored``), and a half-written
  last line of metrics.jsonl is cut instead of having the next row run into it.
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from specforge.algorithms.eagle3.algorithm import Eagle3Options
from specforge.config import Config, TrainConfig
from specforge.data.vocab import DraftVocab
from specforge.registry import get_algorithm, load_draft
from specforge.training.checkpoint import CheckpointManager, list_checkpoints, load_train_state, step_dir
from specforge.training.trainer import run_identity
from tests.helpers.ray_run import cfg_overrides, losses
from tests.helpers.trainer import feature_batch, setup_trainer, trainable_params

REPO = Path(__file__).parent.parent
EAGLE3 = get_algorithm("eagle3")


def _cfg(**train) -> Config:
    train = {"precision": "fp32", "lr": 1e-2, "warmup_steps": 0, "max_grad_norm": 10.0, **train}
    return Config(draft=Eagle3Options(vocab_size=48, ttt_length=3), train=TrainConfig(**train))


FACTS = {"data": "cache-abc", "num_samples": 12, "global_batch": 2}


def identity_of(cfg, *args, **kwargs) -> dict:
    """``run_identity`` of an EAGLE-3 run of ``cfg`` (its algorithm bound to it)."""
    return run_identity(EAGLE3.bind(cfg), cfg, *args, **kwargs)


def test_checkpoint_is_servable_by_another_user_and_resumes_exactly(tmp_path):
    target, rows, trainer = setup_trainer()
    batch = feature_batch(target, rows)
    for _ in range(2):
        trainer.step([batch])
    vocab = DraftVocab(trainer.draft.d2t, trainer.draft.t2d)
    identity = identity_of(_cfg(), target, vocab, FACTS, total_steps=10)
    old = os.umask(0o022)
    try:
        path = CheckpointManager(tmp_path, identity=identity).save(trainer)
    finally:
        os.umask(old)
    # readable (and the folder listable) by others, like a plain mkdir/open under umask 022
    assert path.stat().st_mode & 0o777 == 0o755
    assert {f.name: f.stat().st_mode & 0o777 for f in path.iterdir()} == {
        "config.json": 0o644, "model.safetensors": 0o644, "training_state.pt": 0o644}
    # the served file holds the dtype config.json declares (d2t/t2d keep int64/bool)
    declared = json.loads((path / "config.json").read_text())["torch_dtype"]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert declared == "bfloat16"
    assert dtypes.pop("d2t") == "I64" and dtypes.pop("t2d") == "BOOL"
    assert set(dtypes.values()) == {"BF16"}, dtypes
    # what a server loads = the trained weights rounded to that dtype
    served = load_draft(path, target).trainable_state_dict()
    for k, v in trainable_params(trainer).items():
        assert torch.equal(served[k], v.to(torch.bfloat16).float()), k
    # the training state keeps the fp32 master weights, the data cursor and the run identity
    state = load_train_state(path)
    assert all(v.dtype == torch.float32 for k, v in state["model"].items() if v.is_floating_point())
    assert state["cursor"] == {"step": 2, "epoch": 0, "sample_offset": 4, "global_batch": 2, "num_samples": 12}
    assert state["identity"] == identity and set(state["rng"]) >= {"torch", "python", "numpy"}
    # resume: two more steps from the checkpoint == two more steps straight through, bit for bit
    _, _, resumed = setup_trainer(seed=123)
    assert CheckpointManager(tmp_path, identity=identity).load(resumed) == 2
    for _ in range(2):
        trainer.step([batch])
        resumed.step([batch])
    for k, v in trainable_params(trainer).items():
        assert torch.equal(trainable_params(resumed)[k], v), k


def test_resume_refuses_another_run_naming_what_differs(tmp_path):
    target, _, trainer = setup_trainer()
    vocab = DraftVocab(trainer.draft.d2t, trainer.draft.t2d)
    saved = identity_of(_cfg(), target, vocab, FACTS, total_steps=10)
    CheckpointManager(tmp_path, identity=saved).save(trainer)

    def refused(identity) -> str:
        _, _, other = setup_trainer(seed=1)
        with pytest.raises(ValueError, match="different run") as err:
            CheckpointManager(tmp_path, identity=identity).load(other)
        return str(err.value)

    up = target.model.model.layers[3].mlp.up_proj.weight
    original = up.detach().clone()
    with torch.no_grad():  # a fine-tune of the same target that moved one matrix a little
        up.mul_(1.001)
    msg = refused(identity_of(_cfg(), target, vocab, FACTS, total_steps=10))
    assert msg.count(": checkpoint ") == 1 and "target: checkpoint" in msg
    with torch.no_grad():
        up.copy_(original)
    other_vocab = DraftVocab(vocab.d2t.roll(1), vocab.t2d)
    assert "vocab: checkpoint" in refused(identity_of(_cfg(), target, other_vocab, FACTS, total_steps=10))
    msg = refused(identity_of(_cfg(lr=2e-2), target, vocab, {**FACTS, "data": "cache-other", "global_batch": 4},
                               total_steps=10))
    for part in ("data: checkpoint 'cache-abc', this run 'cache-other'", "global_batch: checkpoint 2, this run 4",
                 "train.lr: checkpoint 0.01, this run 0.02", "checkpoint.resume=false"):
        assert part in msg, (part, msg)
    # train.adam_eps is recorded off its default only: a checkpoint from before the key resumes at the default
    msg = refused(identity_of(_cfg(adam_eps=1e-3), target, vocab, FACTS, total_steps=10))
    assert msg.count(": checkpoint ") == 1 and "train.adam_eps: checkpoint '<absent>', this run 0.001" in msg, msg
    # a changed schedule (train.max_steps, via the LR horizon): the keys, both values, and both ways forward
    msg = refused(identity_of(_cfg(lr=2e-2), target, vocab, FACTS, total_steps=30))
    for part in ("total_steps (the LR schedule's length in steps, from train.max_steps and train.epochs): "
                 "checkpoint 10, this run 30", "train.lr: checkpoint 0.01, this run 0.02", "restore these values",
                 f"draft.init_from={tmp_path}", "Training a finished draft longer"):
        assert part in msg, (part, msg)
    assert "checkpoint.resume=false" not in msg
    # the same run resumes (the attention implementation is not part of the identity)
    _, _, same = setup_trainer(seed=2)
    cfg = _cfg()
    cfg.draft.attention = "eager"
    assert CheckpointManager(tmp_path, identity=identity_of(cfg, target, vocab, FACTS, total_steps=10)).load(same) == 0


def test_train_ranks_at_different_steps_are_refused():
    from specforge.ray_train import agreed_start
    from specforge.runtime.actors import WorkerError

    assert agreed_start([4, 4], ["train[0]", "train[1]"]) == 4
    with pytest.raises(WorkerError, match=r"train\[0\] at step 4, train\[1\] at step 2.*checkpoint.dir"):
        agreed_start([4, 2], ["train[0]", "train[1]"])


# ---------------------------------------------------------------- a hard-killed driver
# (the tiny Ray run: cfg_overrides and losses from tests/helpers/ray_run.py, its assets fixture from conftest)

KILL_STEPS = 24  # four epochs of the 12 train samples: the faults land well before the end


def _cli(args, env=None) -> subprocess.Popen:
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    # its own session: the driver and every process of the Ray cluster it starts can be found and killed
    p = subprocess.Popen([sys.executable, "-m", "specforge.ray_train", *args], cwd=REPO, env=env,
                         start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    p.started = time.time() - 1  # the file times' rounding
    return p


def _session_pids(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getsid(int(d.name)) == sid and (d / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    pids.append(int(d.name))
            except (OSError, IndexError):  # gone meanwhile
                pass
    return pids


def _kill_session(sid: int) -> None:
    """SIGKILL what is left of that session (the Ray cluster the killed driver started), nothing else."""
    deadline = time.time() + 30
    while (pids := _session_pids(sid)) and time.time() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
    assert not _session_pids(sid), "processes of the killed run survived"


def _shm_held(pids, since: float) -> set[str]:
    """The files under /dev/shm that ``pids`` map or hold open, and the OpenMP registrations named by them
    written since ``since`` (an older one is a dead process' of the same pid): what a killed process leaves
    there (specforge.children)."""
    from specforge.children import PROC

    procs: dict = {}
    exec(PROC, procs)
    registered = {f"/dev/shm/__KMP_REGISTERED_LIB_{pid}_{os.getuid()}" for pid in pids}
    return {f for pid in pids for f in procs["shm_of"](pid)} | \
        {f for f in registered if os.path.exists(f) and os.path.getmtime(f) >= since}


def _cmdlines(pids) -> list[str]:
    out = []
    for pid in pids:
        with contextlib.suppress(OSError):
            out.append(f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:200])
    return out


def _stop_and_check(p, out, kill) -> str:
    """Fault ``kill(p)`` on the running driver ``p``; then nothing of its session may be left within 30 s
    (processes, or what they held in /dev/shm). The driver's output."""
    held = _shm_held(_session_pids(p.pid), since=p.started)
    try:
        kill(p)
        try:
            log, _ = p.communicate(timeout=60)
            p.ended = time.monotonic()  # the driver's end, apart from the wait for its session below
        except subprocess.TimeoutExpired:
            raise AssertionError("the driver did not end within 60 s of the fault") from None
        deadline = time.time() + 30  # the driver's reaper (children.reaper) takes its Ray cluster with it
        while _session_pids(p.pid) and time.time() < deadline:
            time.sleep(0.2)
        assert not (left := _session_pids(p.pid)), f"processes of the stopped run survived it: {_cmdlines(left)}"
        assert not [f for f in held if os.path.exists(f)], "shared-memory files of the stopped run were left"
    finally:
        _kill_session(p.pid)
    return log


def _wait_for(p, path: Path, timeout: float = 400) -> None:
    deadline = time.time() + timeout
    while not path.exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert p.poll() is None and path.exists(), f"{path} never came:\n" + p.stdout.read()[-3000:]


@pytest.fixture
def short_tmp():
    """A folder with a short path (Ray's socket paths live under it; pytest's tmp_path is too long), removed
    after the test with the Ray sessions' logs it holds."""
    folder = tempfile.mkdtemp(prefix="/tmp/sfk")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_run_stopped_at_any_moment_resumes_exactly(assets, ray_session, tmp_path, short_tmp, capsys):
    """The same command, run again after each fault, and then the same run to its end, log the uninterrupted
    run's losses and held-out evals. The faults, at fixed moments (``specforge.failpoints`` holds a train rank there):
    the driver SIGKILLed while a rank writes step 4's checkpoint, after step 2's save (step 2 stays latest;
    the next run removes the partial save and says so); the driver SIGKILLed during the held-out eval
    after step 4; the Ray head (the GCS of the driver's own cluster) killed mid-step (the driver ends at once
    with one error line naming it and the last good checkpoint, status 1). After each: no process of the
    run's session within 30 s, nor a file it held in /dev/shm (control, checked: a cluster started without
    its reaper outlives the driver). The uninterrupted run, and the last one that resumes after the head's
    loss and runs to the end, are ``fit`` in this process, on the session's cluster: a resume reads only
    the run's folder, and each faulted run above already starts a driver and a cluster of its own (a
    fourth driver for the last run cost ~30 CPU-s). (A fourth fault, the driver SIGKILLed mid-step with no
    rank held, was dropped for time: the same assertions hold after the two driver SIGKILLs above, and
    the head's loss is the mid-step fault; benchmarks/chaos.py kills at random moments.) Over 30 s: three
    drivers (``python -m specforge.ray_train``), each importing torch and starting its own Ray cluster and
    two train actors (~30 CPU-s a driver on 2 cores), beside the two runs in this process."""
    import psutil

    from specforge.config import load_config
    from specforge.ray_train import fit

    ray_tmp = short_tmp
    marks = tmp_path / "marks"

    def run_args(out):
        return cfg_overrides(assets, out, "placement.mode=colocated", f"train.max_steps={KILL_STEPS}",
                             "train.eval_every=4", "checkpoint.every_steps=2", "checkpoint.keep_last=0",
                             "checkpoint.resume=true")

    def args(out):  # the drivers' own clusters: ray.* decides where Ray runs, not what the run computes
        return run_args(out) + [f"ray.temp_dir={ray_tmp}", "ray.num_cpus=4"]

    def start(out, failpoint=None):
        env = {"SPECFORGE_FAILPOINTS": failpoint, "SPECFORGE_FAILPOINT_DIR": str(marks)} if failpoint else {}
        return _cli(args(out), env)

    def sigkill(p):
        os.kill(p.pid, signal.SIGKILL)

    fit(load_config(None, run_args(tmp_path / "straight")))
    out = tmp_path / "killed"
    ckpts = out / "checkpoints"
    latest = lambda: os.readlink(ckpts / "latest")  # noqa: E731

    step = lambda: int(latest().split("-")[1])  # noqa: E731

    p = start(out, "checkpoint.write:pause@2")  # 1. the driver while step 4's checkpoint is written (step 2's is)
    _wait_for(p, marks / "checkpoint.write")
    _stop_and_check(p, out, sigkill)
    before = step()
    assert before == 2 and list_checkpoints(ckpts)[-1].name == latest()
    assert [d.name for d in ckpts.glob(".tmp-step-*")], "the partial save was expected to stay until the next run"
    (marks / "checkpoint.write").unlink()

    p = start(out, "eval:pause")  # 2. the driver during the next held-out eval (before that step's save)
    _wait_for(p, marks / "eval")
    log = _stop_and_check(p, out, sigkill)
    assert f"resuming at step {before}" in log and "removed the partial save an interrupted run left (.tmp-step-" in log
    assert not list(ckpts.glob(".tmp-step-*")) and step() == before

    p = start(out)  # 3. the Ray head, mid-step
    _wait_for(p, step_dir(ckpts, before + 2))
    gcs = [c for c in psutil.Process(p.pid).children() if "gcs_server" in " ".join(c.cmdline())]
    t0 = time.monotonic()
    log = _stop_and_check(p, out, lambda p: gcs[0].kill())
    assert p.returncode == 1 and p.ended - t0 < 30, (p.returncode, log[-2000:])
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"the Ray head was lost (its GCS process {gcs[0].pid} exited)" in errors[0], log[-2000:]
    assert f"last good checkpoint: {ckpts / latest()}; rerun the same command" in errors[0]
    assert step() < KILL_STEPS, "the run was expected to stop before its end"

    resumed_at = step()
    capsys.readouterr()
    fit(load_config(None, run_args(out)))  # 4. the same run, to the end (here, as the uninterrupted one)
    assert f"resuming at step {resumed_at}" in capsys.readouterr().out
    for kind in ("train", "eval"):
        want = {r["step"]: r["loss"] for r in losses(tmp_path / "straight", kind)}
        got = losses(out, kind)
        every = 1 if kind == "train" else 4
        assert sorted(want) == list(range(every, KILL_STEPS + 1, every))
        assert {r["step"] for r in got} == set(want)  # nothing skipped
        for r in got:  # every run's rows alike, the faulted runs' and the last one's
            assert r["loss"] == want[r["step"]], (kind, r["step"])


# ---------------------------------------------------------------- rows saved but never logged


class _DriverDied(Exception):
    pass


def test_rows_saved_but_not_logged_are_restored_on_resume(assets, tmp_path, monkeypatch, capsys):
    from specforge.config import load_config
    from specforge.tracking import MetricsLogger
    from specforge.train import run
    from specforge.training.checkpoint import recorded_rows

    def cfg(out):  # a save after step 2, and a held-out eval after it (the save waits for the eval)
        return load_config(None, cfg_overrides(assets, out, "train.max_steps=4", "train.eval_every=2",
                                               "checkpoint.every_steps=2", "checkpoint.keep_last=0",
                                               "checkpoint.resume=true"))

    def rows(out):
        return {(r["kind"], r["step"]): r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}

    run(cfg(tmp_path / "straight"))
    want = rows(tmp_path / "straight")
    assert set(want) == {("train", 1), ("train", 2), ("eval", 2), ("train", 3), ("train", 4), ("eval", 4)}

    out, log = tmp_path / "killed", MetricsLogger.log

    def dies_at_step_2(self, step, metrics, kind="train"):
        if step == 2:
            raise _DriverDied  # the workers have saved step 2 (and its eval) by now
        log(self, step, metrics, kind)

    monkeypatch.setattr(MetricsLogger, "log", dies_at_step_2)
    with pytest.raises(_DriverDied):
        run(cfg(out))
    monkeypatch.undo()
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 3, "lo')  # and a kill mid-write
    logged = {(r["kind"], r["step"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()[:-1])}
    assert logged == {("train", 1)}  # step 2's rows are only in the checkpoint
    saved = out / "checkpoints" / "step-000002"
    assert {(r["kind"], r["step"]) for r in recorded_rows(saved)} == {("train", 1), ("train", 2), ("eval", 2)}
    capsys.readouterr()

    run(cfg(out))
    said = capsys.readouterr().out
    assert "cut a half-written last line" in said
    assert f"restored the rows of train step 2, eval step 2 from {saved}" in said
    got = rows(out)
    assert set(got) == set(want)
    for key, row in got.items():  # the restored rows, the killed run's and the resumed run's alike
        assert row["loss"] == want[key]["loss"], key
        assert row.get("restored") == (1 if key in {("train", 2), ("eval", 2)} else None), key
