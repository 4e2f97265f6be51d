"""What a finished (or stopped) run leaves for a reader: summary.md and the samples file.

summary.md opens with what the run was (the objective by the name the user chose, with the
objective it builds and every parameter; model, task, the reward as configured, progress, device,
the best held-out accuracy and the checkpoint `tether export --step best` takes, the command that
reproduces it), then a start / end / best table of the headline metrics, each value with its step.
samples.jsonl holds the first `trainer.log_samples` completions of each logged step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import torch

from . import checkpoint
from .. import objectives
from ..config.sections import Config, EnvConfig, RewardConfig
from .runlog import ACCURACY, accuracy, best, read_metrics, series
from ..tasks import TASKS


def summary_header(
    cfg: Config,
    run_dir: Path,
    start: int,
    steps_done: int,
    wall_s: float,
    device: torch.device,
    signum: Optional[int] = None,
) -> str:
    """What the run was, for the top of summary.md: objective, model, task, reward, progress, device,
    best held-out accuracy and the checkpoint `tether export --step best` takes, and the command that
    reproduces it."""
    rows = read_metrics(run_dir)
    status = (
        "finished"
        if signum is None
        else f"interrupted by signal {signum}; resume with `tether train --resume {run_dir}`"
    )
    task = cfg.data.task + (f" {dict(cfg.data.task_args)}" if cfg.data.task_args else "")
    _, params = objectives.display(cfg.objective)
    label, name = objectives.label_of(cfg.objective), cfg.objective["name"]
    what = f"**{label}** ({name}: {params})" if label != name else f"**{name}** ({params})"
    return "\n".join(
        [
            f"# Run {run_dir.name}",
            "",
            f"- objective: {what}",
            f"- model: {cfg.model.name_or_path} (dtype {cfg.model.dtype}); task: {task}; reward: "
            f"{reward_text(cfg.reward, cfg.data.task, cfg.env)}",
            f"- steps: {steps_done} of {cfg.trainer.total_steps} ({status})",
            f"- wall time: {wall_s:.0f} s on {device}" + (f" (this session, resumed at step {start})" if start else ""),
            f"- best held-out accuracy: {best_text(rows, run_dir)}",
            f"- reproduce: `tether train {run_dir / 'config.yaml'} output_dir={run_dir}-rerun`",
            "",
        ]
    )


def reward_text(r: RewardConfig, task: str, env: EnvConfig | None = None) -> str:
    """The reward the run trained on, as configured: the weighted parts when `reward.weights` is set
    (it wins over `reward.name`), else the named reward, `auto` naming the verifier of `task` (`data.task`),
    or the environment's rewards where episodes are scored by them (`env.reward=env`, as the trainer's setup
    chooses)."""
    if r.weights:
        parts = []
        for name, spec in r.weights.items():
            if isinstance(spec, dict):
                extra = ", ".join(f"{k}={v}" for k, v in spec.items() if k != "weight")
                parts.append(f"{spec.get('weight', 1.0):g} x {name}" + (f" ({extra})" if extra else ""))
            else:
                parts.append(f"{spec:g} x {name}")
        return "weighted: " + " + ".join(parts)
    if r.name == "auto" and env is not None and env.reward_name(r.name) == "episode":
        return "episode (the environment's rewards: env.reward=env)"
    if r.name == "auto":
        own = getattr(TASKS.get(task), "reward", None) if task in TASKS else None
        return f"{own or 'auto'} (the task's own verifier)"
    return r.name


def best_text(rows: list[dict], run_dir: Path) -> str:
    """The best held-out accuracy of the run (its first step) and, truthfully, which checkpoint
    `tether export --step best` takes: the one at that step, one that scores the same later, a worse
    one (the best step was the initial model, or its checkpoint is gone), or none."""
    evals = accuracy(rows)
    if not evals:
        return "none measured"
    step, acc = best(evals)
    at = f"{acc:.3f} at step {step}" + (" (the initial model)" if step == 0 else "")
    kept = checkpoint.best(run_dir, log=lambda *_: None)  # what `tether export --step best` takes
    if kept is None:
        return f"{at}; no checkpoint records a held-out accuracy"
    kept_acc, kept_step = checkpoint.recorded_accuracy(kept), checkpoint.step_of(kept)
    export = f"`tether export {run_dir} --step best OUT`"
    if kept_step == step:
        return f"{at}, in checkpoint `{kept}` ({export})"
    if kept_acc == acc:
        return f"{at}; checkpoint `{kept}` (step {kept_step}) scores the same ({export})"
    return (
        f"{at}, which no checkpoint holds; the best checkpoint is `{kept}` (step {kept_step}, {kept_acc:.3f}; {export})"
    )


def summary_table(run_dir: Path) -> str:
    """Start / end / best of the headline metrics, each with the step it is from (also saved to
    summary.md); a note when held-out accuracy was measured only once."""
    rows = read_metrics(run_dir)
    lines = ["| metric | start | end | best |", "|---|---|---|---|"]
    for key, has_best in (
        (ACCURACY, True),
        ("reward/mean", True),
        ("policy/entropy", False),
        ("rollout/len_mean", False),
        ("policy/kl_old", False),
        ("time/step_s", False),
    ):
        pts = series(rows, key)
        if not pts:
            continue
        cell = lambda p: f"{p[1]:.4f} (step {p[0]})"  # noqa: E731
        end = cell(pts[-1]) if len(pts) > 1 else f"{cell(pts[-1])}, the only value"
        b = cell(best(pts)) if has_best else ""
        lines.append(f"| {key} | {cell(pts[0])} | {end} | {b} |")
    evals = [step for step, _ in accuracy(rows)]
    last = rows[-1]["step"] if rows else 0
    if len(evals) == 1 and last > evals[0]:
        lines += [
            "",
            f"Held-out accuracy was measured once, at step {evals[0]}: the run ended at step {last}, "
            "before its next evaluation (trainer.eval_every), so there is no end value to compare.",
        ]
    return "\n".join(lines)


def write_summary(
    cfg: Config,
    run_dir: Path,
    start: int,
    steps_done: int,
    wall_s: float,
    device: torch.device,
    signum: Optional[int] = None,
) -> str:
    """Write run_dir/summary.md (the header, then the metrics table); returns the table. The objective
    is read from `cfg.objective` (resolved, with the name the user chose)."""
    table = summary_table(run_dir)
    header = summary_header(cfg, run_dir, start, steps_done, wall_s, device, signum)
    (run_dir / "summary.md").write_text(header + "\n" + table + "\n")
    return table


def write_samples(f, step: int, rollout, examples: Sequence, rewards: torch.Tensor, k: int) -> None:
    """The first `k` samples of a step as JSON lines: prompt (as the model saw it: an episode's with the tools'
    description its environment added), completion, answer, reward, finish; a multi-turn episode's also its
    turns, [role, text] in order ("model" for the policy's), and the rewards its steps gave."""
    for i in range(min(k, len(rollout.completions))):
        episode = rollout.episodes[i] if rollout.episodes is not None else {}
        line = {
            "step": step,
            "prompt": episode.get("prompt") or examples[i].prompt,
            "completion": rollout.completions[i],
            "answer": examples[i].answer,
            "reward": float(rewards[i]),
            "finish": rollout.finish_reasons[i],
        }
        if rollout.episodes is not None:
            facts = rollout.episodes[i]
            line.update(turns=[list(t) for t in facts["transcript"]], env_rewards=facts["rewards"])
        f.write(json.dumps(line) + "\n")
    f.flush()
