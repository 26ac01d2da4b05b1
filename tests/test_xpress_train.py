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

import pytest
import torch

from tests.helpers.ray_run import losses as train_rows
from tests.helpers.single_run import assert_resumed_exactly, assert_training_lowers_the_loss, kill_and_resume, run_args
from tests.helpers.single_run import step_losses as losses

pytestmark = [pytest.mark.timeout(900)]
XPRESS = ["draft.algorithm=xpress", "draft.block_size=4", "draft.num_anchors=6", "draft.num_layers=2",
          "draft.refiner_rank=8", "draft.jacobi_passes=2", "draft.consistency_passes=2"]


def args(assets, out, *extra):
    return run_args(assets, out, XPRESS, *extra)


def test_train_resume_checkpoint_eval_and_export(assets, tmp_path, monkeypatch, capsys):
    from specforge import eval as spec_eval
    from specforge import export
    from specforge import train as local
    from specforge.algorithms.xpress.export import check_checkpoint
    from specforge.cli import run_cli
    from specforge.models.target import load_target
    from specforge.registry import algorithm_name, load_draft
    from specforge.training.checkpoint import latest_checkpoint

    straight = tmp_path / "straight"
    assert local.main(args(assets, straight)) == 0
    want = losses(straight)
    first = train_rows(straight)[0]
    assert {"acc_0", "acc_2", "tau", "loss_tf", "loss_consistency", "loss_anchor", "acc_base"} <= set(first)
    assert "acc_3" not in first  # a block of 4 drafts 3 tokens
    assert first["loss"] == pytest.approx(first["loss_tf"] + 0.3 * first["loss_consistency"] +
                                          0.6 * first["loss_anchor"], rel=1e-5)

    killed = tmp_path / "killed"
    assert_resumed_exactly(want, kill_and_resume(args(assets, killed), killed, monkeypatch))

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
    assert_training_lowers_the_loss(lambda out, *extra: args(assets, out, *extra), tmp_path)


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
