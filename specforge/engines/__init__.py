"""Engines that serve drafts: each module knows one engine's contract (docs/ENGINES.md). Here: the one
wording of an engine's refusal of a draft, and what to do instead (``refusal_line``)."""

from __future__ import annotations

from specforge.targets import ENGINE_NAMES

__all__ = ["refusal_line"]


def refusal_line(algo, engine: str) -> str:
    """Why ``engine`` does not serve ``algo``'s drafts (``seam.Format``: its ``refusal``, where it says more)
    and what to do instead: the engines that serve them (with the export command), or our eval where
    none here does. The export's and llama.cpp's refusals both say it this way."""
    why = algo.refusal(engine)
    others = [e for e in algo.engines if e != engine]
    if others:
        instead = (f"export it for {' or '.join(ENGINE_NAMES.get(e, e) for e in others)} instead: "
                   f"python -m specforge.export --engine {'|'.join(others)}")
    else:
        instead = f"no engine here serves {algo.architecture} drafts yet: evaluate it with python -m specforge.eval"
    return (f"{ENGINE_NAMES.get(engine, engine)} cannot serve {algo.architecture} drafts"
            f"{f' ({why})' if why else ''}; {instead}")
