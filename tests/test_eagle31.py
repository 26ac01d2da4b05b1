"""EAGLE-3.1 (``specforge/algorithms/eagle31``): EAGLE-3 with speculators' four switches.

* vLLM: our export, loaded by speculators' own ``Eagle3DraftModel`` (the library whose format vLLM
  serves and whose math defines the flags), gives our logits at every TTT step; flipping a flag in
  the written config, or losing the fc-side norm speculators' converter drops, makes them differ.
* Each engine refuses, with one error and nothing written, a flag it would serve as false.
* Training through the seam lowers the loss, reaches the new norms, and the checkpoint round-trips;
  the fast inference paths (``forward_cached``, the chain drafter, the proposer) and the loss agree
  with the training forward, with a negative control each.
* Config errors: both fc-side norms; EAGLE-3.1 keys under EAGLE-3; bad config.json flags.

Tiny random Llama target (8 layers, hidden 48, vocab 320) and drafts (draft vocab 100), fp32.
"""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specforge import export
from specforge.algorithms.eagle31 import export as e31_export
from specforge.algorithms.eagle31.model import Eagle31ChainDrafter, Eagle31Draft, Eagle31DraftConfig
from specforge.cli import run_cli
from specforge.models.target import TargetModel, forward_aux
from specforge.registry import algorithm_name, by_gguf, get_algorithm, load_draft
from specforge.training.checkpoint import save_checkpoint
from tests.helpers.shared import flip_bound

L, V, N, H = 8, 320, 100, 48
AUX = [1, 3, 6]
ALGO = get_algorithm("eagle31")
TRAINER_DEFAULTS = dict(norm_before_fc=True, norm_before_residual=True, norm_output=True)  # speculators' trainer
PAPER = dict(fc_norm=True, norm_output=True)  # per-feature norms (the EAGLE-3.1 paper's), plain residual


def tiny_target(num_layers=L, vocab=V, sharpen=1.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=H, intermediate_size=96, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)  # sharpen > 1: a peaked teacher, so a draft has something to learn
    return model


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    tiny_target().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target(target_dir):
    from transformers import LlamaForCausalLM

    return TargetModel(model=LlamaForCausalLM.from_pretrained(target_dir).eval(), tokenizer=None,
                       aux_layer_ids=AUX, device=torch.device("cpu"))


def make_draft(target, seed=1, **flags) -> Eagle31Draft:
    """A random EAGLE-3.1 draft for the tiny target, every norm weight away from 1 (a norm skipped or
    applied twice changes the logits)."""
    cfg = Eagle31DraftConfig(hidden_size=H, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=H // 4, vocab_size=V, draft_vocab_size=N, aux_layer_ids=AUX,
                             torch_dtype="float32", rope_theta=5000.0, **flags)
    torch.manual_seed(seed)
    draft = Eagle31Draft(cfg)
    draft.reset_parameters(std=0.1)
    with torch.no_grad():
        for m in draft.modules():
            if m.__class__.__name__ == "RMSNorm":
                m.weight.normal_(1.0, 0.3)
    draft.set_vocab(torch.sort(torch.randperm(V)[:N]).values - torch.arange(N))
    draft.init_embeddings_from_target(target.embed_weight_VH)
    return draft.eval()


def save(draft, root: Path) -> Path:
    return save_checkpoint(root, 5, draft.config.to_hf_config(), draft.export_state_dict(),
                           train_state={"step": 5, "identity": {}})


def run(argv, capsys):
    """The export CLI as a user runs it: (exit code, stdout, stderr)."""
    code = run_cli(lambda: export.main([str(a) for a in argv]))
    out, err = capsys.readouterr()
    return code, out, err


