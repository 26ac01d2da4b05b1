"""A target larger than one GPU (``model.num_gpus``): the split plan keeps decoder layers whole,
in layer order, balanced, with tied weights together; a target loaded through a device map
captures and generates exactly what the same target on one device does; the GPUs each worker
asks for; bad values refused before anything loads.

No GPU here: the dispatched load is exercised with half the layers offloaded to disk (accelerate
moves them in for each forward, as it moves a layer's inputs between GPUs), so the target really
is spread over two places; the real two-GPU check is marked ``gpu``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specforge.config import load_config
from specforge.models.target import capture, load_target, split_plan

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _meta_config(name: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(**json.loads((CONFIGS / "targets" / name).read_text()))


def _layer_device(device_map: dict, n_layers: int, prefix: str = "model.layers.") -> list[int]:
    return [device_map[f"{prefix}{i}"] for i in range(n_layers)]


def test_plan_of_a_70b_target_over_four_gpus():
    hf = _meta_config("meta-llama--Llama-3.3-70B-Instruct.json")
    device_map, per_gpu = split_plan(hf, 4, torch.bfloat16)
    layers = _layer_device(device_map, 80)
    assert sorted(set(device_map.values())) == [0, 1, 2, 3]
    assert layers == sorted(layers)  # a pipeline in layer order: each hidden state crosses a GPU once
    assert not [k for k in device_map if k.startswith("model.layers.") and k.count(".") > 2]  # never cut
    total = 70_553_706_496 * 2
    assert 0 <= sum(per_gpu.values()) - total < 2**20  # the weights + buffers (RoPE's inv_freq)
    layer = 855_654_400 * 2  # one decoder layer's bytes
    assert max(per_gpu.values()) - min(per_gpu.values()) <= 2 * layer  # balanced to a couple of layers
    assert device_map["model.embed_tokens"] == 0


def test_plan_keeps_tied_weights_together():
    """A tied lm_head stays with the embedding on the first GPU while the final norm is on the last:
    the case where ``head_logits`` must move the hidden state to the lm_head (control: untied, the
    lm_head goes last)."""
    from specforge.targets import tiny

    cfg = tiny.llama()
    cfg.tie_word_embeddings = True
    device_map, _ = split_plan(cfg, 2, torch.float32)
    assert device_map["lm_head"] == device_map["model.embed_tokens"] == 0 and device_map["model.norm"] == 1
    untied = tiny.llama()
    untied.tie_word_embeddings = False
    device_map, _ = split_plan(untied, 2, torch.float32)
    assert device_map["lm_head"] == device_map["model.norm"] == 1


@pytest.fixture
def folder(tmp_path):
    from tests.helpers.targets import overrides, target_folder

    target_folder("llama", tmp_path)
    return load_config(None, overrides(tmp_path))


def _spread(monkeypatch, cfg):
    """load_target with model.num_gpus=2, its plan's second GPU replaced by disk offload."""
    import specforge.models.target as target_mod

    real_plan = target_mod.split_plan

    def plan(hf_config, n, dtype):
        device_map, per = real_plan(hf_config, n, dtype)
        return {k: ("disk" if v == 1 and ".layers." in k else "cpu") for k, v in device_map.items()}, per

    monkeypatch.setattr(target_mod, "target_devices", lambda choice, n: [torch.device("cpu")] * n)
    monkeypatch.setattr(target_mod, "split_plan", plan)
    from dataclasses import replace

    return load_target(replace(cfg.model, num_gpus=2))


