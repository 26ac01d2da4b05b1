"""Every row of the supported-targets table (``specforge.targets.FAMILIES``) exported through
``python -m specforge.export`` for each engine of its ``engines`` trait, and checked by that engine's
own code, on the family's tiny random target saved with a tokenizer (tests/helpers/targets.py) and
an untrained EAGLE-3 draft shaped from it (random weights: the checks compare, they need no skill):

* vLLM: the export loaded with vLLM's draft library, ``speculators`` (``Eagle3DraftModel``), fed the
  target features IT names ("after k layers", HF ``hidden_states[k]`` of the text tower): its logits
  equal ours, every TTT step, in the target vocab. Negative control: the export's layer ids put back
  in our numbering make the comparison fail.
* SGLang: the export is the checkpoint, and the mirror of SGLang's loader (tests/helpers/export.py)
  places every tensor.
* llama.cpp (the rows listing it): the target and the draft converted by llama.cpp's own
  ``convert_hf_to_gguf.py``; ``llama-server --spec-type draft-eagle3`` gives the target's own greedy
  output while drafting. Every other row: the export is refused with one error naming the family.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specforge import export
from specforge.algorithms.eagle3.algorithm import Eagle3Options
from specforge.algorithms.eagle3.model import Eagle3Draft, draft_config_from_target
from specforge.cli import run_cli
from specforge.config import ModelConfig
from specforge.engines import llamacpp
from specforge.models.target import forward_aux, load_target, text_tower
from specforge.registry import load_draft
from specforge.targets import FAMILIES, LLAMACPP, SGLANG, VLLM, tiny
from specforge.training.checkpoint import save_checkpoint
from tests.helpers.export import SGLANG_PARAMS, load_speculators, sglang_load, step_logits
from tests.helpers.targets import AUX, target_folder

N = 64  # draft vocab
NAMES = [f.name for f in FAMILIES]
SERVED = [f.name for f in FAMILIES if LLAMACPP in f.engines]
REFUSED = [f.name for f in FAMILIES if LLAMACPP not in f.engines]
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("targets_export")


def run(argv, capsys):
    code = run_cli(lambda: export.main([str(a) for a in argv]))
    out, err = capsys.readouterr()
    return code, out, err


def draft_checkpoint(target_dir: Path, out: Path) -> Path:
    """An untrained EAGLE-3 checkpoint shaped from the target (random weights, a random draft vocab)."""
    from transformers import AutoConfig

    cfg = draft_config_from_target(AutoConfig.from_pretrained(target_dir), Eagle3Options(vocab_size=N), AUX)
    cfg.torch_dtype = "float32"
    torch.manual_seed(1)
    draft = Eagle3Draft(cfg)
    draft.reset_parameters(std=0.1)
    draft.set_vocab(torch.sort(torch.randperm(cfg.vocab_size)[:N]).values - torch.arange(N))
    return save_checkpoint(out, 1, cfg.to_hf_config(), draft.export_state_dict(), train_state={"step": 1})


@functools.lru_cache(maxsize=None)
def _prepared(name: str, where: str) -> tuple[Path, Path]:
    base = Path(where) / name
    target_folder(name, base)
    return base / "target", draft_checkpoint(base / "target", base / "ckpts")


def _exported(name: str, engine: str, root: Path, capsys) -> tuple[Path, Path, Path]:
    """``(target folder, checkpoint, export folder)``: the family's draft exported with ``--engine
    engine`` (the table's engine names are the flag's values), which must succeed for a family the
    table says ``engine`` serves."""
    assert engine in next(f for f in FAMILIES if f.name == name).engines
    target_dir, ckpt = _prepared(name, str(root))
    out = root / name / engine
    code, _, err = run(["--draft", ckpt, "--engine", engine, "--out", out, "--target", target_dir], capsys)
    assert code == 0, err
    return target_dir, ckpt, out


# ---------------------------------------------------------------- vLLM: speculators' logits == ours


@torch.no_grad()
def logits_pairs(ckpt: Path, exported: Path, target_dir: Path, T=16, steps=3):
    """Per TTT step: (ours, speculators') draft logits in the target vocab, each side fed the target
    features its own convention names (ours: layer outputs AUX; theirs: hidden_states[k] of its ids)."""
    target = load_target(ModelConfig(target_path=str(target_dir), dtype="float32", device="cpu"),
                         layers=lambda n: AUX)
    draft = load_draft(ckpt, target)
    theirs = load_speculators(exported)
    ids = torch.randint(3, tiny.V, (1, T + 1), generator=torch.Generator().manual_seed(3))
    aux_ours = forward_aux(target, ids[:, :T])[0]
    hidden = text_tower(target.model)(input_ids=ids[:, :T], output_hidden_states=True).hidden_states
    aux_theirs = torch.cat([hidden[k] for k in theirs.target_layer_ids], dim=-1)
    return step_logits(draft, theirs, ids, aux_ours, aux_theirs, target.lm_head_weight_VH.shape[0], steps)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_vllm_export_gives_our_logits_in_speculators(name, root, capsys):
    target_dir, ckpt, out = _exported(name, VLLM, root, capsys)
    for i, (ours, theirs) in enumerate(logits_pairs(ckpt, out, target_dir)):
        torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5, msg=f"{name}: TTT step {i}")


@pytest.mark.slow
def test_vllm_comparison_fails_on_ids_in_our_numbering(root, capsys):
    """Negative control: the export's layer ids written in our (layer-output) numbering, as a
    converter that forgot vLLM's "after k layers" would: speculators then reads other layers."""
    target_dir, ckpt = _prepared("qwen3_next", str(root))
    out = root / "qwen3_next" / "vllm-unshifted"
    assert run(["--draft", ckpt, "--engine", "vllm", "--out", out, "--target", target_dir], capsys)[0] == 0
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [k + 1 for k in AUX]
    config["eagle_aux_hidden_state_layer_ids"] = AUX
    (out / "config.json").write_text(json.dumps(config))
    ours, theirs = logits_pairs(ckpt, out, target_dir)[0]
    assert not torch.allclose(ours, theirs, rtol=1e-3, atol=1e-3)


# ---------------------------------------------------------------- SGLang: its loader places every tensor


@pytest.mark.parametrize("name", NAMES)
def test_sglang_export_is_the_checkpoint_and_sglang_loads_every_tensor(name, root, capsys):
    target_dir, ckpt, out = _exported(name, SGLANG, root, capsys)
    for f in ("config.json", "model.safetensors"):
        assert (out / f).read_bytes() == (ckpt / f).read_bytes()
    config, weights = json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == AUX  # SGLang's numbering: layer outputs
    landed, dropped = sglang_load(weights)
    assert dropped == [] and set(landed.values()) == SGLANG_PARAMS - {"model.embed_tokens.weight"}
    assert weights["fc.weight"].shape == (tiny.H, 3 * tiny.H)


# ---------------------------------------------------------------- llama.cpp: refused, or served losslessly


@pytest.mark.parametrize("name", REFUSED)
def test_llamacpp_export_refuses_a_family_it_cannot_serve(name, root, capsys):
    target_dir, ckpt = _prepared(name, str(root))
    capsys.readouterr()  # the preparation's progress bars when this test runs first
    out = root / name / "gguf"
    code, _, err = run(["--draft", ckpt, "--engine", "llama.cpp", "--out", out, "--target", target_dir], capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert f"the {name} family" in err and "cannot serve drafts in llama.cpp" in err
    assert ", ".join(SERVED) in err and "SGLang or vLLM" in err
    assert not out.exists()


needs_llamacpp = pytest.mark.skipif(not llamacpp.installed(),
                                    reason="llama.cpp is not built: bash scripts/install_llamacpp.sh")

# What llama.cpp's converter needs of a tiny target beyond our tiny model (test setup, not family traits):
# a tokenizer it recognises (SmolLM2's BPE; Gemma 4's converter reads only a Llama-style byte-fallback BPE,
# conversion/gemma.py Gemma4Model.set_vocab), hence a vocab that holds it.
LLAMA_BPE = {"gemma4"}


def byte_fallback_tokenizer():
    """A Llama-style BPE (byte fallback, '▁' for spaces): 4 specials + 256 byte tokens + 3 pieces, 1 merge."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    toks = ["<pad>", "<bos>", "<eos>", "<unk>"] + [f"<0x{i:02X}>" for i in range(256)] + ["▁", "a", "▁a"]
    merges = [("▁", "a")]  # llama.cpp's loader wants merges in the GGUF
    tk = Tokenizer(models.BPE({t: i for i, t in enumerate(toks)}, merges, byte_fallback=True, unk_token="<unk>"))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")


def llamacpp_target(name: str, out: Path) -> Path:
    """The family's tiny model with a vocab and tokenizer llama.cpp's converter takes."""
    from transformers import AutoTokenizer

    fam = next(f for f in FAMILIES if f.name == name)
    if name in LLAMA_BPE:
        tok = byte_fallback_tokenizer()
    else:
        tok = AutoTokenizer.from_pretrained(load_target_path())
    cfg = getattr(tiny, name)()
    text = cfg.get_text_config()
    text.vocab_size = max(len(tok), tiny.V)
    if hasattr(text, "vocab_size_per_layer_input"):
        text.vocab_size_per_layer_input = text.vocab_size
    if name == "qwen3_moe":  # llama.cpp's Qwen3-MoE converter maps MoE MLPs only (real checkpoints have no dense layer)
        text.mlp_only_layers = []
    torch.manual_seed(0)
    fam.auto_class().from_config(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def load_target_path() -> str:
    from specforge.models.target import resolve_target_path

    return resolve_target_path(ModelConfig())  # the embedded SmolLM2 (its tokenizer)


@pytest.fixture(scope="module")
def converted(root):
    """name -> (target HF folder, draft GGUF job, target GGUF job) for every family llama.cpp serves: the
    export CLI and the target's conversion run two at a time (each is a ~4 s Python process)."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = {}
    with ThreadPoolExecutor(2) as pool:
        for name in SERVED:
            base = root / name / "llamacpp"
            target_dir = llamacpp_target(name, base / "target")
            ckpt = draft_checkpoint(target_dir, base / "ckpts")
            argv = ["--draft", str(ckpt), "--engine", "llama.cpp", "--out", str(base / "gguf"),
                    "--target", str(target_dir)]
            jobs[name] = (target_dir, pool.submit(export.main, argv),
                          pool.submit(llamacpp.convert_target, target_dir, base / "target.gguf"))
        yield jobs


def first_divergence_is_a_tie(got: list[int], want: list[int], prompt: list[int], target_dir: Path) -> bool:
    """Where two greedy continuations first differ, the target's two logits are within float noise
    (ggml's batched verify and its one-token decode round differently; tiny random models have near-ties)."""
    from transformers import AutoModelForCausalLM

    i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + want[:i]])).logits[0, -1]
    return bool((logits[got[i]] - logits[want[i]]).abs() <= 1e-3 * logits.abs().max())


