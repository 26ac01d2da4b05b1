"""``draft.init_from``: a fresh run's draft starts from a published folder (ours, SGLang's EAGLE-3 with
upstream SpecForge's variants, a speculators/vLLM export, z-lab's DFlash), loaded strictly.

Round trips build a seeded draft on the tiny target, write it in a format, then init a draft of
another seed through the trainer's own path (``init_vocab_path`` -> ``build_draft`` ->
``apply_init_from``, as ``TrainWorker.setup``) and compare outputs on the same input; the same
draft without ``init_from`` differs (the negative control).
"""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specforge import export
from specforge.algorithms.dflash.export import save_dflash
from specforge.cli import run_cli
from specforge.config import Config, ModelConfig, TrainConfig
from specforge.data.vocab import build_draft_vocab, load_draft_vocab
from specforge.models.target import TargetModel
from specforge.registry import bound_algorithm, get_algorithm
from specforge.training.checkpoint import load_train_state, save_checkpoint
from specforge.training.init_from import apply_init_from, check_init_from, init_vocab_path
from tests.helpers.models import tiny_target
from tests.helpers.ray_run import make_cfg

V, N, AUX = 320, 48, [1, 2, 3]
EAGLE3, DFLASH = get_algorithm("eagle3"), get_algorithm("dflash")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    tiny_target().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target():
    return TargetModel(model=tiny_target(), tokenizer=None, aux_layer_ids=AUX, device=torch.device("cpu"))


def run_cfg(tmp_path, seed, algorithm="eagle3", init_from=None, **draft):
    options = get_algorithm(algorithm).options
    if algorithm == "eagle3":
        draft = {"vocab_size": N, "ttt_length": 2, **draft}
    else:
        draft = {"num_layers": 1, "block_size": 4, "mask_token_id": V - 1, **draft}
    return Config(draft=options(algorithm=algorithm, init_from=None if init_from is None else str(init_from), **draft),
                  train=TrainConfig(seed=seed, precision="fp32"), model=ModelConfig(cache_dir=str(tmp_path / "cache")))


def own_vocab(seed=3):
    g = torch.Generator().manual_seed(seed)
    rows = [{"input_ids": torch.randint(0, V, (40,), generator=g).tolist(), "loss_mask": [1] * 40} for _ in range(4)]
    return build_draft_vocab(rows, V, N)


def trainer_path(cfg, target, fallback):
    """What a run does: the vocab file (the folder's mapping with init_from), the fresh draft, the weights."""
    path = init_vocab_path(bound_algorithm(cfg), cfg, V)
    vocab = load_draft_vocab(path) if path is not None else fallback
    draft = get_algorithm(cfg.draft.algorithm).bind(cfg).build_draft(target, vocab)
    if cfg.draft.init_from is not None:
        apply_init_from(bound_algorithm(cfg), cfg, draft)
    return draft.eval()


@torch.no_grad()
def outputs(draft, dflash=False):
    g = torch.Generator().manual_seed(7)
    aux = torch.randn(1, 12, 3 * 48, generator=g)
    if dflash:
        blocks = torch.randint(0, V, (1, 2, 4), generator=g)
        return draft(aux, blocks, torch.tensor([[2, 6]]))
    ids, T = torch.randint(0, V, (1, 12), generator=g), 12
    steps = draft(ids, aux, torch.arange(T)[None], [T, T], head=lambda i, h: draft.logits(h))
    return torch.stack([s for s in steps])


def source_eagle3(tmp_path, target):
    """A seeded EAGLE-3 draft (seed 1, its own vocab), saved as our checkpoint: (draft, step folder)."""
    cfg = run_cfg(tmp_path, seed=1)
    draft = EAGLE3.bind(cfg).build_draft(target, own_vocab()).eval()
    hf_config = {**EAGLE3.hf_config(draft), "torch_dtype": "float32"}  # saved exactly (bf16 would round)
    folder = save_checkpoint(tmp_path / "src" / "checkpoints", 3, hf_config, draft.export_state_dict(),
                             train_state={"step": 3})
    return draft, folder


