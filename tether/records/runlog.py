"""Reading what a run directory records: its metrics.jsonl and config.yaml.

metrics.jsonl (written by `sinks.JsonlSink`) has one row per logged step, `{"step": s, name: value}`,
a metric absent or null at the steps where it was not measured (held-out accuracy only every
`trainer.eval_every` steps). Every report reads it the same way, through this module: a metric is
its logged `(step, value)` points, the missing and null steps skipped (`series`); held-out accuracy
is the `eval/accuracy` series (`accuracy`); the best point is the highest value, the earliest of
equals (as `checkpoint.best` picks a checkpoint).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import yaml

from .sinks import read_jsonl

METRICS_FILE = "metrics.jsonl"
HELDOUT_FILE = "heldout.jsonl"
"""Per-problem outcomes of each held-out evaluation: one line per evaluation, {"step", "id": [...], "correct": [0/1],
"answer": [extracted answer or null], "length": [completion tokens]}, columns in the held-out set's order."""
ACCURACY = "eval/accuracy"
"""Held-out greedy accuracy, the metric the reports, claims and `--step best` rank runs by."""

Point = tuple[int, float]


def metrics_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / METRICS_FILE


def has_metrics(run_dir: str | Path) -> bool:
    """Whether `run_dir` is a run directory that has logged (what `tether report` looks for)."""
    return metrics_path(run_dir).exists()


def read_metrics(run_dir: str | Path, missing_ok: bool = False) -> list[dict[str, Any]]:
    """The rows of RUN_DIR/metrics.jsonl (a torn last line dropped); [] when it is missing and
    `missing_ok`, else FileNotFoundError."""
    if missing_ok and not has_metrics(run_dir):
        return []
    return read_jsonl(metrics_path(run_dir))


def heldout(run_dir: str | Path) -> dict[int, dict[str, list]]:
    """{step: that evaluation's per-problem outcomes} from RUN_DIR/heldout.jsonl (HELDOUT_FILE); {} when the run has
    none (one made before tether recorded them)."""
    path = Path(run_dir) / HELDOUT_FILE
    return {row["step"]: row for row in read_jsonl(path)} if path.exists() else {}


def series(rows: list[dict[str, Any]], key: str) -> list[Point]:
    """`key`'s logged (step, value) points, in order, without the steps where it is missing or null."""
    return [(r["step"], r[key]) for r in rows if r.get(key) is not None]


def values(rows: list[dict[str, Any]], key: str) -> list[float]:
    """`key`'s logged values, in order (`series` without the steps)."""
    return [v for _, v in series(rows, key)]


def accuracy(rows: list[dict[str, Any]]) -> list[Point]:
    """The held-out accuracy points (step, accuracy), in order."""
    return series(rows, ACCURACY)


def best(points: list[Point]) -> Point:
    """The (step, value) with the highest value, the earliest of equals; `points` must not be empty."""
    return max(points, key=lambda p: (p[1], -p[0]))


def tail_mean(rows: list[dict[str, Any]], key: str) -> float:
    """The mean of `key` over its last tenth of logged values (at least one); NaN when never logged."""
    vals = values(rows, key)
    return statistics.fmean(vals[-max(1, len(vals) // 10) :]) if vals else float("nan")


def read_config(run_dir: str | Path) -> dict[str, Any]:
    """RUN_DIR/config.yaml as a plain mapping (the run's resolved config; {} when empty)."""
    return yaml.safe_load((Path(run_dir) / "config.yaml").read_text()) or {}


def _progress(run_dir: str | Path) -> tuple[int, int] | None:
    """(last logged step, the total steps its config.yaml asks for); None when config.yaml or metrics.jsonl
    does not say."""
    if not (Path(run_dir) / "config.yaml").exists():
        return None
    total = (read_config(run_dir).get("trainer") or {}).get("total_steps")
    rows = read_metrics(run_dir, missing_ok=True)
    last = rows[-1].get("step") if rows else None
    return (last, total) if isinstance(total, int) and isinstance(last, int) else None


def unfinished(run_dir: str | Path) -> tuple[int, int] | None:
    """(last logged step, total steps) for a run that has not yet logged the last step its config.yaml asks
    for (a run in progress, or one interrupted and not resumed); None when it has, or when its config.yaml
    or metrics.jsonl does not say."""
    progress = _progress(run_dir)
    return progress if progress is not None and progress[0] < progress[1] else None


def finished(run_dir: str | Path) -> bool:
    """It logged the last step its config.yaml asks for and wrote its summary.md (what `tether compare` skips
    on a rerun)."""
    progress = _progress(run_dir) if (Path(run_dir) / "summary.md").exists() else None
    return progress is not None and progress[0] >= progress[1]