def features(target, T=24, seed=3):
    ids = torch.randint(0, V, (1, T + 1), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        aux, last, _ = forward_aux(target, ids)
    return ids, aux, last


# ---------------------------------------------------------------- vLLM: speculators computes our logits


def load_speculators(path: Path):
    from loguru import logger
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    logger.disable("speculators")
    cfg = Eagle3SpeculatorConfig.from_pretrained(str(path))
    cfg.transformer_layer_config._attn_implementation = "eager"  # dense masks (flex wants 128-multiple lengths)
    model = Eagle3DraftModel.from_pretrained(str(path), config=cfg)
    model._load_verifier_weights(overwrite_embed_tokens=True)  # the export has no embedding: the verifier's
    return model.eval()


@torch.no_grad()
def speculators_logits(exported: Path, target, ids, steps=3):
    """Per TTT step, speculators' draft-vocab logits (rows 0 .. T-2-i), fed the features IT names."""
    theirs = load_speculators(exported)
    T = ids.shape[1] - 1
    hidden = target.model(ids[:, :T], output_hidden_states=True).hidden_states
    aux = torch.cat([hidden[k] for k in theirs.target_layer_ids], dim=-1)  # "after k layers"
    pos = torch.arange(T)[None]
    caught = []
    hook = theirs.lm_head.register_forward_hook(lambda _m, _a, out: caught.append(out))
    try:  # row t of step 0 reads token x_{t+1}, as ours
        theirs(hidden_states=aux, input_ids=ids[:, 1:T + 1], document_ids=torch.zeros_like(pos),
               position_ids=pos.clone(), ttt_steps=steps)
    finally:
        hook.remove()
    assert torch.equal(theirs.d2t, load_file(exported / "model.safetensors")["d2t"])
    return [caught[i][0, : T - 1 - i] for i in range(steps)]


@torch.no_grad()
def our_logits(draft, target, ids, steps=3):
    T = ids.shape[1] - 1
    aux, _, _ = forward_aux(target, ids[:, :T])
    out = draft(ids[:, :T], aux, torch.arange(T)[None], [T] * steps, head=lambda i, h: draft.logits(h))
    return [out[i][0, : T - 1 - i] for i in range(steps)]  # rows past the end read padding: not compared


def differ(a, b) -> bool:
    return not all(torch.allclose(x, y, rtol=1e-3, atol=1e-3) for x, y in zip(a, b))


@pytest.mark.parametrize("flags", [TRAINER_DEFAULTS, PAPER], ids=["trainer-defaults", "fc_norm"])
def test_vllm_export_gives_our_logits_in_speculators(tmp_path, target_dir, target, capsys, flags):
    ckpt = save(make_draft(target, **flags), tmp_path / "ckpts")
    assert algorithm_name(json.loads((ckpt / "config.json").read_text())) == "eagle31"
    out = tmp_path / "vllm"
    code, _, err = run(["--draft", ckpt, "--engine", "vllm", "--out", out, "--target", target_dir], capsys)
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    for f in e31_export.FLAGS:  # all four written, false ones too (vLLM reads an absent norm_before_residual as true)
        assert config[f] is bool(flags.get(f, False)), f
    ours_w, written = load_file(ckpt / "model.safetensors"), load_file(out / "model.safetensors")
    extra = ["input_norm.weight"] if flags.get("norm_before_fc") else [f"fc_norm.{k}.weight" for k in range(3)]
    for k in extra:  # the converter drops these; the export adds them back
        assert torch.equal(written[k], ours_w[k]), k

    draft = load_draft(ckpt, target)
    assert type(draft) is Eagle31Draft and draft.config.flags == {f: bool(flags.get(f)) for f in e31_export.FLAGS}
    ids = features(target)[0]
    ours = our_logits(draft, target, ids)
    for i, (a, b) in enumerate(zip(ours, speculators_logits(out, target, ids))):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=f"TTT step {i}")

    # negative controls: each flag flipped in the written config, and the fc-side norm lost
    for f in [f for f in e31_export.FLAGS if flags.get(f)]:
        (out / "config.json").write_text(json.dumps({**config, f: False}))
        assert differ(ours, speculators_logits(out, target, ids)), f"{f} flipped: same logits"
    (out / "config.json").write_text(json.dumps(config))
    save_file({k: v for k, v in written.items() if k not in extra}, out / "model.safetensors",
              metadata={"format": "pt"})
    assert differ(ours, speculators_logits(out, target, ids)), "speculators loads a missing norm as 1, silently"


