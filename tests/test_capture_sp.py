"""Colocated capture with sequence parallelism: the target runs once per SP group.

Two train ranks = one DP group of Ulysses SP 2, three micro-batches of unequal lengths: each rank
runs the target over its share only (micro-batch m on SP rank m mod 2) and gets every micro-batch
exactly as ``sp_slice_batch`` of the whole capture gives it (the reference: what each rank
computed for itself before). Also under NCCL's completion semantics emulated on gloo.
"""

import types

import pytest
import torch

from specforge.parallel.launch import run_ranks

MICRO = [[0, 1], [2], [3, 4]]  # sample ids of the three micro-batches
LENGTHS = [7, 12, 9, 5, 11]


def _target():
    from specforge.models.target import TargetModel
    from tests.helpers.models import tiny_target

    return TargetModel(model=tiny_target(), tokenizer=types.SimpleNamespace(pad_token_id=0),
                       aux_layer_ids=[1, 2, 3], device=torch.device("cpu"))


def _rows():
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(3, 320, (n,), generator=g).tolist(),
             "loss_mask": [0] * 2 + [1] * (n - 2)} for n in LENGTHS]


def _rank(rank, world, packed):
    from specforge.config import load_config
    from specforge.parallel.dims import ParallelDims
    from specforge.runtime.sources import CaptureSource
    from specforge.training.slicing import sp_slice_batch
    from specforge.training.trainer import local_batches

    cfg = load_config(None, ["parallel.sp_ulysses=2", "train.num_workers=2", "draft.ttt_length=3"])
    groups = ParallelDims(1, 2, 1).build([0, 1], rank, "gloo", 60)
    target, rows = _target(), _rows()
    source = CaptureSource(target, types.SimpleNamespace(train=rows), groups, cfg, peers=[0, 1])
    plan = types.SimpleNamespace(split="train", step=0, micro_batches=[MICRO], packed=packed)
    got = source.next_batches(plan)
    assert source.captured == len([m for m in range(len(MICRO)) if m % 2 == rank])  # its share only
    for ids, b in zip(MICRO, got):
        (full,) = local_batches(target, [rows[i] for i in ids], len(ids), 1024)
        lengths = [LENGTHS[i] for i in ids] if packed else None  # a packed plan: the micro-batch is one row
        want = sp_slice_batch(full, rank, 2, 4, lengths)  # halo: ttt_length 3 + 1
        for name in ("input_ids_BT", "loss_mask_BT", "aux_hidden_BTKH", "last_hidden_BTH", "target_ids_BT",
                     "position_ids_BT", *(("doc_ids_BT",) if packed else ())):
            assert torch.equal(getattr(b, name), getattr(want, name)), (ids, name)
        assert (b.num_rows, b.start) == (want.num_rows, want.start)


@pytest.mark.parametrize("semantics, packed", [("gloo", False), ("nccl-semantics", False), ("gloo", True)])
def test_sp_ranks_share_the_capture_and_get_their_slices(tmp_path, monkeypatch, semantics, packed):
    from specforge.device import EMULATE_NCCL_ENV

    if semantics == "nccl-semantics":
        monkeypatch.setenv(EMULATE_NCCL_ENV, "1")  # the spawned ranks inherit it
    run_ranks(_rank, 2, packed, workdir=tmp_path, backend="gloo", timeout_s=120)
