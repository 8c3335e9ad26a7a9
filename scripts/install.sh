#!/usr/bin/env bash
# Install torch_shift (editable) with the given extras, e.g. `scripts/install.sh dev`.
# A machine without torch gets the CPU build pinned to 2.13.0; an existing torch (>= 2.11) is kept,
# so a GPU machine keeps its CUDA build. An unpinned `torch` would pull several GB of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
extras=${1:-}
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  "$PYTHON" -m pip install --quiet "torch==2.13.0"
fi
"$PYTHON" -m pip install --quiet -e ".${extras:+[$extras]}"
if [[ ",$extras," == *",dev,"* ]]; then
  # the torchtitan handoff tests import only its model code: skip its training-job dependencies
  "$PYTHON" -m pip install --quiet --no-deps "torchtitan==0.3.0"
  "$PYTHON" -m pip install --quiet "spmd_types==0.2.3" tyro
fi
