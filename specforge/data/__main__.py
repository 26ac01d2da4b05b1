"""``python -m specforge.data prepare --config configs/x.yaml [section.key=value ...] [--vocab-out PATH]``

Tokenizes the configured conversations with the target's chat template (cached), prints the
statistics table, and optionally builds + saves the draft vocab (the most frequent assistant tokens,
as many as the run's algorithm keeps: EAGLE-3's ``draft.vocab_size``).
"""

from __future__ import annotations

import argparse
import sys
import time

from specforge.cli import run_cli
from specforge.config import load_config
from specforge.data.prepare import prepare_dataset
from specforge.data.vocab import build_draft_vocab, save_draft_vocab
from specforge.models.target import load_tokenizer
from specforge.registry import bound_algorithm


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specforge.data", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="tokenize + cache the training data and print statistics")
    prep.add_argument("--config", default=None, help="YAML config (default: all defaults)")
    prep.add_argument("--vocab-out", default=None, help="also build the draft vocab and save it here (.safetensors)")
    prep.add_argument("--no-progress", action="store_true", help="no progress bar")
    prep.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.max_samples=100")
    args, extra = parser.parse_known_args(argv)
    bad = [e for e in extra if e.startswith("-") or "=" not in e]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    args.overrides = list(args.overrides) + extra  # overrides may come after --options

    try:
        cfg = load_config(args.config, args.overrides)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run_cli(lambda: prepare(cfg, args.vocab_out, progress=not args.no_progress))


def prepare(cfg, vocab_out, progress: bool) -> int:
    """Tokenize (cached), print the statistics, optionally build + save the draft vocab."""
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(cfg.model)
    t_tok = time.perf_counter() - t0
    out = prepare_dataset(
        cfg.data, tokenizer, chat_template=cfg.model.chat_template, cache_dir=cfg.model.cache_dir, progress=progress,
    )
    print(out.stats.table())
    print(f"{'tokenizer load seconds':<40}{t_tok:>12.1f}")
    if vocab_out:
        V = len(tokenizer)
        n = bound_algorithm(cfg).draft_vocab_size(V)
        if n > V:  # only EAGLE-3's own key can ask for more
            raise ValueError(f"config key 'draft.vocab_size'={n} exceeds the target's "
                             f"vocabulary ({V} tokens); choose at most {V}")
        t1 = time.perf_counter()
        vocab = build_draft_vocab(out.train, V, n)  # train split only: eval is never trained on
        path = save_draft_vocab(vocab, vocab_out)
        cov = f"{vocab.coverage:.4f}" if vocab.coverage is not None else "n/a"
        print(f"draft vocab: {n} of {V} target tokens, coverage of train loss tokens {cov}, "
              f"saved to {path} ({time.perf_counter() - t1:.1f} s)")
    print(f"{'total wall seconds':<40}{time.perf_counter() - t0:>12.1f}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
