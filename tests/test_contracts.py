"""Control-plane records and the step planner (no Ray, no torch.distributed)."""

import pickle
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from specforge.contracts import (
    FeatureField,
    FeatureSpec,
    SampleRef,
    StepReport,
    assert_no_tensors,
)
from specforge.parallel.bounds import split_slices
from specforge.runtime.plan import assign_groups, plan_step

pytestmark = pytest.mark.timeout(30)
SPEC = FeatureSpec.hidden_states(hidden_size=8)


def _groups(num_groups, per_group, first_id=0):
    ids = iter(range(first_id, first_id + num_groups * per_group))
    return [[SampleRef(i, 10 + i) for i in (next(ids) for _ in range(per_group))] for _ in range(num_groups)]


def test_one_forward_per_rollout_worker_over_the_union():
    groups = _groups(num_groups=4, per_group=3)
    plan = plan_step(0, groups, rollout_ranks=[0, 1], dp_dst_ranks=[[2], [3], [4], [5]], feature_spec=SPEC)
    assert len(plan.rollout_batches) == 2  # one batch (= one forward) per rollout worker
    forwarded = Counter(sid for batch in plan.rollout_batches for sid in batch)
    assert forwarded == Counter(r.sample_id for g in groups for r in g)  # the union, each once
    for rank, batch in zip(plan.rollout_ranks, plan.rollout_batches):
        served = {t.dst_rank for t in plan.sends_of(rank)}
        assert len(served) == 2  # each worker serves two DP groups in its one batch
        needed = {r.sample_id for g, ranks in zip(groups, [[2], [3], [4], [5]]) if ranks[0] in served for r in g}
        assert set(batch) == needed


def test_sample_shared_by_two_groups_is_forwarded_once_and_sent_to_both():
    shared = SampleRef(7, 12)
    groups = [[shared, SampleRef(1, 5)], [SampleRef(2, 9), shared]]
    plan = plan_step(3, groups, rollout_ranks=[0], dp_dst_ranks=[[1], [2]], feature_spec=SPEC)
    assert sorted(plan.rollout_batches[0]) == [1, 2, 7]
    assert sorted(t.dst_rank for t in plan.transfers if t.sample_id == 7) == [1, 2]


def test_every_group_receives_exactly_its_samples():
    groups = _groups(num_groups=3, per_group=2)
    plan = plan_step(0, groups, rollout_ranks=[0, 1], dp_dst_ranks=[[2], [3], [4]], feature_spec=SPEC)
    for g, ranks in zip(groups, plan.group_ranks):
        got = [(t.sample_id, t.start, t.stop) for t in plan.recvs_of(ranks[0])]
        assert sorted(got) == sorted((r.sample_id, 0, r.length) for r in g)


def test_transfer_order_is_deterministic_and_agrees_per_pair():
    groups = _groups(num_groups=4, per_group=3)
    args = dict(rollout_ranks=[0, 1], dp_dst_ranks=[[2, 3], [4, 5], [6, 7], [8, 9]], feature_spec=SPEC)
    plan = plan_step(5, groups, **args)
    assert plan == plan_step(5, [list(g) for g in groups], **args)  # pure function of its inputs
    assert pickle.loads(pickle.dumps(plan)) == plan  # what a Ray call delivers
    for src in plan.rollout_ranks:
        for dst in range(2, 10):
            sender_view = [t for t in plan.sends_of(src) if t.dst_rank == dst]
            receiver_view = [t for t in plan.recvs_of(dst) if t.src_rank == src]
            assert sender_view == receiver_view


def test_sp_slices_cover_the_sample_with_halo():
    # the one SP slice rule (padded to a multiple of parts), clipped to the sample's tokens
    assert split_slices(10, 3) == [(0, 4, 4), (4, 8, 8), (8, 10, 10)]
    assert split_slices(10, 3, halo=2) == [(0, 4, 6), (4, 8, 10), (8, 10, 10)]
    # a short sample in a micro-batch padded to 9: slices of 5, the second one empty
    assert split_slices(4, 2, halo=2, padded_length=9) == [(0, 4, 4), (4, 4, 4)]
    from specforge.parallel.bounds import slice_bounds
    for T, P, L in [(29, 4, 4), (7, 2, 3), (5, 4, 7)]:
        for r, (start, end, stop) in enumerate(split_slices(T, P, halo=L + 1)):
            s, e, w = slice_bounds(T, r, P, L + 1)
            assert (start, end, stop) == (min(s, T), min(e, T), min(w, T))
    plan = plan_step(0, [[SampleRef(0, 11)]], [0], [[1, 2, 3]], SPEC, halo=3)
    owned = [(t.dst_rank, t.start, t.end, t.stop) for t in plan.transfers]
    assert owned == [(1, 0, 4, 7), (2, 4, 8, 11), (3, 8, 11, 11)]
    # padded micro-batch length: the slices split the padded length
    plan = plan_step(0, [[SampleRef(0, 5), SampleRef(1, 9)]], [0], [[1, 2]], SPEC, halo=2, micro_batch_size=2)
    assert [(t.sample_id, t.dst_rank, t.start, t.end, t.stop) for t in plan.transfers] == [
        (0, 1, 0, 5, 5), (0, 2, 5, 5, 5), (1, 1, 0, 5, 7), (1, 2, 5, 9, 9)]


