"""Faults at fixed moments, the short deterministic versions of issue 57's chaos schedule (each asserts
nothing lost, nothing left behind, and the rerun equal to the uninterrupted run):

* the disk fills while a periodic checkpoint is written (ENOSPC after half its weights file, through a
  write-failure hook at the writer): the previous checkpoint stays ``latest`` and loads, no partial
  folder is left, the state of the failed step is written to a rescue folder, the run ends in one
  line naming the folder and the bytes the save needed, and the same command resumes from the last
  good checkpoint to the uninterrupted run's losses;
* free space already short at a save: refused before a byte is written under the checkpoint folder,
  with the same line and rescue.

A shard corrupted after capture: tests/test_store.py and tests/test_offline.py. Workers killed:
tests/test_failures.py.
"""

import errno

import pytest

from tests.helpers.ray_run import cfg_overrides
from tests.helpers.single_run import step_losses
from tests.helpers.tables import one_error_line

STEPS, EVERY = 4, 2


def _args(assets, out):
    return cfg_overrides(assets, out, "train.num_workers=1", f"train.max_steps={STEPS}",
                         f"checkpoint.every_steps={EVERY}", "checkpoint.keep_last=0", "checkpoint.resume=true")


@pytest.fixture(scope="module")
def straight(assets, tmp_path_factory):
    """The uninterrupted run's per-step losses."""
    from specforge.train import main

    out = tmp_path_factory.mktemp("straight")
    assert main(_args(assets, out)) == 0
    return step_losses(out)



@pytest.mark.parametrize("when", ["mid-write", "before-write"])
def test_a_full_disk_at_a_save_keeps_the_last_checkpoint_and_the_rerun_resumes(assets, tmp_path, monkeypatch, capsys,
                                                                              straight, when):
    import tempfile

    import specforge.training.checkpoint as ck
    from specforge.cli import run_cli
    from specforge.train import main
    from specforge.training.checkpoint import latest_checkpoint, load_train_state

    out = tmp_path / "run"
    root = out / "checkpoints"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # the second rescue root
    (tmp_path / "tmp").mkdir()
    real_save, real_usage = ck.save_file, ck.shutil.disk_usage
    written = []

    def full_save(tensors, path, metadata=None):  # the disk fills half-way through step 4's weights
        if str(path).startswith(f"{root}/") and metadata.get("step") == str(STEPS) and when == "mid-write":
            real_save(tensors, path, metadata)
            with open(path, "r+b") as f:
                f.truncate(f.seek(0, 2) // 2)
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append((str(path), metadata.get("step")))
        return real_save(tensors, path, metadata)

    def short(path):  # free space under the checkpoint folder at step 4: 1 KiB
        usage = real_usage(path)
        if when == "before-write" and str(path) == str(root) and ck.list_checkpoints(root)[-1:] == [
                ck.step_dir(root, EVERY)]:
            return usage._replace(free=1024)
        return usage

    monkeypatch.setattr(ck, "save_file", full_save)
    monkeypatch.setattr(ck.shutil, "disk_usage", short)
    capsys.readouterr()
    assert run_cli(lambda: main(_args(assets, out))) == 1
    line = one_error_line(capsys.readouterr().err)
    assert f"could not write checkpoint step {STEPS} under '{root}'" in line, line
    if when == "mid-write":
        assert "No space left on device while writing step 4, which needs ~" in line, line
    else:
        assert "step 4 needs ~" in line and "1.0 KiB free" in line, line
        assert not [p for p, step in written if p.startswith(f"{root}/") and step == str(STEPS)]  # not a byte
    (rescued,) = out.glob("checkpoints.rescue-*/step-000004")
    assert str(rescued) in line and load_train_state(rescued)["step"] == STEPS  # the trained state kept
    assert latest_checkpoint(root) == ck.step_dir(root, EVERY)  # the last good save stays latest, and loads
    assert load_train_state(latest_checkpoint(root))["step"] == EVERY
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []  # no partial folder left

    monkeypatch.setattr(ck, "save_file", real_save)
    monkeypatch.setattr(ck.shutil, "disk_usage", real_usage)
    assert main(_args(assets, out)) == 0  # the same command: resumes from step 2
    assert latest_checkpoint(root) == ck.step_dir(root, STEPS)
    got = step_losses(out)
    assert sorted(got) == sorted(straight)
    for s in straight:
        assert got[s] == pytest.approx(straight[s], rel=1e-5, abs=1e-7), s


def test_failpoints_are_off_unless_set_and_a_bad_entry_names_itself(monkeypatch, tmp_path):
    """No switch, no effect; ``enospc`` fails the n-th hit only, or the first one after each arming; a
    misspelt entry is refused naming it."""
    from specforge import failpoints

    monkeypatch.delenv(failpoints.ENV, raising=False)
    failpoints.hit("checkpoint.write")  # nothing
    monkeypatch.setattr(failpoints, "_hits", __import__("collections").Counter())
    monkeypatch.setenv(failpoints.ENV, "checkpoint.write:enospc@2")
    failpoints.hit("checkpoint.write")
    failpoints.hit("eval")  # another name: nothing
    with pytest.raises(OSError) as e:
        failpoints.hit("checkpoint.write")
    assert e.value.errno == errno.ENOSPC
    failpoints.hit("checkpoint.write")  # the third: nothing
    monkeypatch.setenv(failpoints.ENV, "checkpoint.write:enospc@armed")
    monkeypatch.setenv(failpoints.DIR_ENV, str(tmp_path))
    failpoints.hit("checkpoint.write")  # not armed: nothing
    (tmp_path / "checkpoint.write.armed").touch()
    with pytest.raises(OSError):
        failpoints.hit("checkpoint.write")
    assert not (tmp_path / "checkpoint.write.armed").exists()
    failpoints.hit("checkpoint.write")  # once per arming
    with pytest.raises(ValueError, match="'checkpoint.wirte:pause'"):
        failpoints.parse("eval,checkpoint.wirte:pause")
