"""Old home of `tether compare` and `tether report`, kept so that existing imports go on working.

The runner moved beside the trainer (`tether.trainer.compare`: it trains), the report to
`tether.reports.report` (it reads finished runs), so that `reports/` no longer sits above `trainer/`. The
report's names (and `RunsFailed`, now in tether.schema) are re-exported here; `compare`, `run_dir` and
`is_finished` are looked up in
`tether.trainer.compare` on first use, with a DeprecationWarning (an attribute lookup, not an import: this
module imports nothing of the trainer).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from ..schema import RunsFailed  # noqa: F401
from .report import (  # noqa: F401
    NULL_SUFFIX,
    discover,
    plot_comparison,
    rewrite_from_summary,
    run_summary,
    write_report,
)
from .sweep import setting_axis  # noqa: F401

MOVED = {"compare", "run_dir", "is_finished", "NULL_MINIBATCH_OFFSET"}


def __getattr__(name: str) -> Any:
    if name in MOVED:
        warnings.warn(
            f"tether.reports.compare.{name} moved to tether.trainer.compare.{name}", DeprecationWarning, stacklevel=2
        )
        return getattr(importlib.import_module("tether.trainer.compare"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
