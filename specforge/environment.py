"""Environment variables set for one call and taken back: what a library reads from the environment
when we call it (Ray's ``ray.init``, a fork of tokenizer workers) is set where the caller set nothing,
for that call alone, so a run never leaves its settings in the caller's ``os.environ``."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Mapping


@contextlib.contextmanager
def env_defaults(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` where ``os.environ`` has no such key, for the block alone; afterwards each key we
    added is gone again unless the block changed it (what the called library wrote itself stays)."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k, v in added.items():
            if os.environ.get(k) == v:
                del os.environ[k]
