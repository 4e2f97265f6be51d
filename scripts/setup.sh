#!/usr/bin/env bash
# Create .venv and install tether with its test tools. torch is installed first and pinned
# to the CPU build so that resolving tether's dependencies never pulls CUDA packages.
# On a GPU machine, install your CUDA torch into the venv first: this script keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  pip install -q "torch==2.13.0"
fi
pip install -q -e ".[dev]"
