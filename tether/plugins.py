"""User code by import path: `module:name` wherever a reward, a task, an environment or a tool is named.

    tether train reward.name=myrewards:score              # a function (completion, example) -> float
    tether train data.task=mytask:JsonlTask data.task_args.path=qa.jsonl warm_start.enabled=false

A name with a colon is an import path; any other is a registry name (no registered name has a
colon, so the two never collide). `entry` is the one place either is turned into an object: the
task and reward registries' lookups and the config's validation all go through it, so an import
path is checked on load, before anything is written, and the value stays the string the user
wrote: the run's config.yaml records it, and a resume imports the same code.

Errors are `ConfigError`s that name the key, what failed (the module that could not be imported
and why, the attribute it lacks) and the expected shape (`REWARD_SHAPE`, `TASK_SHAPE`). The
current directory is searched after `sys.path`, as `python -m` would search it first, so a module
next to the config file is found by the `tether` command too (a module that shadows an installed
one is not: name it differently).

What a user's object leaves out gets its default here, once, where it is loaded, so that the trainer
and the rewards never ask an object what it has: a task becomes a `UserTask` (`finite` False, no
`template`), and `label` and `batches` are what `tether.rewards` reads to give a user's reward the
whole reward protocol (`rewards.UserReward`, `rewards.as_reward`).
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from dataclasses import dataclass
from typing import Any
import typing

from .schema import ConfigError

REWARD_SHAPE = (
    "a function (completion: str, example: tether.tasks.Example) -> float | RewardResult, "
    "or a class whose instances are one (its parameters set by reward.weights)"
)
TASK_SHAPE = (
    "a class or factory called with data.task_args as keywords, returning a task: "
    "reward (a reward name, import path or function), examples(split, n=None, *, seed=None, "
    "unique=True) -> list[Example], and optionally finite, solution(example) -> str (the warm start's), name"
)

ENV_SHAPE = (
    "a class or factory called with env.args as keywords (and `judge`, the run's reward as a function "
    "(reply, example) -> float, when it takes one), returning an environment: reset(example) -> str | None "
    "and step(reply: str) -> tether.envs.Step"
)
TOOL_SHAPE = "a function with type hints and a docstring (its schema), returning the result as text"
SHAPES = {"reward": REWARD_SHAPE, "environment": ENV_SHAPE, "tool": TOOL_SHAPE}

_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


def is_import_path(name: object) -> bool:
    """Whether `name` is `module:attribute` (rather than a registered name)."""
    return isinstance(name, str) and ":" in name


def entry(registry: Any, name: str, key: str) -> Any:
    """The object `name` stands for: registered in `registry` (an unknown name raises the registry's
    KeyError), or imported from `module:attribute` (a failure raises ConfigError naming `key`)."""
    if not is_import_path(name):
        return registry.get(name)
    return _import(name, key, SHAPES.get(registry.kind, TASK_SHAPE))


def _import(spec: str, key: str, shape: str) -> Any:
    if not _PATH.match(spec):
        raise ConfigError(
            f"{key}={spec!r}: an import path is MODULE:NAME, e.g. myrewards:score "
            f"(MODULE importable, a .py file in the current directory or on PYTHONPATH); "
            f"expected {shape}"
        )
    module_name, attr = spec.split(":")
    module = _module(module_name, spec, key)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            where = getattr(module, "__file__", None) or module_name
            public = sorted(
                n
                for n, v in vars(module).items()
                if not n.startswith("_") and callable(v) and getattr(v, "__module__", None) == module.__name__
            )
            raise ConfigError(
                f"{key}={spec!r}: module {module_name!r} ({where}) has no attribute {attr!r}; "
                f"it defines {', '.join(public) or 'no functions or classes'}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{key}={spec!r} is a {type(obj).__name__}, not callable; expected {shape}")
    return obj


def _module(name: str, spec: str, key: str):
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)  # after every installed package: a user's module never shadows one
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name and name.split(".")[0] == err.name.split(".")[0] and name.startswith(err.name):
            raise ConfigError(
                f"{key}={spec!r}: no module named {err.name!r} (searched the current directory "
                f"{cwd} and PYTHONPATH); put {err.name.replace('.', '/')}.py there, or add its "
                "directory to PYTHONPATH"
            ) from None
        raise ConfigError(f"{key}={spec!r}: importing {name!r} failed: ModuleNotFoundError: {err}") from None
    except Exception as err:  # user code at import: a syntax error, a missing dependency, anything it raises
        raise ConfigError(f"{key}={spec!r}: importing {name!r} failed: {type(err).__name__}: {err}") from None


def check_call(fn: Any, args: tuple, kwargs: dict, what: str, shape: str) -> None:
    """Raise ConfigError unless `fn(*args, **kwargs)` binds to its signature (the call is not made)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: the call itself will say
    try:
        sig.bind(*args, **kwargs)
    except TypeError as err:
        raise ConfigError(
            f"{what} cannot be called with {len(args)} argument(s): {err} (its signature is "
            f"{_name(fn)}{sig}); expected {shape}"
        ) from None


