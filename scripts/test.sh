#!/usr/bin/env bash
# Install (if needed) and run the whole test suite. Exit 5 from pytest (no tests ran) is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
export WANDB_MODE=${WANDB_MODE:-offline} RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
export TOKENIZERS_PARALLELISM=false
VENV=${VENV:-.venv}
pytest_with() {  # $1: the python; the rest: pytest's arguments. pytest's exit 5 (no test ran) fails.
  local py=$1 rc
  shift
  set +e
  "$py" -m pytest -ra --durations=20 "$@"
  rc=$?
  set -e
  if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
  exit "$rc"
}
# The GPU suite (-m gpu) on a machine whose python already has a CUDA torch: run it with that python as
# it is (installing would pin the CPU build of torch into .venv, and a GPU node may have no network).
if [[ " $* " == *" -m gpu "* || " $* " == *" -mgpu "* ]]; then
  PY=${PYTHON:-python3}
  if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "GPU suite with $PY ($("$PY" -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))')): nothing installed"
    pytest_with "$PY" "$@"
  fi
fi
# vLLM in its own venv (~/.cache/specforge/vllm, once): tests/test_vllm_backend.py captures through it
# (and fails, not skips, without it). The first time it is mostly a download (~1 GB of wheels): it runs
# in the background, beside the install and the llama.cpp build (compute), and is waited for below.
VLLM_LOG=$(mktemp)
bash scripts/install_vllm.sh >"$VLLM_LOG" 2>&1 &
VLLM_PID=$!
trap 'kill "$VLLM_PID" 2>/dev/null || true' EXIT  # a failed install below does not leave it running
# A fresh venv's install is the one tests/test_install.py checks (no ERROR, one note): its output is kept
# for that test (SPECFORGE_FRESH_INSTALL) instead of a second install into another fresh venv.
if [ -x "$VENV/bin/python" ]; then
  bash scripts/install.sh
else
  FRESH=$(mktemp -d)
  echo "installing into a new venv $VENV (~2-3 min; pip's output when it is done)"
  rc=0
  bash scripts/install.sh >"$FRESH/stdout" 2>"$FRESH/stderr" || rc=$?
  cat "$FRESH/stdout"
  cat "$FRESH/stderr" >&2
  [ "$rc" -eq 0 ] || { echo "scripts/install.sh failed (exit $rc): its output above" >&2; exit "$rc"; }
  printf '%s\n' "$VENV" >"$FRESH/venv"  # as given (install.sh names it so), relative to the repository
  export SPECFORGE_FRESH_INSTALL=$FRESH
fi
# llama.cpp (llama-server + its GGUF converter), built once per version and CPU into ~/.cache/specforge:
# tests/test_engine_llamacpp.py serves drafts with it (and fails, not skips, without it)
VENV="$VENV" bash scripts/install_llamacpp.sh
wait "$VLLM_PID" || { cat "$VLLM_LOG" >&2; echo "scripts/install_vllm.sh failed (its output above)" >&2; exit 1; }
cat "$VLLM_LOG"
rm -f "$VLLM_LOG"
# the tests' own modules compiled once (scripts/install.sh compiles specforge's): the helpers the suite's
# subprocesses import (Ray workers, CLIs) are otherwise compiled again in each where PYTHONDONTWRITEBYTECODE=1
"$VENV/bin/python" -m compileall -q tests >/dev/null
# lint first (seconds): the ruff configuration in pyproject.toml, clean on the whole tree
"$VENV/bin/ruff" check --no-cache . || { echo "ruff found the problems above: fix them (ruff check --fix fixes most)" >&2; exit 1; }
# Two pytest-xdist workers (SPECFORGE_TEST_WORKERS=0: none): much of the suite waits on other processes
# (Ray actors, vLLM engines, llama-server, CLIs), which the other worker fills. One module per worker at a
# time (its module fixtures built once), the longest modules first (tests/conftest.py, LONGEST_FIRST).
WORKERS=${SPECFORGE_TEST_WORKERS:-2}
XDIST=()
[ "$WORKERS" -gt 0 ] && XDIST=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder)
pytest_with "$VENV/bin/python" "${XDIST[@]}" "$@"
