"""P-EAGLE (``specforge/algorithms/peagle``): an EAGLE-3 draft that drafts K tokens in one forward.

* vLLM's format: our export, loaded by speculators' own ``PEagleDraftModel`` (vLLM's draft library)
  and run on a fixed (anchor, depth) layout, gives our training forward's logits at every depth;
  a perturbed ``mask_hidden`` or the target's row in place of the trained mask row does not.
* Training through the runtime (a feature store, offline, one process) lowers the loss, and a
  checkpoint loads back to the same logits; our folder is told apart from EAGLE-3's.
* SGLang and llama.cpp are refused with one error line, by the export CLI and by the llama.cpp
  eval path, writing nothing.
* The eval's proposer drafts, in one forward, the greedy tokens of the training forward's depths.
Tiny random Llama target (6 layers, hidden 48) and a tiny ChatML tokenizer, built here; fp32.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specforge.algorithms.peagle.model import PEagleDraft, PEagleDraftConfig
from specforge.config import load_config
from specforge.models.target import TargetModel, forward_aux
from specforge.registry import algorithm_name, get_algorithm, load_draft
from specforge.training.checkpoint import save_checkpoint

pytestmark = [pytest.mark.timeout(300)]
ALGO = get_algorithm("peagle")
L, H, K, N = 6, 48, 4, 64
AUX = [1, 2, 3]  # our layer-output ids (speculators': 2, 3, 4)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tiny random Llama target + tokenizer folder (vocab = the tokenizer's), its lm_head peaked (a
    random head's next-token distribution is nearly uniform: a loss that can fall), and a tiny ShareGPT file."""
    from tests.helpers.data import write_tiny_assets

    write_tiny_assets(root := tmp_path_factory.mktemp("peagle-assets"), head_scale=20, hidden_size=H,
                      num_hidden_layers=L)
    return root


@pytest.fixture(scope="module")
def target(assets):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(assets / "target").eval()
    return TargetModel(model=model, tokenizer=None, aux_layer_ids=AUX, device=torch.device("cpu"))


def make_draft(target, seed=1, mask_token_id=None) -> PEagleDraft:
    """A P-EAGLE draft for the tiny target with large random weights (every depth's logits differ)."""
    V = target.config.vocab_size
    cfg = PEagleDraftConfig(hidden_size=H, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=H // 4, vocab_size=V, draft_vocab_size=N, aux_layer_ids=AUX, torch_dtype="float32",
                            rope_theta=5000.0, mask_token_id=V - 1 if mask_token_id is None else mask_token_id,
                            parallel_tokens=K)
    torch.manual_seed(seed)
    draft = PEagleDraft(cfg)
    draft.reset_parameters(std=0.1)
    draft.set_vocab(torch.sort(torch.randperm(V)[:N]).values - torch.arange(N))
    draft.init_embeddings_from_target(target.embed_weight_VH)
    with torch.no_grad():
        draft.mask_embed.copy_(torch.randn(H))  # unlike the target's row: a trained mask row
    return draft.eval()


def save(draft, root: Path, step=5) -> Path:
    return save_checkpoint(root, step, ALGO.hf_config(draft), draft.export_state_dict(),
                           train_state={"step": step, "identity": {}})


@torch.no_grad()
def depth_logits(draft, ids_1T1, aux_1TX) -> torch.Tensor:
    """``K x T x N``: the training forward's logits, depth d row t = anchor t's d-th drafted token."""
    T = aux_1TX.shape[1]
    out = draft(ids_1T1, aux_1TX, torch.arange(T)[None], [T] * K, head=lambda d, h: draft.logits(h))
    return torch.stack([o[0] for o in out])


def in_target_vocab(logits_MN: torch.Tensor, d2t: torch.Tensor, V: int) -> torch.Tensor:
    """Draft logits placed at their target ids (vLLM's compute_logits), -1e9 elsewhere."""
    out = logits_MN.new_full((logits_MN.shape[0], V), -1e9)
    out[:, torch.arange(d2t.numel()) + d2t] = logits_MN
    return out


def run_export(argv, capsys):
    from specforge import export
    from specforge.cli import run_cli

    code = run_cli(lambda: export.main([str(a) for a in argv]))
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------- (1) vLLM's format, read by speculators


