"""Engines that serve drafts: each module knows one engine's contract (docs/ENGINES.md)."""
