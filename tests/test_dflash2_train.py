"""DFlash2 through the runtime, single process (``python -m specforge.train``), on the tiny random
Llama target (hidden 48, 297 tokens): chosen by ``draft.algorithm=dflash2``, its loss finite and
falling (a control run at a learning rate that moves nothing stays put), killed after its step-3
checkpoint and run again with the same command (the losses equal the uninterrupted run's), its
checkpoint read back through the registry, evaluated losslessly by ``python -m specforge.eval``,
exported for vLLM by ``python -m specforge.export`` (speculators' DFlash2 format: tests/test_dflash2_export.py)
and refused for SGLang and llama.cpp in one line.
"""

import json

import pytest
import torch

from tests.helpers.ray_run import losses as train_rows
from tests.helpers.single_run import assert_resumed_exactly, assert_training_lowers_the_loss, kill_and_resume, run_args
from tests.helpers.single_run import step_losses as losses

pytestmark = [pytest.mark.timeout(900)]
DFLASH2 = ["draft.algorithm=dflash2", "draft.block_size=4", "draft.num_anchors=6", "draft.num_layers=2",
           "draft.selector_rank=8", "draft.selector_top_k=8"]


def args(assets, out, *extra):
    return run_args(assets, out, DFLASH2, *extra)


def test_train_resume_checkpoint_eval_and_export(assets, tmp_path, monkeypatch, capsys):
    from specforge import eval as spec_eval
    from specforge import export
    from specforge import train as local
    from specforge.algorithms.dflash2.export import check_checkpoint
    from specforge.cli import run_cli
    from specforge.models.target import load_target
    from specforge.registry import algorithm_name, load_draft
    from specforge.training.checkpoint import latest_checkpoint

    straight = tmp_path / "straight"
    assert local.main(args(assets, straight)) == 0
    want = losses(straight)
    first = train_rows(straight)[0]
    assert {"acc_0", "acc_2", "tau", "loss_unary", "loss_selector", "acc_unary", "recall_at_8"} <= set(first)
    assert "acc_3" not in first  # a block of 4 drafts 3 tokens
    assert first["loss"] == pytest.approx(first["loss_unary"] + first["loss_selector"], rel=1e-5)

    killed = tmp_path / "killed"
    assert_resumed_exactly(want, kill_and_resume(args(assets, killed), killed, monkeypatch))

    ckpt = latest_checkpoint(straight / "checkpoints")
    hf = json.loads((ckpt / "config.json").read_text())
    assert hf["architectures"] == ["DFlash2DraftModel"] and algorithm_name(hf) == "dflash2"
    assert (hf["block_size"], hf["conv_kernel_size"], hf["conv_group_size"], hf["selector_rank"],
            hf["selector_top_k"], hf["sample_from_anchor"]) == (4, 2, 16, 8, 8, False)
    check_checkpoint(ckpt)
    from safetensors.torch import load_file

    saved = load_file(ckpt / "model.safetensors")
    target = load_target(_model_cfg(assets), torch.device("cpu"),
                         layers=lambda n: hf["dflash_config"]["target_layer_ids"])
    draft = load_draft(ckpt, target)
    assert type(draft).__name__ == "DFlash2Draft"
    for k, v in draft.export_state_dict().items():
        assert torch.equal(v.to(saved[k].dtype), saved[k]), k
    assert saved["candidate_selector.predecessor_codebook"].shape == (hf["vocab_size"], 8)

    report = tmp_path / "eval.json"
    assert spec_eval.main(["--draft", str(ckpt), "--num-prompts", "2", "--max-new-tokens", "8", "--chain", "3",
                           "--json", str(report), *args(assets, tmp_path / "eval")]) == 0  # raises unless == greedy
    rows = json.loads(report.read_text())["rows"]
    assert [r["setting"] for r in rows] == ["chain 3 fixed"] and rows[0]["new_tokens"] > 0

    capsys.readouterr()
    for engine in ("sglang", "llama.cpp"):
        assert run_cli(lambda: export.main(["--draft", str(ckpt), "--engine", engine, "--out", str(tmp_path / "x"),
                                            "--target", str(assets / "target")])) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "cannot serve DFlash2DraftModel drafts" in err[0], err
        assert "export it for vLLM instead: python -m specforge.export --engine vllm" in err[0], err
    assert not (tmp_path / "x").exists()
    assert export.main(["--draft", str(ckpt), "--engine", "vllm", "--out", str(tmp_path / "x"),
                        "--target", str(assets / "target")]) == 0  # a Llama target: the draft's layers are Qwen3's
    spec = json.loads((tmp_path / "x" / "config.json").read_text())
    assert (spec["speculators_model_type"], spec["aux_hidden_state_layer_ids"]) == (
        "dflash2", [i + 1 for i in hf["dflash_config"]["target_layer_ids"]])
    assert '"method": "dflash"' in capsys.readouterr().out


def _model_cfg(assets):
    from specforge.config import load_config

    return load_config(None, [f"model.target_path={assets / 'target'}", "model.dtype=float32",
                              "model.device=cpu", f"model.cache_dir={assets / 'cache'}"]).model


def test_training_lowers_the_loss(assets, tmp_path):
    """The DFlash2 loss (KL to a random target + the selector's CE) falls over 30 steps; the same run
    at a learning rate that moves nothing (the control) stays where it was."""
    assert_training_lowers_the_loss(lambda out, *extra: args(assets, out, *extra), tmp_path)


def test_the_shipped_cpu_recipe_dry_runs_with_its_parts_in_the_memory_plan():
    """configs/dflash2-smollm2-135m-cpu.yaml: offline from the EAGLE-3 default's store; its draft counts
    DFlash's parameters plus the convolutions (per layer 2 x (2 t H + 2 t G H)) and the selector
    (2 V r + H r), and the memory plan its terms."""
    from pathlib import Path

    from specforge.config import load_config
    from specforge.dryrun import dry_run

    configs = Path(__file__).parent.parent / "configs"
    cfg = load_config(configs / "dflash2-smollm2-135m-cpu.yaml")
    assert (cfg.draft.algorithm, cfg.placement.mode, cfg.store.dir) == ("dflash2", "offline",
                                                                        "runs/smollm2-135m-cpu/features")
    r = dry_run(cfg, single_process=True)
    dflash = dry_run(load_config(configs / "smollm2-135m-dflash-cpu.yaml", ["draft.block_size=8"]),
                     single_process=True)
    V, Hd, d = 49152, 576, cfg.draft
    t, G = d.conv_kernel_size, Hd // d.conv_group_size
    conv = d.num_layers * 2 * (2 * t * Hd + 2 * t * G * Hd)
    assert r.draft_trainable - dflash.draft_trainable == conv + 2 * V * d.selector_rank + Hd * d.selector_rank
    (train,) = r.memory
    assert any(term.name.startswith("DFlash2 loss") for term in train.phases["backward"])
    assert train.peak > dflash.memory[0].peak
