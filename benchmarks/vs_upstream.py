"""Runs the yardstick (``../shared/gpu-bench/ttt_vs_upstream.py``, or its copy ``.gpu-bench/``) against this tree.

    python benchmarks/vs_upstream.py <path to ttt_vs_upstream.py> [its arguments]

The yardstick lives outside the project and was written against an older tree: it imports the trainer
by its path before 212282a (``specforge.train.trainer``, now ``specforge.training.trainer``:
``specforge.train`` became the single-process entry point's module), and hands ``DraftTrainer`` the
algorithm unbound (the trainer now takes ``registry.bound_algorithm(cfg)``). This runs it as
``__main__`` with the old name standing for a module that binds the algorithm it is given to the
config it is given, so the yardstick itself runs unchanged.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    if len(sys.argv) < 2 or not Path(sys.argv[1]).is_file():
        sys.exit("error: give the yardstick's ttt_vs_upstream.py first (../shared/gpu-bench/ or .gpu-bench/), "
                 "then its arguments")
    import types

    from specforge import registry
    from specforge.training import trainer

    class DraftTrainer(trainer.DraftTrainer):
        def __init__(self, algorithm, draft, state, cfg, *args, **kwargs):
            if getattr(algorithm, "facts", None) is None:  # the yardstick's unbound ALGORITHM
                algorithm = registry.bound_algorithm(cfg)
            super().__init__(algorithm, draft, state, cfg, *args, **kwargs)

    old = types.ModuleType("specforge.train.trainer", "the trainer where the yardstick looks for it")
    old.DraftTrainer, old._compute_dtype = DraftTrainer, trainer._compute_dtype
    sys.modules.setdefault("specforge.train.trainer", old)
    script = sys.argv.pop(1)
    sys.argv[0] = script
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
