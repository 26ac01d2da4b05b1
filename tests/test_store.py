"""The offline feature store and ``python -m specforge.capture`` on tiny random Llama targets."""

import dataclasses
import json
import os
from collections import namedtuple
from pathlib import Path

import pytest
import torch

import specforge.capture as capture_mod
import specforge.data.store as store_mod
import specforge.models.target as target_mod
from specforge.capture import iter_features, main, plan_batches, write_store
from specforge.config import Config, DataConfig
from specforge.data.store import (
    INDEX,
    FeatureStore,
    FeatureStoreWriter,
    bytes_per_token,
    check_disk,
    dequantize_rows,
    quantize_rows,
    quantize_smooth,
    store_meta,
    target_fingerprint,
)
from specforge.models.target import TargetModel
from specforge.training.batch import collate
from tests.helpers.models import tiny_target

AUX = [1, 2, 3]
SHARD_MB = 0.03  # ~5 samples per shard at H=48: several shards from a dozen samples
TOKENS = 80  # padded tokens per target forward: several forwards from a dozen samples


def make_target(seed=0):
    torch.manual_seed(seed)
    model = tiny_target(num_layers=6)
    if seed:  # a different checkpoint of the same architecture
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
    return TargetModel(model=model, tokenizer=None, aux_layer_ids=AUX, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def target():
    return make_target()


@pytest.fixture(scope="module")
def rows():
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(14):
        n = int(torch.randint(5, 40, (1,), generator=g))
        mask = (torch.arange(n) >= n // 3).long()
        out.append({"input_ids": torch.randint(0, 320, (n,), generator=g).tolist(), "loss_mask": mask.tolist()})
    return out


@pytest.fixture(scope="module")
def meta(target):
    return store_meta(Config(data=DataConfig(max_length=64)), target, source="test-rows")


def reference(target, rows):
    """Features exactly as write_store computes them (same batches, same padding)."""
    lengths = [len(r["input_ids"]) for r in rows]
    return dict(iter_features(target, rows, plan_batches(lengths, 2, TOKENS), 1024))


def write(target, rows, root, meta, dtype="bfloat16"):
    return write_store(target, rows, root, meta, dtype, SHARD_MB, batch_size=2, progress=False, max_tokens=TOKENS)


def index(root):
    return json.loads((root / "index.json").read_text())


# ---------------------------------------------------------------- round trip


def test_bf16_round_trip_is_exact(target, rows, meta, tmp_path):
    write(target, rows, tmp_path, meta)
    store = FeatureStore(tmp_path, expect=meta)
    assert len(index(tmp_path)["shards"]) > 1
    assert store.ids == list(range(len(rows))) and store.dtype == "bfloat16"
    assert store.lengths == {i: len(r["input_ids"]) for i, r in enumerate(rows)}
    ref = reference(target, rows)
    for sid in store.ids:
        got, want = store.read(sid), ref[sid]
        assert got["input_ids"].dtype == torch.int64 and got["input_ids"].tolist() == rows[sid]["input_ids"]
        assert got["loss_mask"].tolist() == rows[sid]["loss_mask"]
        assert torch.equal(got["target_ids"], want["target_ids_T"])
        assert torch.equal(got["aux_hidden"], want["aux_hidden_TKH"].to(torch.bfloat16))
        assert torch.equal(got["last_hidden"], want["last_hidden_TH"].to(torch.bfloat16))
    part = store.read(3, start=2, stop=7)  # an SP rank's slice
    assert torch.equal(part["aux_hidden"], store.read(3)["aux_hidden"][2:7])


def test_int8_round_trip_within_bound(target, rows, meta, tmp_path):
    write(target, rows, tmp_path, meta, dtype="int8")
    store = FeatureStore(tmp_path, expect=meta)
    ref = reference(target, rows)
    for sid in store.ids:
        got = store.read(sid)
        assert got["aux_hidden"].dtype == torch.float32
        assert torch.equal(got["target_ids"], ref[sid]["target_ids_T"])  # ids are never quantized
        for name, key in (("aux_hidden", "aux_hidden_TKH"), ("last_hidden", "last_hidden_TH")):
            want = ref[sid][key]
            assert (got[name] - want).norm() / want.norm() < 0.01


def test_int8_smoothing_handles_outlier_channels_and_small_layers():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3 * 32, generator=g)
    x[[0, 17], 5] = 3000.0  # massive activations: one channel on a few tokens, as in real Llama layers
    x[:, 9] *= 20  # a channel that is large on every token
    x[:, 64:] *= 1e-3  # a captured layer with a much smaller range
    q, row, col = quantize_smooth(x.to(torch.bfloat16), groups=3, alpha=0.5)
    assert q.dtype == torch.int8 and row.shape == (64, 3) and col.shape == (96,)
    y = dequantize_rows(q, row, col)
    plain = dequantize_rows(*quantize_rows(x, groups=3))  # one absmax per token and layer, no smoothing
    normal = torch.ones(96, dtype=torch.bool)
    normal[[5, 9]] = False
    normal[64:] = False

    def err(z, cols):
        return float((z[:, cols] - x[:, cols]).norm() / x[:, cols].norm())

    assert err(y, normal) < 0.03 and err(plain, normal) > 3 * err(y, normal)
    assert err(y, torch.arange(96) >= 64) < 0.01  # per-layer row scales keep the small layer


def test_bytes_on_disk_match_bytes_per_token(target, rows, meta, tmp_path):
    sizes = {}
    for dtype in ("bfloat16", "int8"):
        root = tmp_path / dtype
        write(target, rows, root, meta, dtype)
        idx = index(root)
        tokens = sum(sh["tokens"] for sh in idx["shards"])
        sizes[dtype] = sum((root / sh["file"]).stat().st_size for sh in idx["shards"]) / tokens
        # the rest: safetensors JSON headers and int8 column scales, per shard (large next to tiny H=48 shards)
        assert bytes_per_token(48, dtype) <= sizes[dtype] <= bytes_per_token(48, dtype) * 1.15
    assert bytes_per_token(576, "bfloat16") == 4 * 576 * 2 + 9
    assert bytes_per_token(576, "int8") < 0.52 * bytes_per_token(576, "bfloat16")
    with pytest.raises(ValueError, match="store.dtype"):
        bytes_per_token(48, "float8")


def test_batch_pads_like_collate(target, rows, meta, tmp_path):
    write(target, rows, tmp_path, meta)
    store = FeatureStore(tmp_path)
    ids = [4, 0, 9]
    b = store.batch(ids, pad_id=7)
    want_ids, want_mask, attn = collate([rows[i] for i in ids], 7)
    assert torch.equal(b.input_ids_BT, want_ids) and torch.equal(b.loss_mask_BT, want_mask)
    T = want_ids.shape[1]
    assert b.aux_hidden_BTKH.shape == (3, T, 3 * 48) and b.last_hidden_BTH.shape == (3, T, 48)
    for j, sid in enumerate(ids):
        n = store.lengths[sid]
        one = store.read(sid)
        assert torch.equal(b.aux_hidden_BTKH[j, :n], one["aux_hidden"])
        assert torch.equal(b.target_ids_BT[j, :n], one["target_ids"])
        assert not b.aux_hidden_BTKH[j, n:].any() and not b.last_hidden_BTH[j, n:].any()
        assert not b.target_ids_BT[j, n:].any() and not b.loss_mask_BT[j, n:].any()


# ---------------------------------------------------------------- resume


def test_interrupted_capture_resumes_without_rewriting_shards(target, rows, meta, tmp_path, monkeypatch):
    full = tmp_path / "full"
    write(target, rows, full, meta)

    real, calls = target_mod.capture, []

    class Killed(Exception):  # stands for Ctrl-C / a kill: the writer must not flush on the way out
        pass

    def dies_on_fifth_forward(*a, **k):
        calls.append(1)
        if len(calls) == 5 and not resuming:
            raise Killed
        return real(*a, **k)

    resuming = False
    monkeypatch.setattr(capture_mod, "capture", dies_on_fifth_forward)  # the capture write_store calls
    root = tmp_path / "resumed"
    with pytest.raises(Killed):
        write(target, rows, root, meta)
    partial = index(root)
    assert not partial["complete"] and 0 < len(partial["shards"]) < len(index(full)["shards"])
    with pytest.raises(ValueError, match="incomplete"):
        FeatureStore(root)
    kept = {sh["file"]: os.stat(root / sh["file"]) for sh in partial["shards"]}
    done = {s["id"] for sh in partial["shards"] for s in sh["samples"]}
    stale = root / f"shard-{len(partial['shards']):05d}.safetensors"
    stale.write_bytes(b"half-written shard that never made it into the index")

    calls.clear()
    resuming = True
    write(target, rows, root, meta)
    batches = plan_batches([len(r["input_ids"]) for r in rows], 2, TOKENS)
    assert len(calls) == sum(1 for b in batches if not done.issuperset(b))  # finished batches skipped
    for name, st in kept.items():
        now = os.stat(root / name)
        assert (now.st_ino, now.st_mtime_ns, now.st_size) == (st.st_ino, st.st_mtime_ns, st.st_size)
    assert index(root) == index(full)  # same shards, same bytes (sha256), same sample placement
    FeatureStore(root).verify()


def test_writer_refuses_other_meta_or_dtype(target, rows, meta, tmp_path):
    write(target, rows[:3], tmp_path, meta)
    with pytest.raises(ValueError, match="max_length"):
        FeatureStoreWriter(tmp_path, dataclasses.replace(meta, max_length=32))
    with pytest.raises(ValueError, match="store.dtype"):
        FeatureStoreWriter(tmp_path, meta, dtype="int8")
    w = FeatureStoreWriter(tmp_path, meta)
    assert w.done() == {0, 1, 2}
    with pytest.raises(ValueError, match="already in the feature store"):
        w.add(1, *[torch.zeros(2)] * 5)


# ---------------------------------------------------------------- identity


@pytest.mark.parametrize("field,other", [("target", None), ("max_length", 32), ("vocab_size", 999),
                                         ("tokenizer", "another-tokenizer"), ("source", "other-data")])
def test_store_of_another_setup_is_refused(target, rows, meta, tmp_path, field, other):
    write(target, rows[:3], tmp_path, meta)
    if field == "target":
        other = target_fingerprint(make_target(seed=1))
    with pytest.raises(ValueError, match=rf"different setup: {field} \(store"):
        FeatureStore(tmp_path, expect=dataclasses.replace(meta, **{field: other}))


def test_target_fingerprint_ignores_dtype_not_weights():
    a, b = make_target(), make_target()
    b.model.to(torch.bfloat16)
    assert target_fingerprint(a) == target_fingerprint(b)
    assert target_fingerprint(a) != target_fingerprint(make_target(seed=1))


# ---------------------------------------------------------------- corruption and disk


def test_corrupt_or_truncated_shard_names_the_file(target, rows, meta, tmp_path):
    write(target, rows, tmp_path, meta)
    shards = index(tmp_path)["shards"]
    first, second, third = (tmp_path / sh["file"] for sh in shards[:3])
    in_first, in_second, in_third = (sh["samples"][0]["id"] for sh in shards[:3])

    last_in_third = shards[2]["samples"][-1]["id"]  # the flipped byte below is in its rows
    want = {k: v.clone() for k, v in FeatureStore(tmp_path).read(last_in_third).items()}
    data = bytearray(third.read_bytes())
    data[-3] ^= 0xFF  # a flipped bit in the tensor bytes (the size unchanged): only the checksum sees it
    third.write_bytes(bytes(data))
    corrupt = (rf"{third.name} is corrupt \(sha256 differs from the index.*delete it and rerun the python -m "
               rf"specforge\.capture command that wrote {tmp_path}: it captures that shard's "
               rf"{len(shards[2]['samples'])} samples again")
    with pytest.raises(ValueError, match=corrupt):  # checked at the shard's first open in a process
        FeatureStore(tmp_path).read(in_third)
    with pytest.raises(ValueError, match=corrupt):
        FeatureStore(tmp_path).verify()
    FeatureStore(tmp_path).read(in_first)  # control: the intact shards still read
    unchecked = FeatureStore(tmp_path)
    unchecked._check_sha256 = lambda sh: None  # control: without the checksum the flipped bytes read silently
    assert not all(torch.equal(v, want[k]) for k, v in unchecked.read(last_in_third).items())
    # the fix the line names: the shard deleted, the capture rerun redoes its samples alone, as they were
    third.unlink()
    write(target, rows, tmp_path, meta)
    assert {sh["file"] for sh in index(tmp_path)["shards"]} >= {first.name, second.name}
    got = FeatureStore(tmp_path).read(last_in_third)
    assert all(torch.equal(got[k], want[k]) for k in want)

    data = first.read_bytes()
    first.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=rf"{first.name} is truncated"):
        FeatureStore(tmp_path).read(in_first)

    data = second.read_bytes()
    second.write_bytes(b"\xff" * 16 + data[16:])  # same size, unreadable header: the checksum names it first
    with pytest.raises(ValueError, match=rf"{second.name} is corrupt \(sha256 differs"):
        FeatureStore(tmp_path).read(in_second)

    (tmp_path / "index.json").write_text("{not json")
    with pytest.raises(ValueError, match="index.json is corrupt"):
        FeatureStore(tmp_path)
    with pytest.raises(ValueError, match="no feature store"):
        FeatureStore(tmp_path / "nowhere")