@pytest.mark.slow
@needs_llamacpp
@pytest.mark.parametrize("name", [f.name for f in FAMILIES if "--no-mtp" in f.llamacpp_target_args])
def test_target_conversion_leaves_out_the_mtp_head(name, converted, tmp_path):
    """Qwen3-Next / 3.5: llama.cpp's converter adds the MTP layers the config counts and asserts their
    tensors exist (conversion/qwen.py _QwenMtpMixin); a checkpoint saved by transformers (the tiny one,
    or a user's fine-tune) has none. convert_target passes the family's --no-mtp; the control without it fails.
    Over 30 s for the first of the module's llama.cpp tests to run: it waits for the module fixture's
    conversions of every family's target and draft (a subprocess each, two at a time)."""
    target_dir, _, target_job = converted[name]
    assert target_job.result().is_file()
    with pytest.raises(ValueError, match=r"converter failed \(exit status 1\)"):  # how it ended, named
        llamacpp._run_converter([str(target_dir), "--outtype", "f32"], tmp_path / "with-mtp.gguf")


# The tiny Gemma 4 (KV shared into a last non-shared layer that is sliding) aborts llama-server at load,
# target alone: src/llama-kv-cache.cpp:268 GGML_ASSERT(map_layer_ids.find(il_reuse) != ...). Real Gemma 4
# checkpoints end their non-shared layers on a full-attention one; a tiny model shaped so fails in transformers.
TINY_UNSERVABLE = {"gemma4": "tiny Gemma 4's KV-sharing pattern aborts llama-server at load (target alone)"}


@pytest.mark.slow
@needs_llamacpp
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(reason=TINY_UNSERVABLE[n], strict=True))
                                  if n in TINY_UNSERVABLE else n for n in SERVED])
def test_llamacpp_serves_the_draft_losslessly(name, converted):
    target_dir, draft_job, target_job = converted[name]
    assert draft_job.result() == 0
    draft, target = target_dir.parent / "gguf" / "draft-f32.gguf", target_job.result()
    prompts = [[5, 17, 200, 42], [7, 7, 9, 11, 13, 250, 1]]  # ids in every tiny vocab
    with llamacpp.LlamaServer(target, threads=1, ctx_size=256) as srv:
        alone = [srv.complete(p, 12).tokens for p in prompts]
    with llamacpp.LlamaServer(target, draft, n_max=3, threads=1, ctx_size=256) as srv:
        spec = [srv.complete(p, 12) for p in prompts]
    assert all(len(t) == 12 for t in alone)
    for p, r, want in zip(prompts, spec, alone):
        assert r.tokens == want or first_divergence_is_a_tie(r.tokens, want, p, target_dir), (p, r.tokens, want)
    assert sum(r.draft_n for r in spec) > 0 and sum(r.verify_rounds for r in spec) > 0
