"""python -m specforge.targets --table: the README's supported-targets table (markdown)."""

from __future__ import annotations

import argparse
import sys

from specforge.cli import run_cli
from specforge.targets import table_markdown


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specforge.targets", description=__doc__)
    ap.add_argument("--table", action="store_true", help="print the supported-targets table (markdown)")
    args = ap.parse_args(argv)
    if not args.table:
        ap.print_help()
        return 0
    print(table_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
