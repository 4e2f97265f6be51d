"""Where metrics go: `MetricSink`s (JSONL, TensorBoard, Weights & Biases) and the progress bar.

The trainer syncs metrics to the host once per step and hands every sink the same flat
`{name: float}` dict. metrics.jsonl is the file of record (one line per step, flushed as it
is written, so a killed run keeps every finished step); the others are views.
"""

from __future__ import annotations

import json
import math
import netrc
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Protocol
import importlib.util


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


def _lines(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(line, row) for each line of a metrics file that parses; a torn last line from a killed run does not."""
    for line in Path(path).read_text().splitlines():
        try:
            yield line, json.loads(line)
        except json.JSONDecodeError:
            continue


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep the rows with step <= last_step (and drop a torn last line) before resuming."""
    kept = [line for line, row in _lines(path) if row.get("step", -1) <= last_step]
    path.write_text("".join(line + "\n" for line in kept))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics file (`tether.records.runlog` reads a run's through this)."""
    return [row for _, row in _lines(path)]


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


def wandb_problem() -> str:
    """Why trainer.wandb=true cannot log (checked before training starts), or "" when it can.

    wandb needs credentials unless it runs offline: WANDB_API_KEY, or a `wandb login` entry in
    ~/.netrc. Without them `wandb.init` fails (or prompts) only once training has begun.
    """

    if importlib.util.find_spec("wandb") is None:
        return (
            "trainer.wandb=true but Weights & Biases is not installed: `pip install wandb`, "
            "or set trainer.wandb=false (metrics.jsonl and TensorBoard are always written)"
        )
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY"):
        return ""
    try:
        if netrc.netrc().authenticators(os.environ.get("WANDB_BASE_URL", "api.wandb.ai").split("://")[-1]):
            return ""
    except (OSError, netrc.NetrcParseError):
        pass
    return (
        "trainer.wandb=true but no Weights & Biases credentials were found: set WANDB_API_KEY (or run "
        "`wandb login`), or log offline with WANDB_MODE=offline (sync later with `wandb sync`), or set "
        "trainer.wandb=false (metrics.jsonl and TensorBoard are always written)"
    )


class WandbSink:
    def __init__(self, project: str, run_dir: Path, config: dict):
        import wandb

        self._run = wandb.init(project=project, dir=str(run_dir), config=config, name=run_dir.name, resume="allow")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


def _duration(seconds: float) -> str:
    seconds = max(int(round(seconds)), 0)
    h, rest = divmod(seconds, 3600)
    return f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"


HEARTBEAT_S = 60.0
"""The longest a plain-text progress log stays silent (`tether train` and `tether eval` to a file)."""


def flushed(log):
    """`log`, flushed at once when it is `print`: a redirected stdout is block-buffered, so a log
    file would otherwise show nothing for minutes (and its first line only at exit)."""
    if log is print:
        return lambda *a, **k: print(*a, **k, flush=True)
    return log


class Heartbeat:
    """A daemon thread that logs `message()` whenever `every_s` seconds pass without a line
    (`beat()` marks one), so a slow step or batch is never silent for long. `close()` stops it."""

    def __init__(self, log, message, every_s: float = HEARTBEAT_S):
        self._log, self._message, self._every = log, message, every_s
        self._last = time.perf_counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tether-heartbeat", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        with self._lock:
            self._last = time.perf_counter()

    @property
    def every(self) -> float:
        return self._every

    def due(self) -> bool:
        """True when `every_s` seconds have passed since the last beat."""
        with self._lock:
            return time.perf_counter() - self._last >= self._every

    def _run(self) -> None:
        while not self._stop.wait(min(self._every, 1.0) / 4):
            with self._lock:
                quiet = time.perf_counter() - self._last
                if quiet < self._every:
                    continue
                self._last = time.perf_counter()
            self._log(self._message(quiet))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def step_line(step: int, total: int, m: dict[str, float], seconds: float) -> str:
    """One step as a practitioner reads it at a glance (docs/training.md, "What a run prints"): the reward, the
    share of groups with no reward variance (`flat`: nothing trains there), the share of tokens the trust region
    clipped low / high, the mean completion length and the truncated share, entropy, the reference KL where
    there is one, and the seconds of the step and where they went."""

    def pct(key: str) -> str:
        return f"{100 * m[key]:.1f}%" if m.get(key) is not None else "-"

    parts = [f"step {step}/{total}", f"reward {m.get('reward/mean', float('nan')):.3f}"]
    if m.get("adv/zero_var_frac") is not None:
        parts.append(f"flat {m['adv/zero_var_frac']:.2f}")
    if m.get("policy/clipfrac_low") is not None:
        parts.append(f"clip {pct('policy/clipfrac_low')}/{pct('policy/clipfrac_high')}")
    if m.get("rollout/len_mean") is not None:
        parts.append(f"len {m['rollout/len_mean']:.0f} (trunc {pct('rollout/truncation_rate')})")
    if m.get("policy/entropy") is not None:
        parts.append(f"ent {m['policy/entropy']:.3f}")
    if m.get("kl/ref") is not None:
        parts.append(f"kl {m['kl/ref']:.4f}")
    if seconds == seconds:  # the step's own seconds and its phases
        phases = [
            ("sample", m.get("time/sample_s")),
            ("logp", (m.get("time/old_logprobs_s") or 0.0) + (m.get("time/ref_logprobs_s") or 0.0)),
            ("update", m.get("time/update_s")),
        ]
        shown = ", ".join(f"{name} {v:.1f}" for name, v in phases if v)
        parts.append(f"{seconds:.1f} s/step" + (f" ({shown})" if shown and seconds >= 1.0 else ""))
    return "  ".join(parts)


def sample_line(sample: tuple[str, str, float], width: int = 120) -> str:
    """A sampled completion with its reward and the example's answer, on one line (a rendered prompt is mostly
    the chat template: the answer says what the completion was asked for)."""
    completion, answer, reward = sample
    completion = " ".join(completion.split())
    text = f"  sample (reward {reward:.2f}, answer {' '.join(answer.split())[:24]}): {completion}"
    return text if len(text) <= width else text[: width - 3] + "..."


class PlainProgress:
    """Progress as plain log lines, for output that is not a terminal (a file, nohup, Slurm, tee): a step line
    (`step_line`) every `every` steps, at every held-out evaluation and at the first step after `heartbeat_s`
    seconds without a line, each complete on its own and flushed, with a sampled completion (`sample_line`) at
    every evaluation and every fifth line; while one step takes longer than `heartbeat_s`, a "step N under
    way" line every `heartbeat_s` seconds, and only then: a finished step resets the heartbeat's clock."""

    SAMPLE_EVERY = 5
    """Step lines between sampled completions (besides the one at every evaluation)."""

    def __init__(self, total: int, start: int = 0, every: int = 25, log=print, heartbeat_s: float = HEARTBEAT_S):
        self._total, self._start, self._every = total, start, max(1, every)
        self._tic = self._last_step = time.perf_counter()
        self._acc, self._acc_step = float("nan"), None
        self._step, self._lines = start, 0
        self._log = flushed(log)
        self._heartbeat = Heartbeat(self._log, self._still, heartbeat_s)
        self._quiet_since = time.perf_counter()  # the last line printed
        self._phase: Optional[tuple[str, float]] = None

    def phase(self, what: Optional[str]) -> None:
        """Name the phase under way outside a step (the step-0 evaluation, an evaluation after a step), which the
        heartbeat names instead of the next step; None: a step again."""
        self._phase = (what, time.perf_counter()) if what else None
        self._heartbeat.beat()

    def _still(self, quiet: float) -> str:
        now = time.perf_counter()
        if self._phase is not None:
            what, since = self._phase
            return f"{what} under way for {_duration(now - since)}, elapsed {_duration(now - self._tic)}"
        return (
            f"step {self._step + 1}/{self._total} under way for {_duration(now - self._last_step)}, "
            f"elapsed {_duration(now - self._tic)}"
        )

    def update(self, step: int, m: dict[str, float], sample: Optional[tuple[str, str, float]] = None) -> None:
        evaluated = "eval/accuracy" in m
        if evaluated:  # the latest held-out accuracy and the step it was measured at
            self._acc, self._acc_step = m["eval/accuracy"], step
        now = time.perf_counter()
        seconds, self._last_step = m.get("time/step_s", float("nan")), now
        self._heartbeat.beat()  # a step finished: the heartbeat speaks only during a step that outlasts it
        self._step = max(self._step, step)
        quiet = now - self._quiet_since >= self._heartbeat.every
        if step <= self._start or not (evaluated or quiet or step % self._every == 0 or step == self._total):
            return
        elapsed = now - self._tic
        done = step - self._start
        eta = (self._total - step) * elapsed / done if done > 0 else float("nan")
        acc = f"  acc {self._acc:.3f} @{self._acc_step}" if self._acc == self._acc else ""
        lines = [f"{step_line(step, self._total, m, seconds)}{acc}  ETA {_duration(eta) if eta == eta else '?'}"]
        if sample is not None and (evaluated or self._lines % self.SAMPLE_EVERY == 0):
            lines.append(sample_line(sample))
        self._lines += 1
        self._quiet_since = now
        for line in lines:
            self._log(line)

    def close(self) -> None:
        self._heartbeat.close()


class Progress:
    """A live bar: step, reward, held-out accuracy, KL and entropy (rich; silent when disabled).
    Use `make_progress` to get plain log lines instead when stdout is not a terminal."""

    def __init__(self, total: int, start: int = 0, enabled: bool = True):
        self._bar = None
        if not enabled:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress as RichProgress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._bar = RichProgress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
        )
        self._task = self._bar.add_task("train", total=total, completed=start, status="")
        self._bar.start()
        self._acc = float("nan")

    def phase(self, what: Optional[str]) -> None:
        """The phase under way outside a step, shown as the bar's status (None: the step's own)."""
        if self._bar is not None and what:
            self._bar.update(self._task, status=f"{what} under way")

    def update(self, step: int, m: dict[str, float], sample: Optional[tuple[str, str, float]] = None) -> None:
        if self._bar is None:
            return
        if sample is not None and "eval/accuracy" in m:  # a sampled completion above the bar at each evaluation
            self._bar.console.print(sample_line(sample, width=self._bar.console.width))
        self._acc = m.get("eval/accuracy", self._acc)
        status = (
            f"reward {m.get('reward/mean', float('nan')):.3f}  acc {self._acc:.3f}  "
            f"kl {m.get('policy/kl_old', float('nan')):.4f}  ent {m.get('policy/entropy', float('nan')):.3f}"
        )
        self._bar.update(self._task, completed=step, status=status)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def make_progress(total: int, start: int, enabled: bool, every: int, log=print, stream=None):
    """A live bar on a terminal; plain log lines every `every` steps otherwise; nothing when disabled."""
    stream = sys.stdout if stream is None else stream
    if enabled and not stream.isatty():
        return PlainProgress(total, start, every, log)
    return Progress(total, start, enabled)