def upstream_sglang(folder: Path, dest: Path, target) -> Path:
    """Upstream SpecForge's variant of the SGLang folder: ``model.`` names, the target embedding saved,
    t2d as uint8 (bool elsewhere), no training_state."""
    dest.mkdir(parents=True)
    shutil.copy(folder / "config.json", dest / "config.json")
    w = load_file(folder / "model.safetensors")
    w = {("model." + k if k.startswith("midlayer.") else k): v for k, v in w.items()}
    w["embed_tokens.weight"] = target.embed_weight_VH.clone()
    w["t2d"] = w["t2d"].to(torch.uint8)
    save_file(w, str(dest / "model.safetensors"))
    return dest


@pytest.mark.parametrize("fmt", ["step", "latest", "sglang", "upstream", "vllm"])
def test_an_eagle3_draft_starts_from_each_format(tmp_path, target, target_dir, capsys, fmt):
    src, folder = source_eagle3(tmp_path, target)
    if fmt == "latest":
        folder = folder.parent / "latest"
    elif fmt == "upstream":
        folder = upstream_sglang(folder, tmp_path / "upstream", target)
    elif fmt in ("sglang", "vllm"):
        assert export.main(["--draft", str(folder), "--engine", fmt, "--out", str(tmp_path / fmt),
                            "--target", str(target_dir)]) == 0
        folder = tmp_path / fmt
    capsys.readouterr()
    fresh = trainer_path(run_cfg(tmp_path, seed=2, init_from=folder), target, own_vocab(seed=9))
    torch.testing.assert_close(outputs(fresh), outputs(src), rtol=0, atol=1e-6)
    torch.testing.assert_close(fresh.d2t, src.d2t, rtol=0, atol=0)
    # the negative control: the same seed and vocab without init_from is another draft
    other = trainer_path(run_cfg(tmp_path, seed=2), target, src_vocab(src))
    assert (outputs(other) - outputs(src)).abs().max() > 100 * (outputs(fresh) - outputs(src)).abs().max() + 1e-3


def src_vocab(draft):
    from specforge.data.vocab import DraftVocab

    return DraftVocab(draft.d2t.clone(), draft.t2d.clone())


def test_a_dflash_draft_starts_from_its_zlab_folder(tmp_path, target):
    cfg = run_cfg(tmp_path, seed=1, algorithm="dflash")
    vocab = own_vocab()
    src = DFLASH.bind(cfg).build_draft(target, vocab).eval()
    folder = save_dflash(src, tmp_path / "zlab", dtype=torch.float32)
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    fresh = trainer_path(run_cfg(tmp_path, seed=2, algorithm="dflash", init_from=folder), target, vocab)
    torch.testing.assert_close(outputs(fresh, dflash=True), outputs(src, dflash=True), rtol=0, atol=1e-6)
    other = trainer_path(run_cfg(tmp_path, seed=2, algorithm="dflash"), target, vocab)
    assert (outputs(other, dflash=True) - outputs(src, dflash=True)).abs().max() > 1e-2


# ---------------------------------------------------------------- errors


def rewritten(folder: Path, dest: Path, change) -> Path:
    shutil.copytree(folder, dest)
    w = load_file(dest / "model.safetensors")
    change(w)
    save_file(w, str(dest / "model.safetensors"))
    return dest


def test_missing_extra_and_misshapen_tensors_are_one_error(tmp_path, target):
    _, folder = source_eagle3(tmp_path, target)
    missing = rewritten(folder, tmp_path / "missing", lambda w: w.pop("midlayer.self_attn.q_proj.weight"))
    extra = rewritten(folder, tmp_path / "extra", lambda w: w.update(foo=torch.zeros(2)))
    for path, text in ((missing, "missing midlayer.self_attn.q_proj.weight"), (extra, "extra foo")):
        with pytest.raises(ValueError, match="same draft.* sizes") as e:
            trainer_path(run_cfg(tmp_path, seed=2, init_from=path), target, None)
        assert f"draft.init_from: {path}: {text}" in str(e.value)
    with pytest.raises(ValueError) as e:  # a run whose draft is wider than the folder's
        trainer_path(run_cfg(tmp_path, seed=2, init_from=folder, intermediate_size=64), target, None)
    assert "midlayer.mlp.down_proj.weight is [48, 96], the draft needs [48, 64]" in str(e.value)
    assert "; missing" not in str(e.value) and "; extra" not in str(e.value) and f"{folder}: midlayer" in str(e.value)