def test_plan_holds_micro_batches_and_padded_lengths_and_colocated_plans_no_transfers():
    groups = [[SampleRef(0, 5), SampleRef(1, 9), SampleRef(2, 3)], [SampleRef(3, 4), SampleRef(4, 2), SampleRef(5, 7)]]
    plan = plan_step(0, groups, [0], [[1], [2]], SPEC, micro_batch_size=2)
    assert plan.micro_batches == (((0, 1), (2,)), ((3, 4), (5,)))
    assert plan.padded_lengths == ((9, 3), (4, 7))
    colocated = plan_step(0, groups, [], [[1], [2]], SPEC, micro_batch_size=2, split="eval")
    assert colocated.transfers == () and colocated.rollout_batches == () and colocated.recv_bytes(1) == 0
    assert ((colocated.micro_batches, colocated.padded_lengths, colocated.split)
            == (plan.micro_batches, plan.padded_lengths, "eval"))


def test_balanced_assignment_evens_tokens_and_round_robin_cycles():
    assert assign_groups([100, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10], 2) == [0] + [1] * 10
    assert assign_groups([5, 5, 5, 5, 5], 2, "round_robin") == [0, 1, 0, 1, 0]
    with pytest.raises(ValueError, match="round_robin"):
        assign_groups([1], 1, "random")


def test_plan_rejects_bad_input():
    with pytest.raises(ValueError, match="twice"):
        plan_step(0, [[SampleRef(1, 3), SampleRef(1, 3)]], [0], [[1]], SPEC)
    with pytest.raises(ValueError, match="two lengths"):
        plan_step(0, [[SampleRef(1, 3)], [SampleRef(1, 4)]], [0], [[1], [2]], SPEC)
    with pytest.raises(ValueError, match="no train ranks"):
        plan_step(0, [[SampleRef(1, 3)]], [0], [[]], SPEC)


def test_feature_spec_sizes():
    assert SPEC.names == ("aux_hidden", "last_hidden", "target_ids", "input_ids", "loss_mask")
    assert SPEC.bytes_per_token() == (3 * 8 + 8) * 2 + 8 + 8 + 1
    assert FeatureField("ids", 1, "int64").shape(5) == (5,)
    with pytest.raises(ValueError, match="dtype"):
        FeatureField("x", 2, "complex64")
    with pytest.raises(ValueError, match="duplicate"):
        FeatureSpec((FeatureField("x", 1, "int8"), FeatureField("x", 1, "int8")))


@dataclass(frozen=True)
class _Outer:
    report: StepReport
    extra: tuple


def test_assert_no_tensors_passes_records_and_names_nested_tensors():
    plan = plan_step(0, _groups(2, 2), [0], [[1], [2]], SPEC)
    report = StepReport(rank=1, step=0, metrics={"loss": 1.5}, timings_ms={"recv": 2.0}, bytes_recv=10)
    assert_no_tensors(plan)
    assert_no_tensors(report)
    bad = _Outer(StepReport(0, 0, metrics={"loss": torch.tensor(1.0)}), ())
    with pytest.raises(TypeError, match=r"record\.report\.metrics\['loss'\]"):
        assert_no_tensors(bad)
    with pytest.raises(TypeError, match=r"record\.extra\[1\]\[0\]"):
        assert_no_tensors(_Outer(report, (1, [np.zeros(2)])))
    with pytest.raises(TypeError, match="Parameter"):
        assert_no_tensors({"w": [torch.nn.Parameter(torch.zeros(1))]})


def test_contracts_module_is_stdlib_only():
    import ast
    import sys
    from pathlib import Path

    import specforge.contracts as contracts
    import specforge.parallel.bounds as bounds

    def imported(module) -> set[str]:
        tree = ast.parse(Path(module.__file__).read_text())
        return {(a.name if isinstance(n, ast.Import) else n.module)
                for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}

    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    # the ground: no specforge module at all
    assert {m for m in imported(contracts) if m.split(".")[0] not in stdlib} == set()
    assert {m.split(".")[0] for m in imported(bounds)} <= stdlib
