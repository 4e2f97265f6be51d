"""Where metrics go: `MetricSink`s (JSONL, TensorBoard, Weights & Biases) and the progress bar.

The trainer syncs metrics to the host once per step and hands every sink the same flat
`{name: float}` dict. metrics.jsonl is the file of record (one line per step, flushed as it
is written, so a killed run keeps every finished step); the others are views.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional, Protocol


class MetricSink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def _clean(value: float) -> Optional[float]:
    return None if value is None or (isinstance(value, float) and not math.isfinite(value)) else value


class JsonlSink:
    """metrics.jsonl: {"step": s, name: value, ...} per line; non-finite values become null."""

    def __init__(self, path: Path, resume_after: Optional[int] = None):
        self.path = path
        if resume_after is not None and path.exists():
            truncate_jsonl(path, resume_after)
        self._f = path.open("a")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep the rows with step <= last_step (and drop a torn last line) before resuming."""
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("step", -1) <= last_step:
            kept.append(line)
    path.write_text("".join(line + "\n" for line in kept))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn last line from a killed run
    return rows


class TensorBoardSink:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self._w = SummaryWriter(str(log_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            if v is not None and math.isfinite(v):
                self._w.add_scalar(k, v, step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class WandbSink:
    def __init__(self, project: str, run_dir: Path, config: dict):
        try:
            import wandb
        except ImportError:
            raise RuntimeError(
                "trainer.wandb=true but Weights & Biases is not installed: `pip install wandb`, "
                "or set trainer.wandb=false (metrics.jsonl and TensorBoard are always written)"
            ) from None
        self._run = wandb.init(project=project, dir=str(run_dir), config=config, name=run_dir.name, resume="allow")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


class Progress:
    """A live bar: step, reward, held-out accuracy, KL and entropy (rich; silent when disabled)."""

    def __init__(self, total: int, start: int = 0, enabled: bool = True):
        self._bar = None
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self._bar = RichProgress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TimeRemainingColumn(), TextColumn("{task.fields[status]}"),
        )
        self._task = self._bar.add_task("train", total=total, completed=start, status="")
        self._bar.start()
        self._acc = float("nan")

    def update(self, step: int, m: dict[str, float]) -> None:
        if self._bar is None:
            return
        self._acc = m.get("eval/accuracy", self._acc)
        status = (
            f"reward {m.get('reward/mean', float('nan')):.3f}  acc {self._acc:.3f}  "
            f"kl {m.get('policy/kl_old', float('nan')):.4f}  ent {m.get('policy/entropy', float('nan')):.3f}"
        )
        self._bar.update(self._task, completed=step, status=status)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
