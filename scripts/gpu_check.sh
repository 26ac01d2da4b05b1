#!/usr/bin/env bash
# Issue 46's one prepared call on a lent GPU (one H100/H200, no network), under 8.5 minutes in all: the
# project's one-GPU suite, its step at the 8B draft shapes with each core and packed rows, the fused loss
# kernels (every train.loss kind, issue 58), and the yardstick's step against SpecForge v0.2.0. Every part
# has its own timeout, so a hang in one still leaves the others' figures. Output: $OUT/gpu_check/<part>.log
# and summary.txt. On an H200 (2026-11-30, be72d44) the parts took: suite >110 s (cut there), step 133,
# losses 32, yardstick 91, after a ~35 s machine start: a second call fits a 15-minute lease only if short.
#
# Before the call, on the CPU machine: the wheels the GPU image lacks (../shared/gpu-bench/README.md:
# transformers, datasets, dill, multiprocess at the versions .venv has; the vLLM export needs speculators
# 0.9.0 and pydantic's wheels, its second list). Ray is not carried (too large): its stand-in is used.
#     echo "/.gpu-bench/" >> .git/info/exclude; cp -r ../shared/gpu-bench .gpu-bench   # + .gpu-bench/whl
# vLLM (issue 55's GPU part: the connector's CUDA path in test_the_target_in_vllm_on_the_device, two engines on
# two GPU sets in test_two_engines_each_on_its_own_gpus where two GPUs are lent; both skip without vLLM): its CUDA
# wheel for the device's torch and the dependencies the image lacks, into .gpu-bench/whl, the wheels over 60 MiB
# split into parts carried over successive calls (the loop below joins them). Not yet done on a lent GPU.
# then the device call, from the project root, carrying .gpu-bench:
#     COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_check.sh        (the device tool sets $OUT)
# COMMIT is passed in: the device copy of the tree has no .git. Then record GPU, torch and commit in
# benchmarks/README.md ("GPU runs") and decide draft.attention, train.pack_tokens, train.recompute_mlp,
# loss.SOFT_CE_KERNEL, layers.COMPILE_NORM and layers.COMPILE_ROTARY from the figures.
# DRY=1 prints the parts instead of running them (tests/test_install.py runs it so).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to a results folder}
R="$OUT/gpu_check"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
T0=$(date +%s)

part() {  # part NAME SECONDS COMMAND...: one part under its own timeout; its log and exit status
  local name=$1 secs=$2 rc
  shift 2
  if [ "${DRY:-0}" = 1 ]; then echo "$name (${secs}s): $*"; return 0; fi
  echo "[t+$(($(date +%s) - T0))s] $name"
  timeout "$secs" "$@" >"$R/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc ($(($(date +%s) - T0))s)" | tee -a "$R/summary.txt"
  tail -15 "$R/$name.log"
}

if [ "${DRY:-0}" != 1 ]; then
  mkdir -p "$R"
  # a wheel over one call's carry (vLLM's CUDA wheel, 321 MiB) comes in parts, one or two per call while the
  # machine stays warm (split -b 60M NAME.whl .gpu-bench/whl/NAME.whl.part-), put back together here
  for first in .gpu-bench/whl/*.whl.part-aa; do
    [ -e "$first" ] || continue
    whole=${first%.part-aa}
    cat "$whole".part-* > "$whole" && rm -f "$whole".part-*
  done
  if ls .gpu-bench/whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .gpu-bench/whl/*.whl 2>&1 | tail -3
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  # no Ray there (its wheel is larger than a call carries): the yardstick's stand-in, last on the path, lets the
  # single-process path import; the suite's Ray tests skip it (it has no version)
  if ! python3 -c "import ray" 2>/dev/null && [ -d .gpu-bench/raystub ]; then
    export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/.gpu-bench/raystub
  fi
  {
    echo "commit ${COMMIT:-unknown} $(date -u +%F' '%H:%M) UTC"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  } | tee "$R/summary.txt"
fi
# 1. the one-GPU suite: every entry point and algorithm, the memory model against max_memory_allocated
part gpu_suite 200 python3 -m pytest -m gpu -p no:cacheprovider -q -rs tests/test_gpu.py tests/test_gpu_entry.py
# 2. the step at 8B draft shapes: sdpa (auto) and flex cores, T 2k/4k/8k, and packed rows of 4096 tokens
part gpu_step 150 python3 benchmarks/bench_gpu_step.py --attention sdpa,flex --pack 4096 --no-readme
# 3. the fused loss kernels (soft CE and every other loss kind) against the torch rows, autotuned; speed and peak
part losses 45 python3 benchmarks/bench_soft_ce.py --reps 5 --no-readme
# 4. the yardstick: the project's step against SpecForge v0.2.0's flex path, same weights and features
if [ -d .gpu-bench ] || [ "${DRY:-0}" = 1 ]; then
  part vs_v020 110 python3 benchmarks/vs_upstream.py .gpu-bench/ttt_vs_upstream.py --device cuda --shapes gpu --project . \
    --out "$OUT/gpu_check/ttt_vs_upstream" --time-budget-s 95 --fp32-check-T 0
fi
[ "${DRY:-0}" = 1 ] || echo "done in $(($(date +%s) - T0))s" | tee -a "$R/summary.txt"
