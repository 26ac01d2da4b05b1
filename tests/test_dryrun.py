"""``--dry-run``: the shipped GPU configs are planned from their target's config.json alone (the
published copies in configs/targets/: no network here), on the meta device, without Ray; the
printed bytes are the parameters times the dtype's size, and on a real (tiny) target folder the
dry run's counts equal the loaded models'."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from specforge.config import load_config
from specforge.dryrun import MASTER_BYTES, OPTIMIZER_BYTES, dry_run, read_target_config, shipped_config
from specforge.targets import text_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# config -> (target hub id, published total parameters, placement)
GPU = {
    "qwen3-30b-a3b.yaml": ("Qwen/Qwen3-30B-A3B", 30.5e9, "disaggregated"),
    "gpt-oss-20b.yaml": ("openai/gpt-oss-20b", 20.9e9, "colocated"),
    "gemma-3-27b.yaml": ("google/gemma-3-27b-it", 27.4e9, "disaggregated"),
}


def _printed(out: str, what: str) -> tuple[int, int, int]:
    m = re.search(rf"{what}\n\s+([\d,]+) parameters x (\d) B \(bfloat16\) = ([\d,]+) bytes", out)
    assert m, out
    return tuple(int(g.replace(",", "")) for g in m.groups())


@pytest.mark.parametrize("name", sorted(GPU))
def test_gpu_config_dry_run(name, capsys):
    import ray

    from specforge.ray_train import main

    hub_id, published, placement = GPU[name]
    assert shipped_config(hub_id) is not None
    assert main(["--config", str(CONFIGS / name), "--dry-run"]) == 0
    assert not ray.is_initialized()
    out = capsys.readouterr().out
    params, size, nbytes = _printed(out, r"config\.json: .*" + re.escape(hub_id.replace("/", "--")) + r"\.json")
    assert size == 2 and nbytes == params * 2  # bf16, as model.dtype names
    assert abs(params - published) / published < 0.01, params
    assert f"placement {placement}" in out

    cfg = load_config(CONFIGS / name)
    r = dry_run(cfg)
    assert (r.target_params, r.target_bytes) == (params, nbytes)
    shard = -(-(MASTER_BYTES * r.draft_params + OPTIMIZER_BYTES * r.draft_trainable) // cfg.train.num_workers)
    hidden = text_config(read_target_config(cfg)[0]).hidden_size
    assert r.state_bytes == cfg.draft.vocab_size * hidden * 4  # EAGLE-3's teacher rows, fp32
    if placement == "disaggregated":
        assert r.workers == {"rollout": cfg.rollout.num_workers, "train": cfg.train.num_workers}
        assert r.per_device == {"rollout": nbytes, "train": shard + r.state_bytes}
    else:
        assert r.per_device == {"train": nbytes + shard + r.state_bytes}
    assert r.global_batch == cfg.train.batch_size * cfg.train.num_workers
    assert r.feature_bytes_per_step == r.global_batch * cfg.data.max_length * r.feature_bytes_per_token
    assert f"{r.per_device['train']:,} bytes" in out


@pytest.mark.parametrize("name", ["qwen3_moe", "gemma3"])
def test_dry_run_counts_equal_the_loaded_models(name, tmp_path, capsys):
    """On a real target folder (a tiny random model) the counts are those of the models a run loads."""
    from specforge.algorithms import get_algorithm
    from specforge.data.vocab import DraftVocab
    from specforge.local import main
    from specforge.models.target import load_target
    from tests.test_targets_train import overrides, target_folder

    target_folder(name, tmp_path)
    args = overrides(tmp_path) + ["placement.mode=colocated", "model.dtype=bfloat16"]
    assert main(["--dry-run", *args]) == 0
    out = capsys.readouterr().out
    assert "single process (colocated)" in out and not (tmp_path / "out").exists()
    cfg = load_config(None, args)
    r = dry_run(cfg, single_process=True)
    target = load_target(cfg.model, torch.device("cpu"))
    assert r.target_params == sum(p.numel() for p in target.model.parameters())
    assert r.target_bytes == 2 * r.target_params and r.target_dtype == "bfloat16"
    V = target.config.vocab_size
    vocab = DraftVocab(torch.zeros(cfg.draft.vocab_size, dtype=torch.long), torch.zeros(V, dtype=torch.bool))
    draft = get_algorithm("eagle3").build_draft(cfg, target, vocab)
    assert r.draft_params == sum(p.numel() for p in draft.parameters())
    assert r.draft_trainable == sum(p.numel() for p in draft.parameters() if p.requires_grad)


def test_dry_run_flags_are_checked(tmp_path, capsys):
    from specforge.ray_train import main

    assert main(["--config", str(CONFIGS / "qwen3-30b-a3b.yaml"), "--target-config", "x.json"]) != 0
    assert "--target-config is only read with --dry-run" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{not json")
    assert main(["--config", str(CONFIGS / "qwen3-30b-a3b.yaml"), "--dry-run",
                 "--target-config", str(tmp_path / "bad.json")]) != 0
    assert "is not a target config.json" in capsys.readouterr().err
    # another target's config.json on purpose: the plan follows it
    assert main(["--config", str(CONFIGS / "qwen3-30b-a3b.yaml"), "--dry-run",
                 "--target-config", str(CONFIGS / "targets" / "openai--gpt-oss-20b.json")]) == 0
    assert "gpt_oss (GptOssForCausalLM)" in capsys.readouterr().out
