"""Checkpoint saves of an FSDP2-sharded draft: host memory per rank, the writer vs the other rank.

    python benchmarks/bench_save.py [--repeats 3] [--no-readme]

2 train ranks (spawned processes, gloo, ``parallelize_draft`` with dp=2), the SmolLM2-135M-shaped
EAGLE-3 draft of ``bench_ttt.py`` (hidden 576, target vocab 49152: a frozen, replicated embedding
of 113 MB fp32; draft vocab 8192), one fp32 train step so that AdamW has its state, then one save.
Rank 0 is the writer (the FSDP mesh's first rank). Each method runs in fresh processes, so one
method's freed memory cannot hide the next one's peak.

* "before": the save of the parent commit, reproduced here: ``full_state_dict`` copied every
  entry it kept (the frozen embedding too, on every rank that met it before the first sharded
  entry) and ``get_optimizer_state_dict(full_state_dict=True)`` all-gathered the full AdamW state
  onto every rank (on a GPU: onto each rank's GPU).
* "after": ``CheckpointManager.save``'s gathers (``parallel/fsdp.py``): no frozen weight, every
  shard gathered to the writer's host memory only, one tensor at a time.

Per rank: "held" = bytes of the tensors the gathers return on that rank (what the rank keeps
while the files are written); "largest new" = the largest tensor any op creates during the
gathers (views excluded; a TorchDispatchMode sees every op, collectives included); "peak RSS
gather" / "peak RSS save" = the rise of the process's resident-set high-water mark (reset through
/proc/self/clear_refs) over the RSS just before, for the gathers alone and for the whole save
(gathers + the writer's bf16 safetensors and torch.save), each in fresh processes; the median
of ``--repeats`` runs (range in parentheses: RSS peaks move by tens of MB from run to run with
the allocator's arenas; held bytes and tensor sizes do not move). On a GPU the same gathers put
"before"'s full state on every rank's device; "after" holds one full tensor at a time on the
writer's device only (the gather target) and one shard on the others; this machine has none.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import append_section, header_markdown, machine_info, markdown_table  # noqa: E402
from benchmarks.ttt_step import make_batch, make_draft  # noqa: E402

DRAFT_VOCAB, T = 8192, 128
METHODS = ("before", "after")


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB -> MiB
    raise KeyError(field)


def _reset_peak() -> float:
    """Reset the RSS high-water mark (VmHWM) to the current RSS; returns that RSS in MB."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_mb("VmRSS")


