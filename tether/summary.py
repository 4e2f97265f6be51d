"""What a finished (or stopped) run leaves for a reader: summary.md and the samples file.

summary.md opens with what the run was (objective and every parameter, model, task, reward,
progress, device, the best held-out accuracy and the checkpoint that holds it, the command that
reproduces it), then a start / end / best table of the headline metrics. samples.jsonl holds the
first `trainer.log_samples` completions of each logged step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import torch

from . import checkpoint, objectives
from .config import Config
from .sinks import read_jsonl


def summary_header(cfg: Config, obj, run_dir: Path, start: int, steps_done: int, wall_s: float,
                   device: torch.device, signum: Optional[int] = None) -> str:
    """What the run was, for the top of summary.md: objective, model, task, progress, device, best
    held-out accuracy and its checkpoint, and the command that reproduces it."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    evals = [(r["eval/accuracy"], r["step"]) for r in rows if r.get("eval/accuracy") is not None]
    best_acc, best_step = max(evals, key=lambda e: (e[0], -e[1])) if evals else (float("nan"), None)
    kept = checkpoint.best(run_dir, log=lambda *_: None)  # the kept checkpoint of the best held-out accuracy
    where = (f"checkpoint `{kept}`, `tether export {run_dir} --step best OUT`" if kept is not None
             else "no checkpoint holds it (the initial model)")
    status = ("finished" if signum is None
              else f"interrupted by signal {signum}; resume with `tether train --resume {run_dir}`")
    task = cfg.data.task + (f" {dict(cfg.data.task_args)}" if cfg.data.task_args else "")
    params = ", ".join(f"{k}={v}" for k, v in objectives.describe(obj).items() if k != "name")
    return "\n".join([
        f"# Run {run_dir.name}",
        "",
        f"- objective: **{obj.name}** ({params})",
        f"- model: {cfg.model.name_or_path} (dtype {cfg.model.dtype}); task: {task}; reward: {cfg.reward.name}",
        f"- steps: {steps_done} of {cfg.trainer.total_steps} ({status})",
        f"- wall time: {wall_s:.0f} s on {device}" + (f" (this session, resumed at step {start})" if start else ""),
        f"- best held-out accuracy: {best_acc:.3f} at step {best_step} ({where})",
        f"- reproduce: `tether train {run_dir / 'config.yaml'} output_dir={run_dir}-rerun`",
        "",
    ])


def summary_table(run_dir: Path) -> str:
    """Start / end / best of the headline metrics, as text (also saved to summary.md)."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    lines = ["| metric | start | end | best |", "|---|---|---|---|"]
    for key, best in (("eval/accuracy", max), ("reward/mean", max), ("policy/entropy", None),
                      ("rollout/len_mean", None), ("policy/kl_old", None), ("time/step_s", None)):
        vals = [r[key] for r in rows if r.get(key) is not None]
        if vals:
            b = f"{best(vals):.4f}" if best else ""
            lines.append(f"| {key} | {vals[0]:.4f} | {vals[-1]:.4f} | {b} |")
    return "\n".join(lines)


def write_summary(cfg: Config, obj, run_dir: Path, start: int, steps_done: int, wall_s: float,
                  device: torch.device, signum: Optional[int] = None) -> str:
    """Write run_dir/summary.md (the header, then the metrics table); returns the table."""
    table = summary_table(run_dir)
    header = summary_header(cfg, obj, run_dir, start, steps_done, wall_s, device, signum)
    (run_dir / "summary.md").write_text(header + "\n" + table + "\n")
    return table


def write_samples(f, step: int, rollout, examples: Sequence, rewards: torch.Tensor, k: int) -> None:
    """The first `k` samples of a step as JSON lines: prompt, completion, answer, reward, finish."""
    for i in range(min(k, len(rollout.completions))):
        f.write(json.dumps({"step": step, "prompt": examples[i].prompt, "completion": rollout.completions[i],
                            "answer": examples[i].answer, "reward": float(rewards[i]),
                            "finish": rollout.finish_reasons[i]}) + "\n")
    f.flush()
