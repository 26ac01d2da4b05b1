"""No config key is silently ignored: each is read by the code or rejected with a ValueError that
names it; the stop rule (max_steps, epochs); the single process runs the same plan as the DP groups."""

import ast
import dataclasses
import math
from pathlib import Path

import pytest

from specforge.config import Config, load_config

PKG = Path(__file__).parent.parent / "specforge"
# Values no entry point can run with (with the other overrides given): the shared check() rejects
# them, naming the first key.
REJECTED = ["model.num_gpus=2 model.device=cpu"]


def _keys() -> list[str]:
    return [f"{s.name}.{f.name}" for s in dataclasses.fields(Config) for f in dataclasses.fields(s.default_factory())]


def _attributes_read() -> set[str]:
    """Every attribute name read anywhere in specforge/ except where the config is defined."""
    names = set()
    for path in PKG.rglob("*.py"):
        if path.name != "config.py":
            names |= {n.attr for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute)}
    return names


def test_every_key_is_read_or_rejected():
    read = _attributes_read()
    rejected = {r.split("=")[0] for r in REJECTED}
    unused = [k for k in _keys() if k.split(".")[1] not in read and k not in rejected]
    assert not unused, f"config keys nothing reads (use them or reject them in runtime.loop.check): {unused}"


@pytest.mark.parametrize("override", REJECTED)
def test_rejected_values_name_their_key(override):
    from specforge.runtime.loop import check

    with pytest.raises(ValueError, match=override.split("=")[0].replace(".", r"\.")):
        check(load_config(None, override.split()))


def test_placements_name_the_distribution_keys_they_do_not_apply():
    from specforge.runtime.loop import DISTRIBUTION_KEYS, not_applied

    assert set(DISTRIBUTION_KEYS) <= set(_keys())
    cfg = load_config(Path(__file__).parent.parent / "configs" / "smollm2-135m-cpu.yaml",
                      ["placement.mode=disaggregated"])
    assert not_applied(cfg, "single") == ["placement.mode='disaggregated'", "placement.max_inflight_mb=256.0"]
    assert not_applied(cfg, "disaggregated") == []
    # offline is a feature source, not a distribution: one process runs it as it is
    assert not_applied(load_config(None, ["placement.mode=offline"]), "single") == []
    assert not_applied(Config(), "single") == []
    colocated = load_config(None, ["placement.transport=object_store", "rollout.num_workers=2"])
    assert not_applied(colocated, "colocated") == ["placement.transport='object_store'", "rollout.num_workers=2"]


def test_stop_rule_first_of_max_steps_and_epochs():
    from specforge.runtime.plan import total_steps

    common = ["train.batch_size=3", "train.num_workers=2"]  # global batch 6
    assert total_steps(load_config(None, [*common, "train.max_steps=null", "train.epochs=2"]), 10) == math.ceil(20 / 6)
    assert total_steps(load_config(None, [*common, "train.max_steps=3", "train.epochs=2"]), 10) == 3
    assert total_steps(load_config(None, [*common, "train.epochs=0.5", "train.max_steps=null"]), 10) == 1
    assert total_steps(load_config(None, [*common, "train.max_steps=50"]), 10) == 50  # epochs null: no epoch limit
    with pytest.raises(ValueError, match=r"'train\.max_steps'.*train\.epochs"):
        load_config(None, ["train.max_steps=null"])
    with pytest.raises(ValueError, match=r"'train\.epochs'"):
        load_config(None, ["train.epochs=0"])


def _planner(cfg, rollout_ranks, train_ranks):
    from specforge.contracts import Layout
    from specforge.runtime.plan import Planner, RunData

    data = RunData(lengths=tuple(5 + i % 7 for i in range(40)), eval_lengths=(4, 9, 3, 8, 6, 5, 7, 2, 9), vocab_path="",
                   hidden_size=8, wire_dtype="float32")
    return Planner(cfg, data, Layout(cfg.placement.mode, rollout_ranks, train_ranks, ""))


def test_single_process_plan_is_the_dp_groups_micro_batches_in_order():
    from specforge.runtime.loop import single_process

    cfg = load_config(None, ["train.num_workers=4", "parallel.sp_ulysses=2", "train.batch_size=2", "train.grad_accum=3",
                             "placement.mode=disaggregated", "train.eval_every=2", "train.max_steps=5"])
    dist, one = _planner(cfg, (0,), (1, 2, 3, 4)), _planner(single_process(cfg), (), (0,))
    assert one.total_steps == dist.total_steps == 5 and one.global_batch == dist.global_batch == 12
    for item in one.schedule(0):
        a, b = dist.task(item), one.task(item)
        assert b.micro_batches == (sum(a.micro_batches, ()),) and b.padded_lengths == (sum(a.padded_lengths, ()),)
        assert b.transfers == () and a.transfers  # the single process computes its own features
    assert one.schedule(3) == [("train", 3), ("eval", 4), ("train", 4)]
    # eval: the first 8 held-out samples (a multiple of the DP groups), micro-batched like training
    assert (dist.task(("eval", 4)).split == "eval"
            and dist.task(("eval", 4)).micro_batches == (((0, 1), (2, 3)), ((4, 5), (6, 7))))


def test_periodic_eval_without_held_out_samples_is_rejected():
    cfg = load_config(None, ["train.num_workers=16", "train.eval_every=10"])  # 9 held-out samples, 16 DP groups
    with pytest.raises(ValueError, match=r"'train\.eval_every'.*data\.num_eval"):
        _planner(cfg, (), tuple(range(16)))
