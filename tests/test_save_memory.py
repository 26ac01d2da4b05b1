"""Saves of an FSDP2-sharded draft (2 ranks, gloo): what each rank holds, and that resume stays exact.

* The checkpoint holds no frozen weight (the target's embedding), and no rank copies it to save.
* Only the writer (the mesh's first rank) receives the full weights and optimizer state: the
  other rank's gathers return nothing, and no op on it creates a tensor larger than one shard.
  Controls: torch's ``get_optimizer_state_dict(full_state_dict=True)`` hands rank 1 the full
  state, and ``include_frozen=True`` does copy the embedding.
* Saved on 2 ranks, loaded into a fresh 2-rank draft: the next step equals the uninterrupted one,
  bit for bit; the gathered optimizer state equals torch's own full state dict.
"""

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from specforge.parallel.dims import ParallelDims
from specforge.parallel.fsdp import full_optimizer_state, full_state_dict, gather_to_first
from specforge.parallel.launch import run_ranks
from specforge.parallel.parallelize import parallelize_draft, sum_over_train_ranks
from specforge.registry import bound_algorithm
from specforge.training.checkpoint import CheckpointManager, load_train_state
from specforge.training.trainer import DraftTrainer
from tests.helpers.ranks import sample_rows, setup_sp, sp_cfg

FROZEN = "embed_tokens.weight"


def _sharded_trainer(rank):
    groups = ParallelDims(dp=2).build([0, 1], rank, timeout_s=90)
    cfg = sp_cfg()
    draft, teacher, batches = setup_sp()
    draft = parallelize_draft(draft, ParallelDims(dp=2), groups, cfg.train.precision, bound_algorithm(cfg))
    trainer = DraftTrainer(bound_algorithm(cfg), draft, teacher, cfg, torch.device("cpu"),
                           reduce_sum=sum_over_train_ranks(groups))
    return trainer, [sample_rows(b, rank) for b in batches]


def _gathers_uneven_shards(rank):
    """torch.chunk's split: 5 rows = 3 + 2, 1 row = 1 + 0 (rank 1's shard is empty)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    for shape in ((5, 3), (1, 4), (6,)):
        full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
        got = gather_to_first(distribute_tensor(full, mesh, [Shard(0)]))
        assert torch.equal(got, full) if rank == 0 else got is None, (rank, shape, got)


class _LargestTensor(TorchDispatchMode):
    """The most elements of any NEW tensor an op creates inside the ``with`` (collectives included;
    views and in-place results share an input's memory and do not count; a DTensor counts its shard)."""

    numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and _storage(t) not in inputs:
                self.numel = max(self.numel, _local(t).numel())
        return out


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _storage(t) -> int:
    try:
        return _local(t).untyped_storage().data_ptr()
    except RuntimeError:  # no storage to share (a tensor subclass' outer shell): new
        return -id(t)


def _save_rank(rank, world, root):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    _gathers_uneven_shards(rank)
    trainer, batches = _sharded_trainer(rank)
    draft = trainer.draft
    trainer.step([batches[0]])
    trainer.evaluate([batches[2]])  # a forward without backward leaves the FSDP root's parameters unsharded
    assert not any(isinstance(p, DTensor) for p in draft.parameters())

    # what each rank creates while saving: the non-writer never more than one shard of a tensor
    shard = max(v.to_local().numel() for v in draft.state_dict().values() if isinstance(v, DTensor))
    with _LargestTensor() as during_save:
        path = CheckpointManager(root, writer=rank == 0).save(trainer)
        optim = full_optimizer_state(draft, trainer.optimizer)
        weights = full_state_dict(draft, include_frozen=False)
    with _LargestTensor() as torch_gather:  # control: torch's full optimizer state dict on every rank
        torch_full = get_optimizer_state_dict(draft, trainer.optimizer, options=StateDictOptions(full_state_dict=True))
    assert torch_gather.numel >= draft.lm_head.weight.numel() > shard, (torch_gather.numel, shard)
    with_frozen = full_state_dict(draft)  # control: the default keeps frozen parameters
    if rank == 1:  # the non-writer holds nothing of the save
        assert during_save.numel <= shard, (during_save.numel, shard)
        assert path is None and optim == {} and weights == {} and with_frozen == {}
        # control: torch's full optimizer state dict does give rank 1 the whole state
        lm = torch_full["state"]["lm_head.weight"]["exp_avg"]
        assert lm.shape == draft.lm_head.weight.shape and not isinstance(lm, DTensor)
    else:
        assert FROZEN not in weights and FROZEN in with_frozen  # control
        assert torch.equal(with_frozen[FROZEN], draft.embed_tokens.weight)
        saved = load_train_state(path)
        assert FROZEN not in saved["model"] and saved["model"].keys() == weights.keys() - {"inv_freq"}
        # the gathered optimizer state is torch's full state dict, in host memory
        assert optim["param_groups"] == torch_full["param_groups"]
        assert optim["state"].keys() == torch_full["state"].keys()
        for name, st in torch_full["state"].items():
            for k, v in st.items():
                assert optim["state"][name][k].device.type == "cpu"
                assert torch.equal(optim["state"][name][k], v), (name, k)
                assert torch.equal(saved["optimizer"]["state"][name][k], v), (name, k)
    dist.barrier()  # the writer's files are complete

    # resume: a fresh 2-rank draft loaded from the save takes the same next step, bit for bit
    trainer.step([batches[1]])
    after = full_state_dict(draft, include_frozen=False)
    resumed, _ = _sharded_trainer(rank)
    torch.manual_seed(1234)  # the RNG state comes from the checkpoint, not from here
    assert CheckpointManager(root, writer=rank == 0).load(resumed) == 1
    resumed.step([batches[1]])
    again = full_state_dict(resumed.draft, include_frozen=False)
    assert again.keys() == after.keys()
    for k, v in after.items():
        assert torch.equal(again[k], v), k


@pytest.mark.timeout(240)
def test_save_gathers_to_the_writer_only_and_resumes_exactly(tmp_path):
    run_ranks(_save_rank, 2, str(tmp_path / "ckpt"), workdir=tmp_path, timeout_s=150)
