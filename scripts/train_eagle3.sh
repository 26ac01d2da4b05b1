#!/usr/bin/env bash
# Train an EAGLE-3 draft with the Ray orchestrator, then measure it with real speculative decoding.
#
#   bash scripts/train_eagle3.sh [--config configs/<run>.yaml] [dotted.overrides=...]
#
# Installs into .venv first if it is missing (set SKIP_INSTALL=1 to skip). With no --config it
# trains the embedded default (SmolLM2-135M-Instruct + ShareGPT, CPU/gloo). Extra arguments are
# passed to `python -m specforge.ray_train`, e.g. train.max_steps=50 ray.address=auto.
set -euo pipefail
cd "$(dirname "$0")/.."
export WANDB_MODE=${WANDB_MODE:-offline} RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=${RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER:-0}
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled} TOKENIZERS_PARALLELISM=false
VENV=${VENV:-.venv}
if [ -z "${SKIP_INSTALL:-}" ] && [ ! -x "$VENV/bin/python" ]; then bash scripts/install.sh; fi
CONFIG=configs/smollm2-135m-cpu.yaml
if [ "${1:-}" = "--config" ]; then CONFIG=$2; shift 2; fi
"$VENV/bin/python" -m specforge.ray_train --config "$CONFIG" "$@"
OUT=$("$VENV/bin/python" -c "import sys; from specforge.config import load_config; from specforge.train.trainer import checkpoint_root; print(checkpoint_root(load_config(sys.argv[1], sys.argv[2:])))" "$CONFIG" "$@")
CKPT=$(ls -d "$OUT"/step-* 2>/dev/null | tail -n 1)
if [ -n "${SKIP_EVAL:-}" ] || [ -z "$CKPT" ]; then exit 0; fi
echo "evaluating $CKPT with chain speculative decoding on held-out prompts"
"$VENV/bin/python" -m specforge.eval --config "$CONFIG" --draft "$CKPT" --num-prompts "${EVAL_PROMPTS:-16}" "$@"
