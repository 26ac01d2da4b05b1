"""Data plane transfer: our P2PTransport vs raw torch.distributed send/recv vs the Ray object store.

Two Ray actors (rank 0 = rollout, rank 1 = train) in one communicator move the same EAGLE-3
features (SmolLM2-135M shapes: per token 3*576 + 576 bf16 + target/input ids + loss mask) for a
step of 8 samples at several sizes. Each measurement starts after a barrier and is timed on the
receiver until the last byte is usable; GB/s counts feature payload bytes. Also prints the wire
bytes per token against shipping full-vocabulary logits.

    python benchmarks/bench_transfer.py [--sizes-mb 1 8 64] [--no-readme]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ray  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import append_section, header_markdown, machine_info, markdown_table  # noqa: E402

from specforge.contracts import FeatureSpec, SampleRef  # noqa: E402
from specforge.runtime.actors import DistributedWorker, gather, init_communicator, spawn_actors  # noqa: E402
from specforge.runtime.dataplane import (  # noqa: E402
    ObjectStoreTransport,
    P2PTransport,
    Prefetcher,
    SendWindow,
    spawn_mailbox,
    synthetic_features,
)
from specforge.runtime.plan import plan_step  # noqa: E402

SMOL_H, SMOL_V = 576, 49152
LLAMA_H, LLAMA_V = 4096, 128256
SPEC = FeatureSpec.hidden_states(SMOL_H)
SAMPLES_PER_STEP = 8
SRC, DST = 0, 1


def make_plans(size_mb: float, num_steps: int) -> list:
    length = max(1, round(size_mb * 2**20 / SPEC.bytes_per_token() / SAMPLES_PER_STEP))
    return [
        plan_step(step, [[SampleRef(i, length) for i in range(SAMPLES_PER_STEP)]], [SRC], [[DST]], SPEC)
        for step in range(num_steps)
    ]


class BenchPeer(DistributedWorker):
    def __init__(self):
        super().__init__(num_threads=1)
        self.features = {}

    def prepare(self, plan) -> int:
        lengths = dict(plan.lengths)
        self.features = {sid: synthetic_features(SPEC, sid, lengths[sid]) for sid in plan.batch_of(SRC)}
        return len(self.features)

    def measure(self, plan, reps: int) -> dict[str, list[float]]:
        """Time one step of each method, interleaved rep by rep so load drift (other processes
        on the machine) hits every method alike. Each timing starts after a barrier."""
        rank = dist.get_rank()
        transports = {
            "p2p auto (default)": P2PTransport(pack="auto"),
            "p2p packed": P2PTransport(pack=True),
            "p2p per-field": P2PTransport(pack=False),
            "object store": ObjectStoreTransport(rank=rank),
        }
        steps = {name: self._transport_fn(plan, t) for name, t in transports.items()}
        steps["raw send/recv"] = self._raw_fn(plan, blocking=True)
        steps["raw isend/irecv"] = self._raw_fn(plan, blocking=False)
        names, times = list(steps), {name: [] for name in steps}
        for rep in range(reps + 1):  # rep 0 warms up; each rep starts at another method
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                fn = steps[name]
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                if rep:
                    times[name].append(time.perf_counter() - t0)
        return times

    def _transport_fn(self, plan, transport):
        if dist.get_rank() == SRC:
            return lambda: transport.send_step(plan, self.features).wait()
        return lambda: transport.post_recv(plan).release()  # wait, then done with the step

    def _raw_fn(self, plan, blocking: bool):
        """The same tensors with plain torch.distributed, one message per field: blocking
        send/recv in turn, or every isend/irecv posted at once and then waited on."""
        slices = [(tr, f) for tr in plan.transfers for f in SPEC.fields]
        dtypes = {"bfloat16": torch.bfloat16, "int64": torch.int64, "int8": torch.int8}
        if dist.get_rank() == SRC:
            def step():
                tensors = [self.features[tr.sample_id][f.name][tr.start : tr.stop] for tr, f in slices]
                if blocking:
                    for t in tensors:
                        dist.send(t, DST)
                else:
                    for w in [dist.isend(t, DST) for t in tensors]:
                        w.wait()
            return step

        def step():
            tensors = [torch.empty(f.shape(tr.num_tokens), dtype=dtypes[f.dtype]) for tr, f in slices]
            if blocking:
                for t in tensors:
                    dist.recv(t, SRC)
            else:
                for w in [dist.irecv(t, SRC) for t in tensors]:
                    w.wait()
        return step

    def pipelined(self, plans, pack, inflight_steps: int = 2) -> float:
        """Steady state: receiver keeps ``inflight_steps`` posted (Prefetcher), sender keeps as
        many outstanding (SendWindow). Returns seconds per step (no compute to hide behind)."""
        rank, transport = dist.get_rank(), P2PTransport(pack=pack)
        budget = inflight_steps * plans[0].recv_bytes(DST)
        dist.barrier()
        t0 = time.perf_counter()
        if rank == SRC:
            window = SendWindow(budget)
            for plan in plans:
                window.push(transport.send_step(plan, self.features))
            window.drain()
        else:
            for _ in Prefetcher(transport, plans, max_inflight_bytes=budget):
                pass
        return (time.perf_counter() - t0) / len(plans)


def run(sizes_mb: list[float], write_readme: bool) -> None:
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=True, _temp_dir="/tmp/sfray")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    group = spawn_actors(BenchPeer, 2, num_cpus=1, label="peer", timeout_s=120)
    group.labels = ["rollout[0]", "train[0]"]
    init_communicator(group.actors, group.labels, timeout_s=120)
    mailbox = spawn_mailbox()  # noqa: F841  (the driver owns it for the run)

    def both(method, *args):
        return gather([getattr(a, method).remote(*args) for a in group.actors], group.labels, 600, what=method)[DST]

    rows, series = [], {}
    for size in sizes_mb:
        reps = 40 if size <= 2 else 20 if size <= 16 else 12
        plans = make_plans(size, num_steps=max(reps, 8))
        payload = plans[0].recv_bytes(DST)
        both("prepare", plans[0])
        results = both("measure", plans[0], reps)
        best = {k: payload / min(v) / 1e9 for k, v in results.items()}
        median = {k: payload / statistics.median(v) / 1e9 for k, v in results.items()}
        best["p2p auto, pipelined"] = median["p2p auto, pipelined"] = payload / both("pipelined", plans, "auto") / 1e9
        for k, v in median.items():
            series.setdefault(k, []).append(v)
        ours, best_raw = median["p2p auto (default)"], max(median["raw send/recv"], median["raw isend/irecv"])
        rows.append([
            f"{payload / 2**20:.1f}", plans[0].transfers[0].num_tokens * SAMPLES_PER_STEP, reps,
            *(f"{median[k]:.2f} ({best[k]:.2f})" for k in best),
            f"{ours / best_raw:.2f}x", f"{ours / median['object store']:.1f}x",
        ])
        print(f"{size} MB, median (best) GB/s: " + ", ".join(f"{k} {median[k]:.2f} ({best[k]:.2f})" for k in best),
              flush=True)
    group.shutdown()
    ray.shutdown()

    headers = ["MiB/step", "tokens", "reps", *series, "auto/best raw", "auto/object store"]
    table = markdown_table(headers, rows)
    wire = bytes_per_token_table()
    plot = Path(__file__).with_suffix(".png")
    save_plot(plot, [r[0] for r in rows], series)
    body = "\n\n".join([
        f"`python benchmarks/bench_transfer.py` -- {header_markdown(machine_info())}",
        "Two Ray actors, one gloo communicator, one step = 8 SmolLM2-135M samples "
        f"({SPEC.bytes_per_token()} B/token: aux 3H + last H bf16, target/input ids int64, loss mask int8). "
        "GB/s of payload: median of `reps` timed steps (best in parentheses; single steps vary by up to 2x, "
        "more on a shared machine), each timed on the receiver from a barrier until the data is usable. "
        "\"packed\" = one message per (sample, destination), \"per-field\" = one per field; "
        "\"auto\" (ours, the default) packs slices under 4 MiB, \"best raw\" = the better of "
        "blocking send/recv and all-posted isend/irecv of the same tensors (one message per field). "
        "Methods are interleaved rep by rep in rotating order, so background load affects all alike. "
        "\"pipelined\" = Prefetcher/SendWindow with 2 steps in flight, mean over the run (no compute to "
        "overlap here, so it shows the queueing overhead, not a gain). Ratios use the medians.",
        table,
        "Bytes per token on the wire (ours) vs shipping full-vocabulary logits instead of the last hidden state:",
        wire,
        f"![transfer throughput]({plot.name})",
    ])
    print("\n" + body)
    if write_readme:
        append_section("Data plane transfer", body)


def bytes_per_token_table() -> str:
    rows = []
    for name, h, v in [("SmolLM2-135M", SMOL_H, SMOL_V), ("Llama-3-8B", LLAMA_H, LLAMA_V)]:
        ours = FeatureSpec.hidden_states(h).bytes_per_token()
        ids = 8 + 8 + 1  # target ids, input ids, loss mask
        logits_bf16 = 3 * h * 2 + v * 2 + ids
        logits_fp32 = 3 * h * 2 + v * 4 + ids
        rows.append([name, h, v, f"{ours:,} ({ours / 1024:.1f} KiB)", f"{logits_bf16:,} ({logits_bf16 / 1024:.1f} KiB)",
                     f"{logits_fp32:,} ({logits_fp32 / 1024:.1f} KiB)",
                     f"{logits_bf16 / ours:.1f}x / {logits_fp32 / ours:.1f}x"])
    return markdown_table(["target", "H", "V", "ours: aux 3H + last H (bf16) + ids, B", "aux + logits bf16, B",
                           "aux + logits fp32, B", "logits/ours (bf16 / fp32)"], rows)


def save_plot(path: Path, sizes: list[str], series: dict[str, list[float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [float(s) for s in sizes]
    for name, ys in series.items():
        ax.plot(xs, ys, marker="o", label=name, linestyle="--" if "pipelined" in name else "-")
    ax.set_xscale("log")
    ax.set_xlabel("MiB per step")
    ax.set_ylabel("GB/s (payload, median)")
    ax.set_title("Feature transfer between two Ray actors (gloo, loopback)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 8, 64])
    parser.add_argument("--no-readme", action="store_true", help="print only; do not update benchmarks/README.md")
    args = parser.parse_args()
    run(args.sizes_mb, write_readme=not args.no_readme)