def load_speculators(path: Path):
    from loguru import logger
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig

    logger.disable("speculators")
    cfg = PEagleSpeculatorConfig.from_pretrained(str(path))
    cfg.transformer_layer_config._attn_implementation = "eager"  # dense float masks: any length, same math
    return PEagleDraftModel.from_pretrained(str(path), config=cfg).eval()


@torch.no_grad()
def speculators_logits(model, ids_1T1, aux_1TX, anchor, depth) -> torch.Tensor:
    """speculators' training forward on a FIXED (anchor, depth) layout (its COD sampler replaced),
    read at its lm_head: ``rows x N`` in the layout's order. Shifted inputs, as its data pipeline
    feeds it: input_ids[j] = x_{j+1}, hidden_states[j] = the target's features at j."""
    import speculators.models.peagle.core as core
    from speculators.losses import resolve_loss_config

    T = aux_1TX.shape[1]
    caught, real = [], core.generate_cod_sample_indices
    core.generate_cod_sample_indices = lambda **kw: (anchor, depth)
    hook = model.lm_head.register_forward_hook(lambda _m, _a, o: caught.append(o))
    try:
        model(hidden_states=aux_1TX, input_ids=ids_1T1[:, 1:], document_ids=torch.zeros(1, T, dtype=torch.long),
              verifier_last_hidden_states=torch.zeros(1, T, H), num_depths=K,
              loss_config=resolve_loss_config("kl_div", "eager"))
    finally:
        hook.remove()
        core.generate_cod_sample_indices = real
    return caught[0][0]


def _rewrite(src: Path, dest: Path, **tensors) -> Path:
    """A copy of an export folder with some tensors replaced."""
    dest.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dest / f.name).write_bytes(f.read_bytes())
    save_file({**load_file(src / "model.safetensors"), **tensors}, dest / "model.safetensors",
              metadata={"format": "pt"})
    return dest


def test_speculators_peagle_model_gives_our_logits_on_our_export(assets, target, tmp_path, capsys):
    draft = make_draft(target)
    V, M = draft.config.vocab_size, draft.config.mask_token_id
    save(draft, tmp_path / "ckpts")
    code, out, err = run_export(["--draft", tmp_path / "ckpts", "--engine", "vllm", "--out", tmp_path / "vllm",
                                 "--target", assets / "target"], capsys)
    assert code == 0, err
    assert ('"method": "eagle3"' in out and '"parallel_drafting": true' in out
            and f'"num_speculative_tokens": {K}' in out), out
    served = tmp_path / "vllm"
    config, weights = json.loads((served / "config.json").read_text()), load_file(served / "model.safetensors")
    assert config["speculators_model_type"] == "peagle" and config["mask_token_id"] == M
    assert config["norm_before_residual"] is False and config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]
    assert weights["mask_hidden"].shape == (1, 1, 3 * H)
    assert torch.equal(weights["embed_tokens.weight"][M], draft.mask_embed.detach())  # the trained mask row
    assert torch.equal(weights["embed_tokens.weight"][:M], target.embed_weight_VH[:M].detach())  # the target's

    T = 20
    ids = torch.randint(0, V, (1, T + 1), generator=torch.Generator().manual_seed(3))
    ids[0, 6] = M  # the mask token as a real input too: both read the one served row
    aux_ours = forward_aux(target, ids[:, :T])[0]  # our capture: hooks on layer outputs 1, 2, 3
    theirs = load_speculators(served)
    hidden = target.model(ids[:, :T], output_hidden_states=True).hidden_states
    aux_theirs = torch.cat([hidden[k] for k in theirs.target_layer_ids], dim=-1)  # "after k layers": 2, 3, 4
    anchor = torch.cat([torch.arange(T - d) for d in range(K)])  # every anchor a with a + d < T
    depth = torch.cat([torch.full((T - d,), d) for d in range(K)])

    ours = depth_logits(draft, ids, aux_ours)[depth, anchor]
    d2t = draft.d2t
    want = in_target_vocab(ours, d2t, V)
    got = in_target_vocab(speculators_logits(theirs, ids, aux_theirs, anchor, depth), weights["d2t"], V)
    assert (got - want).abs().max() < 1e-4, (got - want).abs().max()
    assert ours[depth > 0].std() > 0.1  # the mask rows' logits are not degenerate

    # negative controls: a perturbed mask_hidden, or the target's row in place of the trained mask row,
    # change every mask row (depth >= 1) and no depth-0 row whose inputs avoid them
    table = weights["embed_tokens.weight"].clone()
    table[M] = target.embed_weight_VH[M].detach()
    for name, bad in (("hidden", {"mask_hidden": weights["mask_hidden"] + 0.5 * torch.randn(1, 1, 3 * H)}),
                      ("row", {"embed_tokens.weight": table})):
        other = load_speculators(_rewrite(served, tmp_path / name, **bad))
        got = in_target_vocab(speculators_logits(other, ids, aux_theirs, anchor, depth), weights["d2t"], V)
        diff = (got - want).abs().amax(dim=-1)
        assert (diff[depth > 0] > 1e-2).all(), name
        assert diff[(depth == 0) & (anchor < 5)].max() < 1e-4, name  # rows before the mask token's position


