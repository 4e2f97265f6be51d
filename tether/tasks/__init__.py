"""Verifiable tasks: a registry of example sources with held-out splits.

    task = get_task("countdown", count=3, seed=0)
    train = task.examples("train", 1000, unique=False)   # i.i.d. stream for training
    test = task.examples("test", 200)                     # distinct held-out problems
    reward = tether.rewards.get_reward(task.reward)

Registered: `arithmetic`, `countdown` (synthetic, generated from a seed) and `math` (files or
hub datasets with prompt templates). Each task names its default reward.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Callable

from .arithmetic import Arithmetic
from .base import SPLITS, DataError, Example, Split, Task, split_of, stable_hash
from .countdown import Countdown, solve_all
from .expression import Evaluated, ExpressionError, check_countdown, evaluate
from .math import TEMPLATES, MathTask, apply_template, load_math_dataset, render_prompt
from ..core.registry import Registry

TASKS: Registry[Callable[..., Task]] = Registry("task")
TASKS.register("arithmetic")(Arithmetic)
TASKS.register("countdown")(Countdown)
TASKS.register("math")(MathTask)


def get_task(name: str, **knobs: Any) -> Task:
    """Build the task called `name` with its knobs (the fields of its dataclass).

    An unknown knob raises with the valid ones (and the nearest match).
    """
    cls = TASKS.get(name)
    valid = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = [k for k in knobs if k not in valid]
    if unknown:
        near = {k: difflib.get_close_matches(k, valid, n=1) for k in unknown}
        raise ValueError(f"task {name!r} has no knob(s) {near}; valid knobs: {valid}")
    return cls(**knobs)


def task_names() -> list[str]:
    """Names of the registered tasks."""
    return TASKS.names()


__all__ = [
    "SPLITS", "TASKS", "TEMPLATES", "Arithmetic", "Countdown", "DataError", "Evaluated", "Example",
    "ExpressionError", "MathTask", "Split", "Task", "apply_template",
    "check_countdown", "evaluate", "get_task", "load_math_dataset", "render_prompt",
    "solve_all", "split_of", "stable_hash", "task_names",
]