def test_a_shard_changed_while_the_run_reads_it_is_caught_at_the_next_read(target, rows, meta, tmp_path,
                                                                           monkeypatch):
    """A shard already checked and open in this process (memory-mapped), then written to by another job,
    the size unchanged: the next read checks it again (its inode, size and mtime changed) and names it,
    instead of reading the new bytes through the open map."""
    from specforge.data import store as store_module

    write(target, rows, tmp_path, meta)
    sh = index(tmp_path)["shards"][0]
    path, first, last = tmp_path / sh["file"], sh["samples"][0]["id"], sh["samples"][-1]["id"]
    store, blind = FeatureStore(tmp_path), FeatureStore(tmp_path)
    want = {k: v.clone() for k, v in store.read(last).items()}
    assert all(torch.equal(store.read(last)[k], want[k]) for k in want)  # control: untouched, read again
    blind.read(last)
    with open(path, "r+b") as f:  # in place (same inode): an open map sees the new bytes
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ValueError, match=rf"{path.name} is corrupt \(sha256 differs"):
        store.read(first)
    # control: the same open store without the stamp reads the flipped bytes silently
    monkeypatch.setattr(store_module, "_stamp", lambda p: blind._seen[0])
    assert not all(torch.equal(v, want[k]) for k, v in blind.read(last).items())


