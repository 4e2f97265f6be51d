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

from typing import Any, Callable, Mapping

from .arithmetic import Arithmetic
from .base import SPLITS, DataError, Example, Split, Task, split_of, stable_hash
from .countdown import Countdown, solve_all
from .expression import Evaluated, ExpressionError, check_countdown, evaluate
from .math import TEMPLATES, MathTask, apply_template, load_math_dataset, render_prompt
from ..core.registry import Registry, did_you_mean
from ..plugins import entry, is_import_path, parameters, type_hints, user_task
from ..schema import ConfigError, coerce, field_docs

TASKS: Registry[Callable[..., Task]] = Registry("task")
TASKS.register("arithmetic")(Arithmetic)
TASKS.register("countdown")(Countdown)
TASKS.register("math")(MathTask)


def task_factory(name: str) -> Callable[..., Task]:
    """The class or factory `name` stands for: a registered task, or a user's `module:Name`
    (tether.plugins; a failed import raises ConfigError)."""

    return entry(TASKS, name, "data.task")


def takes_tokenizer(name: str) -> bool:
    """Whether task `name`'s class or factory takes a `tokenizer` (math does: it renders its prompts in the
    model's chat template); whoever builds such a task passes the model's."""
    return "tokenizer" in parameters(task_factory(name))[0]


def get_task(name: str, **knobs: Any) -> Task:
    """Build the task called `name` (registered, or an import path) with its knobs (the keyword
    parameters of its class or factory: a registered task's dataclass fields).

    An unknown knob or a missing one raises ConfigError (`check_task_knobs`). A user's task is
    checked and given the whole `Task` protocol here (`tether.plugins.user_task`), once.
    """

    check_task_knobs(name, knobs)
    factory = task_factory(name)
    if "tokenizer" not in knobs and "tokenizer" in parameters(factory)[1]:  # the trainer passes it; a caller must
        raise ConfigError(
            f"task {name!r} needs a tokenizer (its factory has no default for it): pass "
            f"get_task({name!r}, tokenizer=...), or train it with `tether train`, which passes the model's"
        )
    task = factory(**knobs)
    return user_task(task, name) if is_import_path(name) else task


def check_task_knobs(name: str, knobs: Mapping[str, Any], key: str = "", types: bool = False) -> None:
    """`knobs` against task `name`'s class or factory, the one check of a task's knobs (the config's on
    load, `get_task`'s): each knob exists (else the closest and the valid ones), and with `types`
    has its annotated type (a config value's; `get_task` takes what Python code passes), and every
    knob without a default is given. The tokenizer is the trainer's to pass, never a user's knob.
    Raises ConfigError, each message prefixed by `key.KNOB: ` when `key` (data.task_args) is given."""

    factory = task_factory(name)
    valid, required, any_keyword = parameters(factory)
    hints = type_hints(factory) if types else {}
    at = (lambda knob: f"{key}.{knob}") if key else (lambda knob: knob)
    user = [k for k in valid if k != "tokenizer"]
    for knob, value in knobs.items():
        if knob not in valid and not any_keyword:
            raise ConfigError(
                f"{at(knob) + ': ' if key else ''}task {name!r} has no knob {knob!r}."
                f"{did_you_mean(knob, user)} Valid knobs: {', '.join(user) or 'none'}."
            )
        if knob != "tokenizer" and knob in hints:
            coerce(value, hints[knob], at(knob))
    missing = [k for k in required if k not in knobs and k != "tokenizer"]
    if not missing:
        return
    docs = field_docs(factory) if isinstance(factory, type) else {}
    what = f" ({docs[missing[0]].rstrip('.')})" if docs.get(missing[0]) else ""
    more = f" (and {', '.join(missing[1:])})" if missing[1:] else ""
    if not key:
        raise ConfigError(f"task {name!r} needs the knob {missing[0]!r}{what}{more}")
    raise ConfigError(
        f"{at(missing[0])}: task {name!r} needs it{what} and it is not set; set {at(missing[0])}=VALUE"
        f"{more}; `tether train --help-config` lists every task's knobs"
    )


def task_names() -> list[str]:
    """Names of the registered tasks."""
    return TASKS.names()


__all__ = [
    "SPLITS",
    "TASKS",
    "TEMPLATES",
    "Arithmetic",
    "Countdown",
    "DataError",
    "Evaluated",
    "Example",
    "ExpressionError",
    "MathTask",
    "Split",
    "Task",
    "apply_template",
    "check_countdown",
    "check_task_knobs",
    "evaluate",
    "get_task",
    "task_factory",
    "load_math_dataset",
    "render_prompt",
    "solve_all",
    "split_of",
    "stable_hash",
    "task_names",
]
