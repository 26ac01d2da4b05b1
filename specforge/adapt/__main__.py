"""``python -m specforge.adapt --config cfg.yaml [adapt.key=value ...]``: rounds over served traffic.

With ``adapt.serve=true`` (the default) llama-server serves the live draft behind a logging proxy on
``adapt.host:adapt.port`` (OpenAI API: point clients there); every ``adapt.min_rows`` new training
rows start a round. With ``adapt.serve=false`` the rounds read ``adapt.traffic`` until it runs dry.
Stop with Ctrl-C; run the same command again to resume (a round in progress resumes where it was; one
whose inputs changed starts again; a round that failed is undone, so the same command after a fix
starts a new one). ``--reset`` moves ``adapt.dir`` aside and starts over from ``adapt.draft``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from typing import Optional

from specforge.adapt.rounds import Adapter, adapt_root, check
from specforge.config import load_config


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specforge.adapt", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None)
    ap.add_argument("--reset", action="store_true",
                    help="move adapt.dir aside (nothing is deleted) and start over from adapt.draft")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    root = adapt_root(cfg)
    if args.reset and root.exists():
        aside = root.with_name(f"{root.name}.previous-{time.strftime('%Y%m%d-%H%M%S')}")
        shutil.move(str(root), str(aside))
        print(f"adapt: --reset: moved {root} aside to {aside}")
    target = check(cfg)  # every key, file and folder before any work (a capture, a conversion, a server)
    with Adapter(cfg, target=target) as adapter:
        done = adapter.run()
    print(f"adapt: {done} round(s) done; live draft {adapter.state.live}; rounds in {root / 'metrics.jsonl'}")
    if done == 0 and not cfg.adapt.serve:
        raise ValueError(f"adapt.traffic: no round could run ({adapter.traffic} has fewer than adapt.min_rows="
                         f"{cfg.adapt.min_rows} new usable rows); add traffic or lower adapt.min_rows")
    return 0


if __name__ == "__main__":
    from specforge.cli import run_cli

    sys.exit(run_cli(main, errors=(RuntimeError,), interrupted="adapt: interrupted; run the same command to resume"))