def parameters(fn: Any) -> tuple[list[str], list[str], bool]:
    """(keyword parameter names, the required ones, whether it takes **kwargs) of a class or function."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return [], [], True
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    required = [p.name for p in named if p.default is p.empty]
    return [p.name for p in named], required, any(p.kind == p.VAR_KEYWORD for p in params)


def type_hints(fn: Any) -> dict[str, Any]:
    """The parameters' annotations of a class (its __init__) or function, {} when unresolvable."""

    target = fn.__init__ if isinstance(fn, type) else fn
    try:
        return typing.get_type_hints(target)
    except Exception:  # an annotation naming something the module does not import: skip the type check
        return {}


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def check_task(task: Any, spec: str, needs_solution: bool) -> None:
    """A task built from an import path has what the trainer calls (ConfigError naming what is missing);
    a `UserTask` is checked as the object the user's code built (`built`)."""
    task = built(task)
    missing = [a for a in ("reward", "examples") if not hasattr(task, a)]
    if needs_solution and not callable(getattr(task, "solution", None)):
        missing.append("solution (the warm start trains on it; or set warm_start.enabled=false)")
    if missing:
        raise ConfigError(
            f"data.task={spec!r}: the object it built ({type(task).__name__}) has no "
            f"{', '.join(missing)}; expected {TASK_SHAPE}"
        )
    if not callable(task.examples):
        raise ConfigError(f"data.task={spec!r}: {type(task).__name__}.examples is not a method; expected {TASK_SHAPE}")


@dataclass(frozen=True, eq=False)
class UserTask:
    """A task from the user's code (`data.task=MODULE:NAME`) with the whole `tether.tasks.Task` protocol:
    `reward`, `examples` and `solution` are the user's object's own, and what TASK_SHAPE lets it leave
    out has its default (`user_task`). Compared by identity."""

    task: Any
    """The object the user's class or factory built (`built`)."""
    name: str
    """Its `name` when that is a string, else the import path."""
    finite: bool
    """Its `finite` (True: a fixed dataset, read in epochs); False when it has none."""
    template: str | None
    """Its prompt `template` when that is a string (strict \\boxed{} extraction follows it), else None."""

    @property
    def reward(self) -> Any:
        """Its reward: a reward name, an import path, or its own function (completion, example) -> float."""
        return self.task.reward

    def examples(self, split: str, *args: Any, **kwargs: Any) -> list:
        """Its `examples(split, n=None, *, seed=None, unique=True)`, called with exactly the arguments given."""
        return self.task.examples(split, *args, **kwargs)

    def solution(self, example: Any) -> str:
        """Its `solution(example)` (the warm start's target; `check_task` requires one when the warm start runs)."""
        return self.task.solution(example)


def user_task(task: Any, spec: str) -> UserTask:
    """The task the user's code built from `spec`, checked (`check_task`, ConfigError) and wrapped: the one
    place a user's task is asked what it has."""
    check_task(task, spec, needs_solution=False)
    name, template = getattr(task, "name", None), getattr(task, "template", None)
    return UserTask(
        task,
        name if isinstance(name, str) else spec,
        bool(getattr(task, "finite", False)),
        template if isinstance(template, str) else None,
    )


def built(task: Any) -> Any:
    """The object a user's task factory built: what a `UserTask` wraps, or `task` itself."""
    return task.task if isinstance(task, UserTask) else task


def label(obj: Any) -> str:
    """What messages call a user's reward (or any callable): its `name` when that is a string, else its
    function's or class's name."""
    name = getattr(obj, "name", None)
    return name if isinstance(name, str) else getattr(obj, "__name__", type(obj).__name__)


def batches(reward: Any) -> bool:
    """Whether a user's reward scores whole batches itself: it has a `score_batch(completions, examples)`."""
    return hasattr(reward, "score_batch")
