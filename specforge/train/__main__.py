import sys

from specforge.cli import run_cli
from specforge.local import main

sys.exit(run_cli(main))
