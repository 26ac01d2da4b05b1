"""What checking a feature-store shard's sha256 at its first open costs a reading process.

    python benchmarks/bench_shard_check.py [--shard-mb 256] [--repeats 3] [--no-readme]

A store of one shard of about ``--shard-mb`` MiB (Llama-8B-like rows: hidden 4096, 3 captured layers,
bf16; random features) is written to a temporary folder; a fresh ``FeatureStore`` then reads one
sample (the first read of the shard: its open, with the check ``FeatureStore._check_sha256``, which
reads the whole file) and a second sample (the shard already open), once as shipped and once with
the check stubbed out. The shard file is in the page cache (just written), as it is for a run that
reads a store it captured; a cold read from disk adds the disk's own read of the file.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import append_section, header_markdown, markdown_table  # noqa: E402
from specforge.data.store import FeatureStore, FeatureStoreWriter, StoreMeta  # noqa: E402

H, K, T = 4096, 3, 2048  # hidden, captured layers, tokens a sample


def write_store(root: Path, shard_mb: float) -> int:
    meta = StoreMeta(target="t", tokenizer="k", vocab_size=1000, aux_layer_ids=tuple(range(K)), hidden_size=H,
                     max_length=T, source="bench")
    samples = max(2, int(shard_mb * 2**20 / (T * (K + 1) * H * 2)))
    with FeatureStoreWriter(root, meta, shard_mb=shard_mb * 1.5) as w:  # one shard: the buffer never fills
        for i in range(samples):
            w.add(i, torch.randint(0, 1000, (T,)), torch.ones(T), torch.randn(T, K * H), torch.randn(T, H),
                  torch.randint(0, 1000, (T,)))
    return sum(p.stat().st_size for p in root.glob("shard-*"))


def first_and_next(root: Path, check: bool) -> tuple[float, float]:
    store = FeatureStore(root)
    if not check:
        store._check_sha256 = lambda shard: None
    t0 = time.perf_counter()
    store.read(0)
    t1 = time.perf_counter()
    store.read(1)
    return t1 - t0, time.perf_counter() - t1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shard-mb", type=float, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-readme", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        size = write_store(Path(d), args.shard_mb)
        rows = []
        for check in (True, False):
            runs = [first_and_next(Path(d), check) for _ in range(args.repeats)]
            first, nxt = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
            rate = f"{size / first / 1e9:.2f}" if check else "-"
            rows.append(["sha256 at first open" if check else "no check", f"{size / 2**20:.0f}",
                         f"{first * 1e3:.0f}", f"{nxt * 1e3:.1f}", rate])
    table = markdown_table(["reader", "shard MiB", "first read ms", "next read ms", "GB/s checked"], rows)
    body = (f"{header_markdown()}\n\n`python benchmarks/bench_shard_check.py` (median of {args.repeats}; one "
            f"thread; the shard in the page cache). Each process pays the first-read cost once per shard it "
            f"opens (a DP rank reading a 100 GB store: about 100 GB / the rate above over its run).\n\n{table}")
    print(table)
    if not args.no_readme:
        append_section("Feature store: the sha256 check at a shard's first open", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
