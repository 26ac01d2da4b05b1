"""The tiny ChatML tokenizer and ShareGPT rows/files (from tests/test_data_prepare.py)."""

import json

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}"
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


WORDS = "hello world user assistant system question answer".split()


def tiny_rows(n: int = 14) -> list[dict]:
    """``n`` short two-turn ShareGPT rows over the tokenizer's seven words."""
    return [rec(" ".join(WORDS[(i + j) % 7] for j in range(3 + i % 4)),
                " ".join(WORDS[(2 * i + j) % 7] for j in range(6 + i % 5))) for i in range(n)]


def write_tiny_assets(root, num_rows: int = 14, head_scale=None, tok=None, **llama):
    """``root/target`` (a tiny random Llama, seed 0, + ``tok`` or :func:`make_tokenizer`'s) and
    ``root/data.jsonl`` (:func:`tiny_rows`). ``head_scale`` multiplies the lm_head (a peaked next-token
    distribution: a loss that can fall); ``llama`` overrides the LlamaConfig's sizes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tok or make_tokenizer()
    sizes = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), **{**sizes, **llama}))
    if head_scale is not None:
        with torch.no_grad():
            model.lm_head.weight.mul_(head_scale)
    model.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    write_jsonl(root / "data.jsonl", tiny_rows(num_rows))
    return root
