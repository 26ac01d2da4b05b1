"""The GPU suite: `bash scripts/test.sh -m gpu` on a machine with CUDA (each test names how many
GPUs it needs and skips with fewer). The CPU suite skips these (tests/conftest.py) and forces the
CPU everywhere else, so it runs unchanged on a GPU machine.

What it checks, each against the CPU/single-process result the CPU suite already pins:
* NCCL p2p, packed and field by field; a CPU tensor handed to an NCCL transfer is refused;
  completion under NCCL (``wait()`` returns at once; ``finish`` sees completion; abort ends it).
* FSDP2's bf16 mixed precision on 2 GPUs against the fp32 step (tests/test_mixed_precision.py's
  tolerances).
* The TTT cores (SDPA and the fast core) against the eager reference, forward and backward.
* Capture on the GPU equals capture on the CPU; gpt-oss's flex-attention capture equals eager.
* A disaggregated run (1 rollout + 2 train GPUs) against the single process; a killed rollout
  worker under NCCL is replaced and nothing is lost.
Results go to benchmarks/README.md ("GPU suite") whenever a GPU machine is at hand.
"""

import time

import pytest
import torch
import torch.distributed as dist

from specforge.contracts import FeatureSpec, SampleRef
from specforge.parallel.launch import run_ranks
from specforge.registry import bound_algorithm
from specforge.runtime.dataplane import P2PTransport, synthetic_features
from specforge.runtime.plan import plan_step
from tests.helpers.ray_run import losses, make_cfg

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]
SPEC = FeatureSpec.hidden_states(hidden_size=64, hidden_dtype="bfloat16")


def need_gpus(n: int) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA devices")


# ------------------------------------------------------------------------------- data plane


def _plan():
    # sample 0 is large enough to go field by field under pack="auto" (over PACK_BELOW_BYTES)
    return plan_step(0, [[SampleRef(0, 9000)], [SampleRef(1, 9)]], [0], [[1], [2]], SPEC)


def _p2p(rank, world, pack):
    from specforge.device import pick_device

    here = pick_device("auto", rank)
    transport, plan = P2PTransport(device=here, pack=pack), _plan()
    lengths = dict(plan.lengths)
    if rank == 0:
        feats = {sid: {k: v.to(here) for k, v in synthetic_features(SPEC, sid, lengths[sid]).items()}
                 for sid in plan.batch_of(0)}
        if pack == "auto":  # the negative control: a CPU field on an NCCL transfer is refused, named
            bad = {sid: {**f, "input_ids": f["input_ids"].cpu()} for sid, f in feats.items()}
            with pytest.raises(ValueError, match=r"field 'input_ids' is on cpu, the data plane's communicator on cuda"):
                transport.send_step(plan, bad)
        transport.send_step(plan, feats).wait()
        torch.cuda.synchronize(here)
        return
    got = transport.post_recv(plan).wait()
    torch.cuda.synchronize(here)
    for sid, fb in got.items():
        want = synthetic_features(SPEC, sid, lengths[sid])
        for name in SPEC.names:
            assert fb[name].device == here
            assert torch.equal(fb[name].cpu(), want[name][fb.start : fb.stop]), (sid, name)


@pytest.mark.parametrize("pack", [True, False, "auto"])
def test_nccl_p2p_delivers_exactly_what_was_sent(tmp_path, pack):
    need_gpus(3)
    run_ranks(_p2p, 3, pack, workdir=tmp_path, backend="nccl", timeout_s=300)


def _nccl_completion(rank, world):
    from specforge.device import pick_device
    from specforge.runtime.completion import Completion, PeerLost

    here = pick_device("auto", rank)
    if rank == 0:
        time.sleep(2.0)
        dist.send(torch.arange(1.0, 5.0, device=here), dst=1)
        dist.send(torch.arange(1.0, 5.0, device=here), dst=1)  # for the aborted receive, so the group ends cleanly
        return
    c = Completion(stream=True, timeout_s=60)
    buf = torch.zeros(4, device=here)
    works = c.post([dist.P2POp(dist.irecv, buf, peer=0)])
    t0 = time.monotonic()
    for w in works:
        w.wait()
    assert time.monotonic() - t0 < 1.0, "NCCL's wait blocked the CPU: the emulation's premise is wrong"
    c.finish(works, "recv")
    assert torch.equal(buf.cpu(), torch.arange(1.0, 5.0))
    buf2 = torch.zeros(4, device=here)
    works = c.post([dist.P2POp(dist.irecv, buf2, peer=0)])
    c.abort("test abort")
    with pytest.raises(PeerLost, match="test abort"):
        c.finish(works, "recv 2")
    time.sleep(3.0)