def test_vllm_export_checks_the_norms_it_adds(tmp_path, target_dir, target, capsys, monkeypatch):
    ckpt = save(make_draft(target, **TRAINER_DEFAULTS), tmp_path / "ckpts")
    monkeypatch.setattr(e31_export, "add_tensors", lambda out, tensors: None)  # what the converter alone writes
    code, _, err = run(["--draft", ckpt, "--engine", "vllm", "--out", tmp_path / "vllm", "--target", target_dir],
                       capsys)
    assert code == 1 and "speculators' converter wrote" in err and "input_norm.weight missing" in err, err
    assert not (tmp_path / "vllm").exists()


# ---------------------------------------------------------------- flags an engine would ignore: refused


@pytest.mark.parametrize("engine, flag, others", [
    ("sglang", "norm_before_residual", "vllm or llama.cpp"), ("sglang", "norm_before_fc", "vllm or llama.cpp"),
    ("llama.cpp", "fc_norm", "sglang or vllm"), ("llama.cpp", "norm_output", "sglang or vllm")])
def test_an_engine_refuses_a_flag_it_would_ignore(tmp_path, target_dir, target, capsys, monkeypatch, engine, flag,
                                                  others):
    from specforge.engines import llamacpp

    # llama.cpp: a converter that is never reached (installed or not, the refusal comes first)
    monkeypatch.setattr(llamacpp, "find_converter", lambda: Path("/nonexistent/convert_hf_to_gguf.py"))
    ckpt = save(make_draft(target, **{flag: True}), tmp_path / "ckpts")
    out = tmp_path / "out"
    code, _, err = run(["--draft", ckpt, "--engine", engine, "--out", out, "--target", target_dir], capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert re.search(f"--engine {re.escape(engine)}: the EAGLE-3.1 draft( .*)? sets {flag}=true, "
                     f"which {re.escape(engine)} does not read", err), err
    assert f"export it for {others}, or train it with draft.{flag}=false" in err, err
    assert not out.exists() and not list(tmp_path.glob(".out*")), "the refused export left files behind"


def test_engines_take_the_flags_they_read(tmp_path, target_dir, target, capsys):
    # SGLang reads fc_norm and norm_output: the checkpoint's files, as they are
    ckpt = save(make_draft(target, **PAPER), tmp_path / "paper")
    assert run(["--draft", ckpt, "--engine", "sglang", "--out", tmp_path / "sg"], capsys)[0] == 0
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "sg" / name).read_bytes() == (ckpt / name).read_bytes()
    # llama.cpp's converter reads norm_before_fc / norm_before_residual at the staged config's top level
    flags = dict(norm_before_fc=True, norm_before_residual=True)
    draft_config = make_draft(target, **flags).config.to_hf_config()
    staged = ALGO.llamacpp_config(draft_config, {"num_hidden_layers": L})
    assert staged["norm_before_fc"] is True and staged["norm_before_residual"] is True
    assert staged["eagle_aux_hidden_state_layer_ids"] == [k + 1 for k in AUX]  # layer inputs, as EAGLE-3's
    with pytest.raises(ValueError, match="norm_output=true, which llama.cpp does not read"):
        ALGO.llamacpp_config({**draft_config, "norm_output": True}, {"num_hidden_layers": L})


# ---------------------------------------------------------------- training, checkpoint, fast paths


