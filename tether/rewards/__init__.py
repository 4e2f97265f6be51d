"""Rewards: a registry of pure, typed verifiers, and weighted combinations of them.

    reward = get_reward("exact_match")
    reward = get_reward("overlong", max_tokens=64, cache=16)
    reward = get_reward({"math": 1.0, "format": 0.1,
                         "overlong": {"weight": 1.0, "max_tokens": 512, "cache": 128}},
                        timeout_s=10.0, strict=True)     # options shared by the parts that take them
    results = score_batch(reward, completions, examples)   # list[RewardResult]

Registered rewards are either plain functions (no parameters) or small frozen dataclasses
whose fields are the parameters. A combination's score is sum_k w_k * score_k; its components
are each reward's unweighted score under its name (and its own sub-components as "name/key").
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..tasks import Example
from ..core.registry import Registry
from .base import (RewardFn, RewardResult, accuracy, check_verdicts, rollout_examples, score_batch, score_rollout,
                   verifier_faults)
from .math_verifier import Math, MathVerifier, asks_for_boxed, math_verify_score, strict_for_task
from .simple import (
    Format,
    Overlong,
    boxed_answers,
    countdown,
    exact_match,
    overlong_penalty,
    with_completion_tokens,
)

REWARDS: Registry[Any] = Registry("reward")
REWARDS.register("exact_match")(exact_match)
REWARDS.register("countdown")(countdown)
REWARDS.register("format")(Format)
REWARDS.register("overlong")(Overlong)
REWARDS.register("math")(Math)


@dataclass(frozen=True)
class Combined:
    """A weighted sum of named rewards.

    Attributes:
        parts: (name, weight, reward) triples, scored in this order.
    """

    parts: tuple[tuple[str, float, RewardFn], ...]

    def _merge(self, results: Sequence[RewardResult]) -> RewardResult:
        total, components, reasons, faults = 0.0, {}, [], ()
        for (name, weight, _), result in zip(self.parts, results):
            total += weight * result.score
            components[name] = result.score
            components.update({f"{name}/{k}": v for k, v in result.components.items() if k != name})
            if result.reason:
                reasons.append(f"{name}: {result.reason}")
            faults += result.faults
        return RewardResult(total, components, "; ".join(reasons), faults)

    def score_batch(self, completions: Sequence[str], examples: Sequence[Example]) -> list[RewardResult]:
        per_part = [score_batch(reward, completions, examples) for _, _, reward in self.parts]
        return [self._merge(row) for row in zip(*per_part)]

    def __call__(self, completion: str, example: Example) -> RewardResult:
        return self.score_batch([completion], [example])[0]


def _build(name: str, params: Mapping[str, Any]) -> RewardFn:
    entry = REWARDS.get(name)
    if not isinstance(entry, type):
        if params:
            raise ValueError(f"reward {name!r} takes no parameters, got {sorted(params)}")
        return entry
    valid = [f.name for f in dataclasses.fields(entry) if f.init]
    unknown = {k: difflib.get_close_matches(k, valid, n=1) for k in params if k not in valid}
    if unknown:
        raise ValueError(f"reward {name!r} has no parameter(s) {unknown}; valid: {valid}")
    required = [
        f.name for f in dataclasses.fields(entry)
        if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    missing = [k for k in required if k not in params]
    if missing:
        raise ValueError(f"reward {name!r} needs parameter(s) {missing}")
    return entry(**params)


def get_reward(name_or_config: str | Mapping[str, Any], **params: Any) -> RewardFn:
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
    known = set().union(*map(reward_options, REWARDS.names()))
    unknown = {k: difflib.get_close_matches(k, sorted(known), n=1) for k in params if k not in known}
    if unknown:
        raise ValueError(f"no reward takes the option(s) {unknown}; options: {sorted(known)}")
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
    entry = REWARDS.get(name)
    return {f.name for f in dataclasses.fields(entry) if f.init} if isinstance(entry, type) else set()


def task_reward(task: Any, name: str = "auto", weights: Mapping[str, Any] | None = None, timeout_s: float = 5.0,
                strict: bool = True) -> RewardFn:
    """The verifier a task is trained and evaluated with: its own reward (`name="auto"`), a named
    one, or a weighted combination, each part given `timeout_s` and `strict` when it takes them
    (strict extraction only when the task's template asks for a final \\boxed{} answer)."""
    options = {"timeout_s": timeout_s, "strict": strict_for_task(task, strict)}
    if weights:
        return get_reward(dict(weights), **options)
    name = task.reward if name == "auto" else name
    return get_reward(name, **{k: v for k, v in options.items() if k in reward_options(name)})


def reward_names() -> list[str]:
    """Names of the registered rewards."""
    return REWARDS.names()


__all__ = [
    "REWARDS", "Combined", "Format", "Math", "MathVerifier", "Overlong", "RewardFn",
    "RewardResult", "asks_for_boxed", "boxed_answers", "countdown", "exact_match", "get_reward",
    "math_verify_score", "overlong_penalty", "reward_names", "reward_options", "score_batch", "strict_for_task",
    "task_reward", "accuracy", "check_verdicts", "rollout_examples", "score_rollout",
    "verifier_faults", "with_completion_tokens",
]