def test_the_export_refuses_more_tokens_than_trained(assets, target, tmp_path, capsys):
    save(make_draft(target), tmp_path / "ckpts")
    code, _, err = run_export(["--draft", tmp_path / "ckpts", "--engine", "vllm", "--out", tmp_path / "v",
                               "--target", assets / "target", "--num-speculative-tokens", K + 1], capsys)
    assert code == 1 and f"trained for at most {K}" in err and not (tmp_path / "v").exists()
    code, out, err = run_export(["--draft", tmp_path / "ckpts", "--engine", "vllm", "--out", tmp_path / "v2",
                                 "--target", assets / "target", "--num-speculative-tokens", 2], capsys)
    assert code == 0, err
    assert '"num_speculative_tokens": 2' in out
    assert json.loads((tmp_path / "v2" / "config.json").read_text())["speculators_config"][
        "proposal_methods"][0]["speculative_tokens"] == 2


# ---------------------------------------------------------------- (2) training, checkpoints


def run_cfg(assets, out, *extra):
    return load_config(None, [
        f"model.target_path={assets / 'target'}", "model.dtype=float32", "model.device=cpu",
        f"model.cache_dir={assets / 'cache'}", f"data.path={assets / 'data.jsonl'}", "data.max_length=64",
        "data.num_eval=2", "draft.algorithm=peagle", "draft.vocab_size=64", f"draft.parallel_tokens={K}",
        "train.lr=1e-2", "train.warmup_steps=0", "train.batch_size=2", "train.precision=fp32", "train.num_threads=1",
        "train.num_workers=1", "train.log_every=1", "train.eval_every=0", f"train.output_dir={out}",
        "tracking.wandb=false", "checkpoint.every_steps=0", "checkpoint.keep_last=1", "checkpoint.resume=false",
        f"store.dir={assets / 'features'}", *extra])


def _losses(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["kind"] == "train"]


