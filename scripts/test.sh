#!/usr/bin/env bash
# Install (if needed) and run the whole test suite. Exit 5 from pytest (no tests ran) is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
export WANDB_MODE=${WANDB_MODE:-offline} RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
export TOKENIZERS_PARALLELISM=false
VENV=${VENV:-.venv}
bash scripts/install.sh
# llama.cpp (llama-server + its GGUF converter), built once per version and CPU into ~/.cache/specforge:
# tests/test_engine_llamacpp.py serves drafts with it (and fails, not skips, without it)
VENV="$VENV" bash scripts/install_llamacpp.sh
# lint first (seconds): the ruff configuration in pyproject.toml, clean on the whole tree
"$VENV/bin/ruff" check --no-cache . || { echo "ruff found the problems above: fix them (ruff check --fix fixes most)" >&2; exit 1; }
set +e
"$VENV/bin/python" -m pytest -ra --durations=15 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
