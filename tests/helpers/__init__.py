"""Plain helpers shared by several test modules (shared pytest fixtures live in tests/conftest.py).

A test module imports from here, never from another test module (tests/test_layering.py checks it):

* ``data``: the tiny ChatML tokenizer and ShareGPT rows/files.
* ``models``: the tiny random Llama target.
* ``trainer``: a single-process EAGLE-3 trainer on it.
* ``dflash``: the tiny DFlash draft.
* ``ray_run``: the tiny Ray run's config, metrics and checks (its ``assets`` target/data: conftest).
* ``plan``: the driver's planner of a disaggregated run.
* ``failures``: the failure tests' disaggregated run and the worker killer.
* ``ranks``: the multi-rank harness (gloo ranks against the single process: SP, FSDP, mixed precision).
* ``targets``: the supported families' tiny models and target folders.
* ``export``: what SGLang's and vLLM's (speculators') loaders do with an export.
* ``tolerance``: tolerances derived from the dtype and the number of summed terms (equivalence tests).
"""
