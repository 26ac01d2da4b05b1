"""XPress through the runtime, single process (``python -m specforge.train``), on the tiny random
Llama target (hidden 48, 297 tokens): chosen by ``draft.algorithm=xpress``, its loss finite and
falling (a control run at a learning rate that moves nothing stays put), killed after its step-3
checkpoint and run again with the same command (the losses equal the uninterrupted run's), packed
rows (``train.pack_tokens``) giving the padded run's losses, its checkpoint read back through the
registry, evaluated losslessly by ``python -m specforge.eval`` (Jacobi drafting through its
proposer), refused by ``python -m specforge.export`` (no engine serves it: tests/test_xpress_export.py) and with ring
sequence parallelism, each in one line.
"""

import json
import math

import pytest
import torch

from tests.helpers.ray_run import losses as train_rows

pytestmark = [pytest.mark.timeout(900)]
STEPS, KILL_AFTER = 6, 3
XPRESS = ["draft.algorithm=xpress", "draft.block_size=4", "draft.num_anchors=6", "draft.num_layers=2",
          "draft.refiner_rank=8", "draft.jacobi_passes=2", "draft.consistency_passes=2"]


def args(assets, out, *extra):
    return [f"model.target_path={assets / 'target'}", "model.dtype=float32", "model.device=cpu",
            f"model.cache_dir={assets / 'cache'}", f"data.path={assets / 'data.jsonl'}", "data.max_length=64",
            "data.num_eval=2", *XPRESS, "train.lr=1e-2", "train.warmup_steps=0", "train.batch_size=2",
            f"train.max_steps={STEPS}", "train.precision=fp32", "train.num_threads=1", "train.num_workers=1",
            "train.log_every=1", "train.eval_every=0", f"train.output_dir={out}", "tracking.wandb=false",
            f"checkpoint.every_steps={KILL_AFTER}", "checkpoint.keep_last=0", "checkpoint.resume=true",
            "parallel.timeout_s=90", *extra]


def losses(out):
    return {r["step"]: r["loss"] for r in train_rows(out)}


class _Killed(BaseException):
    """Ends a run between two steps as a SIGKILL would: no cleanup, no save on the way out."""