Usage = namedtuple("Usage", "total used free")


def test_check_disk_refuses_before_writing(target, rows, meta, tmp_path, monkeypatch):
    monkeypatch.setattr(store_mod.shutil, "disk_usage", lambda p: Usage(10_000, 9_000, 1_000))
    check_disk(tmp_path / "not" / "yet", 900)  # 945 with the margin: fits
    with pytest.raises(ValueError, match=r"needs 1\.0 KiB .*1000 B free"):
        check_disk(tmp_path, 1_000)
    with pytest.raises(ValueError, match="not enough disk space"):
        write(target, rows, tmp_path / "store", meta)
    assert not list((tmp_path / "store").glob("shard-*"))


# ---------------------------------------------------------------- the CLI


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tiny random Llama target + ChatML tokenizer folder and a tiny ShareGPT JSONL (12 rows)."""
    from tests.helpers.data import write_tiny_assets

    write_tiny_assets(root := tmp_path_factory.mktemp("assets"), num_rows=12)
    return root


def cli_args(assets, out, *extra):
    return [f"model.target_path={assets / 'target'}", "model.dtype=float32", f"model.cache_dir={assets / 'cache'}",
            f"data.path={assets / 'data.jsonl'}", "data.max_length=64", "data.num_eval=2", "train.batch_size=2",
            f"train.output_dir={out}", "store.shard_mb=0.02", "--no-progress", *extra]


def test_capture_cli_end_to_end(assets, tmp_path, capsys):
    from specforge.config import load_config
    from specforge.data.prepare import prepare_dataset
    from specforge.models.target import capture, load_target

    assert main(cli_args(assets, tmp_path)) == 0
    out = capsys.readouterr().out
    assert "B/token (bfloat16)" in out and "0 samples already stored" in out

    overrides = [a for a in cli_args(assets, tmp_path) if "=" in a]
    cfg = load_config(None, overrides)
    tgt = load_target(cfg.model)
    data = prepare_dataset(cfg.data, tgt.tokenizer, cache_dir=cfg.model.cache_dir, progress=False)
    store = FeatureStore(tmp_path / "features", expect=store_meta(cfg, tgt, data.cache_key))
    assert len(store) == len(data.train) == 10
    row = data.train[5]
    got = store.read(5)
    assert got["input_ids"].tolist() == row["input_ids"] and got["loss_mask"].tolist() == row["loss_mask"]
    alone = capture(tgt, torch.tensor([row["input_ids"]]))  # unpadded: equal up to bf16 rounding
    torch.testing.assert_close(got["aux_hidden"].float(), alone.aux_hidden_BTKH[0], atol=0.05, rtol=0.02)

    assert main(cli_args(assets, tmp_path)) == 0  # a complete store: nothing to do
    assert "10 samples already stored, 0 B to write" in capsys.readouterr().out

    assert main(cli_args(assets, tmp_path, "store.dtype=int8")) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "store.dtype" in last
    assert main(cli_args(assets, tmp_path, "data.max_length=32")) == 1
    assert "max_length (store: 64, this run: 32)" in capsys.readouterr().err


def test_a_capture_killed_while_it_rewrites_the_index_resumes_to_the_same_store(assets, tmp_path):
    """``python -m specforge.capture`` SIGKILLed at its second index rewrite (held there by a failpoint: the
    new index written to its temp file, not yet renamed): the store keeps the index before it, which opens
    as the partial store it is; the same command then completes it, equal to an uninterrupted capture's
    (same shards, same bytes) and intact. The control: a capture held at the first rewrite has no index."""
    import signal
    import subprocess
    import sys
    import time

    repo = Path(__file__).resolve().parent.parent

    def capture(out, failpoint=None):
        env = {**os.environ, "SPECFORGE_FAILPOINTS": failpoint or "",
               "SPECFORGE_FAILPOINT_DIR": str(tmp_path / "marks")}
        return subprocess.Popen([sys.executable, "-m", "specforge.capture", *cli_args(assets, out)], cwd=repo, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def killed_at(out, n):
        mark = tmp_path / "marks" / "store.index"
        mark.unlink(missing_ok=True)
        p = capture(out, f"store.index:pause@{n}")
        deadline = time.monotonic() + 300
        while not mark.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mark.exists(), p.communicate()[0][-2000:]
        p.send_signal(signal.SIGKILL)
        p.wait(30)
        return out / "features"

    first = killed_at(tmp_path / "first", 1)
    assert not (first / INDEX).exists() and (first / (INDEX + ".tmp")).exists()  # the control
    root = killed_at(tmp_path / "killed", 2)
    partial = index(root)
    assert not partial["complete"] and len(partial["shards"]) == 1
    with pytest.raises(ValueError, match="incomplete"):
        FeatureStore(root)
    assert len(FeatureStore(root, allow_partial=True)) == len(partial["shards"][0]["samples"])
    p = capture(tmp_path / "killed")  # the same command
    assert p.wait(300) == 0, p.communicate()[0][-2000:]
    assert main(cli_args(assets, tmp_path / "straight")) == 0
    assert index(root) == index(tmp_path / "straight" / "features")
    FeatureStore(root).verify()
    assert not (root / (INDEX + ".tmp")).exists()


def test_the_writer_never_stores_nan_or_an_all_zero_layer(meta, tmp_path):
    """Whatever computed them (a capture, regenerate's, an engine), features go through the writer, which
    refuses NaN or inf anywhere and a captured layer that is all zeros, naming the layer and the store;
    nothing of the refused sample is written. Control: a sample zero in some tokens of a layer is kept."""
    K, H = len(meta.aux_layer_ids), meta.hidden_size
    ids, mask, last, tgt = torch.arange(4), torch.ones(4), torch.randn(4, H), torch.arange(4)
    with FeatureStoreWriter(tmp_path, meta) as w:
        nan = torch.randn(4, K * H)
        nan[2, H + 1] = float("nan")
        with pytest.raises(ValueError, match=rf"feature store {tmp_path}: captured target layer "
                                             rf"{meta.aux_layer_ids[1]} .*NaN or inf"):
            w.add(0, ids, mask, nan, last, tgt)
        zero = torch.randn(4, K, H)
        zero[:, 2] = 0
        with pytest.raises(ValueError, match=rf"layer {meta.aux_layer_ids[2]} .*is all zeros"):
            w.add(0, ids, mask, zero.view(4, K * H), last, tgt)
        some = torch.randn(4, K, H)
        some[:3, 2] = 0  # the control: one token of the layer lives
        w.add(0, ids, mask, some.view(4, K * H), last, tgt)
    assert FeatureStore(tmp_path).lengths == {0: 4}