def _nbytes(obj) -> int:
    from torch.utils._pytree import tree_flatten

    seen, total = set(), 0
    for t in tree_flatten(obj)[0]:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def _gather_before(draft, optimizer):
    """The parent commit's gathers (checkpoint.py + fsdp.full_state_dict), kept here to compare."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    out, keep = {}, True
    for name, v in draft.state_dict().items():
        if isinstance(v, DTensor):
            keep = v.device_mesh.get_local_rank() == 0
            v = v.full_tensor()
        if keep:
            out[name] = v.detach().cpu().clone()
    keys = set(draft.export_state_dict())
    weights = {k: v for k, v in (out if keep else {}).items() if k in keys}
    optim = get_optimizer_state_dict(draft, optimizer, options=StateDictOptions(full_state_dict=True))
    return weights, optim


def _gather_after(draft, optimizer):
    from specforge.parallel.fsdp import full_optimizer_state, full_state_dict

    keys = set(draft.export_state_dict())
    return ({k: v for k, v in full_state_dict(draft, include_frozen=False).items() if k in keys},
            full_optimizer_state(draft, optimizer))


def _rank(rank: int, world: int, method: str, phase: str, out_dir: str) -> None:
    import gc

    import torch.distributed as dist

    from specforge.algorithms.eagle3.algorithm import Eagle3Options
    from specforge.config import Config, TrainConfig
    from specforge.models.features import TrainBatch
    from specforge.parallel.dims import ParallelDims
    from specforge.parallel.parallelize import parallelize_draft, sum_over_train_ranks
    from specforge.registry import bound_algorithm
    from specforge.training.checkpoint import CheckpointManager, capture_rng, save_or_rescue
    from specforge.training.trainer import DraftTrainer
    from tests.test_save_memory import _LargestTensor

    cfg = Config(draft=Eagle3Options(vocab_size=DRAFT_VOCAB, ttt_length=2),
                 train=TrainConfig(precision="fp32", lr=1e-4, warmup_steps=0))
    groups = ParallelDims(dp=world).build(list(range(world)), rank, timeout_s=600)
    torch.manual_seed(0)
    draft = make_draft(DRAFT_VOCAB)
    teacher = torch.randn(DRAFT_VOCAB, 576) * 0.05
    b = make_batch(1, T, draft)
    batch = TrainBatch(b["input_ids_BT"], b["loss_mask_BT"], b["aux_hidden_BTKH"].float(), b["last_hidden_BTH"].float(),
                       b["target_ids_BT"])
    draft = parallelize_draft(draft, ParallelDims(dp=world), groups, cfg.train.precision, bound_algorithm(cfg))
    trainer = DraftTrainer(bound_algorithm(cfg), draft, teacher, cfg, torch.device("cpu"),
                           reduce_sum=sum_over_train_ranks(groups))
    trainer.step([batch])
    gc.collect()
    dist.barrier()
    base = _reset_peak()
    if phase == "gather":
        with _LargestTensor() as largest:
            weights, optim = (_gather_before if method == "before" else _gather_after)(draft, trainer.optimizer)
        out = {"held_mb": _nbytes((weights, optim)) / 2**20, "largest_mb": largest.numel * 4 / 2**20}  # all fp32
    elif method == "after":
        CheckpointManager(Path(out_dir, "ckpt"), writer=rank == 0).save(trainer)
        out = {}
    else:  # the parent commit's save: its gathers, then the same files on the writer
        weights, optim = _gather_before(draft, trainer.optimizer)
        if rank == 0:
            state = {"step": 1, "optimizer": optim, "full_optimizer_state": True,
                     "model": {k: v.detach().to("cpu") for k, v in weights.items()},
                     "scheduler": trainer.scheduler.state_dict(), "rng": capture_rng()}
            save_or_rescue(Path(out_dir, "ckpt"), 1, trainer.algorithm.hf_config(draft), weights, state)
        out = {}
    out["peak_mb"] = max(0.0, _status_mb("VmHWM") - base)  # a rise; RSS may also have dropped
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))


def measure(method: str, phase: str) -> list[dict]:
    """``phase``: "gather" (the gathers alone) or "save" (the whole save); fresh processes each."""
    from specforge.parallel.launch import run_ranks

    with tempfile.TemporaryDirectory() as d:
        run_ranks(_rank, 2, method, phase, d, workdir=d, timeout_s=1200)
        return [json.loads(Path(d, f"rank{r}.json").read_text()) for r in range(2)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-readme", action="store_true")
    args = ap.parse_args()
    info = machine_info()
    info["load"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    results = {m: [[] for _ in range(2)] for m in METHODS}
    for _ in range(args.repeats):  # interleaved, so that background load touches both methods alike
        for m in METHODS:
            for r, (g, sv) in enumerate(zip(measure(m, "gather"), measure(m, "save"))):
                results[m][r].append({**g, "save_peak_mb": sv["peak_mb"]})
    info["load_after"] = " ".join(f"{x:.1f}" for x in os.getloadavg())

    def cell(runs: list[dict], key: str, fmt: str) -> str:
        vals = sorted(x[key] for x in runs)
        med = format(statistics.median(vals), fmt)
        return med if len(vals) == 1 or vals[0] == vals[-1] else f"{med} ({vals[0]:{fmt}}-{vals[-1]:{fmt}})"

    rows = [[m, "0 (writer)" if r == 0 else "1", cell(runs, "held_mb", ".1f"), cell(runs, "largest_mb", ".1f"),
             cell(runs, "peak_mb", ".0f"), cell(runs, "save_peak_mb", ".0f")]
            for m in METHODS for r, runs in enumerate(results[m])]
    table = markdown_table(["save", "rank", "held MiB", "largest new tensor MiB", "peak RSS gather MiB",
                            "peak RSS save MiB"], rows)
    print(header_markdown(info))
    print(table)
    if not args.no_readme:
        body = (f"`python benchmarks/bench_save.py` -- {header_markdown(info)}\n\n"
                "2 ranks (gloo, FSDP2 dp=2), SmolLM2-135M-shaped draft (frozen embedding 49152 x 576 fp32 = 108 MiB, "
                "replicated; trainable 9.8 M parameters = 37 MiB fp32, AdamW state 75 MiB), one save after one step. "
                "before = the parent commit's gathers (every rank all-gathers the full AdamW state; the embedding "
                "copied on every rank); after = gathered shard by shard to the writer's host memory, frozen weights "
                "left out. held = what the gathers return on the rank; largest new tensor = the largest any op "
                "creates during them; peak RSS = rise of the resident high-water mark over the RSS just before "
                "(gathers alone; the whole save incl. the writer's files); median of "
                f"{args.repeats} runs (range). See the script's docstring.\n\n"
                f"{table}\n")
        append_section("Saves", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
