"""The GPU suite on ONE GPU: every entry point, each algorithm (part of ``bash scripts/test.sh -m gpu``).

One CPU device cannot show a device mismatch, and kernels and multi-GPU runs alone do not run the
entry points: a run can stop at step 1 on a GPU although every CPU test passes. Here, on one CUDA
device, with a bf16 target and the GPU precision policy (``train.precision=auto``):

* per algorithm (EAGLE-3, EAGLE-3.1, P-EAGLE, DFlash, DSpark, DFlash2, XPress, MTP): ``python -m
  specforge.train`` for 6 steps; the same run killed after its step-3 checkpoint and run again, whose
  losses equal the uninterrupted run's; ``python -m specforge.eval`` on the checkpoint (it raises
  unless every output equals greedy decoding); ``python -m specforge.export`` for SGLang and vLLM
  where the algorithm serves there (llama.cpp's GGUF conversion reads only the saved files: the CPU
  suite covers it), each engine it does not serve refused in one line, and the GPU-written
  checkpoint loaded on the CPU;
* capture on the GPU equals capture on the CPU for four families (a dense Llama, an MoE, gpt-oss,
  Gemma-3 with sliding windows);
* ``python -m specforge.capture`` into a store, then offline training from it, on the GPU;
* the memory model against ``torch.cuda.max_memory_allocated`` at a non-trivial size, per algorithm
  (within 10%);
* where Ray is installed: a colocated Ray run with one train worker on the GPU, against the single process.

``SPECFORGE_GPU_REHEARSAL=cpu bash scripts/test.sh -m gpu -k test_gpu_entry`` runs the same tests on the
CPU (the memory comparison, which needs CUDA's allocator, is skipped there): a check of the suite
itself on a machine without a GPU. No test needs the network; Ray and llama.cpp are optional.
"""

import copy
import json
import os

import pytest
import torch

from specforge.registry import get_algorithm
from tests.helpers.data import write_tiny_assets
from tests.helpers.single_run import STEPS, assert_resumed_exactly, kill_and_resume, run_args
from tests.helpers.single_run import step_losses as losses

pytestmark = [pytest.mark.gpu, pytest.mark.rehearsal, pytest.mark.timeout(600)]
DEVICE = "cpu" if os.environ.get("SPECFORGE_GPU_REHEARSAL") == "cpu" else "cuda"

ALGORITHMS = {
    "eagle3": ["draft.vocab_size=64", "draft.ttt_length=3"],
    "eagle31": ["draft.vocab_size=64", "draft.ttt_length=3"],
    "peagle": ["draft.vocab_size=64", "draft.parallel_tokens=4"],
    "dflash": ["draft.block_size=4", "draft.num_anchors=6", "draft.num_layers=1"],
    "dspark": ["draft.block_size=4", "draft.num_anchors=6", "draft.num_layers=1", "draft.markov_rank=8"],
    "dflash2": ["draft.block_size=4", "draft.num_anchors=6", "draft.num_layers=1", "draft.selector_rank=8",
                "draft.selector_top_k=8"],
    "xpress": ["draft.block_size=4", "draft.num_anchors=6", "draft.num_layers=1", "draft.refiner_rank=8",
               "draft.jacobi_passes=2", "draft.consistency_passes=2"],
    "mtp": ["draft.num_speculative_steps=3"],
}
# The engines ``python -m specforge.export`` serves each algorithm's drafts for (every other one is refused in a
# line): each algorithm's ``engines``. DFlash2: vLLM (speculators' DFlash2 format); XPress, MTP: none here yet
# (tests/test_xpress_export.py checks why).
ENGINES = {
    "eagle3": ("sglang", "vllm", "llama.cpp"), "eagle31": ("sglang", "vllm", "llama.cpp"), "peagle": ("vllm",),
    "dflash": ("sglang", "vllm", "llama.cpp"), "dspark": ("llama.cpp", "vllm"), "dflash2": ("vllm",), "xpress": (),
    "mtp": (),
}