def test_training_from_a_store_lowers_the_loss_and_saves_the_mask(assets, target, tmp_path):
    """Offline (a feature store the target filled), one process: 30 steps at lr 1e-2 lower the loss of
    every depth below 0.6x; the same run at lr 1e-9 (the control) stays within 5%. The checkpoint is ours (not
    EAGLE-3's), holds the trained mask, and loads."""
    from specforge.capture import capture_store
    from specforge.train import run

    capture_store(run_cfg(assets, tmp_path / "c"), progress=False)
    ratios, ckpts = {}, {}
    for lr in ("1e-2", "1e-9"):
        out = tmp_path / lr
        ckpts[lr] = run(run_cfg(assets, out, "placement.mode=offline", "train.max_steps=30", f"train.lr={lr}"))
        recs = _losses(out)
        assert [r["step"] for r in recs] == list(range(1, 31))
        assert all(f"acc_{d}" in recs[0] for d in range(K)) and f"acc_{K}" not in recs[0]
        ratios[lr] = {key: sum(r[key] for r in recs[-5:]) / sum(r[key] for r in recs[:5])
                      for key in ["loss"] + [f"loss_{d}" for d in range(K)]}
    # (the control's ratio differs from 1 only by the batches' own losses: other samples, same draft)
    assert all(v < 0.6 for v in ratios["1e-2"].values()) and all(v > 0.95 for v in ratios["1e-9"].values()), ratios

    hf = json.loads((ckpts["1e-2"] / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLMPEagle"] and hf["peagle_config"]["parallel_tokens"] == K
    assert algorithm_name(hf) == "peagle"
    trained, untouched = load_draft(ckpts["1e-2"], target), load_draft(ckpts["1e-9"], target)
    assert (trained.mask_hidden - untouched.mask_hidden).abs().max() > 1e-3  # trained and saved
    assert (trained.mask_embed - untouched.mask_embed).abs().max() > 1e-3


def test_a_checkpoint_loads_back_to_the_same_logits_and_is_told_apart_from_eagle3(target, tmp_path):
    from specforge.algorithms.eagle3.model import Eagle3DraftConfig

    draft = make_draft(target)
    ckpt = save(draft, tmp_path / "ckpts")
    loaded = load_draft(ckpt, target)
    assert type(loaded) is PEagleDraft and loaded.config.mask_token_id == draft.config.mask_token_id
    ids = torch.randint(0, draft.config.vocab_size, (1, 17), generator=torch.Generator().manual_seed(4))
    aux = torch.randn(1, 16, 3 * H, generator=torch.Generator().manual_seed(5))
    want = depth_logits(draft, ids, aux)
    assert torch.equal(depth_logits(loaded, ids, aux), want)
    # negative control: without the mask the folder is refused, naming the tensor
    weights = load_file(ckpt / "model.safetensors")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((ckpt / "config.json").read_text())
    save_file({k: v for k, v in weights.items() if k != "mask_hidden"}, bad / "model.safetensors")
    with pytest.raises(ValueError, match="missing mask_hidden"):
        load_draft(bad, target)
    # an EAGLE-3 folder stays EAGLE-3's; ours is ours
    eagle3 = Eagle3DraftConfig(hidden_size=H, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=12, vocab_size=draft.config.vocab_size, draft_vocab_size=N).to_hf_config()
    assert algorithm_name(eagle3) == "eagle3" and not ALGO.owns_checkpoint(eagle3)
    assert algorithm_name(json.loads((ckpt / "config.json").read_text())) == "peagle"


def test_build_draft_is_eagle3s_draft_plus_the_mask(assets, target):
    """The EAGLE-3 part of a fresh draft is exactly EAGLE-3's build (reused, not rebuilt); the mask
    embedding starts as the target's row; a hidden size other than the target's is refused."""
    from specforge.data.vocab import DraftVocab
    from specforge.preflight import check_run

    cfg = run_cfg(assets, assets / "unused")
    V = target.config.vocab_size
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[:N] = True
    vocab = DraftVocab(torch.zeros(N, dtype=torch.long), t2d)
    draft = ALGO.bind(cfg).build_draft(target, vocab)
    eagle = get_algorithm("eagle3").bind(load_config(None, [f"{k}={v}" for k, v in (
        ("draft.vocab_size", 64), ("model.target_path", assets / "target"))])).build_draft(target, vocab)
    mine = draft.state_dict()
    assert all(torch.equal(mine[k], v) for k, v in eagle.state_dict().items())
    assert draft.config.mask_token_id == V - 1  # no mask token, no unused slot: the highest id outside the vocab
    assert torch.equal(draft.mask_embed.detach(), target.embed_weight_VH[V - 1].detach())
    assert (not draft.embed_tokens.weight.requires_grad and draft.mask_embed.requires_grad
            and draft.mask_hidden.requires_grad)
    with pytest.raises(ValueError, match=r"'draft\.hidden_size'=32: a P-EAGLE draft has the target's hidden size"):
        check_run(run_cfg(assets, assets / "unused", "draft.hidden_size=32"))
    with pytest.raises(ValueError, match=r"'draft\.ttt_length'=3 applies to draft\.algorithm=eagle3, not peagle"):
        run_cfg(assets, assets / "unused", "draft.ttt_length=3")  # load_config validates


# ---------------------------------------------------------------- (3) SGLang and llama.cpp refused


@pytest.mark.parametrize("engine", ["sglang", "llama.cpp"])
def test_sglang_and_llamacpp_exports_are_refused_with_one_line(assets, target, tmp_path, capsys, engine):
    save(make_draft(target), tmp_path / "ckpts")
    out = tmp_path / "out"
    code, stdout, err = run_export(["--draft", tmp_path / "ckpts", "--engine", engine, "--out", out,
                                    "--target", assets / "target"], capsys)
    assert code == 1 and stdout == ""
    assert len(err.splitlines()) == 1 and err.startswith("error: --engine ") and "vllm" in err, err
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["ckpts"]  # no temp folder left either


def test_the_llamacpp_eval_path_refuses_it(assets, target, tmp_path, monkeypatch):
    """``python -m specforge.eval --engine llama.cpp`` converts each draft with ``convert_draft``
    (serve_eval.evaluate_engine): a P-EAGLE draft is refused there, before any converter runs."""
    from specforge.engines import llamacpp
    from specforge.eval import served as serve_eval

    ckpt = save(make_draft(target), tmp_path / "ckpts")
    ran = []
    monkeypatch.setattr(serve_eval, "find_server", lambda: None)
    monkeypatch.setattr(serve_eval, "find_converter", lambda: None)
    monkeypatch.setattr(llamacpp, "find_converter", lambda: None)
    monkeypatch.setattr(serve_eval, "cached_target_gguf", lambda *a, **k: tmp_path / "target.gguf")
    monkeypatch.setattr(llamacpp, "_run_converter", lambda *a, **k: ran.append(a))
    with pytest.raises(ValueError) as e:
        serve_eval.evaluate_engine(assets / "target", [ckpt], [[1, 2, 3]], 4, progress=False)
    msg = str(e.value)
    assert "\n" not in msg and "LlamaForCausalLMPEagle" in msg and "vLLM" in msg, msg
    assert ran == []
    with pytest.raises(ValueError, match="LlamaForCausalLMPEagle"):
        llamacpp.draft_spec_type(json.loads((ckpt / "config.json").read_text()))


# ---------------------------------------------------------------- (4) the proposer


@torch.no_grad()
def test_the_proposer_drafts_the_training_forwards_depths_in_one_forward(target):
    """start + propose: the K tokens (and logits) are depth 0..K-1 of the last real row's anchor in
    the training forward; again after accepting tokens (the mask rows' keys were dropped). The
    control: the neighbouring anchor's depths are other tokens."""
    draft = make_draft(target)
    V, M = draft.config.vocab_size, draft.config.mask_token_id
    T = 24
    ids = torch.randint(0, V, (1, T + 1), generator=torch.Generator().manual_seed(6))
    ids[0, 4] = M
    aux = torch.randn(1, T, 3 * H, generator=torch.Generator().manual_seed(7))
    dense = depth_logits(draft, ids, aux)  # K x T x N
    greedy = draft.draft_to_target_ids(dense.argmax(-1))  # K x T target ids

    prop = ALGO.proposer(draft, torch.float32)
    calls = []
    real = prop.drafter.prefill
    prop.drafter.prefill = lambda *a: calls.append(a[0].numel()) or real(*a)
    a = 9  # anchor: pending rows 0..a (target features 0..a, tokens 1..a+1)
    prop.start(ids[0, : a + 2].tolist(), aux[0, : a + 1])
    got = prop.propose(K)
    assert calls == [a + 1 + K - 1]  # one forward: the pending rows and K - 1 mask rows
    assert got == greedy[:, a].tolist()
    torch.testing.assert_close(prop.last_logits, dense[:, a], atol=1e-5, rtol=1e-5)
    assert got != greedy[:, a + 1].tolist()  # the control: another anchor drafts otherwise

    # accept 3 tokens: the target ran rows a+1..a+3; the next anchor is a + 3
    prop.accept(ids[0, a + 2 : a + 5].tolist(), aux[0, a + 1 : a + 4])
    assert len(prop.drafter.cache) == a + 1  # the mask rows' keys are gone
    got = prop.propose(7)  # more than K asked: K drafted
    assert got == greedy[:, a + 3].tolist()
    torch.testing.assert_close(prop.last_logits, dense[:, a + 3], atol=1e-5, rtol=1e-5)
    assert ALGO.dynamic_drafting is False and ALGO.max_tokens_per_round(ALGO.hf_config(draft)) == K