def test_nccl_completion_semantics_are_what_the_emulation_models(tmp_path):
    need_gpus(2)
    run_ranks(_nccl_completion, 2, workdir=tmp_path, backend="nccl", timeout_s=120)


# ------------------------------------------------------------------------- mixed precision


def _bf16_rank_gpu(rank, world, ref_path):
    import math

    from specforge.device import pick_device
    from specforge.parallel.dims import ParallelDims
    from specforge.parallel.fsdp import apply_fsdp, bf16_mp_policy, grads_full
    from specforge.parallel.parallelize import sum_over_train_ranks
    from specforge.training.trainer import DraftTrainer
    from tests.helpers.ranks import GRAD_RTOL, LOSS_RTOL, NORM_RTOL, rel_error, sample_rows, setup_sp, sp_cfg

    here = pick_device("auto", rank)
    groups = ParallelDims(dp=2).build([0, 1], rank, "nccl", 90, here)
    cfg = sp_cfg()
    cfg.train.precision = "bf16"
    draft, teacher, batches = setup_sp()
    draft.to(here)
    apply_fsdp(draft, groups.fsdp_mesh, mp_policy=bf16_mp_policy())  # what parallelize_draft does on CUDA
    trainer = DraftTrainer(bound_algorithm(cfg), draft, teacher.to(here), cfg, here,
                           reduce_sum=sum_over_train_ranks(groups))
    m = trainer.step([sample_rows(batches[0], rank)])
    grads = {k: g.cpu() for k, g in grads_full(draft).items()}
    if rank != 0:
        return
    ref, ref_grads, _ = torch.load(ref_path)
    assert math.isclose(m["loss"], ref["loss"], rel_tol=LOSS_RTOL), (m["loss"], ref["loss"])
    assert math.isclose(m["grad_norm"], ref["grad_norm"], rel_tol=NORM_RTOL)
    errors = {k: rel_error(grads[k], g) for k, g in ref_grads.items()}
    assert max(errors.values()) < GRAD_RTOL, errors


def test_bf16_fsdp_on_gpus_matches_fp32_within_tolerance(tmp_path):
    """The bf16 FSDP2 policy on 2 GPUs over NCCL against the single-process fp32 step on the CPU,
    with tests/test_mixed_precision.py's tolerances (loss 1e-3, grad norm 1e-2, per-tensor grads 5e-2)."""
    from tests.helpers.ranks import fp32_step

    need_gpus(2)
    ref, ref_grads = fp32_step([0, 1])
    _, alone = fp32_step([0])
    torch.save((ref, ref_grads, alone), tmp_path / "ref.pt")
    run_ranks(_bf16_rank_gpu, 2, str(tmp_path / "ref.pt"), workdir=tmp_path, backend="nccl", timeout_s=300)


# ----------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("impl", ["sdpa", "fast", "flex"])
@pytest.mark.parametrize("num_keys", [1, 3])
def test_ttt_cores_match_eager_on_gpu(impl, num_keys):
    """fp32 forward and backward within 1e-4 (TF32 off); bf16 within 2e-2 of the fp32 reference."""
    from specforge.algorithms.eagle3.attention import IMPLS, ttt_attention_eager

    need_gpus(1)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    B, Hq, Hkv, T, D = 2, 8, 2, 257, 64
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        torch.manual_seed(0)
        q = torch.randn(B, Hq, T, D, device="cuda").to(dtype).requires_grad_()
        ks = [torch.randn(B, Hkv, T, D, device="cuda").to(dtype).requires_grad_() for _ in range(num_keys)]
        vs = [torch.randn(B, Hkv, T, D, device="cuda").to(dtype).requires_grad_() for _ in range(num_keys)]
        out = IMPLS[impl](q, ks, vs)
        ref = ttt_attention_eager(q.float(), [k.float() for k in ks], [v.float() for v in vs])
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
        grad = torch.randn_like(ref)
        got = torch.autograd.grad(out.float(), [q, *ks, *vs], grad)
        want = torch.autograd.grad(ref, [q, *ks, *vs], grad)
        for g, w in zip(got, want):
            torch.testing.assert_close(g.float(), w.float(), atol=5 * tol,
                                       rtol=5 * tol)  # bf16 leaves: bf16 grads on both sides