def test_a_dispatched_target_captures_and_generates_as_one_device(folder, monkeypatch):
    from specforge.models.generate import SamplingParams, generate

    whole = load_target(folder.model)
    spread = _spread(monkeypatch, folder)
    assert spread.split and not whole.split
    assert "disk" in spread.model.hf_device_map.values()  # really dispatched: half its layers are loaded per forward
    ids = torch.randint(0, whole.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    a, b = capture(whole, ids), capture(spread, ids)
    torch.testing.assert_close(b.aux_hidden_BTKH, a.aux_hidden_BTKH, rtol=0, atol=0)
    torch.testing.assert_close(b.last_hidden_BTH, a.last_hidden_BTH, rtol=0, atol=0)
    assert torch.equal(b.target_ids_BT, a.target_ids_BT)
    torch.testing.assert_close(spread.logits(b.last_hidden_BTH[0]), whole.logits(a.last_hidden_BTH[0]))
    # generation with features kept: a split target runs HF generate + one capture pass
    prompts = [[5, 9, 2, 7], [3, 3, 8]]
    params = SamplingParams(max_new_tokens=6)
    g_whole = generate(whole, prompts, params, stop_ids=set(), capture=True)
    g_spread = generate(spread, prompts, params, stop_ids=set(), capture=True)
    for x, y in zip(g_whole, g_spread):
        assert x.output_ids == y.output_ids
        torch.testing.assert_close(y.features.aux_hidden_BTKH, x.features.aux_hidden_BTKH, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_two_gpus_capture_equals_one(folder):
    from dataclasses import replace

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    one = load_target(replace(folder.model, device="cuda"))
    two = load_target(replace(folder.model, device="cuda", num_gpus=2))
    assert two.split and {d for d in two.model.hf_device_map.values()} == {0, 1}
    ids = torch.randint(0, one.config.vocab_size, (2, 11), device=one.device)
    a, b = capture(one, ids), capture(two, ids)
    assert b.aux_hidden_BTKH.device == two.device == torch.device("cuda", 0)
    torch.testing.assert_close(b.aux_hidden_BTKH, a.aux_hidden_BTKH)
    assert torch.equal(b.target_ids_BT, a.target_ids_BT)


def test_gpus_each_worker_asks_for():
    from specforge.preflight import check_resources, check_workers, needed_resources

    # the shipped config runs the target in vLLM over rollout.tp_size=4 GPUs: 1 rollout x 4 GPUs + 4 train x 1
    assert (needed_resources(load_config(CONFIGS / "llama3.3-70b-instruct.yaml"), use_gpu=True)
            == {"CPU": 5.0, "GPU": 8.0})
    split = ["rollout.backend=hf", "rollout.tp_size=1", "model.num_gpus=4"]  # the same GPUs, split by layers
    cfg = load_config(CONFIGS / "llama3.3-70b-instruct.yaml", split)  # 1 rollout x 4 GPUs + 4 train x 1
    assert needed_resources(cfg, use_gpu=True) == {"CPU": 5.0, "GPU": 8.0}
    assert needed_resources(cfg, use_gpu=False) == {"CPU": 5.0}
    colocated = load_config(CONFIGS / "llama3.3-70b-instruct.yaml", split + ["placement.mode=colocated"])
    assert needed_resources(colocated, use_gpu=True)["GPU"] == 16.0  # each train worker runs the target
    offline = load_config(CONFIGS / "llama3.3-70b-instruct.yaml", split + ["placement.mode=offline"])
    assert needed_resources(offline, use_gpu=True)["GPU"] == 4.0  # no target forward in training
    with pytest.raises(ValueError, match=r"need 8 GPU \(model.num_gpus per worker that runs the target\).* has 7"):
        check_resources(cfg, True, {"CPU": 64.0, "GPU": 7.0}, "the cluster")
    check_resources(cfg, True, {"CPU": 64.0, "GPU": 8.0}, "the cluster")
    # regenerate's Ray tasks each run the target
    with pytest.raises(ValueError, match=r"regenerate.num_workers=2 workers need 4 GPU"):
        check_workers("regenerate.num_workers", 2, True, {"CPU": 8.0, "GPU": 3.0}, "the cluster", gpus=2)


def test_bad_num_gpus_is_refused_before_anything_loads(capsys):
    from specforge.device import cuda_allowed, target_devices
    from specforge.ray_train import main
    from specforge.runtime.loop import check, not_applied

    with pytest.raises(ValueError, match=r"model.num_gpus'=2.*model.device cuda or auto"):
        check(load_config(None, ["model.num_gpus=2", "model.device=cpu"]))
    check(load_config(None, ["model.num_gpus=2"]))  # auto: decided where the workers run
    if not cuda_allowed():  # no CUDA, or the CPU suite forcing the CPU on a machine with CUDA
        with pytest.raises(ValueError, match=r"model.num_gpus'=2: splitting the target over GPUs needs CUDA"):
            target_devices("auto", 2)
    assert target_devices("auto", 1) == [torch.device("cuda", 0) if cuda_allowed() else torch.device("cpu")]
    # the drivers refuse it before preparing data or starting workers (offline runs no target forward)
    from specforge.preflight import check_target_gpus

    for mode in ("colocated", "disaggregated"):
        with pytest.raises(ValueError, match=r"model.num_gpus'=2: .*this run's workers get none"):
            check_target_gpus(load_config(None, ["model.num_gpus=2", f"placement.mode={mode}"]), use_gpu=False)
        check_target_gpus(load_config(None, ["model.num_gpus=2", f"placement.mode={mode}"]), use_gpu=True)
    check_target_gpus(load_config(None, ["model.num_gpus=2", "placement.mode=offline"]), use_gpu=False)
    with pytest.raises(ValueError, match=r"model.num_gpus'=0 must be >= 1"):
        load_config(None, ["model.num_gpus=0"])
    # the key it replaces names its successor
    assert main(["rollout.tp_size=2"]) == 1
    err = capsys.readouterr().err
    assert "rollout.tp_size" in err and "model.num_gpus" in err and err.count("\n") == 1
    assert "model.num_gpus=4" in not_applied(load_config(None, ["placement.mode=offline", "model.num_gpus=4"]),
                                             "offline")


_RSS = """
import sys, torch
from dataclasses import replace
from specforge.config import load_config
from specforge.models.target import load_target, load_tokenizer, resolve_target_path

def anon():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("RssAnon"))

cfg = load_config(None, ["model.dtype=" + sys.argv[1], "model.device=cpu"])
resolve_target_path(cfg.model)  # the converted folder exists before measuring
load_tokenizer(cfg.model)  # imports and the tokenizer (~120 MB) are not the weights
before = anon()
t = load_target(cfg.model, torch.device("cpu"), on_host=True)
w = t.lm_head_weight_VH.float().sum() + t.embed_weight_VH.float().sum()  # what a train worker copies
params = sum(p.numel() * p.element_size() for p in t.model.parameters())
print(anon() - before, params)
"""


@pytest.mark.slow
def test_a_train_worker_keeps_the_target_memory_mapped(tmp_path):
    """``on_host`` (a train worker fed by rollout workers or a store): in the checkpoint's own dtype
    the weights stay memory-mapped, so reading the embedding and lm_head costs their pages, not the
    target's bytes in private memory; a dtype conversion (the control) does cost them. Each load in a
    process of its own, forked from the fork server (torch and transformers already imported: what the
    measure leaves out anyway)."""
    from specforge.forkserver import run_script_in_child

    script = tmp_path / "rss.py"
    script.write_text(_RSS)

    def grown(dtype: str) -> tuple[int, int]:
        log = tmp_path / f"{dtype}.log"
        assert run_script_in_child(str(script), [dtype], str(log)) == 0, log.read_text()[-2000:]
        return tuple(int(x) for x in log.read_text().split()[-2:])

    mapped, params = grown("float32")  # the embedded default's converted folder is float32
    assert mapped < 0.25 * params, (mapped, params)
    converted, half = grown("bfloat16")
    assert converted > 0.6 * half, (converted, half)
