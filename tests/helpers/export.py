"""What SGLang's and vLLM's (speculators') loaders do with an EAGLE-3 export (from tests/test_export.py,
shared by tests/test_targets_export.py), and the export CLI run for llama.cpp (tests/test_engine_dflash.py,
tests/test_dspark.py)."""

from pathlib import Path

import torch
from safetensors.torch import load_file

V = 320  # the vocab of tests/test_export.py's tiny target: in_target_vocab's default


# ---------------------------------------------------------------- SGLang


# Read from sgl-project/sglang python/sglang/srt/models/llama_eagle3.py: the parameters of
# LlamaForCausalLMEagle3 (q/k/v and gate/up are stacked into qkv_proj / gate_up_proj) ...
SGLANG_PARAMS = {
    "model.embed_tokens.weight", "model.fc.weight", "model.norm.weight", "lm_head.weight",
    "model.midlayer.input_layernorm.weight", "model.midlayer.hidden_norm.weight",
    "model.midlayer.post_attention_layernorm.weight", "model.midlayer.self_attn.qkv_proj.weight",
    "model.midlayer.self_attn.o_proj.weight", "model.midlayer.mlp.gate_up_proj.weight",
    "model.midlayer.mlp.down_proj.weight",
}
SGLANG_STACKED = [(".qkv_proj", ".q_proj"), (".qkv_proj", ".k_proj"), (".qkv_proj", ".v_proj"),
                  (".gate_up_proj", ".gate_proj"), (".gate_up_proj", ".up_proj")]


def sglang_load(names):
    """... and its load_weights: d2t -> hot_token_id, t2d skipped, a stacked name rewritten, then the
    name or ``model.`` + name if that is a parameter, and SILENTLY NOTHING otherwise.
    Returns (parameter each name landed on or None, names that would be dropped)."""
    landed = {}
    for name in names:
        if "d2t" in name or "t2d" in name:
            continue
        for param, shard in SGLANG_STACKED:
            if shard in name:
                name = name.replace(shard, param)
                break
        landed[name] = name if name in SGLANG_PARAMS else f"model.{name}" if f"model.{name}" in SGLANG_PARAMS else None
    return {k: v for k, v in landed.items() if v}, sorted(k for k, v in landed.items() if v is None)


# ---------------------------------------------------------------- vLLM (speculators)


def load_speculators(path: Path, window=None):
    """speculators' Eagle3 model of an export; ``window`` (an int, or "full") overrides the sliding
    window its config names."""
    from loguru import logger
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    logger.disable("speculators")  # its INFO lines go to the stderr pytest captured when loguru was imported

    cfg = Eagle3SpeculatorConfig.from_pretrained(str(path))
    if window == "full":
        cfg.transformer_layer_config.layer_types = ["full_attention"]
    elif window is not None:
        cfg.transformer_layer_config.sliding_window = int(window)
    # Dense float masks instead of flex attention's block masks (which want 128-multiple lengths): same math.
    cfg.transformer_layer_config._attn_implementation = "eager"
    model = Eagle3DraftModel.from_pretrained(str(path), config=cfg)
    # speculators 0.9 pins transformers<=5.19: under 5.23 from_pretrained leaves an embedding that the
    # checkpoint does not hold uninitialised (not the NaN its "load from the verifier" test looks for),
    # so load the verifier's embedding explicitly, as the export intends (it has none of its own).
    assert "embed_tokens.weight" not in load_file(path / "model.safetensors")
    model._load_verifier_weights(overwrite_embed_tokens=True)
    return model.eval()


def in_target_vocab(logits_TN: torch.Tensor, d2t: torch.Tensor, vocab: int = V) -> torch.Tensor:
    """Draft logits placed at their target ids (vLLM's compute_logits), -1e9 elsewhere."""
    out = logits_TN.new_full((logits_TN.shape[0], vocab), -1e9)
    out[:, torch.arange(d2t.numel()) + d2t] = logits_TN
    return out


@torch.no_grad()
def step_logits(draft, theirs, ids, aux_ours, aux_theirs, vocab: int, steps: int):
    """Per TTT step: (ours, speculators') logits in the target vocab over the rows both define, our
    draft fed ``aux_ours`` and speculators' ``aux_theirs`` over the same ``ids`` (T + 1 tokens)."""
    T = ids.shape[1] - 1
    pos = torch.arange(T)[None]
    ours = draft(ids[:, :T], aux_ours, pos, [T] * steps, head=lambda i, h: draft.logits(h))
    caught = []
    hook = theirs.lm_head.register_forward_hook(lambda _m, _a, out: caught.append(out))
    try:  # row t of their step 0 reads token x_{t+1}, as ours; later steps shift it themselves
        theirs(hidden_states=aux_theirs, input_ids=ids[:, 1 : T + 1], document_ids=torch.zeros_like(pos),
               position_ids=pos.clone(), ttt_steps=steps)
    finally:
        hook.remove()
    # rows past the sequence end read padding (zeros for us, token 0 for them): compared up to T - 1 - i
    return [(in_target_vocab(ours[i][0, : T - 1 - i], draft.d2t, vocab),
             in_target_vocab(caught[i][0, : T - 1 - i], theirs.d2t, vocab)) for i in range(steps)]


# ---------------------------------------------------------------- llama.cpp, through the export CLI


def export_for_llamacpp(draft_dir: Path, target_dir: Path, out: Path) -> tuple[Path, str]:
    """(the GGUF, what the CLI printed): ``python -m specforge.export --engine llama.cpp`` run in-process,
    which must exit 0; its f32 draft GGUF is what a user serves."""
    import contextlib
    import io

    from specforge.export import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = main(["--draft", str(draft_dir), "--engine", "llama.cpp", "--out", str(out), "--target", str(target_dir)])
    assert rc == 0, printed.getvalue()[-2000:]
    return out / "draft-f32.gguf", printed.getvalue()
