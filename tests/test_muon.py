"""``train.optimizer=muon`` (``specforge/training/optim.py``): which parameters Muon takes, our Muon against
``torch.optim.Muon`` (bit for bit with the iterations in bf16, torch's dtype), the one optimizer against
Muon and AdamW run apart, exact resume, the schedule over both groups, the memory model, and two FSDP2
ranks (gloo) against one process.

The multi-rank tolerance: Muon's Newton-Schulz iterations (fp32 on a CPU: ``optim.ns_dtype``) have a
slope of 3.4445 at 0, so over 5 iterations they multiply an error in a small singular direction up to
~490 times: a worst-case bound from the dtype alone would admit anything. Instead each matrix's tolerance
is fp32's own error on that matrix, measured: the fp32 orthogonalization of the same momentum (at three
scales) against the fp64 one. The ranks' update lies within 3 times it of the one process's (1.45-2.0
times here: both runs carry that error, and their gradients' fp32 difference passes the same slope);
the control, each rank's half of the matrix orthogonalized alone, lies 1e5 times it away.
"""

import copy
import math

import pytest
import torch

from specforge.config import TrainConfig, load_config
from specforge.parallel.launch import run_ranks
from specforge.training import optim
from specforge.training.optim import Muon, MuonAdamW, build_optimizer, muon_params, orthogonalize

LR = 1e-2


def _model():
    torch.manual_seed(0)
    m = torch.nn.Sequential()
    m.add_module("embed_tokens", torch.nn.Embedding(50, 16))
    m.add_module("fc", torch.nn.Linear(24, 16))
    m.add_module("up", torch.nn.Linear(16, 32, bias=False))
    m.add_module("norm", torch.nn.LayerNorm(32))
    m.add_module("lm_head", torch.nn.Linear(32, 50, bias=False))
    return m