def test_capture_on_gpu_equals_cpu():
    from specforge.algorithms.eagle3.algorithm import aux_layer_ids
    from specforge.config import ModelConfig
    from specforge.models.target import TargetModel, capture
    from tests.helpers.models import tiny_target

    need_gpus(1)
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_target()
    layers = aux_layer_ids(ModelConfig(), model.config.num_hidden_layers)
    ids = torch.randint(0, 320, (2, 33))
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0
    cpu = capture(TargetModel(model=model, tokenizer=None, aux_layer_ids=layers, device=torch.device("cpu")), ids, mask)
    gpu_model = tiny_target().cuda()
    gpu = capture(TargetModel(model=gpu_model, tokenizer=None, aux_layer_ids=layers, device=torch.device("cuda", 0)),
                  ids.cuda(), mask.cuda())
    torch.testing.assert_close(gpu.aux_hidden_BTKH.cpu(), cpu.aux_hidden_BTKH, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(gpu.last_hidden_BTH.cpu(), cpu.last_hidden_BTH, atol=1e-4, rtol=1e-4)
    assert (gpu.target_ids_BT.cpu() == cpu.target_ids_BT).float().mean() > 0.99  # argmax ties may differ


def test_gpt_oss_captures_with_flex_attention_as_eager_does():
    """gpt-oss has no SDPA; on CUDA the capture uses flex attention (``capture_attention``), which
    must give eager's features (bf16-free: fp32, 1e-4)."""
    from transformers import GptOssForCausalLM

    from specforge.models.target import TargetModel, capture
    from specforge.targets import tiny

    need_gpus(1)
    torch.backends.cuda.matmul.allow_tf32 = False
    feats = {}
    for impl in ("eager", "flex_attention"):
        torch.manual_seed(0)
        model = GptOssForCausalLM._from_config(tiny.gpt_oss(), attn_implementation=impl).cuda().eval()
        ids = torch.randint(3, 256, (2, 40), device="cuda")
        feats[impl] = capture(TargetModel(model=model, tokenizer=None, aux_layer_ids=[1, 2, 3],
                                          device=torch.device("cuda", 0)), ids, torch.ones_like(ids))
    torch.testing.assert_close(feats["flex_attention"].aux_hidden_BTKH, feats["eager"].aux_hidden_BTKH, atol=1e-4,
                               rtol=1e-4)
    torch.testing.assert_close(feats["flex_attention"].last_hidden_BTH, feats["eager"].last_hidden_BTH, atol=1e-4,
                               rtol=1e-4)


# ------------------------------------------------------------------------------- runs on Ray


def test_disaggregated_on_gpus_matches_single_process(assets, ray_session, tmp_path):
    """1 rollout + 2 train GPUs over NCCL against one process on one GPU (fp32 everywhere, TF32
    off: losses within 1e-3 relative; GPU reductions are not bit-exact across layouts)."""
    from specforge.ray_train import fit
    from specforge.train import run

    need_gpus(3)
    gpu = ["model.device=cuda", "parallel.backend=auto"]
    run(make_cfg(assets, tmp_path / "single", *gpu, "train.grad_accum=2", "train.num_workers=1"))
    fit(make_cfg(assets, tmp_path / "disagg", *gpu, "placement.mode=disaggregated", "rollout.num_workers=1"))
    ref, got = losses(tmp_path / "single"), losses(tmp_path / "disagg")
    assert [r["step"] for r in got] == [r["step"] for r in ref] and ref
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3), a["step"]


def test_killed_rollout_worker_is_replaced_under_nccl(assets, ray_session, tmp_path, monkeypatch):
    """The failure test of the CPU suite (tests/test_failures.py) on GPUs with real NCCL: the
    driver's peer_lost ends the train ranks' pending receives; the run recovers before
    parallel.timeout_s and every step is trained once."""
    from dataclasses import replace

    import specforge.ray_train as rt
    from tests.helpers.failures import STEPS, failure_cfg, killing

    need_gpus(3)
    causes, real_recover = [], rt.recover
    monkeypatch.setattr(rt, "recover", lambda cfg, data, use_gpu, err, cluster: (
        causes.append(str(err)), real_recover(cfg, data, use_gpu, err, cluster)))
    cfg = failure_cfg(assets, tmp_path / "killed")
    cfg = replace(cfg, model=replace(cfg.model, device="cuda"), parallel=replace(cfg.parallel, backend="auto"))
    with killing("rollout", 0, after_step=1):
        rt.fit(cfg)
    assert len(causes) == 1 and "not completed within" not in causes[0], causes
    assert [r["step"] for r in losses(tmp_path / "killed")] == list(range(1, STEPS + 1))