def need_device():
    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    write_tiny_assets(root := tmp_path_factory.mktemp("gpu-assets"))
    return root


def overrides(assets, out, algorithm, *extra):
    """The tiny run on ``DEVICE`` with the GPU's policy: a bf16 target, ``train.precision=auto``."""
    return run_args(assets, out, [f"draft.algorithm={algorithm}", *ALGORITHMS[algorithm]], *extra, device=DEVICE,
                    dtype="bfloat16", precision="auto", threads=2, timeout_s=120)


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_train_resume_eval_export_on_one_device(assets, tmp_path, monkeypatch, capsys, algorithm):
    from specforge import eval as spec_eval
    from specforge import export
    from specforge import train as local
    from specforge.cli import run_cli
    from specforge.models.target import TargetModel
    from specforge.registry import load_draft
    from specforge.training.checkpoint import latest_checkpoint

    need_device()
    straight = tmp_path / "straight"
    assert local.main(overrides(assets, straight, algorithm)) == 0
    want = losses(straight)
    assert sorted(want) == list(range(1, STEPS + 1)) and all(v == v for v in want.values()), want

    killed = tmp_path / "killed"
    assert_resumed_exactly(want, kill_and_resume(overrides(assets, killed, algorithm), killed, monkeypatch))

    ckpt = latest_checkpoint(straight / "checkpoints")
    report = tmp_path / "eval.json"
    assert spec_eval.main(["--draft", str(ckpt), "--num-prompts", "2", "--max-new-tokens", "8", "--json", str(report),
                           *overrides(assets, tmp_path / "eval", algorithm)]) == 0  # raises unless outputs == greedy
    assert json.loads(report.read_text())["rows"], "the eval wrote no row"

    algo = get_algorithm(algorithm)
    assert algo.engines == ENGINES[algorithm]
    for engine in algo.engines:
        if (algorithm, engine) == ("eagle31", "sglang"):  # refused by design: SGLang ignores EAGLE-3.1's norms
            continue
        if engine == "llama.cpp":
            continue  # a GGUF conversion reads the saved files alone, whatever device wrote them: the CPU
            # suite converts and serves it (tests/test_engine_llamacpp.py); the GPU machine has no llama.cpp build
        out = tmp_path / f"export-{engine}"
        assert export.main(["--draft", str(ckpt), "--engine", engine, "--out", str(out),
                            "--target", str(assets / "target")]) == 0
        assert any(out.iterdir())
    capsys.readouterr()
    for engine in sorted({"sglang", "vllm", "llama.cpp"} - set(algo.engines)):  # refused before anything loads
        refused = ["--draft", str(ckpt), "--engine", engine, "--out", str(tmp_path / f"refused-{engine}"),
                   "--target", str(assets / "target")]
        assert run_cli(lambda: export.main(refused)) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--engine {engine}: " in err[0] and " cannot serve " in err[0], err
    # the GPU-written checkpoint loads on a machine with the CPU only (its tensors come back on the host)
    from transformers import AutoModelForCausalLM

    target = TargetModel(model=AutoModelForCausalLM.from_pretrained(assets / "target"), tokenizer=None,
                         aux_layer_ids=[1, 2, 3], device=torch.device("cpu"))
    draft = load_draft(str(ckpt), target)
    assert {p.device.type for p in draft.parameters()} == {"cpu"}


# ---------------------------------------------------------------------------- capture


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "gpt_oss", "gemma3_text"])
def test_capture_on_the_device_equals_the_cpus(family):
    from specforge.models.target import TargetModel, capture
    from tests.helpers.targets import build_family

    need_device()
    if DEVICE == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    cpu = build_family(family)
    model = copy.deepcopy(cpu.model).to(DEVICE)
    here = TargetModel(model=model, tokenizer=None, aux_layer_ids=cpu.aux_layer_ids, device=torch.device(DEVICE))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (2, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 27:] = 0  # a padded row
    want = capture(cpu, ids, mask)
    got = capture(here, ids.to(DEVICE), mask.to(DEVICE))
    keep = mask.bool()
    for name in ("aux_hidden_BTKH", "last_hidden_BTH"):
        a, b = getattr(got, name).cpu()[keep], getattr(want, name)[keep]
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{family} {n}: {m}")
    assert (got.target_ids_BT.cpu()[keep] == want.target_ids_BT[keep]).float().mean() > 0.98  # argmax ties


