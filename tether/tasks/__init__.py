"""Verifiable tasks: a registry of example sources with held-out splits.

    task = get_task("countdown", count=3, seed=0)
    train = task.examples("train", 1000, unique=False)   # i.i.d. stream for training
    test = task.examples("test", 200)                     # distinct held-out problems
    reward = tether.rewards.get_reward(task.reward)

Registered: `arithmetic`, `countdown` (synthetic, generated from a seed) and `math` (files or
hub datasets with prompt templates). Each task names its default reward. An import path
`module:Name` names a user's task class or factory instead (tether.plugins).
"""

from __future__ import annotations

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


def task_factory(name: str) -> Callable[..., Task]:
    """The class or factory `name` stands for: a registered task, or a user's `module:Name`
    (tether.plugins; a failed import raises ConfigError)."""
    from ..plugins import entry

    return entry(TASKS, name, "data.task")


def get_task(name: str, **knobs: Any) -> Task:
    """Build the task called `name` (registered, or an import path) with its knobs (the keyword
    parameters of its class or factory: a registered task's dataclass fields).

    An unknown knob raises with the valid ones (and the nearest match), a missing one names it.
    """
    from ..plugins import check_task, is_import_path, parameters

    factory = task_factory(name)
    valid, required, any_keyword = parameters(factory)
    unknown = [k for k in knobs if k not in valid and not any_keyword]
    if unknown:
        near = {k: difflib.get_close_matches(k, valid, n=1) for k in unknown}
        raise ValueError(f"task {name!r} has no knob(s) {near}; valid knobs: {valid}")
    missing = [k for k in required if k not in knobs]
    if missing:
        raise ValueError(f"task {name!r} needs the knob(s) {missing}")
    task = factory(**knobs)
    if is_import_path(name):
        check_task(task, name, needs_solution=False)
    return task


def task_names() -> list[str]:
    """Names of the registered tasks."""
    return TASKS.names()


__all__ = [
    "SPLITS", "TASKS", "TEMPLATES", "Arithmetic", "Countdown", "DataError", "Evaluated", "Example",
    "ExpressionError", "MathTask", "Split", "Task", "apply_template",
    "check_countdown", "evaluate", "get_task", "task_factory", "load_math_dataset", "render_prompt",
    "solve_all", "split_of", "stable_hash", "task_names",
]
