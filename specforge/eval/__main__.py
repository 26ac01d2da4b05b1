"""``python -m specforge.eval``: see ``specforge/eval/__init__.py``."""

import sys

from specforge.cli import run_cli
from specforge.eval import main

sys.exit(run_cli(main))
