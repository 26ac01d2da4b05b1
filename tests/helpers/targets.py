"""The supported families' tiny random models (from tests/test_targets.py) and a family's target folder +
offline run config (from tests/test_targets_train.py)."""

import torch

from specforge.models.target import TargetModel
from specforge.targets import FAMILIES, tiny
from tests.helpers.data import CHATML, rec, write_jsonl

AUX = [0, 2, 4]
NAMES = [f.name for f in FAMILIES]
WORDS = "hello world user assistant system question answer why how what the a is of to".split()


def build_family(name: str) -> TargetModel:
    """The family's tiny random model with its norms moved off their start. Each test module caches it
    itself (``built = functools.lru_cache(maxsize=None)(build_family)``)."""
    fam = next(f for f in FAMILIES if f.name == name)
    torch.manual_seed(0)
    model = fam.auto_class().from_config(getattr(tiny, name)()).eval().requires_grad_(False)
    with torch.no_grad():  # norms start at 1 (or 0 for 1 + w norms): move them so a wrong norm offset shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    return TargetModel(model=model, tokenizer=None, aux_layer_ids=list(AUX), device=torch.device("cpu"))


def word_tokenizer():
    """A word-level fast tokenizer (19 ids, inside every tiny model's 256) with a ChatML template;
    ids 0, 2 = the tiny configs' pad and eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]"] + WORDS
    tk = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.decoder = decoders.WordPiece()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  unk_token="[UNK]", additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHATML
    return tok


def target_folder(name: str, root):
    """The family's tiny random model + the tokenizer in ``root/target``, 12 chats in ``root/data.jsonl``."""
    fam = next(f for f in FAMILIES if f.name == name)
    torch.manual_seed(0)
    fam.auto_class().from_config(getattr(tiny, name)()).save_pretrained(root / "target")
    word_tokenizer().save_pretrained(root / "target")
    n = len(WORDS)
    rows = [rec(" ".join(WORDS[(i + j) % n] for j in range(3 + i % 4)),
                " ".join(WORDS[(2 * i + j) % n] for j in range(10 + i % 5))) for i in range(12)]
    write_jsonl(root / "data.jsonl", rows)


def overrides(root) -> list[str]:
    return [f"model.target_path={root / 'target'}", "model.dtype=float32", "model.device=cpu",
            f"model.cache_dir={root / 'cache'}", f"model.aux_layer_ids={AUX}".replace(" ", ""),
            f"data.path={root / 'data.jsonl'}", "data.max_length=64", "data.num_eval=4",
            "draft.vocab_size=256", "draft.ttt_length=3", "train.lr=1e-2", "train.warmup_steps=0",
            "train.batch_size=2", "train.max_steps=3", "train.precision=fp32", "train.num_threads=1",
            "train.num_workers=1", "train.log_every=1", "train.eval_every=0", f"train.output_dir={root / 'out'}",
            "tracking.wandb=false", "checkpoint.every_steps=0", "checkpoint.resume=false",
            "placement.mode=offline", f"store.dir={root / 'features'}", "store.dtype=bfloat16"]
