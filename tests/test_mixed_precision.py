"""Mixed precision: the GPU's bf16 FSDP2 policy run on CPU ranks (gloo) against fp32; fp16 refused.

``parallelize_draft`` applies ``bf16_mp_policy`` (bf16 params and compute, fp32 gradient
reduce-scatter) on CUDA when the run computes in bf16; here the same ``apply_fsdp`` call runs on 2
gloo ranks with the trainer's bf16 autocast, one sample per rank, and is compared after one step
with the single-process fp32 trainer on both samples.

Tolerances (measured on this test's draft: loss 4.8e-5, grad norm 2.7e-3, worst per-tensor
gradient 1.9e-2, the same as single-process bf16 autocast without FSDP):
* loss: relative 1e-3. The soft cross-entropy's statistics stay fp32; only the matmuls round to
  bf16 (unit roundoff 2^-8 = 3.9e-3 per product, averaged over many rows and terms).
* gradients: relative L2 error per tensor 5e-2, grad norm 1e-2. The backward runs in bf16
  through a 4-step TTT unroll, each step adding rounding of the activations it reuses; the norm
  and attention weights' gradients (sums of many rounded products) are the worst.
Control: the fp32 gradient of one sample alone (the rank's share, as if the other rank's
reduction were lost) is far outside the gradient tolerance.
"""

import math

import pytest
import torch

from specforge.config import Config, TrainConfig, load_config
from specforge.parallel.launch import run_ranks
from specforge.parallel.parallelize import mixed_precision
from specforge.registry import bound_algorithm
from specforge.training.trainer import DraftTrainer
from tests.helpers.ranks import GRAD_RTOL, LOSS_RTOL, NORM_RTOL, fp32_step, rel_error, sample_rows, setup_sp, sp_cfg


def _bf16_rank(rank, world, ref_path):
    from specforge.parallel.dims import ParallelDims
    from specforge.parallel.fsdp import apply_fsdp, bf16_mp_policy, grads_full
    from specforge.parallel.parallelize import sum_over_train_ranks

    groups = ParallelDims(dp=2).build([0, 1], rank, timeout_s=90)
    cfg = sp_cfg()
    cfg.train.precision = "bf16"
    draft, teacher, batches = setup_sp()
    apply_fsdp(draft, groups.fsdp_mesh, mp_policy=bf16_mp_policy())  # what parallelize_draft does on CUDA
    seen = []
    draft.register_forward_pre_hook(lambda m, _: seen.append(m.midlayer.self_attn.q_proj.weight.dtype))  # after FSDP's
    trainer = DraftTrainer(bound_algorithm(cfg), draft, teacher, cfg, torch.device("cpu"),
                           reduce_sum=sum_over_train_ranks(groups))
    m = trainer.step([sample_rows(batches[0], rank)])
    grads = grads_full(draft)  # collective
    assert seen and set(seen) == {torch.bfloat16}, seen  # the policy's unsharded params are bf16 in the forward
    assert {p.dtype for p in draft.parameters()} == {torch.float32}  # fp32 master weights and optimizer
    assert {p.grad.dtype for p in draft.parameters() if p.grad is not None} == {torch.float32}  # fp32 reduction
    if rank != 0:
        return
    ref, ref_grads, alone = torch.load(ref_path)
    assert m["valid_tokens"] == ref["valid_tokens"]
    assert math.isclose(m["loss"], ref["loss"], rel_tol=LOSS_RTOL), (m["loss"], ref["loss"])
    assert m["loss"] != ref["loss"]  # bf16 did run (an fp32 path would agree to ~1e-7)
    assert math.isclose(m["grad_norm"], ref["grad_norm"], rel_tol=NORM_RTOL), (m["grad_norm"], ref["grad_norm"])
    assert grads.keys() == ref_grads.keys()
    errors = {k: rel_error(grads[k], g) for k, g in ref_grads.items()}
    assert max(errors.values()) < GRAD_RTOL, errors
    # control: a rank's own share of the gradient is rejected by the same tolerance
    assert min(rel_error(alone[k], g) for k, g in ref_grads.items()) > GRAD_RTOL


@pytest.mark.timeout(240)
def test_bf16_fsdp_policy_matches_fp32_within_tolerance(tmp_path):
    ref, ref_grads = fp32_step([0, 1])
    _, alone = fp32_step([0])
    torch.save((ref, ref_grads, alone), tmp_path / "ref.pt")
    run_ranks(_bf16_rank, 2, str(tmp_path / "ref.pt"), workdir=tmp_path, timeout_s=150)


def test_the_policy_is_chosen_for_bf16_on_gpus_only():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")  # device objects only: no GPU needed
    policy = mixed_precision("bf16", cuda)
    assert isinstance(policy, MixedPrecisionPolicy)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert mixed_precision("fp32", cuda) is None and mixed_precision("bf16", cpu) is None


def test_fp16_is_refused_before_workers_start(capsys):
    from specforge.ray_train import main

    with pytest.raises(ValueError, match=r"'train.precision'='fp16'.*use 'bf16'"):
        load_config(None, ["train.precision=fp16"])
    assert main(["train.precision=fp16"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: config key 'train.precision'") and "'bf16'" in err[0], err
    # a Config built in code (not validated) is refused by the trainer too
    draft, teacher, _ = setup_sp()
    with pytest.raises(ValueError, match="train.precision"):
        cfg = Config(train=TrainConfig(precision="fp16"))
        DraftTrainer(bound_algorithm(cfg), draft, teacher, cfg, torch.device("cpu"))
