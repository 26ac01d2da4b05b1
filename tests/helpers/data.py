"""The tiny ChatML tokenizer and ShareGPT rows/files (from tests/test_data_prepare.py)."""

import json

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_tokenizer(extra_tokens=()):
    """A tiny byte-level BPE fast tokenizer with a ChatML template (fast to build)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", *extra_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tk.train_from_iterator(["hello world user assistant system question answer"] * 20, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHATML
    return tok


def rec(q, a):
    return {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}


def write_jsonl(path, records_or_lines):
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records_or_lines]
    path.write_text("\n".join(lines) + "\n")
    return path
