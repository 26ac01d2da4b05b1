"""MTP through the runtime, single process (``python -m specforge.train``), on the tiny random Llama
target (hidden 48, 297 tokens): chosen by ``draft.algorithm=mtp``, its loss finite and falling (a control
run at a learning rate that moves nothing stays put), killed after its step-3 checkpoint and run again
with the same command (the losses equal the uninterrupted run's), its checkpoint read back through the
registry, evaluated losslessly by ``python -m specforge.eval`` (through its proposer), exported for vLLM
(speculators' ``MTPDraftModel`` loads the export, its frozen parts from the target) and refused for
SGLang and llama.cpp in one line each.
"""

import json

import pytest
import torch

from tests.helpers.ray_run import losses as train_rows
from tests.helpers.single_run import assert_resumed_exactly, assert_training_lowers_the_loss, kill_and_resume, run_args
from tests.helpers.single_run import step_losses as losses

pytestmark = [pytest.mark.timeout(900)]
MTP = ["draft.algorithm=mtp", "draft.num_speculative_steps=3", "draft.step_weight_beta=0.6"]


def args(assets, out, *extra):
    return run_args(assets, out, MTP, *extra)


def test_train_resume_checkpoint_eval_and_export(assets, tmp_path, monkeypatch, capsys):
    from specforge import eval as spec_eval
    from specforge import export
    from specforge import train as local
    from specforge.cli import run_cli
    from specforge.registry import algorithm_name
    from specforge.training.checkpoint import latest_checkpoint

    straight = tmp_path / "straight"
    assert local.main(args(assets, straight)) == 0
    want = losses(straight)
    first = train_rows(straight)[0]
    assert {"acc_0", "acc_2", "loss_0", "loss_2", "tau"} <= set(first) and "acc_3" not in first
    w = [0.6 ** k / (1 + 0.6 + 0.36) for k in range(3)]
    assert first["loss"] == pytest.approx(sum(wk * first[f"loss_{k}"] for k, wk in enumerate(w)), rel=1e-5)

    killed = tmp_path / "killed"
    assert_resumed_exactly(want, kill_and_resume(args(assets, killed), killed, monkeypatch))

    ckpt = latest_checkpoint(straight / "checkpoints")
    hf = json.loads((ckpt / "config.json").read_text())
    assert hf["architectures"] == ["MTPDraftModel"] and algorithm_name(hf) == "mtp"
    assert hf["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3

    report = tmp_path / "eval.json"
    assert spec_eval.main(["--draft", str(ckpt), "--num-prompts", "2", "--max-new-tokens", "8", "--chain", "3",
                           "--json", str(report), *args(assets, tmp_path / "eval")]) == 0  # raises unless == greedy
    rows = json.loads(report.read_text())["rows"]
    assert [r["setting"] for r in rows] == ["chain 3 fixed"] and rows[0]["new_tokens"] > 0
    # the folder says which target layer it reads (the last), so an EAGLE-3 run's config evaluates it too
    from specforge.compat import draft_aux_ids

    layers = json.loads((assets / "target" / "config.json").read_text())["num_hidden_layers"]
    assert draft_aux_ids(hf) == [layers - 1]
    eagle = [a for a in args(assets, tmp_path / "eval-eagle") if a not in MTP]
    assert spec_eval.main(["--draft", str(ckpt), "--num-prompts", "2", "--max-new-tokens", "8", "--chain", "3",
                           *eagle]) == 0

    capsys.readouterr()
    for engine in ("sglang", "llama.cpp", "vllm"):  # vLLM 0.32 reads no mtp speculators folder
        assert run_cli(lambda: export.main(["--draft", str(ckpt), "--engine", engine, "--out", str(tmp_path / "x"),
                                            "--target", str(assets / "target")])) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--engine {engine}: " in err[0], err
        assert "cannot serve MTPDraftModel drafts (" in err[0], err
    assert "not mtp" in err[0]
    from specforge.algorithms.mtp.export import export as write_speculators
    from specforge.export import resolve_target
    from specforge.seam import ExportRequest

    out = tmp_path / "speculators"
    target, target_config = resolve_target(str(assets / "target"))
    assert "from_pretrained" in write_speculators("vllm", ckpt, out, ExportRequest(out, target, target_config))
    _speculators_loads(out, ckpt, assets)


def _speculators_loads(out, ckpt, assets):
    """speculators' own loader reads the vLLM export (the verifier named in it: the target's folder) and
    computes the logits of our draft loaded from the checkpoint."""
    from loguru import logger
    from speculators.models.mtp import MTPDraftModel

    from specforge.models.target import load_target
    from specforge.registry import load_draft

    logger.disable("speculators")
    model = MTPDraftModel.from_pretrained(str(out), dtype=torch.float32).eval()  # the verifier parts unrounded
    target = load_target(_model_cfg(assets), torch.device("cpu"), layers=lambda n: [n - 1])
    draft = load_draft(ckpt, target)
    assert type(draft).__name__ == "MTPDraft"
    g = torch.Generator().manual_seed(0)
    hidden, ids = torch.randn(1, 16, 48, generator=g), torch.randint(0, 297, (1, 16), generator=g)
    with torch.no_grad():
        theirs = model(input_ids=ids, hidden_states=hidden)[0]
        ours = [draft.logits(o[:, :12]) for o in draft(hidden, ids)]
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # the same (bf16-saved) weights, fp32 compute


def _model_cfg(assets):
    from specforge.config import load_config

    return load_config(None, [f"model.target_path={assets / 'target'}", "model.dtype=float32",
                              "model.device=cpu", f"model.cache_dir={assets / 'cache'}"]).model


def test_training_lowers_the_loss(assets, tmp_path):
    """The MTP loss falls over 30 steps; the same run at a learning rate that moves nothing stays put."""
    assert_training_lowers_the_loss(lambda out, *extra: args(assets, out, *extra), tmp_path)


def test_the_shipped_cpu_recipe_dry_runs_with_its_parts_in_the_memory_plan():
    """configs/mtp-smollm2-135m-cpu.yaml: offline from its own store (the last layer); its draft counts one
    Qwen3 layer plus input_proj (2 H x H) and four norms, and the memory plan its terms."""
    from pathlib import Path

    from specforge.config import load_config
    from specforge.dryrun import dry_run

    cfg = load_config(Path(__file__).parent.parent / "configs" / "mtp-smollm2-135m-cpu.yaml")
    assert (cfg.draft.algorithm, cfg.placement.mode, cfg.store.dir) == ("mtp", "offline",
                                                                        "runs/mtp-smollm2-135m-cpu/features")
    r = dry_run(cfg, single_process=True)
    Hd, I, q, kv = 576, 1536, 576, 192
    layer = 2 * Hd * q + 2 * Hd * kv + 3 * Hd * I + 2 * Hd + 2 * 64
    assert r.draft_trainable == layer + 2 * Hd * Hd + 3 * Hd
    (train,) = r.memory
    assert any(term.name.startswith("activations: 3 MTP steps") for term in train.phases["backward"])
    steps1 = dry_run(load_config(Path(__file__).parent.parent / "configs" / "mtp-smollm2-135m-cpu.yaml",
                                 ["draft.num_speculative_steps=1"]), single_process=True)
    assert train.peak > steps1.memory[0].peak
