"""The reward registry, and the one way to build a reward from a name or a weighted config.

    reward = get_reward("exact_match")
    reward = get_reward("overlong", max_tokens=64, cache=16)
    reward = get_reward({"math": 1.0, "format": 0.1,
                         "overlong": {"weight": 1.0, "max_tokens": 512, "cache": 128}},
                        timeout_s=10.0, strict=True)     # options shared by the parts that take them
    verifier = task_reward(task)                         # the task's own, as the trainer builds it

Registered rewards are either plain functions (no parameters; stored with the whole reward
protocol, `base.Adapted`) or small frozen dataclasses whose fields are the parameters. Wherever a
reward is named, an import path `module:name` names a user's reward instead (tether.plugins,
`user.user_reward`). Everything built here is a `base.Reward`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Sequence

from ..core.registry import Registry, did_you_mean
from ..plugins import built, entry, is_import_path, parameters
from ..schema import ConfigError
from ..tasks import Task
from .base import Reward, as_reward
from .combined import Combined
from .isolated import isolate
from .math_verifier import Math, strict_for_task
from .simple import Format, Overlong, countdown, episode, exact_match
from .user import user_reward


class RewardRegistry(Registry[Any]):
    """The reward registry: a class is stored as it is (its instances, built with parameters, are
    rewards); a plain function is stored with the whole reward protocol (`as_reward`), once, so the
    reward `get_reward` returns for a name is always the same object."""

    def register(self, name: str) -> Callable[[Any], Any]:
        store = super().register(name)

        def decorator(obj: Any) -> Any:
            store(obj if isinstance(obj, type) else as_reward(obj))
            return obj

        return decorator


REWARDS = RewardRegistry("reward")
REWARDS.register("exact_match")(exact_match)
REWARDS.register("countdown")(countdown)
REWARDS.register("format")(Format)
REWARDS.register("overlong")(Overlong)
REWARDS.register("math")(Math)
REWARDS.register("episode")(episode)


def reward_entry(name: str) -> Any:
    """The function or class `name` stands for: a registered reward, or a user's `module:name`
    (tether.plugins; a failed import raises ConfigError)."""

    return entry(REWARDS, name, "reward.name")


def _parameters(entry: Any) -> tuple[list[str], list[str]]:
    """(parameters, required ones) of a reward class (its constructor's keywords: a dataclass's init
    fields); a function takes none."""
    if not isinstance(entry, type):
        return [], []

    valid, required, _ = parameters(entry)
    return valid, required


def _build(name: str, params: Mapping[str, Any]) -> Reward:
    entry = reward_entry(name)
    if not isinstance(entry, type):
        if params:
            raise ValueError(f"reward {name!r} takes no parameters, got {sorted(params)}")
        return user_reward(entry, name) if is_import_path(name) else entry
    check_reward_params(name, params)
    valid, required = _parameters(entry)
    missing = [k for k in required if k not in params]
    if missing:
        raise ValueError(f"reward {name!r} needs parameter(s) {missing}")
    return user_reward(entry(**params), name) if is_import_path(name) else as_reward(entry(**params))


def get_reward(name_or_config: str | Mapping[str, Any], **params: Any) -> Reward:
    """A reward from a name (plus its parameters) or a weighted config (plus shared options).

    A config maps names to a weight, or to a dict of a "weight" and that reward's parameters:
    `{"exact_match": 1.0, "format": 0.1}`, `{"overlong": {"weight": 1, "max_tokens": 64, "cache": 16}}`.
    With a config, keyword arguments are options shared by its parts: each goes to every part
    that has a parameter of that name and does not set it itself, so
    `get_reward({"math": 1.0, "format": 0.1}, timeout_s=10, strict=False)` builds the math part
    with both (the trainer passes `reward.timeout_s` and `reward.strict` this way). An option
    that no registered reward takes is an error.
    """
    if isinstance(name_or_config, str):
        return _build(name_or_config, params)
    if not name_or_config:
        raise ValueError("empty reward config")
    known = sorted(set().union(*map(reward_options, REWARDS.names())))
    unknown = [k for k in params if k not in known]
    if unknown:
        raise ValueError(
            f"no reward takes the option {unknown[0]!r}.{did_you_mean(unknown[0], known)} Options: {', '.join(known)}."
        )
    parts = []
    for name, spec in name_or_config.items():
        if isinstance(spec, Mapping):
            spec = dict(spec)
            weight = spec.pop("weight", 1.0)
        else:
            weight, spec = spec, {}
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ValueError(f"weight of reward {name!r} must be a number, got {weight!r}")
        shared = {k: v for k, v in params.items() if k in reward_options(name) and k not in spec}
        parts.append((name, float(weight), _build(name, {**shared, **spec})))
    return Combined(tuple(parts))


def reward_options(name: str) -> set[str]:
    """The parameters the named reward takes (empty for a plain function)."""
    return set(_parameters(reward_entry(name))[0])


def check_reward_params(name: str, params: Iterable[str], key: str = "", also: Sequence[str] = ()) -> None:
    """Each of `params` is a parameter of reward `name`, or one of `also` (the config's `weight`);
    else a ConfigError naming the first that is not, the closest and the valid ones, prefixed by
    `key.PARAM: ` when `key` (reward.weights.NAME) is given. The one check of a reward's parameters:
    the config's on load and `get_reward`'s."""

    valid = sorted(reward_options(name))
    unknown = sorted(set(params) - set(valid) - set(also))
    if unknown:
        param = unknown[0]
        raise ConfigError(
            f"{f'{key}.{param}: ' if key else ''}reward {name!r} has no parameter {param!r}."
            f"{did_you_mean(param, valid)} Valid: {', '.join([*also, *valid]) or 'none'}."
        )


def task_reward(
    task: Task,
    name: str = "auto",
    weights: Mapping[str, Any] | None = None,
    timeout_s: float = 5.0,
    strict: bool = True,
    isolated: bool = False,
) -> Reward:
    """The verifier a task is trained and evaluated with: its own reward (`name="auto"`), a named
    one, or a weighted combination, each part given `timeout_s` and `strict` when it takes them
    (strict extraction only when the task's template asks for a final \\boxed{} answer); with
    `isolated`, the parts from the user's code run in a worker under `timeout_s` (`isolate`)."""
    options = {"timeout_s": timeout_s, "strict": strict_for_task(task, strict)}
    user = ""  # the name of a reward from the user's code
    if weights:
        reward = get_reward(dict(weights), **options)
    else:
        name = task.reward if name == "auto" else name
        if not isinstance(name, str):  # a user's task (`UserTask`) with its own verifier function
            user = f"{type(built(task)).__name__}.reward"
            reward = user_reward(name, user)
        else:
            user = name if is_import_path(name) else ""
            reward = get_reward(name, **{k: v for k, v in options.items() if k in reward_options(name)})
    return isolate(reward, timeout_s, user) if isolated else reward


def reward_names() -> list[str]:
    """Names of the registered rewards."""
    return REWARDS.names()


__all__ = [
    "REWARDS",
    "RewardRegistry",
    "check_reward_params",
    "get_reward",
    "reward_entry",
    "reward_names",
    "reward_options",
    "task_reward",
]