def test_another_algorithm_a_non_draft_and_a_vocab_size_are_refused(tmp_path, target):
    _, folder = source_eagle3(tmp_path, target)
    with pytest.raises(ValueError,
                       match=r"holds a eagle3 draft, but draft.algorithm is 'dflash': set draft.algorithm=eagle3"):
        check_init_from(run_cfg(tmp_path, seed=2, algorithm="dflash", init_from=folder))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="is not a draft folder"):
        check_init_from(run_cfg(tmp_path, seed=2, init_from=tmp_path / "model"))
    with pytest.raises(ValueError, match="no such folder"):
        check_init_from(run_cfg(tmp_path, seed=2, init_from=tmp_path / "nowhere"))
    with pytest.raises(ValueError,
                       match=f"its draft vocab has {N} tokens, draft.vocab_size is 40: set draft.vocab_size={N}"):
        vocab_path_of(run_cfg(tmp_path, seed=2, init_from=folder, vocab_size=40), V)
    with pytest.raises(ValueError, match="target vocabulary of 320 tokens, the target has 400"):
        vocab_path_of(run_cfg(tmp_path, seed=2, init_from=folder), 400)
    bad = rewritten(folder, tmp_path / "bad", lambda w: w["d2t"].__setitem__(-1, 10_000))
    with pytest.raises(ValueError, match="maps draft ids outside the target vocabulary"):
        vocab_path_of(run_cfg(tmp_path, seed=2, init_from=bad), V)


def vocab_path_of(cfg, target_vocab_size: int):
    """``init_vocab_path`` of an EAGLE-3 run of ``cfg`` (its algorithm bound to it)."""
    return init_vocab_path(EAGLE3.bind(cfg), cfg, target_vocab_size)


def test_a_config_fact_without_a_shape_is_compared(tmp_path, target):
    """Same tensors, other math: the mask token of a DFlash folder, the layers an EAGLE-3 draft fuses."""
    cfg = run_cfg(tmp_path, seed=1, algorithm="dflash")
    folder = save_dflash(DFLASH.bind(cfg).build_draft(target, own_vocab()), tmp_path / "zlab")
    with pytest.raises(ValueError, match=rf"its dflash_config.mask_token_id is {V - 1}, the run's draft has {V - 2} "
                                         rf"\(set draft.mask_token_id={V - 1}\)"):
        trainer_path(run_cfg(tmp_path, seed=2, algorithm="dflash", init_from=folder, mask_token_id=V - 2), target,
                     own_vocab())
    _, folder = source_eagle3(tmp_path, target)
    other = TargetModel(model=target.model, tokenizer=None, aux_layer_ids=[1, 2, 4], device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids is \[1, 2, 3\], the run's draft has "
                                         r"\[1, 2, 4\] \(set model.aux_layer_ids=\[1, 2, 3\]\)"):
        trainer_path(run_cfg(tmp_path, seed=2, init_from=folder), other, None)
    windowed = run_cfg(tmp_path, seed=1, sliding_window=4)
    draft = EAGLE3.bind(windowed).build_draft(target, own_vocab())
    folder = save_checkpoint(tmp_path / "windowed", 1, EAGLE3.hf_config(draft), draft.export_state_dict())
    with pytest.raises(ValueError,
                       match=r"its sliding window is 4, the run's draft has null \(set draft.sliding_window=4\)"):
        trainer_path(run_cfg(tmp_path, seed=2, init_from=folder), target, None)


def test_a_folder_a_fresh_start_would_move_aside_is_refused(assets, tmp_path):
    from specforge.train import run

    first = run(make_cfg(assets, tmp_path / "a", "train.num_workers=1", "train.max_steps=1"))
    with pytest.raises(ValueError, match="lies in this run's checkpoint folder"):
        check_init_from(make_cfg(assets, tmp_path / "a", f"draft.init_from={first}"))
    check_init_from(make_cfg(assets, tmp_path / "b", f"draft.init_from={first}"))  # another run's: fine


