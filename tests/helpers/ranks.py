"""The multi-rank harness: a tiny random draft and batches identical in every process, its
single-process reference, and gloo ranks compared with it (from tests/test_parallel_sp.py, shared
by tests/test_parallel_fsdp.py, tests/test_peagle_sp.py, tests/test_mixed_precision.py,
tests/test_save_memory.py and tests/test_gpu.py).

``run_ranks`` spawns the ranks, which import the rank function's module: this one (or the test
module that defines its own)."""

import math

import torch

from specforge.algorithms.eagle3.algorithm import Eagle3Options
from specforge.algorithms.eagle3.attention import ttt_attention_eager
from specforge.algorithms.eagle3.model import Eagle3Draft, Eagle3DraftConfig
from specforge.config import Config, TrainConfig
from specforge.models.features import TrainBatch
from specforge.parallel.dims import ParallelDims
from specforge.parallel.fsdp import full_state_dict, grads_full
from specforge.parallel.launch import run_ranks
from specforge.parallel.parallelize import parallelize_draft, sum_over_train_ranks
from specforge.registry import bound_algorithm
from specforge.training.slicing import sp_slice_batch
from specforge.training.trainer import DraftTrainer
from tests.helpers.tolerance import assert_grads_close, assert_weights_close

V, N, H, I, T, L, STEPS = 300, 100, 64, 128, 29, 4, 3
SAMPLE_LENGTHS = (T, 21)  # the two samples of every batch of draft_and_batches (row 1 right-padded)
LR = 1e-2
ADAM_EPS = LR  # lr / eps = 1: a step moves a weight at most twice its gradient's gap (tolerance.adamw_tol)
# The longest chain of sums into a gradient entry (tests/helpers/tolerance.py): the 2 x T rows of L
# steps summed into it, and per TTT step, forward and backward, the widest dot products: fc's 3H,
# the projections' H, the MLP's I, the attention's keys (T per step so far) and the softmax's N.
GRAD_TERMS = 2 * T * L + 2 * L * (3 * H + H + I + L * T + N)


def sp_cfg() -> Config:
    return Config(draft=Eagle3Options(ttt_length=L), train=TrainConfig(precision="fp32", lr=LR, warmup_steps=0,
                                                                       max_grad_norm=10.0, adam_eps=ADAM_EPS))


def draft_and_batches(make_draft, mask_token_id=None):
    """``make_draft()`` (built and reset under seed 0), its vocab, a teacher and STEPS batches of 2 x T,
    identical in every process; ``mask_token_id``: also an input token (row 0, position 7)."""
    g = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        draft = make_draft()
        draft.reset_parameters(std=0.1)
    draft.set_vocab(torch.sort(torch.randperm(V, generator=g)[:N]).values - torch.arange(N))
    teacher = torch.randn(N, H, generator=g) * 0.5
    inv = draft.draft_to_target_ids()
    batches = []
    for _ in range(STEPS):
        mask = torch.zeros(2, T, dtype=torch.long)
        mask[0, 3:12] = 1
        mask[0, 15:22] = 1  # nothing counts past row 19: with 4 ranks, rank 3 has no valid rows
        mask[1, 6:20] = 1
        ids = torch.randint(0, V, (2, T), generator=g)
        if mask_token_id is not None:
            ids[0, 7] = mask_token_id  # the mask token as an input: its trained row
        ids[1, SAMPLE_LENGTHS[1] :] = 0  # right padding of row 1
        tgt = torch.where(torch.rand(2, T, generator=g) < 0.8, inv[torch.randint(0, N, (2, T), generator=g)],
                          torch.randint(0, V, (2, T), generator=g))
        batches.append(TrainBatch(ids, mask, torch.randn(2, T, 3 * H, generator=g), torch.randn(2, T, H, generator=g),
                                  tgt))
    return draft, teacher, batches


def setup_sp():
    """EAGLE-3 draft, teacher and STEPS batches, identical in every process."""
    cfg = Eagle3DraftConfig(hidden_size=H, intermediate_size=I, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, vocab_size=V, draft_vocab_size=N)
    return draft_and_batches(lambda: Eagle3Draft(cfg))


def sp_reference(setup=setup_sp, cfg=sp_cfg) -> dict:
    """The single process over ``setup()``'s batches: metrics, gradients after every step, final parameters."""
    draft, teacher, batches = setup()
    c = cfg()
    trainer = DraftTrainer(bound_algorithm(c), draft, teacher, c, torch.device("cpu"))
    out = {"metrics": [], "grads": []}
    for b in batches:
        out["metrics"].append(trainer.step([b]))
        out["grads"].append({k: p.grad.detach().clone() for k, p in draft.named_parameters() if p.grad is not None})
    out["params"] = {k: v.detach().clone() for k, v in draft.state_dict().items()}
    return out


def check_grads(step: int, grads: dict, want: dict, n: int = GRAD_TERMS) -> None:
    assert_grads_close(step, grads, want, n)


def check_params(state: dict, want: dict, grads: list[dict], cfg: Config, n: int = GRAD_TERMS, what="param") -> None:
    """fp32 weights after ``len(grads)`` steps of ``cfg`` whose gradients were ``grads`` (the reference's)."""
    assert_weights_close(state, want, grads, cfg.train.lr, cfg.train.adam_eps, n, what=what)


