import sys

from specforge.cli import run_cli
from specforge.train.trainer import main

sys.exit(run_cli(main))
