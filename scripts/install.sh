#!/usr/bin/env bash
# Install torch_shift (editable) with the given extras, e.g. `scripts/install.sh serve,dev`.
#
# torch: an existing torch >= 2.11 is kept (a GPU machine keeps its CUDA build). Otherwise torch 2.13.0 is
# installed: on a machine without an NVIDIA GPU the CPU-only build from PyTorch's CPU wheel index (PyPI's
# default torch wheel pulls about 20 CUDA packages, several GB); where that index cannot be reached, the plain
# pin from the configured index; with a GPU, the CUDA build from PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
extras=${1:-}
TORCH_PIN="torch==2.13.0"
CPU_INDEX="https://download.pytorch.org/whl/cpu"

if ! "$PYTHON" -c '
import sys, torch
version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if version >= (2, 11) else 1)' 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[install] $TORCH_PIN (CUDA build, an NVIDIA GPU is present: several GB with its CUDA packages)" >&2
    "$PYTHON" -m pip install "$TORCH_PIN"
  elif "$PYTHON" -c "import urllib.request; urllib.request.urlopen('$CPU_INDEX/torch/', timeout=15)" 2>/dev/null; then
    echo "[install] $TORCH_PIN, CPU-only build from $CPU_INDEX (no NVIDIA GPU here)" >&2
    "$PYTHON" -m pip install --quiet --index-url "$CPU_INDEX" "$TORCH_PIN"
  else
    echo "[install] $CPU_INDEX cannot be reached: $TORCH_PIN from the configured package index (pip's progress" \
         "follows), which on PyPI is the CUDA build (about 20 CUDA packages, several GB) unless the index holds a" \
         "CPU wheel; to avoid that, install a CPU torch >= 2.11 first" >&2
    "$PYTHON" -m pip install "$TORCH_PIN"
  fi
fi
# compat mode puts this checkout on sys.path (a .pth file) instead of setuptools' import hook, which comes after
# sys.path: with the hook, a script run from the folder that holds a clone named torch_shift imported that clone
# as an empty namespace package
"$PYTHON" -m pip install --quiet -e ".${extras:+[$extras]}" --config-settings editable_mode=compat
if [[ ",$extras," == *",dev,"* ]]; then
  # the torchtitan handoff tests import only its model code: skip its training-job dependencies
  "$PYTHON" -m pip install --quiet --no-deps "torchtitan==0.3.0"
  "$PYTHON" -m pip install --quiet "spmd_types==0.2.3" tyro
  # aiperf (tests/test_aiperf.py runs it against the server) pins huggingface_hub < 2 and other versions this
  # environment does not keep: it gets an environment of its own, .venv-aiperf/
  if [[ ! -x .venv-aiperf/bin/aiperf ]]; then
    "$PYTHON" -m venv .venv-aiperf
    .venv-aiperf/bin/python -m pip install --quiet "aiperf==0.13.0"
  fi
fi
