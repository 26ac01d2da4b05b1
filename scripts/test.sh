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
  "$py" -m pytest -ra --durations=15 "$@"
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
bash scripts/install.sh
# llama.cpp (llama-server + its GGUF converter), built once per version and CPU into ~/.cache/specforge:
# tests/test_engine_llamacpp.py serves drafts with it (and fails, not skips, without it)
VENV="$VENV" bash scripts/install_llamacpp.sh
# vLLM in its own venv (~/.cache/specforge/vllm, once): tests/test_vllm_backend.py captures through it
# (and fails, not skips, without it)
bash scripts/install_vllm.sh
# lint first (seconds): the ruff configuration in pyproject.toml, clean on the whole tree
"$VENV/bin/ruff" check --no-cache . || { echo "ruff found the problems above: fix them (ruff check --fix fixes most)" >&2; exit 1; }
pytest_with "$VENV/bin/python" "$@"