def test_capture_into_a_store_then_offline_training_on_the_device(assets, tmp_path):
    from specforge import capture
    from specforge import train as local
    from specforge.data.store import FeatureStore

    need_device()
    store = tmp_path / "features"
    args = overrides(assets, tmp_path / "offline", "eagle3", "placement.mode=offline", f"store.dir={store}",
                     "train.max_steps=4", "checkpoint.every_steps=0")
    assert capture.main(["--no-progress", *args]) == 0
    assert len(FeatureStore(store)) > 0
    assert local.main(args) == 0
    got = losses(tmp_path / "offline")
    assert sorted(got) == [1, 2, 3, 4] and all(v == v for v in got.values())


def test_the_target_in_vllm_on_the_device(tmp_path):
    """rollout.backend=vllm on the device: the engine's features of a tiny bf16 target equal our
    transformers forward's on the same device within bf16 rounding (argmax ties aside), and a
    single-process online run of 3 steps trains on them. Heads 32 wide (vLLM's CPU attention has no
    16-wide kernel, for the rehearsal). Skipped where vLLM is not installed (scripts/install_vllm.sh)."""
    from specforge import train as local
    from specforge.config import load_config
    from specforge.models.target import capture, load_target
    from specforge.models.vllm_engine import engine_factory, engine_python
    from specforge.training.batch import collate

    need_device()
    try:
        engine_python(None)
    except ValueError as err:
        pytest.skip(str(err))
    write_tiny_assets(tmp_path, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    args = overrides(tmp_path, tmp_path / "online", "eagle3", "rollout.backend=vllm",
                     "rollout.vllm_args=[--enforce-eager]", "placement.mode=colocated",
                     "train.max_steps=3", "checkpoint.every_steps=0", "checkpoint.resume=false")
    cfg = load_config(None, args)
    layers = [1, 2, 4]
    hf = load_target(cfg.model, torch.device(DEVICE), layers=lambda n: layers)
    eng = load_target(cfg.model, torch.device(DEVICE), layers=lambda n: layers, engine_for=engine_factory(cfg))
    try:
        g = torch.Generator().manual_seed(0)
        rows = [{"input_ids": torch.randint(3, 60, (n,), generator=g).tolist(), "loss_mask": [1] * n} for n in (40, 17)]
        ids, _, attn = collate(rows, 0)
        ids, attn = ids.to(DEVICE), attn.to(DEVICE)
        want, got = capture(hf, ids, attn), capture(eng, ids, attn)
    finally:
        eng.engine.close()
    keep = attn.bool().cpu()
    for name in ("aux_hidden_BTKH", "last_hidden_BTH"):  # per token: max error / max value (bf16: 0.2-2%)
        a, b = getattr(got, name).float().cpu()[keep], getattr(want, name).float().cpu()[keep]
        rel = (a - b).flatten(1).abs().amax(1) / b.flatten(1).abs().amax(1)
        assert rel.max() < 0.05, (name, rel.max())
    assert (got.target_ids_BT.cpu()[keep] == want.target_ids_BT.cpu()[keep]).float().mean() > 0.9
    del hf
    assert local.main(args) == 0
    got_losses = losses(tmp_path / "online")
    assert sorted(got_losses) == [1, 2, 3] and all(v == v for v in got_losses.values())


def test_two_engines_each_on_its_own_gpus(tmp_path, monkeypatch):
    """Where two or more GPUs are lent and vLLM is installed: two engines started as two launcher ranks start
    them (``LOCAL_RANK`` 0 and 1, tensor parallel 1, every GPU visible to both, as under torchrun or Ray's
    NOSET) land each on its rank's GPU: while both run, each of GPU 0 and GPU 1 has lost at least the memory
    one engine takes, and each engine's features equal our transformers forward on its own GPU. Engines that
    inherited this process' environment as it is (before ``started_spec`` named their GPUs) would both take
    GPU 0, and GPU 1 would lose nothing: the memory check fails then (``tests/test_vllm_start.py`` checks the
    environments themselves on the CPU, with that control). Unverified until a machine with two GPUs and vLLM
    runs it: the GPUs lent so far (one H100 or H200) skip it."""
    from specforge.config import load_config
    from specforge.models.target import capture, load_target
    from specforge.models.vllm_engine import engine_factory, engine_python
    from specforge.training.batch import collate

    need_device()
    if DEVICE != "cuda" or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    try:
        engine_python(None)
    except ValueError as err:
        pytest.skip(str(err))
    write_tiny_assets(tmp_path, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    cfg = load_config(None, overrides(tmp_path, tmp_path / "two", "eagle3", "rollout.backend=vllm",
                                      "rollout.vllm_args=[--enforce-eager]", "rollout.vllm_gpu_memory_utilization=0.2"))
    layers = [1, 2, 4]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    free_before = [torch.cuda.mem_get_info(i)[0] for i in (0, 1)]
    engines = []
    try:
        for rank in (0, 1):
            monkeypatch.setenv("LOCAL_RANK", str(rank))
            engines.append(load_target(cfg.model, torch.device("cuda", rank), layers=lambda n: layers,
                                       engine_for=engine_factory(cfg)))
        taken = [free_before[i] - torch.cuda.mem_get_info(i)[0] for i in (0, 1)]
        one = 0.2 * torch.cuda.get_device_properties(0).total_memory * 0.5  # half an engine's share, at least
        assert all(t > one for t in taken), [f"{t / 2**30:.1f} GiB" for t in taken]
        g = torch.Generator().manual_seed(0)
        rows = [{"input_ids": torch.randint(3, 60, (n,), generator=g).tolist(), "loss_mask": [1] * n} for n in (40, 17)]
        ids, _, attn = collate(rows, 0)
        for rank, eng in enumerate(engines):
            dev = torch.device("cuda", rank)
            hf = load_target(cfg.model, dev, layers=lambda n: layers)
            want, got = capture(hf, ids.to(dev), attn.to(dev)), capture(eng, ids.to(dev), attn.to(dev))
            keep = attn.bool()
            a, b = got.last_hidden_BTH.float().cpu()[keep], want.last_hidden_BTH.float().cpu()[keep]
            assert ((a - b).abs().amax(1) / b.abs().amax(1)).max() < 0.05, rank
            del hf
    finally:
        for eng in engines:
            eng.engine.close()


# ----------------------------------------------------------------------- the memory model

H, V, N, T = 1024, 32000, 8000, 2048  # a draft of a 1B-class target; the features of one 2k-token sample


def _shapes(algorithm):
    if algorithm in ("eagle3", "eagle31"):
        return [f"draft.vocab_size={N}", "draft.ttt_length=7"]
    if algorithm == "peagle":
        return [f"draft.vocab_size={N}", "draft.parallel_tokens=8"]
    if algorithm == "mtp":  # one layer shaped as the target's, three teacher-forced steps (speculators' default)
        return ["draft.num_speculative_steps=3"]
    # DFlash2 and XPress: their defaults otherwise (selector rank 256, top 16; refiner rank 256, 3 passes)
    return ["draft.block_size=16", "draft.num_anchors=32", "draft.num_layers=2", f"draft.mask_token_id={V - 1}"] + (
        ["draft.markov_rank=64"] if algorithm == "dspark" else [])


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_memory_model_within_ten_percent_of_the_measured_peak(algorithm):
    from transformers import LlamaConfig, LlamaForCausalLM

    from specforge import memory
    from specforge.config import load_config
    from specforge.data.vocab import DraftVocab
    from specforge.dryrun import _state_tensors
    from specforge.models.features import TrainBatch
    from specforge.models.target import TargetModel
    from specforge.training.trainer import DraftTrainer

    need_device()
    dev = torch.device(DEVICE)
    cfg = load_config(None, [f"draft.algorithm={algorithm}", *_shapes(algorithm), f"data.max_length={T}",
                             "train.batch_size=1", "train.precision=auto", f"model.device={DEVICE}"])
    algo = get_algorithm(algorithm).bind(cfg)
    torch.manual_seed(0)
    lc = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=4 * H, num_hidden_layers=4, num_attention_heads=16,
                     num_key_value_heads=4, max_position_embeddings=2 * T)
    target = TargetModel(model=LlamaForCausalLM(lc).to(torch.bfloat16).eval(), tokenizer=None,
                         aux_layer_ids=algo.feature_layers(4), device=torch.device("cpu"))
    n = min(algo.draft_vocab_size(V), V)
    vocab = DraftVocab(torch.zeros(n, dtype=torch.long), torch.arange(V) < n)
    draft = algo.build_draft(target, vocab).to(dev)
    state = algo.train_state(target, vocab)
    trainer = DraftTrainer(algo, draft, state, cfg, dev)
    del target
    K = len(algo.feature_layers(4))
    g = torch.Generator().manual_seed(1)

    def batch():
        ids = torch.randint(0, n, (1, T), generator=g)
        return TrainBatch(ids, torch.ones(1, T, dtype=torch.long),
                          torch.randn(1, T, K * H, generator=g).to(torch.bfloat16),
                          torch.randn(1, T, H, generator=g).to(torch.bfloat16), ids.clone()).to(dev)

    trainer.step([batch()])  # the first step makes AdamW's state
    b = batch()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    trainer.step([b])
    p = memory.StepPrecision(compute=2 if trainer.amp_dtype is not None else 4, world=1)
    s = memory.SeqShape(1, T, 1, 1, max(algo.sp_halo() - 1, 0))
    features = T * (K * H * 2 + H * 2 + 3 * 8)  # bf16 features, int64 ids / mask / argmax
    state_bytes = sum(t.numel() * 4 for t in _state_tensors(state))  # the trainer holds it in fp32
    step = algo.memory_step(draft, s, p, DEVICE == "cuda")
    dm = memory.train_device("train", 1, memory.DraftParams.of(draft), p, step, state_bytes, features)
    phase = max((k for k in dm.phases if k != "checkpoint save"), key=dm.phase_bytes)
    predicted = dm.held_bytes + dm.phase_bytes(phase)
    if DEVICE != "cuda":
        pytest.skip(f"predicted {predicted / 2**20:.0f} MiB ({phase}); the measured peak needs CUDA's allocator")
    measured = torch.cuda.max_memory_allocated()
    assert 0.9 <= predicted / measured <= 1.1, (algorithm, phase, predicted / 2**20, measured / 2**20)


# ------------------------------------------------------------------------------- Ray


@pytest.mark.ray
def test_colocated_ray_run_with_one_train_worker_on_the_device(assets, tmp_path):
    pytest.importorskip("ray", minversion="2.40",  # a stand-in ray (.gpu-bench/raystub) has no version
                        reason="Ray is not installed: the single-process tests above still ran")
    from specforge import train as local
    from specforge.config import load_config
    from specforge.ray_train import fit

    need_device()
    single = overrides(assets, tmp_path / "single", "eagle3", "checkpoint.resume=false", "checkpoint.every_steps=0",
                       "train.max_steps=3")
    assert local.main(single) == 0
    colocated = overrides(assets, tmp_path / "ray", "eagle3", "checkpoint.resume=false", "checkpoint.every_steps=0",
                          "train.max_steps=3", "placement.mode=colocated", "train.num_workers=1",
                          "parallel.backend=auto", "ray.num_cpus=4", "ray.temp_dir=/tmp/sfgpu")
    fit(load_config(None, colocated))
    want, got = losses(tmp_path / "single"), losses(tmp_path / "ray")
    assert sorted(got) == sorted(want) == [1, 2, 3]
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-4), step
