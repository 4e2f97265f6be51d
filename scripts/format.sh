#!/usr/bin/env bash
# Apply pyproject.toml's ruff configuration to the whole tree: `ruff format`, then the lint's safe fixes.
# Run it in a commit of its own (it reflows most files), then set FORMAT_ENFORCED = True in
# tests/tooling/test_ruff_passes_on_the_tree.py so that CI keeps the tree formatted.
set -euo pipefail
cd "$(dirname "$0")/.."
RUFF=${RUFF:-.venv/bin/ruff}
"$RUFF" format .
"$RUFF" check --fix .
