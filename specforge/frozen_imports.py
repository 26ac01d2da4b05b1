"""Imported last by the fork server (``specforge.forkserver.PRELOAD``; the suite's Ray zygote too,
tests/helpers/ray_zygote.py), for its effect: the objects its imports made are collected once and frozen
(``gc.freeze``), so the garbage collection of a child forked from it never walks them again. Left as they
were (in the young generations: a fresh server has never run a full collection), every child's first full
collections walked them all: torch's and transformers' ~350k objects. They are unfrozen at exit (an
``atexit`` handler the children inherit), where the interpreter's last collection frees them as it did
before (frozen ones it leaves: triton's nanobind bindings then print a page of "leaked" lines)."""

import atexit
import gc

gc.collect()
gc.freeze()
atexit.register(gc.unfreeze)
