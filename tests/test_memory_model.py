"""The memory model (specforge/memory.py) against a measurement, and the refusal it drives.

* At a tiny shape, for every algorithm (EAGLE-3's TTT unroll, the DFlash family's blocks, MTP's
  steps, ...), the model's peak of a train step is within 20% of the peak the CPU allocator reports
  for the same step (benchmarks/bench_memory.py's method: the profiler's allocation events).
  Control: the dry run's old count (weights + AdamW, no activations) is far outside that tolerance.
* The driver refuses a config whose predicted peak exceeds ``ray.gpu_memory_gib`` with one error
  line naming the device, both figures and the keys to change, before Ray starts; a GPU that holds
  it passes; a DFlash or SP run names its own keys.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from specforge import memory
from specforge.config import load_config
from specforge.registry import get_algorithm

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_memory", ROOT / "benchmarks" / "bench_memory.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


# each algorithm's own keys at the tiny shape: heads of rank 64 (the defaults' 256 would outweigh the
# activations of 96 tokens at H=128, and the control below wants the activations to matter); P-EAGLE's
# mask token set (no tokenizer to resolve it) and 4 parallel tokens
EXTRA = {"dspark": {"markov_rank": 64}, "dflash2": {"selector_rank": 64}, "xpress": {"refiner_rank": 64},
         "peagle": {"mask_token_id": 1999, "parallel_tokens": 4}}


@pytest.mark.parametrize("algo", ["eagle3", "dflash", "dspark", "dflash2", "xpress", "mtp", "eagle31", "peagle"])
def test_model_matches_the_measured_peak(algo):
    """The algorithm's draft from its own ``build_draft`` and its own ``memory_step`` terms (the
    bench goes through the registry, as the dry run does)."""
    bench = _bench()
    case = bench.Case(f"tiny {algo}", algo=algo, B=2, T=96, H=128, I=320, Hq=4, Hkv=2, D=32, V=2000, N=500,
                      ttt=4, anchors=24, block=4, extra=EXTRA.get(algo, {}))
    measured = bench.measure(case)
    dev = bench.predict(case)
    predicted, _ = bench.predicted_peak(dev)
    assert abs(predicted / measured - 1) < 0.20, (predicted, measured)
    # control: a count of fp32 weights + AdamW alone (nothing transient) misses most of it
    weights_and_adam = sum(t.nbytes for t in dev.held if "params" in t.name or "AdamW" in t.name)
    assert weights_and_adam / measured < 0.5, (weights_and_adam, measured)


def test_a_config_that_cannot_fit_is_refused_before_ray_starts(tmp_path, capsys):
    import ray

    from specforge.ray_train import main
    from tests.helpers.targets import overrides, target_folder

    target_folder("llama", tmp_path)
    capsys.readouterr()  # the tiny target's save progress bars
    was = ray.is_initialized()  # the session's cluster may be up (tests/conftest.py): this run starts none
    assert main(overrides(tmp_path) + ["ray.gpu_memory_gib=0.5"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: predicted peak "), err
    assert "GiB on each train GPU" in err[0] and "0.5 GiB available (ray.gpu_memory_gib=0.5)" in err[0]
    assert "train.batch_size" in err[0] and "data.max_length" in err[0]
    assert ray.is_initialized() == was and not (tmp_path / "out" / "checkpoints").exists()


def test_the_check_passes_a_gpu_that_holds_it_and_names_the_device_that_does_not():
    from specforge.dryrun import memory_plan
    from specforge.preflight import check_memory

    cfg = load_config(CONFIGS / "llama3.1-8b-instruct.yaml", ["ray.gpu_memory_gib=80"])
    check_memory(cfg)  # fits an 80 GiB GPU
    small, big = sorted(memory_plan(cfg), key=lambda d: d.peak)
    assert {small.device, big.device} == {"train GPU", "rollout GPU"} and small.peak > 8 * memory.GiB
    between = (small.peak + big.peak) / 2 / memory.GiB  # holds one kind of device, not the other
    with pytest.raises(ValueError, match=rf"on each {big.device} .* exceeds the {between:.1f} GiB available"):
        check_memory(load_config(CONFIGS / "llama3.1-8b-instruct.yaml", [f"ray.gpu_memory_gib={between:.2f}"]))
    with pytest.raises(ValueError, match="must be > 0"):
        check_memory(load_config(None, ["ray.gpu_memory_gib=0"]))


def test_a_cpu_run_is_held_against_this_machines_memory(monkeypatch):
    """No GPU: every process's peak together against MemAvailable (here set to a figure between the
    default's peak and a 64k-token sample's), one line naming the keys, before any worker starts."""
    from specforge.dryrun import memory_plan
    from specforge.preflight import check_memory

    cfg = load_config(CONFIGS / "smollm2-135m-cpu.yaml", [])
    long = load_config(CONFIGS / "smollm2-135m-cpu.yaml", ["data.max_length=65536"])
    small, big = (sum(d.peak * d.count for d in memory_plan(c)) for c in (cfg, long))
    monkeypatch.setattr(memory, "host_available_bytes", lambda: (small + big) // 2)
    check_memory(cfg)
    with pytest.raises(ValueError, match=r"in all \(1 x train process .*\) exceeds the .* GiB this machine has "
                                         r"available; lower train.batch_size, data.max_length, .*draft.sliding_window"):
        check_memory(long)
    monkeypatch.setattr(memory, "host_available_bytes", lambda: None)  # unknown: no check
    check_memory(long)


def test_sequence_parallelism_divides_the_activations():
    """Ulysses over 2 ranks halves the rows each rank computes: the causal-block probabilities (T^2)
    halve too (heads split), the peak drops; the refusal names parallel.sp for EAGLE-3."""
    from specforge.dryrun import memory_plan

    def train(*extra):
        cfg = load_config(CONFIGS / "qwen3-8b.yaml", list(extra))
        return next(d for d in memory_plan(cfg) if d.device.startswith("train"))

    sdpa = "draft.attention=sdpa"  # the core that keeps probabilities (auto is flex on a GPU)
    one, two = train("parallel.sp_ulysses=1", sdpa), train("parallel.sp_ulysses=2", sdpa)
    probs = lambda d: next(t.nbytes for t in d.phases["forward end"] if "probabilities" in t.name)  # noqa: E731
    assert abs(probs(one) / probs(two) - 2) < 0.05
    assert two.peak < one.peak
    with pytest.raises(ValueError, match="parallel.sp_ulysses"):
        memory.check_fits([one], one.peak - 1, "test", load_config(CONFIGS / "qwen3-8b.yaml"), get_algorithm("eagle3"))


def test_frozen_parameters_are_whole_on_every_rank():
    """FSDP2 keeps the frozen embedding whole (ignored_params): more train ranks shrink the trainable
    shard, never the embedding (the dry run once divided both)."""
    from specforge.dryrun import memory_plan

    def held(n):
        dev = memory_plan(load_config(CONFIGS / "gemma-3-27b.yaml", [f"train.num_workers={n}"]))[0]
        return {t.name: t.nbytes for t in dev.held}

    two, six = held(2), held(6)
    # a bf16 run from a bf16 target: the trainer holds the embedding in bf16 (models.layers.hold_frozen_tables)
    frozen = "frozen draft params (full replica on every rank, fp32; the tables bf16)"
    assert two[frozen] == six[frozen] > 2.5 * memory.GiB  # 262k x 5376 bf16
    assert abs(two["draft params (fp32, sharded over 2)"] / six["draft params (fp32, sharded over 6)"] - 3) < 0.01


def test_the_single_process_trainer_refuses_what_cannot_fit_before_loading(tmp_path):
    """python -m specforge.train makes the same check on its own (single-process) plan."""
    from specforge.train import run
    from tests.helpers.targets import overrides, target_folder

    target_folder("llama", tmp_path)
    with pytest.raises(ValueError, match=r"^predicted peak .* GiB on each train GPU .*\(ray\.gpu_memory_gib=0\.01\)"):
        run(load_config(None, overrides(tmp_path) + ["ray.gpu_memory_gib=0.01"]))
    assert not (tmp_path / "out" / "checkpoints").exists()