def _grads(model, seed):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def test_muon_takes_the_hidden_matrices():
    """Hidden 2-D matrices (fc, attention, MLP, a low-rank head's inner maps) go to Muon; token tables,
    vocabulary heads and factors (DSpark's markov, DFlash2's codebooks, XPress's readout), vectors (norms,
    biases, a [1, n] projection) and frozen weights stay with AdamW."""
    from tests.helpers.ttt import tiny_draft

    d = tiny_draft()
    d.embed_tokens.weight.requires_grad_(False)
    for name in ("markov_w1", "successor_codebook", "readout", "inner"):
        d.register_parameter(name, torch.nn.Parameter(torch.randn(50, 8)))
    d.register_parameter("proj", torch.nn.Parameter(torch.randn(1, 40)))
    muon, adamw = muon_params(d.named_parameters())
    ids = {id(p) for p in muon}
    names = {n for n, p in d.named_parameters() if id(p) in ids}
    assert names == {"fc.weight", "inner", *(f"midlayer.{m}.weight" for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj"))}
    assert len(muon) + len(adamw) == sum(p.requires_grad for p in d.parameters())


MUON_KW = dict(weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5, adjust_lr_fn="match_rms_adamw")


def test_our_muon_is_torchs_with_its_iterations_in_bf16(monkeypatch):
    """With the iterations in bf16 (torch's dtype; ours on a GPU), three steps of ``optim.Muon`` equal
    ``torch.optim.Muon``'s bit for bit, state included; on a CPU they run in fp32 (``ns_dtype``), which
    moves the weights otherwise (the control) but within fp32's spread of an fp64 orthogonalization."""
    assert optim.ns_dtype(torch.device("cpu")) == torch.float32
    assert optim.ns_dtype(torch.device("cuda", 0)) == torch.bfloat16
    monkeypatch.setattr(optim, "ns_dtype", lambda device: torch.bfloat16)
    a, b, c = _model(), _model(), _model()
    ours = Muon(muon_params(a.named_parameters())[0], lr=LR, **MUON_KW)
    theirs = torch.optim.Muon(muon_params(b.named_parameters())[0], lr=LR, **MUON_KW)
    for step in range(3):
        _grads(a, step)
        _grads(b, step)
        ours.step()
        theirs.step()
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert all(torch.equal(ours.state[x]["momentum_buffer"], theirs.state[y]["momentum_buffer"])
               for x, y in zip(muon_params(a.named_parameters())[0], muon_params(b.named_parameters())[0]))
    monkeypatch.undo()
    fp32 = Muon(muon_params(c.named_parameters())[0], lr=LR, **MUON_KW)
    for step in range(3):
        _grads(c, step)
        fp32.step()
    assert not torch.equal(c.fc.weight, b.fc.weight)
    m = torch.randn(24, 16, generator=torch.Generator().manual_seed(1))
    exact = orthogonalize(m.double(), torch.float64)
    assert ((orthogonalize(m, torch.float32).double() - exact).norm() / exact.norm()) < 1e-4
    assert ((orthogonalize(m, torch.bfloat16).double() - exact).norm() / exact.norm()) > 1e-3  # bf16's, wider


def test_one_optimizer_equals_muon_and_adamw_apart():
    """Three steps of the one optimizer (under the schedule) equal ``optim.Muon`` over the hidden matrices
    and AdamW over the rest stepped apart, at the learning rates the schedule gives each group, bit for
    bit; AdamW alone where ``train.optimizer`` is adamw."""
    cfg = TrainConfig(optimizer="muon", lr=LR, muon_lr=2 * LR, warmup_steps=1, max_steps=4)
    a, b = _model(), _model()
    opt, sched = build_optimizer(a.named_parameters(), cfg, 4)
    assert isinstance(opt, MuonAdamW) and [g["lr"] for g in opt.param_groups] == [LR, 2 * LR][::-1]
    muon_b, adamw_b = muon_params(b.named_parameters())
    m = Muon(muon_b, lr=2 * LR, **MUON_KW)
    w = torch.optim.AdamW(adamw_b, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    for step in range(3):
        _grads(a, step)
        _grads(b, step)
        factors = [g["lr"] / g["initial_lr"] for g in opt.param_groups]
        assert factors[0] == factors[1]  # one schedule over both groups
        m.param_groups[0]["lr"], w.param_groups[0]["lr"] = 2 * LR * factors[0], LR * factors[1]
        opt.step()
        sched.step()
        m.step()
        w.step()
        for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(pa, pb), (step, n)
    plain, _ = build_optimizer(_model().named_parameters(), TrainConfig(lr=LR), 4)
    assert isinstance(plain, torch.optim.AdamW)


def test_resume_with_muon_is_exact():
    """A state dict taken after two steps, loaded into a fresh optimizer, steps as the original does
    (both groups' state: Muon's momentum and AdamW's moments); the control: a fresh optimizer without it
    moves otherwise."""
    cfg = TrainConfig(optimizer="muon", lr=LR, warmup_steps=0, max_steps=4)
    a = _model()
    opt, sched = build_optimizer(a.named_parameters(), cfg, 4)
    for step in range(2):
        _grads(a, step)
        opt.step()
        sched.step()
    saved, saved_sched, b, c = copy.deepcopy(opt.state_dict()), sched.state_dict(), copy.deepcopy(a), copy.deepcopy(a)
    assert {len(s) for s in saved["state"].values()} == {1, 3}  # Muon: momentum; AdamW: step, m, v
    opt_b, sched_b = build_optimizer(b.named_parameters(), cfg, 4)
    opt_b.load_state_dict(saved)
    sched_b.load_state_dict(saved_sched)
    opt_c, _ = build_optimizer(c.named_parameters(), cfg, 4)
    for model, o in ((a, opt), (b, opt_b), (c, opt_c)):
        _grads(model, 2)
        o.step()
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters()))


def test_muon_config_and_memory():
    """Bad values name the key; the dry run holds one fp32 momentum per Muon parameter (not AdamW's two)
    and counts the matrix it orthogonalizes whole."""
    from pathlib import Path

    from specforge.dryrun import memory_plan

    with pytest.raises(ValueError, match=r"'train\.optimizer': got 'sgd'.*'adamw', 'muon'"):
        load_config(None, ["train.optimizer=sgd"])
    with pytest.raises(ValueError, match=r"'train\.muon_lr'=-1\.0 must be > 0"):
        load_config(None, ["train.optimizer=muon", "train.muon_lr=-1"])
    with pytest.raises(ValueError, match=r"'train\.muon_weight_decay'=-0\.1 must be >= 0"):
        load_config(None, ["train.muon_weight_decay=-0.1"])
    config = Path(__file__).parent.parent / "configs" / "smollm2-135m-cpu.yaml"

    def terms(*over):
        dev = memory_plan(load_config(config, ["data.max_length=512", *over]))[0]
        return {t.name: t.nbytes for t in dev.held}, {t.name: t.nbytes for t in dev.phases["optimizer step"]}

    (held_a, step_a), (held_m, step_m) = terms(), terms("train.optimizer=muon")
    momentum = held_m["Muon momentum (fp32, one rank)"]
    adamw = "AdamW m, v (fp32, one rank)"
    assert momentum > 0 and held_a[adamw] - held_m[adamw] == 2 * momentum
    assert any(n.startswith("Muon: the largest matrix") for n in step_m)
    assert not any(n.startswith("Muon") for n in list(held_a) + list(step_a))


# ---------------------------------------------------------------- two FSDP2 ranks against one process


def _cfg():
    from tests.helpers.ranks import sp_cfg

    cfg = sp_cfg()
    cfg.train.optimizer = "muon"
    return cfg


def _one_step(ref_path=None):
    """The single process's first step: (weights before, gradients, weights after)."""
    from specforge.registry import bound_algorithm
    from specforge.training.trainer import DraftTrainer
    from tests.helpers.ranks import sample_rows, setup_sp

    draft, teacher, batches = setup_sp()
    cfg = _cfg()
    before = {k: v.detach().clone() for k, v in draft.state_dict().items()}
    trainer = DraftTrainer(bound_algorithm(cfg), draft, teacher, cfg, torch.device("cpu"))
    trainer.step([sample_rows(batches[0], 0), sample_rows(batches[0], 1)])
    grads = {k: p.grad.detach().clone() for k, p in draft.named_parameters() if p.grad is not None}
    out = before, grads, {k: v.detach().clone() for k, v in draft.state_dict().items()}
    if ref_path is not None:
        torch.save(out, ref_path)
    return out


def _muon_rank(rank, world, ref_path):
    from specforge.parallel.dims import ParallelDims
    from specforge.parallel.fsdp import full_state_dict
    from specforge.parallel.parallelize import parallelize_draft, sum_over_train_ranks
    from specforge.registry import bound_algorithm
    from specforge.training.trainer import DraftTrainer
    from tests.helpers.ranks import sample_rows, setup_sp

    groups = ParallelDims(dp=2).build([0, 1], rank, timeout_s=90)
    cfg = _cfg()
    draft, teacher, batches = setup_sp()
    draft = parallelize_draft(draft, ParallelDims(dp=2), groups, cfg.train.precision, bound_algorithm(cfg))
    trainer = DraftTrainer(bound_algorithm(cfg), draft, teacher, cfg, torch.device("cpu"),
                           reduce_sum=sum_over_train_ranks(groups))
    assert isinstance(trainer.optimizer, MuonAdamW)
    trainer.step([sample_rows(batches[0], groups.dp_rank)])
    state = full_state_dict(draft)
    if rank == 0:
        torch.save(state, str(ref_path) + ".ranks")


def _ns(m: torch.Tensor) -> torch.Tensor:
    return orthogonalize(m, optim.ns_dtype(m.device)).float()  # what the CPU ranks ran


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.timeout(240)
def test_fsdp_dp2_muon_orthogonalizes_whole_matrices(tmp_path):
    """Two FSDP2 ranks (each a sample, every matrix sharded on its rows) take the one process's Muon step to
    within fp32's own error on each matrix (the module docstring): Muon's iterations saw each whole matrix.
    Control: each rank's half of a matrix orthogonalized alone lands far outside it. The one process's
    update is first recomputed from its gradient (torch's first step: the Nesterov update is 0.0975 of
    the gradient), so the test reads what Muon did, not what it assumes."""
    before, grads, want = _one_step(tmp_path / "ref.pt")
    run_ranks(_muon_rank, 2, str(tmp_path / "ref.pt"), workdir=tmp_path, timeout_s=150)
    got = torch.load(str(tmp_path / "ref.pt") + ".ranks")
    muon = _muon_names()
    assert muon and "fc.weight" in muon
    for k, v in want.items():
        if k in muon:
            scale = LR * 0.2 * math.sqrt(max(v.shape))  # match_rms_adamw
            update = (before[k] * (1 - LR * 0.1) - v) / scale  # weight decay 0.1, then lr * scale * O
            g = grads[k] * (0.05 * 0.95 + 0.05)  # buf = 0.05 g; update = g.lerp(buf, 0.95)
            exact = orthogonalize(g.double(), torch.float64)
            spread = max(_rel(_ns(g * c).double(), exact) for c in (1.0, 0.6, 1.7))  # fp32's own error here
            # what the one process did: Muon's step on its gradient (the lerps round the bf16 input otherwise)
            assert _rel(_ns(g), update) <= 2 * spread, k
            err = _rel((before[k] * (1 - LR * 0.1) - got[k]) / scale, update)
            assert err <= 3 * spread, (k, err, spread)
            shard_local = torch.cat([_ns(h) for h in g.chunk(2, 0)])
            assert _rel(shard_local, update) > 100 * spread, k
        elif k in grads:  # AdamW's parameters: the gradients' fp32 agreement, as the AdamW runs check
            from tests.helpers.ranks import check_params

            check_params({k: got[k]}, {k: v}, [{k: grads[k]}], _cfg())
        else:
            assert torch.equal(got[k], v), k


def _muon_names() -> set:
    """The parameter names of the harness's draft that Muon takes."""
    from tests.helpers.ranks import setup_sp

    d = setup_sp()[0]
    ids = {id(p) for p in muon_params(d.named_parameters())[0]}
    return {n for n, p in d.named_parameters() if id(p) in ids}


def test_a_muon_run_resumes_exactly_from_its_checkpoint(tmp_path):
    """The trainer's checkpoint (the full optimizer state through DCP, keyed by name) of a Muon run: two
    more steps after loading it equal two more straight through, bit for bit; a run with another
    optimizer or loss is refused naming the key (recorded off the defaults only)."""
    from specforge.algorithms.eagle3 import ALGORITHM as EAGLE3
    from specforge.data.vocab import DraftVocab
    from specforge.training.checkpoint import CheckpointManager
    from specforge.training.trainer import run_identity
    from tests.helpers.trainer import feature_batch, setup_trainer, trainable_params

    target, rows, trainer = setup_trainer(optimizer="muon")
    assert isinstance(trainer.optimizer, MuonAdamW)
    batch = feature_batch(target, rows)
    for _ in range(2):
        trainer.step([batch])
    vocab = DraftVocab(trainer.draft.d2t, trainer.draft.t2d)
    facts = {"data": "cache-abc", "num_samples": 12, "global_batch": 2}

    def identity(trainer_):
        return run_identity(EAGLE3.bind(trainer_.cfg), trainer_.cfg, target, vocab, facts, total_steps=10)

    CheckpointManager(tmp_path, identity=identity(trainer)).save(trainer)
    _, _, resumed = setup_trainer(seed=123, optimizer="muon")
    assert CheckpointManager(tmp_path, identity=identity(resumed)).load(resumed) == 2
    for _ in range(2):
        trainer.step([batch])
        resumed.step([batch])
    for k, v in trainable_params(trainer).items():
        assert torch.equal(trainable_params(resumed)[k], v), k
    for other, key in (({}, "train.optimizer: checkpoint 'muon', this run '<absent>'"),
                       ({"optimizer": "muon", "loss": "tv"}, "train.loss: checkpoint '<absent>', this run 'tv'")):
        _, _, o = setup_trainer(seed=1, **other)
        with pytest.raises(ValueError, match="different run") as err:
            CheckpointManager(tmp_path, identity=identity(o)).load(o)
        assert key in str(err.value), str(err.value)
