"""The bad-input table pattern (tests/test_bad_input.py and each algorithm's tests): a row of keys is
refused in one ValueError matching its pattern; a row without one is the table's control and passes."""

import pytest

from specforge.config import load_config
from tests.helpers.ray_run import cfg_overrides


def one_error_line(err: str, *needles: str) -> str:
    """The one ``error:`` line of an entry point's stderr ``err`` (no traceback), holding each of ``needles``."""
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def assert_row(check, pattern) -> None:
    """``check()`` raises a ValueError matching ``pattern``; with ``pattern`` None it passes (the control)."""
    if pattern is None:
        check()
        return
    with pytest.raises(ValueError, match=pattern):
        check()


def config_refused(algorithm: str, overrides, pattern, control):
    """``overrides`` refused by the config as ``algorithm``; the config of ``control`` (the same keys at valid
    values: the negative control) loads and is returned."""
    with pytest.raises(ValueError, match=pattern):
        load_config(None, [f"draft.algorithm={algorithm}", *overrides])
    return load_config(None, [f"draft.algorithm={algorithm}", *control])


def algorithm_cfg(assets, out, algorithm: str, *overrides, drop=()):
    """The tiny Ray run's config (tests/helpers/ray_run.py) as ``algorithm`` on one train worker: its
    EAGLE-3 ``draft.*`` keys and any key starting with one of ``drop`` left out."""
    base = [o for o in cfg_overrides(assets, out) if not o.startswith(("draft.", "train.num_workers=", *drop))]
    return load_config(None, [*base, f"draft.algorithm={algorithm}", "train.num_workers=1", *overrides])