def test_train_resume_checkpoint_eval_and_export(assets, tmp_path, monkeypatch, capsys):
    from specforge import eval as spec_eval
    from specforge import export
    from specforge import train as local
    from specforge.algorithms.xpress.export import check_checkpoint
    from specforge.cli import run_cli
    from specforge.models.target import load_target
    from specforge.registry import algorithm_name, load_draft
    from specforge.runtime.loop import LocalCluster
    from specforge.training.checkpoint import latest_checkpoint
    from specforge.training.trainer import DraftTrainer

    straight = tmp_path / "straight"
    assert local.main(args(assets, straight)) == 0
    want = losses(straight)
    assert sorted(want) == list(range(1, STEPS + 1)) and all(math.isfinite(v) and v > 0 for v in want.values())
    first = train_rows(straight)[0]
    assert {"acc_0", "acc_2", "tau", "loss_tf", "loss_consistency", "loss_anchor", "acc_base"} <= set(first)
    assert "acc_3" not in first  # a block of 4 drafts 3 tokens
    assert first["loss"] == pytest.approx(first["loss_tf"] + 0.3 * first["loss_consistency"] +
                                          0.6 * first["loss_anchor"], rel=1e-5)

    killed = tmp_path / "killed"
    real_step = DraftTrainer.step

    def step(self, micro_batches):
        if self.step_count == KILL_AFTER:
            raise _Killed
        return real_step(self, micro_batches)

    with monkeypatch.context() as m:
        m.setattr(DraftTrainer, "step", step)
        m.setattr(LocalCluster, "save", lambda self: None)
        with pytest.raises(_Killed):
            local.main(args(assets, killed))
    assert (killed / "checkpoints" / f"step-{KILL_AFTER:06d}").is_dir()
    assert local.main(args(assets, killed)) == 0  # the same command again resumes
    got = losses(killed)
    assert sorted(got) == sorted(want)
    for s in want:
        assert got[s] == pytest.approx(want[s], rel=1e-5, abs=1e-7), (s, got[s], want[s])

    ckpt = latest_checkpoint(straight / "checkpoints")
    hf = json.loads((ckpt / "config.json").read_text())
    assert hf["architectures"] == ["XPressDraftModel"] and algorithm_name(hf) == "xpress"
    assert (hf["block_size"], hf["xpress_rank"], hf["xpress_mlp_ratio"], hf["num_jacobi_passes"],
            hf["sample_from_anchor"]) == (4, 8, 2, 2, False)
    check_checkpoint(ckpt)
    from safetensors.torch import load_file

    saved = load_file(ckpt / "model.safetensors")
    target = load_target(_model_cfg(assets), torch.device("cpu"),
                         layers=lambda n: hf["dflash_config"]["target_layer_ids"])
    draft = load_draft(ckpt, target)
    assert type(draft).__name__ == "XPressDraft"
    for k, v in draft.export_state_dict().items():
        assert torch.equal(v.to(saved[k].dtype), saved[k]), k
    assert saved["refiner_head.readout.weight"].shape == (hf["vocab_size"], 8)
    assert saved["refiner_head.mix_l"].shape == (8, 4, 4)

    report = tmp_path / "eval.json"
    assert spec_eval.main(["--draft", str(ckpt), "--num-prompts", "2", "--max-new-tokens", "8", "--chain", "3",
                           "--json", str(report), *args(assets, tmp_path / "eval")]) == 0  # raises unless == greedy
    rows = json.loads(report.read_text())["rows"]
    assert [r["setting"] for r in rows] == ["chain 3 fixed"] and rows[0]["new_tokens"] > 0

    capsys.readouterr()
    for engine in ("sglang", "vllm", "llama.cpp"):
        assert run_cli(lambda: export.main(["--draft", str(ckpt), "--engine", engine, "--out", str(tmp_path / "x"),
                                            "--target", str(assets / "target")])) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--engine {engine}: " in err[0] and "cannot serve XPressDraftModel drafts (" in err[0]
        assert "no engine here serves XPressDraftModel drafts yet" in err[0], err
        assert "XPress" in err[0].split("(", 1)[1], err


def _model_cfg(assets):
    from specforge.config import load_config

    return load_config(None, [f"model.target_path={assets / 'target'}", "model.dtype=float32",
                              "model.device=cpu", f"model.cache_dir={assets / 'cache'}"]).model


def test_training_lowers_the_loss(assets, tmp_path):
    """The XPress loss (CE + TV to a random target, three terms) falls over 30 steps; the same run
    at a learning rate that moves nothing (the control) stays where it was."""
    from specforge import train as local

    ratios = {}
    for lr in ("1e-2", "1e-9"):
        out = tmp_path / lr
        assert local.main(args(assets, out, "train.max_steps=30", f"train.lr={lr}", "checkpoint.every_steps=0",
                               "train.batch_size=1")) == 0
        recs = [v for _, v in sorted(losses(out).items())]
        assert all(math.isfinite(v) for v in recs)
        ratios[lr] = sum(recs[-4:]) / sum(recs[:4])
    print(ratios)
    assert ratios["1e-2"] < 0.9 and ratios["1e-9"] > 0.95, ratios


def test_the_shipped_cpu_recipe_dry_runs_with_its_parts_in_the_memory_plan():
    """configs/xpress-smollm2-135m-cpu.yaml: offline from the EAGLE-3 default's store; its draft counts
    DFlash's parameters plus the refiner (2 V r + 2 H r + 3 r^2 + r K^2 + 3 r m, m = 2 r), and the
    memory plan its terms; fewer consistency passes plan less memory."""
    from pathlib import Path

    from specforge.config import load_config
    from specforge.dryrun import dry_run

    configs = Path(__file__).parent.parent / "configs"
    cfg = load_config(configs / "xpress-smollm2-135m-cpu.yaml")
    assert (cfg.draft.algorithm, cfg.placement.mode, cfg.store.dir) == ("xpress", "offline",
                                                                        "runs/smollm2-135m-cpu/features")
    r = dry_run(cfg, single_process=True)
    dflash = dry_run(load_config(configs / "smollm2-135m-dflash-cpu.yaml", ["draft.block_size=8"]),
                     single_process=True)
    V, Hd, d = 49152, 576, cfg.draft
    rank, K = d.refiner_rank, d.block_size
    m = rank * d.refiner_mlp_ratio
    refiner = 2 * V * rank + 2 * Hd * rank + 3 * rank * rank + rank * K * K + 3 * rank * m
    assert r.draft_trainable - dflash.draft_trainable == refiner
    (train,) = r.memory
    assert any(term.name.startswith("XPress loss") for term in train.phases["backward"])
    fewer = dry_run(load_config(configs / "xpress-smollm2-135m-cpu.yaml", ["draft.consistency_passes=1"]),
                    single_process=True)
    assert fewer.memory[0].peak < train.peak


def test_sequence_parallelism_is_refused_in_one_line(assets, tmp_path, capsys):
    from specforge import train as local
    from specforge.cli import run_cli

    capsys.readouterr()
    assert run_cli(lambda: local.main(args(assets, tmp_path / "sp", "parallel.sp_ring=2",
                                           "train.num_workers=2"))) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "XPress has no sequence parallelism" in err[0], err