def test_training_lowers_the_loss_and_the_checkpoint_round_trips(tmp_path):
    from specforge.config import load_config
    from specforge.data.vocab import DraftVocab
    from specforge.models.features import TrainBatch

    model = tiny_target(num_layers=6, sharpen=8.0)
    target = TargetModel(model=model, tokenizer=None, aux_layer_ids=[1, 2, 3], device=torch.device("cpu"))
    cfg = load_config(None, ["draft.algorithm=eagle31", "draft.vocab_size=64", "draft.ttt_length=3",
                             "model.aux_layer_ids=[1,2,3]", "train.seed=0"])
    assert {f: getattr(cfg.draft, f) for f in e31_export.FLAGS} == {**dict.fromkeys(e31_export.FLAGS, False),
                                                                       **TRAINER_DEFAULTS}
    ids = torch.randint(0, V, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        aux, last, _ = forward_aux(target, ids)
        target_ids = model.lm_head(model.model.norm(last)).argmax(-1)
    batch = TrainBatch(ids, torch.ones_like(ids), aux, last, target_ids)
    top = torch.sort(torch.bincount(target_ids.flatten(), minlength=V).argsort(descending=True)[:64]).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[top] = True
    vocab = DraftVocab(top - torch.arange(64), t2d)

    draft = ALGO.bind(cfg).build_draft(target, vocab)
    assert type(draft) is Eagle31Draft and draft.input_norm is not None and draft.fc_norm is None
    state = ALGO.bind(cfg).train_state(target, vocab)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(12):
        loss, _ = ALGO.bind(cfg).loss(draft, batch, state, step, None, training=True)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.8 * losses[0], losses  # measured: 11.4 -> 8.5 (a peaked teacher: its entropy is the floor)
    assert not torch.equal(draft.input_norm.weight, torch.ones_like(draft.input_norm.weight))  # trained too

    ckpt = save_checkpoint(tmp_path, 12, ALGO.hf_config(draft), draft.export_state_dict())
    ALGO.check_checkpoint(ckpt)
    loaded = load_draft(ckpt, target)
    assert type(loaded) is Eagle31Draft and loaded.config == draft.config
    draft.eval()
    with torch.no_grad():  # the file holds config.json's torch_dtype: the trained weights, rounded to it
        dtype = getattr(torch, draft.config.torch_dtype)
        for p in draft.parameters():
            if p.requires_grad:  # the saved ones (the embedding is the target's, frozen, not saved)
                p.copy_(p.to(dtype))
        pos = torch.arange(32).expand(2, 32)
        a = draft(ids, aux, pos, [32] * 3, head=lambda i, h: draft.logits(h))
        b = loaded(ids, aux, pos, [32] * 3, head=lambda i, h: loaded.logits(h))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("flags", [TRAINER_DEFAULTS, PAPER, dict(norm_before_residual=True)],
                         ids=["trainer-defaults", "fc_norm", "residual"])
def test_inference_paths_and_the_loss_agree_with_the_training_forward(target, flags):
    from specforge.algorithms.eagle3.loss import ttt_loss, ttt_loss_reference
    from specforge.algorithms.eagle3.model import ChainDrafter, DraftKVCache
    from specforge.config import load_config
    from specforge.models.features import TrainBatch

    draft = make_draft(target, **flags)
    ids, aux, last = features(target, T=20)
    T = 20
    with torch.no_grad():
        steps = draft(ids[:, :T], aux[:, :T], torch.arange(T)[None], [T] * 2, head=lambda i, h: draft.logits(h))
        # forward_cached: prefill on raw target features, then one drafted token fed its own hidden
        cache = DraftKVCache()
        h0, z0 = draft.forward_cached(ids[:, 1:T], aux[:, : T - 1], torch.arange(T - 1)[None], cache)
        d = z0[0, -1].argmax().view(1)  # the drafted token: a draft id (chain) / its target id (forward_cached)
        h1, z1 = draft.forward_cached(draft.draft_to_target_ids(d)[None], h0[:, -1:], torch.tensor([[T - 1]]), cache)
        fast = Eagle31ChainDrafter(draft, torch.float32)
        g0, y0 = fast.prefill(ids[0, 1:T], aux[0, : T - 1])
        g1, y1 = fast.step(d, g0[-1:])
        plain = ChainDrafter(draft, torch.float32)  # EAGLE-3's: no fc-side norms, residual, output norm
        q0, p0 = plain.prefill(ids[0, 1:T], aux[0, : T - 1])
        _, p1 = plain.step(d, q0[-1:])
    torch.testing.assert_close(z0[0], steps[0][0, : T - 1], rtol=1e-5, atol=1e-5)  # step 0 rows
    torch.testing.assert_close(y0, z0[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y1, z1[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g1, h1[0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(torch.cat([p0, p1]), torch.cat([y0, y1]), rtol=1e-3, atol=1e-3)
    assert ALGO.proposer(draft, torch.float32).drafter.__class__ is Eagle31ChainDrafter

    # the loss: EAGLE-3's fast TTT loss through the seam equals the reference on this draft's own logits
    cfg = load_config(None, ["draft.algorithm=eagle31", "draft.ttt_length=3", *[f"draft.{f}={flags.get(f, False)}"
                                                                                 for f in e31_export.FLAGS]])
    with torch.no_grad():
        target_ids = target.model.lm_head(target.model.model.norm(last)).argmax(-1)
    batch = TrainBatch(ids, torch.ones_like(ids), aux, last, target_ids)
    teacher = torch.randn(N, H, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got, counts = ALGO.bind(cfg).loss(draft, batch, teacher, 0, None, training=False)  # the whole unroll
        want, want_counts = ttt_loss_reference(draft, batch, teacher, 3, cfg.draft.ttt_decay)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(counts, want_counts, rtol=1e-5, atol=1e-4)
        if flags.get("norm_output"):  # negative control: EAGLE-3's loss on the draft itself norms twice
            assert not torch.allclose(ttt_loss(draft, batch, teacher, 3, cfg.draft.ttt_decay)[0], want, rtol=1e-4)


def test_a_run_trains_an_eagle31_draft_and_a_flags_off_one_is_eagle3(tmp_path):
    """The whole runtime on ``draft.algorithm: eagle31`` (the config's keys, the trainer, the checkpoint
    manager); with every flag off the folder is EAGLE-3's and loads as EAGLE-3's draft."""
    from specforge.config import load_config
    from specforge.train import run as train

    root = tmp_path / "assets"
    _assets(root)
    base = [f"model.target_path={root / 'target'}", "model.dtype=float32", "model.device=cpu",
            f"model.cache_dir={root / 'cache'}", f"data.path={root / 'data.jsonl'}", "data.max_length=64",
            "data.num_eval=2", "draft.algorithm=eagle31", "draft.vocab_size=64", "draft.ttt_length=2",
            "train.lr=1e-2", "train.warmup_steps=0", "train.batch_size=2", "train.max_steps=3", "train.precision=fp32",
            "train.num_threads=1", "train.num_workers=1", "train.log_every=1", "train.eval_every=0",
            "tracking.wandb=false", "checkpoint.every_steps=0", "checkpoint.keep_last=1", "checkpoint.resume=false"]
    on = Path(train(load_config(None, base + [f"train.output_dir={tmp_path / 'on'}"])))
    off = Path(train(load_config(None, base + [f"train.output_dir={tmp_path / 'off'}"]
                                 + [f"draft.{f}=false" for f in e31_export.FLAGS])))
    hf_on, hf_off = (json.loads((p / "config.json").read_text()) for p in (on, off))
    assert {f: hf_on[f] for f in e31_export.FLAGS} == {**dict.fromkeys(e31_export.FLAGS, False), **TRAINER_DEFAULTS}
    assert algorithm_name(hf_on) == "eagle31" and "input_norm.weight" in load_file(on / "model.safetensors")
    assert algorithm_name(hf_off) == "eagle3" and not any(hf_off[f] for f in e31_export.FLAGS)
    get_algorithm("eagle3").check_checkpoint(off)  # an EAGLE-3 folder: no extra tensor
    recs = [json.loads(x) for x in (tmp_path / "on" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if r["kind"] == "train"] == [1, 2, 3] and recs[0]["loss"] > 0


def _assets(root: Path) -> None:
    """A tiny random Llama target + byte-level BPE tokenizer (ChatML) and a tiny ShareGPT JSONL."""
    from tests.helpers.data import write_tiny_assets

    write_tiny_assets(root)


# ---------------------------------------------------------------- config errors and ownership


def test_config_errors():
    from specforge.config import load_config

    with pytest.raises(ValueError) as e:
        load_config(None, ["draft.algorithm=eagle31", "draft.fc_norm=true"])  # norm_before_fc defaults to true
    msg = str(e.value)
    assert "'draft.norm_before_fc' and 'draft.fc_norm' are both true" in msg and "set one of them false" in msg
    assert len(msg.splitlines()) == 1
    load_config(None, ["draft.algorithm=eagle31", "draft.fc_norm=true", "draft.norm_before_fc=false"])  # the fix
    with pytest.raises(ValueError, match="'draft.norm_output'=True applies to draft.algorithm=eagle31"):
        load_config(None, ["draft.norm_output=true"])  # an EAGLE-3 run
    with pytest.raises(ValueError, match="norm_before_fc and fc_norm are both true"):
        Eagle31DraftConfig(hidden_size=H, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=12, vocab_size=V, draft_vocab_size=N, norm_before_fc=True, fc_norm=True)
    cfg = load_config(Path(__file__).parent.parent / "configs" / "eagle31-smollm2-135m-cpu.yaml")
    assert cfg.draft.algorithm == "eagle31" and {f: getattr(cfg.draft, f) for f in e31_export.FLAGS} == {
        **dict.fromkeys(e31_export.FLAGS, False), **TRAINER_DEFAULTS}


def test_check_checkpoint_names_bad_flags_and_missing_norms(tmp_path, target):
    ckpt = save(make_draft(target, **TRAINER_DEFAULTS), tmp_path / "ckpts")
    config, weights = json.loads((ckpt / "config.json").read_text()), load_file(ckpt / "model.safetensors")

    def folder(name, cfg, w):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        save_file(w, tmp_path / name / "model.safetensors")
        return tmp_path / name

    cases = [(folder("both", {**config, "fc_norm": True}, weights), "norm_before_fc and fc_norm are both true"),
             (folder("str", {**config, "norm_output": "yes"}, weights), "norm_output is 'yes', expected true or false"),
             (folder("lost", config, {k: v for k, v in weights.items() if k != "input_norm.weight"}),
              "missing input_norm.weight"),
             (folder("stray", {**config, "norm_before_fc": False}, weights), "unexpected input_norm.weight")]
    for path, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            ALGO.check_checkpoint(path)


def test_ownership_of_folders_and_ggufs():
    eagle3 = {"architectures": ["LlamaForCausalLMEagle3"]}
    assert algorithm_name(eagle3) == "eagle3"
    assert algorithm_name({**eagle3, **dict.fromkeys(e31_export.FLAGS, False)}) == "eagle3"  # flags off: EAGLE-3's
    for f in e31_export.FLAGS:
        assert algorithm_name({**eagle3, f: True}) == "eagle31", f
    assert not ALGO.owns_checkpoint({"architectures": ["DFlashDraftModel"], "norm_output": True})
    names = {"fc.weight", "blk.0.attn_norm_2.weight", "output_norm.weight"}
    assert by_gguf("eagle3", names) is get_algorithm("eagle3")
    assert by_gguf("eagle3", names | {"enc.output_norm.weight"}) is ALGO
    assert not ALGO.owns_gguf("dflash", names | {"enc.output_norm.weight"})


# ---------------------------------------------------------------- llama.cpp: served as we evaluate it (slow)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_llamacpp_serves_a_norm_before_fc_draft_as_we_evaluate_it(tmp_path, smollm2_store):
    """A draft with the two flags llama.cpp reads (norm_before_fc, norm_before_residual), trained 40
    steps on a small store of the embedded SmolLM2 target, converted by llama.cpp's converter: the GGUF
    records both flags and holds the input norm (so it reads as EAGLE-3.1's), and llama-server's
    acceptance equals our eval's on the same prompts (the tolerance of tests/test_engine_llamacpp.py).
    Over 30 s: 40 train steps, the first 30 TTT step 0 alone (``draft.ttt_warmup_steps``, ~5x cheaper; the
    last 10 train the fed-back positions the chain of 3 drafts), then each prompt decoded twice (ours, the
    server's) with a 135M target in fp32, 32 new tokens a prompt. Measured on one thread: training 29 CPU-s (56
    with all 40 steps unrolled), acceptance 1.1553 both (1.1515 at 48 new tokens), 6/6 outputs equal."""
    from specforge.config import load_config
    from specforge.data.heldout import eval_prompts, heldout_rows
    from specforge.engines import llamacpp
    from specforge.eval import _eos_ids, speculative_decode
    from specforge.models.target import load_target, resolve_target_path
    from specforge.train import run as train

    llamacpp.find_server()  # fail at once, naming the install command
    cfg = load_config(Path(__file__).parent.parent / "configs" / "eagle31-smollm2-135m-cpu.yaml", [
        *smollm2_store[1], "draft.norm_output=false", "draft.vocab_size=2048", "draft.ttt_warmup_steps=30",
        "train.max_steps=40", "train.epochs=null", "train.max_minutes=null", "train.batch_size=4", "train.eval_every=0",
        "train.log_every=10", "train.precision=fp32", f"train.output_dir={tmp_path}", "tracking.wandb=false",
        "checkpoint.keep_last=1"])
    ckpt = Path(train(cfg))
    assert json.loads((ckpt / "config.json").read_text())["norm_before_fc"] is True
    target = load_target(cfg.model)
    prompts = eval_prompts(heldout_rows(cfg, target.tokenizer), 6, 256)
    gguf = llamacpp.cached_target_gguf(resolve_target_path(cfg.model), "f32")
    draft_gguf = llamacpp.convert_draft(ckpt, resolve_target_path(cfg.model), tmp_path / "draft.gguf")

    from gguf import GGUFReader

    reader = GGUFReader(str(draft_gguf))
    flag = {name: bool(f.parts[f.data[0]][0]) for name, f in reader.fields.items() if name.startswith("eagle3.norm_")}
    assert flag == {"eagle3.norm_before_fc": True, "eagle3.norm_before_residual": True}, flag
    assert by_gguf("eagle3", {t.name for t in reader.tensors}) is ALGO

    proposer, eos, chain, max_new = ALGO.proposer(load_draft(ckpt, target), torch.float32), _eos_ids(target), 3, 32
    with llamacpp.LlamaServer(gguf, draft_gguf, n_max=chain, threads=1) as srv:
        runs = [srv.complete(p, max_new) for p in prompts]
    tokens = forwards = same = 0
    for p, r in zip(prompts, runs):  # our decoding's losslessness is tests/test_eval.py's claim
        got, st = speculative_decode(target, proposer, p, max_new, chain, eos)
        tokens, forwards = tokens + st.new_tokens - 1, forwards + st.verify_forwards
        same += r.tokens == got
    ours = tokens / forwards
    served = sum(r.predicted_n - 1 for r in runs) / sum(r.predicted_n - 1 - r.draft_n_accepted for r in runs)
    print(f"acceptance: ours {ours:.4f}, llama-server {served:.4f} per forward")
    assert same >= len(prompts) - 1, f"only {same}/{len(prompts)} llama.cpp outputs equal our decoding"
    assert abs(served - ours) <= flip_bound(chain, forwards), (served, ours, forwards)
    assert served > 1.05  # the trained draft is not a no-op, else parity would prove little
