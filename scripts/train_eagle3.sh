#!/usr/bin/env bash
# Train an EAGLE-3 draft, then measure it with real speculative decoding against the target alone.
#
#   bash scripts/train_eagle3.sh [--config configs/<run>.yaml] [--with-llamacpp] [dotted.overrides=...]
#
# --with-llamacpp (or WITH_LLAMACPP=1): if llama.cpp's llama-server is not built yet, build it in the
# background at low priority (nice 19) while the draft trains, so the run ends with its rows too
# (the build takes ~6 min on 2 idle cores; beside training, both take longer).
#
# Installs into .venv first if it is missing (set SKIP_INSTALL=1 to skip). With no --config it runs
# the embedded default (SmolLM2-135M-Instruct + ShareGPT, CPU/gloo), whose recipe is offline:
#   1. data     the target reads 500 ShareGPT conversations once and their features go to the
#               feature store (store.fill=capture: python -m specforge.capture); store.fill=regenerate
#               has the target write the answers instead (python -m specforge.regenerate), keeping
#               the hidden states it computes while generating
#   2. train    two epochs over the store (python -m specforge.ray_train, placement.mode=offline)
#   3. eval     trained draft vs prompt lookup on held-out prompts: acceptance length, speedup
# Online configs (placement.mode colocated | disaggregated) skip step 1. Every step resumes where
# it stopped when rerun. Extra arguments are dotted overrides passed to every step.
set -euo pipefail
cd "$(dirname "$0")/.."
export WANDB_MODE=${WANDB_MODE:-offline} RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=${RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER:-0}
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled} TOKENIZERS_PARALLELISM=false
VENV=${VENV:-.venv}
if [ -z "${SKIP_INSTALL:-}" ] && [ ! -x "$VENV/bin/python" ]; then bash scripts/install.sh; fi
PY="$VENV/bin/python"
CONFIG=configs/smollm2-135m-cpu.yaml
WITH_LLAMACPP=${WITH_LLAMACPP:-}
while [ $# -gt 0 ]; do
  case "$1" in
    --config) CONFIG=$2; shift 2 ;;
    --with-llamacpp) WITH_LLAMACPP=1; shift ;;
    *) break ;;
  esac
done
start=$(date +%s)
phase() { echo; echo "== $1 ($(( ($(date +%s) - start) / 60 )) min since start)"; }

# What this config asks for (one line: placement mode, how the store is filled, checkpoint folder).
# A bad config is one error: line (the same check ray_train makes), not a traceback.
SETTINGS=$("$PY" - "$CONFIG" "$@" <<'EOF'
import sys
from specforge.cli import run_cli
def main():
    from specforge.config import load_config
    from specforge.training.trainer import checkpoint_root
    cfg = load_config(sys.argv[1], sys.argv[2:])
    print(cfg.placement.mode, cfg.store.fill, checkpoint_root(cfg))
sys.exit(run_cli(main))
EOF
) || exit 1
read -r MODE FILL OUT <<< "$SETTINGS"

llamacpp_installed() { "$PY" -c 'import sys; from specforge.engines.llamacpp import installed; sys.exit(0 if installed() else 1)'; }
BUILD_PID=
BUILD_LOG=${TMPDIR:-/tmp}/specforge-llamacpp-build-$$.log
if [ -n "$WITH_LLAMACPP" ] && ! llamacpp_installed; then
  echo "llama.cpp: building llama-server in the background (nice 19) while the draft trains; log: $BUILD_LOG"
  VENV="$VENV" nice -n 19 bash scripts/install_llamacpp.sh >"$BUILD_LOG" 2>&1 &
  BUILD_PID=$!
fi

if [ "$MODE" = offline ]; then
  phase "1/3 data: store.fill=$FILL"
  "$PY" -m "specforge.$FILL" --config "$CONFIG" "$@"
fi
phase "2/3 train: placement.mode=$MODE"
"$PY" -m specforge.ray_train --config "$CONFIG" "$@"
# The dashboards (held-out beside training, epochs marked), written now and named in the final table.
RUN=$("$PY" -c 'import sys; from specforge.config import load_config as l; print(l(sys.argv[1], sys.argv[2:]).train.output_dir)' "$CONFIG" "$@")
PLOTS=$("$PY" -m specforge.plot "$RUN") || PLOTS="none written (python -m specforge.plot $RUN failed)"
# ray_train exits non-zero if it could not save; the newest complete checkpoint is the one to measure.
CKPT=$("$PY" -c 'import sys; from specforge.training.checkpoint import latest_checkpoint as l; print(l(sys.argv[1]) or "")' "$OUT")
if [ -n "${SKIP_EVAL:-}" ]; then exit 0; fi
if [ -z "$CKPT" ]; then echo "error: no checkpoint under $OUT to evaluate" >&2; exit 1; fi
phase "3/3 eval: $CKPT vs prompt lookup, chain speculative decoding on held-out prompts"
"$PY" -m specforge.eval --config "$CONFIG" --draft "$CKPT" --draft prompt-lookup --num-prompts "${EVAL_PROMPTS:-16}" "$@"
# The same draft served by llama.cpp's llama-server, when it is installed (optional component).
if [ -n "$BUILD_PID" ]; then
  phase "3b: waiting for the background llama.cpp build ($BUILD_LOG)"
  wait "$BUILD_PID" || { tail -5 "$BUILD_LOG" >&2; echo "warning: the llama.cpp build failed (log: $BUILD_LOG)" >&2; }
fi
if llamacpp_installed; then
  # the build is cached per machine; this venv may still lack the converter's Python deps (instant when cached)
  VENV="$VENV" bash scripts/install_llamacpp.sh >/dev/null
  phase "3b eval: $CKPT served by llama.cpp (llama-server, greedy, the same held-out prompts)"
  "$PY" -m specforge.eval --config "$CONFIG" --draft "$CKPT" --engine llama.cpp --num-prompts "${EVAL_PROMPTS:-16}" "$@" \
    || echo "warning: the llama.cpp rows failed (see above); the draft and the rows above stand" >&2
else
  echo; echo "llama.cpp rows: not installed. Run \`bash scripts/install_llamacpp.sh\` (once, ~6 min on 2 idle cores), then"
  echo "  $PY -m specforge.eval --config $CONFIG --draft $CKPT --engine llama.cpp"
  echo "or rerun this script with --with-llamacpp to build it in the background while the draft trains."
fi
echo; echo "dashboards of $RUN/metrics.jsonl (wandb draws the same as train_vs_heldout/*):"
echo "$PLOTS" | sed 's/^/  /'
phase "done"
