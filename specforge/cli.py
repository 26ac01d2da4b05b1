"""One error style for every ``python -m specforge.*`` entry point.

A user mistake (a bad key, a missing file, a dataset without usable rows, a worker that failed
and named itself) is one line on stderr, ``error: <what was wrong and what to do>``, and exit
code 1; Ctrl-C is exit code 130. Only a bug shows a traceback. ``SPECFORGE_TRACEBACK=1`` shows
the traceback of every error (for reports and debugging).

    if __name__ == "__main__":
        sys.exit(run_cli(main))
"""

from __future__ import annotations

import os
import sys
from typing import Callable, Optional, Sequence

# ValueError: every check of ours; OSError: a missing/unreadable file, named by its message.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError)


def one_line(err: BaseException) -> str:
    """The error's message on one line (HTTP bodies and YAML marks carry newlines)."""
    return " ".join(str(err).split()) or type(err).__name__


def run_cli(main: Callable[[], Optional[int]], errors: Sequence[type[BaseException]] = (),
            interrupted: str = "interrupted") -> int:
    """Run ``main`` (an entry point's body) and turn user errors (``USER_ERRORS`` + ``errors``)
    into one line on stderr and exit code 1, Ctrl-C into ``interrupted`` and 130."""
    try:
        return main() or 0
    except (*USER_ERRORS, *errors) as err:
        if os.environ.get("SPECFORGE_TRACEBACK"):
            raise
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        return 130


# The --dry-run flags of the training entry points, here (stdlib only) so that an entry point can parse its
# arguments and read its config before it imports torch: an unknown key is one line at once (a value's check
# imports the draft algorithm's module, and with it torch).
def with_dry_run_flags(ap) -> None:
    """The ``--dry-run`` flags of the training entry points (``specforge.dryrun`` runs them)."""
    ap.add_argument("--dry-run", action="store_true",
                    help="build the target and the draft on the meta device, print parameters, bytes per device "
                         "and the plan, and exit (no weights, no data, no Ray)")
    ap.add_argument("--target-config", default=None,
                    help="with --dry-run: the target's config.json to plan with (default: the target's own, or "
                         "the published copy in configs/targets/ for a hub id)")


def check_flags(args) -> None:
    if args.target_config and not args.dry_run:
        raise ValueError("--target-config is only read with --dry-run (a run reads the target's own config.json)")