def test_the_cli_gives_one_error_line_before_any_model_loads(assets, tmp_path, capsys, monkeypatch):
    from specforge import train as local
    from specforge.models import target as target_module

    monkeypatch.setattr(target_module, "load_target", lambda *a, **k: pytest.fail("a model loaded"))
    dflash = tmp_path / "dflash"
    dflash.mkdir()
    (dflash / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
    args = [f"model.target_path={assets / 'target'}", f"model.cache_dir={assets / 'cache'}",
            f"data.path={assets / 'data.jsonl'}", f"train.output_dir={tmp_path / 'out'}", "tracking.wandb=false",
            f"draft.init_from={dflash}"]
    assert run_cli(lambda: local.main(args)) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "holds a dflash draft" in err[0], err


# ---------------------------------------------------------------- training from it, resuming


def test_a_run_trains_from_init_from_and_a_resume_takes_its_own_checkpoint(assets, tmp_path, monkeypatch):
    from specforge.train import run
    from specforge.training import init_from as init_module

    first = run(make_cfg(assets, tmp_path / "a", "train.num_workers=1", "train.max_steps=2"))
    start = load_file(first / "model.safetensors")
    out, init = tmp_path / "b", f"draft.init_from={first.parent / 'latest'}"
    both = ("train.num_workers=1", "train.max_steps=2", "checkpoint.every_steps=1", "checkpoint.keep_last=0", init)
    last = run(make_cfg(assets, out, *both))
    ckpt = last.parent / "step-000001"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows if r["kind"] == "train")
    trained = load_file(ckpt / "model.safetensors")
    assert torch.equal(trained["d2t"], start["d2t"]) and torch.equal(trained["t2d"], start["t2d"])  # the folder's vocab
    changed = [k for k in start if k not in ("d2t", "t2d") and not torch.equal(start[k], trained[k])]
    assert changed, "no weight moved in the step"
    # trained from the folder: its first step's loss is not a fresh draft's
    fresh = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["loss"] != fresh[0]["loss"]

    # resuming after step 1: the run's own checkpoint (weights and vocab), init_from never applied,
    # so step 2 comes out as the uninterrupted run's
    want = load_file(last / "model.safetensors")
    shutil.rmtree(last)
    (out / "checkpoints" / "latest").unlink()
    monkeypatch.setattr(init_module, "apply_init_from", lambda *a: pytest.fail("init_from applied on a resume"))
    resumed = run(make_cfg(assets, out, *both, "checkpoint.resume=true"))
    assert load_train_state(resumed)["step"] == 2
    got = load_file(resumed / "model.safetensors")
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_every_placement_reads_the_folders_vocab(assets, tmp_path):
    """plan.prepare (single process, colocated, disaggregated) and prepare_offline (a feature store)
    point RunData.vocab_path at the folder's mapping, not at one built from the data."""
    from specforge.capture import capture_store
    from specforge.runtime.plan import prepare
    from specforge.train import run

    folder = run(make_cfg(assets, tmp_path / "a", "train.num_workers=1", "train.max_steps=1"))
    mapping = load_file(folder / "model.safetensors")
    store = f"store.dir={tmp_path / 'features'}"
    capture_store(make_cfg(assets, tmp_path / "c", "train.num_workers=1", store), progress=False)
    other = "draft.vocab_size=32"  # the data's own vocab would differ from the folder's (64)
    for mode in ("colocated", "disaggregated", "offline"):
        with pytest.raises(ValueError, match="its draft vocab has 64 tokens, draft.vocab_size is 32"):
            prepare(make_cfg(assets, tmp_path / mode, f"placement.mode={mode}", store, other,
                             f"draft.init_from={folder}"), use_gpu=False)
        data = prepare(make_cfg(assets, tmp_path / mode, f"placement.mode={mode}", store, f"draft.init_from={folder}"),
                       use_gpu=False)
        vocab = load_draft_vocab(data.vocab_path)
        assert Path(data.vocab_path).name.startswith("init-"), mode
        assert torch.equal(vocab.d2t, mapping["d2t"]) and torch.equal(vocab.t2d, mapping["t2d"]), mode


def test_init_from_is_a_draft_key_outside_the_run_identity(tmp_path):
    for algorithm in ("eagle3", "dflash"):
        cfg = run_cfg(tmp_path, seed=1, algorithm=algorithm, init_from="/somewhere")
        assert not any("init_from" in k for k in get_algorithm(algorithm).bind(cfg).identity())
        assert "init_from" in {f.name for f in dataclasses.fields(cfg.draft)}


