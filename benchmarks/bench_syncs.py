"""Host syncs of a rollout worker's step and a train step: the device-to-host reads a GPU would wait
for (``benchmarks/syncs.py``; ``device.synchronize`` calls are listed apart, since the counter does not
see them), by the line that makes them.

    python benchmarks/bench_syncs.py [--no-readme]

On the tiny Llama target of the tests (6 layers, hidden 48, 3 captured layers) and its 6 rows of 1-15
tokens, what ``tests/test_packing_capture.py`` and ``tests/test_host_syncs.py`` pin:

* a rollout worker's step (``RolloutWorker.rollout_step``: collate, capture, the sends, here kept
  in memory), padded, and in packed target rows (``rollout.pack_tokens=16``: three packed rows);
* a train worker's features (``TrainWorker._features``: the feature check and the features-lost flag,
  in the all-reduce every step makes; here the identity, one process) over 3 micro-batches;
* an EAGLE-3 ``DraftTrainer.step`` over 2 micro-batches (TTT length 3).

The counts are the same on every CPU; they are a GPU's waits, not timed.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import append_section, header_markdown, markdown_table  # noqa: E402


def _by_line(syncs) -> str:
    got = collections.Counter()
    for where, n in syncs.where.items():  # "file:line function"
        got[where] += n
    return ", ".join(f"`{w}` {n}" for w, n in sorted(got.items())) or "none"


def measure() -> list[list]:
    import types

    import torch

    import specforge.runtime.workers as workers
    from benchmarks.launches import optimizer_steps
    from benchmarks.syncs import HostSyncs
    from specforge.models.target import TargetModel
    from specforge.training.trainer import local_batches
    from tests.helpers.models import tiny_target
    from tests.helpers.trainer import feature_batch, setup_trainer
    from tests.test_packing_capture import LENGTHS, PLAN, _rollout_worker, _train_worker

    torch.set_num_threads(1)
    target = TargetModel(model=tiny_target(), tokenizer=types.SimpleNamespace(pad_token_id=0),
                         aux_layer_ids=[1, 2, 3], device=torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": torch.randint(3, 320, (n,), generator=g).tolist(), "loss_mask": [0] + [1] * (n - 1)}
            for n in LENGTHS]
    waits: list = []
    real = workers.synchronize
    workers.synchronize = lambda device: waits.append(device) or real(device)
    out = []
    try:
        for name, pack in (("rollout step, padded rows", None), ("rollout step, packed rows (pack_tokens=16)", 16)):
            w, _ = _rollout_worker(target, rows, pack)
            w.rollout_step(PLAN)  # the first call builds what later ones reuse
            del waits[:]
            with HostSyncs() as s:
                w.rollout_step(PLAN)
            out.append([name, s.count, len(waits), _by_line(s)])
        batches = local_batches(target, rows, 2, 1024)
        tw = _train_worker(batches, target.aux_layer_ids)
        del waits[:]
        with HostSyncs() as s:
            tw._features(PLAN, ())
        out.append([f"train worker's features, {len(batches)} micro-batches", s.count, len(waits), _by_line(s)])
    finally:
        workers.synchronize = real
    ttarget, trows, trainer = setup_trainer(seed=0)
    b = feature_batch(ttarget, trows)
    trainer.step([b, b])  # AdamW's state exists from here on
    with HostSyncs() as s:
        s.mark_host(b.length_B, *optimizer_steps(trainer.optimizer))  # host metadata, host counters
        trainer.step([b, b])
    out.append(["EAGLE-3 DraftTrainer.step, 2 micro-batches", s.count, 0, _by_line(s)])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-readme", action="store_true", help="print the table only")
    args = ap.parse_args()
    rows = measure()
    table = markdown_table(["what", "host syncs", "device.synchronize", "where (file:line function, count)"], rows)
    body = (f"`python benchmarks/bench_syncs.py`: {__doc__.split(chr(10) + chr(10))[0].strip()}\n\n"
            f"{header_markdown()}\n\n{table}\n\n"
            "A train step is the features' read plus the trainer's: 1 + (m + 1) for EAGLE-3 over m micro-batches "
            "(its loss reads its rows' sizes once per micro-batch; the step copies counters and gradient norm once). "
            "The rollout step reads nothing: its features are checked by the train ranks that receive them, and its "
            "forward's timer is a CUDA event read after the sends are posted (`device.StageClock`). Packed rows add "
            "transformers' own read of the position ids per packed row.")
    print(table)
    if not args.no_readme:
        append_section("Host syncs of a rollout step and a train step", body)


if __name__ == "__main__":
    main()