def _check_ulysses_head_plans(groups):
    """Core level, every rank checks its own rows: kv heads repeated (4q/1kv) and query heads
    padded (3q/1kv, 9q/3kv) over 2 Ulysses ranks, 2 TTT steps, forward and backward."""
    from specforge.algorithms.eagle3.attention import TTTAttentionCore
    from specforge.parallel.sp import UlyssesAttention

    core = UlyssesAttention(TTTAttentionCore("fast"), groups.ulysses_group)
    r = groups.uly_rank
    for Hq, Hkv in ((4, 1), (3, 1), (9, 3)):
        g = torch.Generator().manual_seed(Hq)
        full = [torch.randn(2, h, 14, 8, generator=g, dtype=torch.float64) for h in (Hq, Hkv, Hkv, Hkv, Hkv)]
        w = torch.randn(2, Hq, 14, 8, generator=g, dtype=torch.float64)
        q, k0, v0, k1, v1 = [x.clone().requires_grad_() for x in full]
        (ttt_attention_eager(q, [k0, k1], [v0, v1]) * w).sum().backward()
        rows = slice(r * 7, (r + 1) * 7)
        lq, lk0, lv0, lk1, lv1 = [x[:, :, rows].clone().requires_grad_() for x in full]
        out = core(lq, [lk0, lk1], [lv0, lv1])
        (out * w[:, :, rows]).sum().backward()
        for a, b in ((out, ttt_attention_eager(q, [k0, k1], [v0, v1])[:, :, rows]), (lq.grad, q.grad[:, :, rows]),
                     (lk0.grad, k0.grad[:, :, rows]), (lv1.grad, v1.grad[:, :, rows])):
            assert torch.allclose(a, b, atol=1e-10), (Hq, Hkv, (a - b).abs().max())


def sp_rank(rank, world, dims_tuple, ref_path, packed=False):
    """One train rank of an SP (x DP) run; rank 0 compares with the reference every step.
    ``packed``: each rank's samples of a step laid end to end in ONE row (``train.pack_tokens``),
    sliced over the SP ranks; the reference is the unpacked single process all the same."""
    dims = ParallelDims(*dims_tuple)
    groups = dims.build(list(range(world)), rank, timeout_s=90)
    cfg = sp_cfg()
    draft, teacher, batches = setup_sp()
    if dims_tuple == (1, 2, 1):
        _check_ulysses_head_plans(groups)
    draft = parallelize_draft(draft, dims, groups, cfg.train.precision, bound_algorithm(cfg))
    trainer = DraftTrainer(bound_algorithm(cfg), draft, teacher, cfg, torch.device("cpu"),
                           reduce_sum=sum_over_train_ranks(groups))
    ref = torch.load(ref_path) if rank == 0 else None
    for step, full in enumerate(batches):
        if dims.dp > 1:  # each DP rank takes its share of the samples
            per = full.input_ids_BT.shape[0] // dims.dp
            fields = ("input_ids_BT", "loss_mask_BT", "aux_hidden_BTKH", "last_hidden_BTH", "target_ids_BT")
            full = TrainBatch(*(getattr(full, f)[groups.dp_rank * per : (groups.dp_rank + 1) * per] for f in fields))
        lengths = list(SAMPLE_LENGTHS) if packed else None
        local = [sp_slice_batch(full, groups.sp_rank, groups.sp_size, L + 1, lengths)
                 if groups.sp_size > 1 or packed else full]
        m = trainer.step(local)
        grads = grads_full(draft)  # all-gather of every gradient shard
        if rank == 0:
            rm = ref["metrics"][step]
            for key in ("loss", "acc_0", f"acc_{L - 1}", "tau", "valid_tokens"):
                assert math.isclose(m[key], rm[key], rel_tol=1e-5, abs_tol=1e-6), (step, key, m[key], rm[key])
            assert math.isclose(m["grad_norm"], rm["grad_norm"], rel_tol=1e-4), (m["grad_norm"], rm["grad_norm"])
            check_grads(step, grads, ref["grads"][step])
    state = full_state_dict(draft)
    if rank == 0:
        check_params(state, ref["params"], ref["grads"], cfg)


def run_sp(tmp_path, dims_tuple, rank_fn=sp_rank, setup=setup_sp, cfg=sp_cfg, *extra):
    """The single-process reference of ``setup``/``cfg`` saved, then ``rank_fn(rank, world, dims_tuple,
    ref_path, *extra)`` on the ranks of ``ParallelDims(*dims_tuple)``."""
    ref_path = tmp_path / "ref.pt"
    torch.save(sp_reference(setup, cfg), ref_path)
    run_ranks(rank_fn, ParallelDims(*dims_tuple).world, dims_tuple, str(ref_path), *extra, workdir=tmp_path,
              timeout_s=150)


# ------------------------------------------------ one sample per rank (tests/test_parallel_fsdp.py)

_FIELDS = ("input_ids_BT", "loss_mask_BT", "aux_hidden_BTKH", "last_hidden_BTH", "target_ids_BT")


def sample_rows(b: TrainBatch, i: int) -> TrainBatch:
    """Sample ``i`` of ``b`` as a batch of one."""
    return TrainBatch(*(getattr(b, f)[i : i + 1] for f in _FIELDS))


# ------------------------------------------------ bf16 against fp32 (tests/test_mixed_precision.py)

LOSS_RTOL, GRAD_RTOL, NORM_RTOL = 1e-3, 5e-2, 1e-2


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def fp32_step(samples) -> tuple[dict, dict]:
    draft, teacher, batches = setup_sp()
    cfg = sp_cfg()
    trainer = DraftTrainer(bound_algorithm(cfg), draft, teacher, cfg, torch.device("cpu"))
    m = trainer.step([sample_rows(batches[0], i) for i in samples])
    return m, {k: p.grad.detach().clone() for k, p in draft.named_parameters() if p.grad is not None}
