"""``python -m specforge.adapt --config cfg.yaml [adapt.key=value ...]``: rounds over served traffic.

With ``adapt.serve=true`` (the default) llama-server serves the live draft behind a logging proxy on
``adapt.host:adapt.port`` (OpenAI API: point clients there); every ``adapt.min_rows`` new training
rows start a round. With ``adapt.serve=false`` the rounds read ``adapt.traffic`` until it runs dry.
Stop with Ctrl-C; run the same command again to resume (a round in progress resumes where it was).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional


def main(argv: Optional[list[str]] = None) -> int:
    from specforge.adapt.rounds import Adapter, adapt_root, check
    from specforge.config import load_config

    ap = argparse.ArgumentParser(prog="python -m specforge.adapt", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    check(cfg)  # every key, file and folder before a model loads or a server starts
    with Adapter(cfg) as adapter:
        done = adapter.run()
    print(f"adapt: {done} round(s) done; live draft {adapter.state.live}; rounds in {adapt_root(cfg) / 'metrics.jsonl'}")
    return 0


if __name__ == "__main__":
    from specforge.cli import run_cli

    sys.exit(run_cli(main, errors=(RuntimeError,), interrupted="adapt: interrupted; run the same command to resume"))
