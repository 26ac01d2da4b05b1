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
    "llama3.1-8b-instruct.yaml": ("meta-llama/Llama-3.1-8B-Instruct", 8.03e9, "disaggregated"),
    "qwen3-8b.yaml": ("Qwen/Qwen3-8B", 8.19e9, "colocated"),
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
    was = ray.is_initialized()  # the session's cluster may be up (tests/conftest.py): the dry run starts none
    assert main(["--config", str(CONFIGS / name), "--dry-run"]) == 0
    assert ray.is_initialized() == was
    out = capsys.readouterr().out
    params, size, nbytes = _printed(out, r"config\.json: .*" + re.escape(hub_id.replace("/", "--")) + r"\.json")
    assert size == 2 and nbytes == params * 2  # bf16, as model.dtype names
    assert abs(params - published) / published < 0.01, params
    assert f"placement {placement}" in out

    cfg = load_config(CONFIGS / name)
    r = dry_run(cfg)
    assert (r.target_params, r.target_bytes) == (params, nbytes)
    # FSDP2 shards the trainable params (fp32 weights + grad + AdamW m, v); the frozen embedding is
    # ignored_params: whole on every rank (fp32, as the draft is built)
    frozen = 4 * (r.draft_params - r.draft_trainable)
    shard = -(-((MASTER_BYTES + OPTIMIZER_BYTES) * r.draft_trainable) // cfg.train.num_workers) + frozen
    hidden = text_config(read_target_config(cfg)[0]).hidden_size
    assert r.state_bytes == cfg.draft.vocab_size * hidden * 4  # EAGLE-3's teacher rows, fp32
    if placement == "disaggregated":
        assert r.workers == {"rollout": cfg.rollout.num_workers, "train": cfg.train.num_workers}
        assert r.per_device == {"rollout": nbytes, "train": shard + r.state_bytes}
    else:
        assert r.per_device == {"train": nbytes + shard + r.state_bytes}
    dp = cfg.train.num_workers // (cfg.parallel.sp_ulysses * cfg.parallel.sp_ring)
    assert r.global_batch == cfg.train.batch_size * cfg.train.grad_accum * dp
    assert r.feature_bytes_per_step == r.global_batch * cfg.data.max_length * r.feature_bytes_per_token
    assert f"{r.per_device['train']:,} bytes" in out
    # the peak of every device: the weights plus what a step adds, with a verdict against an 80 GB GPU
    train = next(d for d in r.memory if d.device == "train GPU")
    assert train.peak > r.per_device["train"] and train.count == cfg.train.num_workers
    assert re.search(r"train GPU \(x\d+\): peak [\d.]+ GiB at '[a-z -]+': fits in 79\.6 GiB of an 80 GB H100", out)


def test_the_frozen_embedding_is_counted_whole_on_every_train_rank():
    """Gemma-3-27B's draft holds a frozen copy of the 262k x 5376 embedding (5.25 GiB in fp32) on every
    train rank (FSDP2 ignored_params); dividing it by the 6 train workers, as the dry run once did,
    printed 3.3 GiB per train GPU for weights + AdamW."""
    cfg = load_config(CONFIGS / "gemma-3-27b.yaml")
    r = dry_run(cfg)
    embedding = 262208 * 5376 * 4
    assert r.draft_params - r.draft_trainable == 262208 * 5376
    assert r.per_device["train"] > embedding + r.state_bytes  # the old formula gave ~3.3 GiB: below the embedding
    old = (-(-(MASTER_BYTES * r.draft_params + OPTIMIZER_BYTES * r.draft_trainable) // cfg.train.num_workers)
           + r.state_bytes)
    assert old < embedding < r.per_device["train"]
    assert 7.0 * 2**30 < r.per_device["train"] < 8.5 * 2**30  # ~7.7 GiB: embedding + shard + teacher rows


@pytest.mark.parametrize("name", ["qwen3_moe", "gemma3"])
def test_dry_run_counts_equal_the_loaded_models(name, tmp_path, capsys):
    """On a real target folder (a tiny random model) the counts are those of the models a run loads."""
    from specforge.data.vocab import DraftVocab
    from specforge.models.target import load_target
    from specforge.registry import get_algorithm
    from specforge.train import main
    from tests.helpers.targets import overrides, target_folder

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
    draft = get_algorithm("eagle3").bind(cfg).build_draft(target, vocab)
    assert r.draft_params == sum(p.numel() for p in draft.parameters())
    assert r.draft_trainable == sum(p.numel() for p in draft.parameters() if p.requires_grad)
    assert r.draft_frozen == [n for n, p in draft.named_parameters() if not p.requires_grad] == ["embed_tokens.weight"]


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


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_shipped_config_dry_runs(name, capsys):
    """A config in configs/ that its own dry run refuses is a broken example (a removed key, a
    placement it cannot run): each one plans here without network or GPUs."""
    from specforge.ray_train import main

    assert main(["--config", str(CONFIGS / name), "--dry-run"]) == 0, capsys.readouterr().err
    assert "placement" in capsys.readouterr().out


def test_a_target_over_several_gpus_is_planned_per_gpu(capsys):
    """llama3.3-70b: 141 GB of bf16 weights, one rollout worker over model.num_gpus=4 GPUs; the dry
    run prints each GPU's share from the same plan the load uses."""
    from specforge.models.target import split_plan
    from specforge.ray_train import main

    cfg = load_config(CONFIGS / "llama3.3-70b-instruct.yaml", HF_SPLIT)
    assert cfg.model.num_gpus == 4
    r = dry_run(cfg)
    hf = read_target_config(cfg)[0]
    shares = list(split_plan(hf, 4, torch.bfloat16)[1].values())
    assert r.target_split == shares and len(shares) == 4
    assert abs(r.target_params - 70.6e9) / 70.6e9 < 0.01
    assert r.per_device["rollout"] == max(shares) < 0.3 * r.target_bytes  # no GPU holds more than its share
    assert max(shares) < 80e9 < r.target_bytes  # why it is split: one 80 GB GPU cannot hold it
    out = capsys.readouterr().out
    assert "the target over model.num_gpus=4 GPUs of each rollout worker" in out
    assert f"per rollout device (fullest): {max(shares):,} bytes" in out
    # colocated: a train worker's first GPU also holds the draft shard; one GPU (no split) holds it all
    co = dry_run(load_config(CONFIGS / "llama3.3-70b-instruct.yaml", HF_SPLIT + ["placement.mode=colocated"]))
    assert co.per_device["train"] >= shares[0] + r.per_device["train"]
    whole = dry_run(load_config(CONFIGS / "llama3.3-70b-instruct.yaml", HF_SPLIT[:2] + ["model.num_gpus=1"]))
    assert whole.target_split == [] and whole.per_device["rollout"] == whole.target_bytes
    capsys.readouterr()
    assert main(["--config", str(CONFIGS / "llama3.3-70b-instruct.yaml"), "--dry-run", *HF_SPLIT[:2],
                 "model.num_gpus=2"]) == 0
    assert "model.num_gpus=2 GPUs" in capsys.readouterr().out


# the shipped 70B config runs its target in vLLM; these keys split it by layers in our process instead
HF_SPLIT = ["rollout.backend=hf", "rollout.tp_size=1", "model.num_gpus=4"]


@pytest.mark.parametrize("name, tp, params, fp8", [
    ("llama3.3-70b-instruct.yaml", 4, 70.6e9, False),
    ("qwen3-235b-a22b.yaml", 8, 235e9, False),
    ("deepseek-v3.yaml", 8, 671e9, True),
])
def test_a_target_in_vllm_is_planned_per_tensor_parallel_gpu(name, tp, params, fp8, capsys):
    """rollout.backend=vllm: a rollout worker gets rollout.tp_size GPUs, each holding 1/tp of the
    weights as vLLM loads them (DeepSeek-V3: its FP8 as shipped, not dequantized) inside the engine's
    share of the GPU; the plan fits the GPU the config names (or an 80 GB H100)."""
    from specforge import memory
    from specforge.preflight import gpus_per_worker

    cfg = load_config(CONFIGS / name)
    assert cfg.rollout.backend == "vllm" and cfg.rollout.tp_size == tp and cfg.model.num_gpus == 1
    assert gpus_per_worker(cfg, "rollout") == tp and gpus_per_worker(cfg, "train") == 1
    r = dry_run(cfg)
    assert abs(r.target_params - params) / params < 0.02
    loaded = r.shipped_bytes if fp8 else r.target_bytes
    if fp8:
        assert r.quantized and r.shipped_bytes < 0.55 * r.target_bytes  # one byte a weight, not two
    assert r.per_device["rollout"] == -(-loaded // tp)
    rollout = next(d for d in r.memory if d.device.startswith("rollout"))
    held = {t.name: t.nbytes for t in rollout.held}
    assert held[f"vLLM engine: target weights / rollout.tp_size={tp}"] == -(-loaded // tp)
    share = cfg.rollout.vllm_gpu_memory_utilization * (r.available or memory.H100_80GB)
    assert sum(v for k, v in held.items() if k.startswith("vLLM engine")) == pytest.approx(share, abs=1)
    assert rollout.peak <= (r.available or memory.H100_80GB)
    out = capsys.readouterr().out
    assert f"tensor parallel over rollout.tp_size={tp} GPUs" in out and "DOES NOT FIT" not in out
    # the engine's start gets the config's setup bound (deepseek-v3: 3600 s), not a fixed 600 s
    assert (f"the engine's start (weights loaded, compiled) may take {cfg.parallel.setup_timeout_s:g} s "
            "(parallel.setup_timeout_s") in out
    # negative control: the same engine share with less room beside it is refused
    tight = dry_run(load_config(CONFIGS / name, ["rollout.vllm_gpu_memory_utilization=0.99"]))
    assert any(d.peak > (tight.available or memory.H100_80GB) for d in tight.memory)


def test_a_quantized_checkpoint_is_also_counted_as_shipped(capsys):
    """gpt-oss ships its experts in mxfp4: as shipped ~13.8 GB (the published checkpoint's size),
    dequantized 41.8 GB (what the per-device rows count: the upper bound)."""
    from specforge.dryrun import meta_models, quantized_as_shipped

    cfg = load_config(CONFIGS / "gpt-oss-20b.yaml")
    r = dry_run(cfg)
    assert r.quantized == "mxfp4" and 13.0e9 < r.shipped_bytes < 14.5e9 < r.target_bytes
    assert f"{r.shipped_bytes:,} bytes" in capsys.readouterr().out
    hf = read_target_config(cfg)[0]
    model = meta_models(cfg, hf, torch.bfloat16)[0].model
    # the checkpoint's modules_to_not_convert are read: without them attention is counted quantized too
    hf.quantization_config = {"quant_method": "mxfp4"}
    assert quantized_as_shipped(model, hf)[1] < r.shipped_bytes
    hf.quantization_config = {"quant_method": "awq"}
    assert quantized_as_shipped(model, hf) == ("awq", None)  # an unknown method: named, not estimated
    del hf.quantization_config
    assert quantized_as_shipped(model, hf) == (None, None)
    assert dry_run(load_config(CONFIGS / "qwen3-30b-a3b.yaml")).quantized is None