@pytest.mark.parametrize("algorithm, draft", [
    ("eagle31", {"vocab_size": N, "ttt_length": 2}),
    ("peagle", {"vocab_size": N, "parallel_tokens": 3, "mask_token_id": V - 1}),
    ("dspark", {"num_layers": 1, "block_size": 4, "mask_token_id": V - 1, "markov_rank": 8}),
])
def test_our_other_algorithms_start_from_their_checkpoints(tmp_path, target, algorithm, draft):
    """EAGLE-3.1, P-EAGLE and DSpark folders are our checkpoints: the same path, every saved tensor equal."""
    algo = get_algorithm(algorithm)

    def cfg(seed, init_from=None):
        options = algo.options(algorithm=algorithm, init_from=None if init_from is None else str(init_from), **draft)
        return Config(draft=options, train=TrainConfig(seed=seed, precision="fp32"),
                      model=ModelConfig(cache_dir=str(tmp_path / "cache")))

    vocab = own_vocab()
    src = algo.bind(cfg(1)).build_draft(target, vocab)
    hf_config = {**algo.hf_config(src), "torch_dtype": "float32"}
    folder = save_checkpoint(tmp_path / "ckpts", 1, hf_config, src.export_state_dict(), train_state={"step": 1})
    fresh = trainer_path(cfg(2, folder), target, own_vocab(seed=9)).export_state_dict()
    want = src.export_state_dict()
    assert fresh.keys() == want.keys() and all(torch.equal(fresh[k], want[k]) for k in want)
    other = trainer_path(cfg(2), target, vocab).export_state_dict()
    assert not all(torch.equal(other[k], want[k]) for k in want)


@pytest.mark.parametrize("algorithm, draft", [
    ("eagle31", {"vocab_size": N, "ttt_length": 2}),
    ("peagle", {"vocab_size": N, "parallel_tokens": 3, "mask_token_id": V - 1}),
])
def test_eagle31_and_peagle_drafts_start_from_their_speculators_exports(tmp_path, target, target_dir, capsys,
                                                                         algorithm, draft):
    algo = get_algorithm(algorithm)

    def cfg(seed, init_from=None):
        options = algo.options(algorithm=algorithm, init_from=None if init_from is None else str(init_from), **draft)
        return Config(draft=options, train=TrainConfig(seed=seed, precision="fp32"),
                      model=ModelConfig(cache_dir=str(tmp_path / "cache")))

    src = algo.bind(cfg(1)).build_draft(target, own_vocab())
    folder = save_checkpoint(tmp_path / "ckpts", 1, {**algo.hf_config(src), "torch_dtype": "float32"},
                             src.export_state_dict(), train_state={"step": 1})
    assert export.main(["--draft", str(folder), "--engine", "vllm", "--out", str(tmp_path / "vllm"),
                        "--target", str(target_dir)]) == 0
    capsys.readouterr()
    fresh = trainer_path(cfg(2, tmp_path / "vllm"), target, own_vocab(seed=9)).export_state_dict()
    want = src.export_state_dict()
    assert fresh.keys() == want.keys() and all(torch.equal(fresh[k], want[k]) for k in want)


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_a_colocated_ray_run_from_init_from_matches_the_single_process(assets, reference, ray_session, tmp_path):
    """The Ray train workers (FSDP2 over 2 ranks) start from the folder as the single process does. Over 30 s
    beside the other pytest worker (30.0-31.2 s): two Ray train actors, ~5 CPU-s each to start, beside the
    single-process run."""
    from specforge.ray_train import fit
    from specforge.train import run
    from tests.helpers.ray_run import losses

    init = f"draft.init_from={reference / 'checkpoints' / 'latest'}"
    run(make_cfg(assets, tmp_path / "single", "train.grad_accum=2", "train.num_workers=1", init))
    fit(make_cfg(assets, tmp_path / "colocated", "placement.mode=colocated", init))
    want, got = losses(tmp_path / "single"), losses(tmp_path / "colocated")
    assert [r["step"] for r in got] == [r["step"] for r in want] and want
    for a, b in zip(want, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), a["step"]
    assert want[0]["loss"] != losses(reference)[0]["loss"]  # it started from the folder, not from scratch
