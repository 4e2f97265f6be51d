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

Wherever a reward is named, an import path `module:name` names a user's reward instead
(tether.plugins): a function (completion, example) -> float | RewardResult, or a class whose
instances are one. A number it returns becomes `RewardResult(score)` (`UserReward`). The trainer
runs a user's reward in a worker process under `reward.timeout_s` (`task_reward(isolated=True)`,
`isolate`, `Isolated`), and every scoring path turns a raise, a non-number or a non-finite score
into 0 with a reason (`base.score_all`).

`PerExample(pick)` scores each example with its own reward (a benchmark of several tasks). Scoring
a rollout is `score_rollout` (`base`); accuracy, held-out greedy accuracy included, is `verdicts`.
"""

from __future__ import annotations

import numbers
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

from ..core.registry import Registry, did_you_mean
from ..plugins import REWARD_SHAPE, check_call, entry, is_import_path, parameters
from ..tasks import Example
from .base import (
    REWARD_ERROR,
    FaultWarnings,
    RewardBroken,
    RewardFn,
    RewardResult,
    Scored,
    reward_label,
    rollout_examples,
    score_all,
    score_batch,
    score_rollout,
    verifier_faults,
    with_completion_tokens,
)
from .isolated import Isolated
from .math_verifier import Math, MathVerifier, asks_for_boxed, math_verify_score, strict_for_task
from .simple import (
    Format,
    Overlong,
    boxed_answers,
    countdown,
    exact_match,
    overlong_penalty,
)
from .verdicts import accuracy, check_verdicts, greedy_accuracy
from ..schema import ConfigError

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


@dataclass(frozen=True)
class PerExample:
    """Each example scored by its own reward, `pick(example)` (a benchmark of several tasks, each
    with its verifier: `tether eval`); one batched call per distinct reward, results in order.

    Attributes:
        pick: example -> the reward that scores it.
    """

    pick: Callable[[Example], RewardFn]

    def score_batch(self, completions: Sequence[str], examples: Sequence[Example]) -> list[RewardResult]:
        groups: dict[int, tuple[RewardFn, list[int]]] = {}
        for i, ex in enumerate(examples):
            reward = self.pick(ex)
            groups.setdefault(id(reward), (reward, []))[1].append(i)
        results: list[RewardResult] = [RewardResult(0.0)] * len(examples)
        for reward, idx in groups.values():
            for i, result in zip(idx, score_batch(reward, [completions[i] for i in idx], [examples[i] for i in idx])):
                results[i] = result
        return results

    def __call__(self, completion: str, example: Example) -> RewardResult:
        return self.score_batch([completion], [example])[0]


def reward_parts(reward: RewardFn, results: Sequence[RewardResult]) -> Any:
    """The reward's weighted parts over `results` (N,), as `tether.core.multi_reward.RewardParts`:
    scores (N, K), each part's unweighted score (a weighted reward's `components[name]`), and weights (K,);
    a reward that is not a weighted combination is its own single part, weight 1. GDPO's
    `reward_aggregation: normalize_then_sum` reads them."""
    import torch

    from ..core.multi_reward import (
        RewardParts,
    )  # lazy: torch; rewards import without it (a config error is reported first)

    if not isinstance(reward, Combined):
        scores = [[r.score] for r in results]
        return RewardParts(
            torch.tensor(scores, dtype=torch.float64).reshape(len(results), 1), torch.ones(1, dtype=torch.float64)
        )
    names = [name for name, _, _ in reward.parts]
    scores = [[r.components.get(n, float("nan")) for n in names] for r in results]
    return RewardParts(
        torch.tensor(scores, dtype=torch.float64).reshape(len(results), len(names)),
        torch.tensor([w for _, w, _ in reward.parts], dtype=torch.float64),
    )


def reward_entry(name: str) -> Any:
    """The function or class `name` stands for: a registered reward, or a user's `module:name`
    (tether.plugins; a failed import raises ConfigError)."""

    return entry(REWARDS, name, "reward.name")


@dataclass(frozen=True)
class UserReward:
    """A reward from a user's code (an import path, or a task's own function): a number it returns
    is the score (reported under `name`), a RewardResult passes as it is; anything else scores 0
    with fault "wrongtype" (and "error": counted in `reward/errors`), as an exception does."""

    fn: Callable[[str, Example], Any]
    name: str

    def __call__(self, completion: str, example: Example) -> RewardResult:
        out = self.fn(completion, example)
        if isinstance(out, RewardResult):
            return out
        if isinstance(out, numbers.Real):
            return RewardResult(float(out), {self.name: float(out)})
        return RewardResult(
            0.0,
            {},
            f"{REWARD_ERROR}: returned {type(out).__name__} {out!r:.40}; expected a float or a RewardResult",
            ("error", "wrongtype"),
        )


PROBE_FAULTS = ("wrongtype", "nonfinite")
"""What `check_user_rewards` refuses before a run: a result that is no number, or is not finite."""


def check_user_rewards(reward: RewardFn, example: Example) -> None:
    """Score an empty completion and the example's own answer with every user reward in `reward`
    (a weighted one's parts, isolated ones, included) before a run starts: a return of the wrong
    type, or a score that is not a finite number (NaN, which would reach the loss), is a ConfigError
    then, not a reward error on every completion of the first step. A reward that raises or times
    out on a probe is left to the scoring path, which scores that completion 0."""

    parts = [part for _, _, part in reward.parts] if isinstance(reward, Combined) else [reward]
    for part in parts:
        if isinstance(part.reward if isinstance(part, Isolated) else part, UserReward):
            probes = ["", example.answer]
            for completion, result in zip(probes, score_all(part, probes, [example] * 2)):
                if any(fault in result.faults for fault in PROBE_FAULTS):
                    probe = f"the example's answer {completion!r:.40}" if completion else "an empty completion"
                    raise ConfigError(
                        f"reward {reward_label(part)} {result.reason.removeprefix(REWARD_ERROR + ': ')} "
                        f"(called on {probe} before training): a reward returns a finite number or a "
                        "RewardResult with one; fix the reward"
                    )


def isolate(reward: RewardFn, timeout_s: float, name: str = "") -> RewardFn:
    """`reward` with every part from the user's code (an import path `module:name`, or the task's own
    function: `name` is then given, or the part's name in a weighted reward is the import path) run in
    a worker process under `timeout_s` per completion (`Isolated`); a part that cannot be sent to a
    worker (it does not pickle: a lambda, a function defined inside another) is a ConfigError naming
    the fix. tether's own rewards bound their own time (linear scanners, the math verifier's worker)."""
    if isinstance(reward, Combined):
        return Combined(
            tuple(
                (part, weight, isolate(fn, timeout_s, part if is_import_path(part) else ""))
                for part, weight, fn in reward.parts
            )
        )
    if not name:
        return reward

    try:
        pickle.dumps(reward)
    except Exception as err:  # pickling a closure raises AttributeError, PicklingError or TypeError
        raise ConfigError(
            f"reward {name} cannot run in a worker process with a time limit: it does not pickle "
            f"({type(err).__name__}: {err}). Define it at the top level of a module (an import "
            "path MODULE:NAME always is), or set reward.isolate=false to run it in the trainer's "
            "process without reward.timeout_s"
        ) from None
    return Isolated(reward, name, timeout_s)


def user_reward(fn: Any, name: str) -> RewardFn:
    """`fn` (completion, example) -> float | RewardResult as a RewardFn, its signature checked
    (ConfigError); one with its own `score_batch` is used as it is."""

    check_call(fn, ("", Example("", "", "")), {}, f"reward {name!r}", REWARD_SHAPE)
    return fn if hasattr(fn, "score_batch") else UserReward(fn, name)


def _parameters(entry: Any) -> tuple[list[str], list[str]]:
    """(parameters, required ones) of a reward class (its constructor's keywords: a dataclass's init
    fields); a function takes none."""
    if not isinstance(entry, type):
        return [], []

    valid, required, _ = parameters(entry)
    return valid, required


def _build(name: str, params: Mapping[str, Any]) -> RewardFn:
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
    return user_reward(entry(**params), name) if is_import_path(name) else entry(**params)


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
    task: Any,
    name: str = "auto",
    weights: Mapping[str, Any] | None = None,
    timeout_s: float = 5.0,
    strict: bool = True,
    isolated: bool = False,
) -> RewardFn:
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
        if not isinstance(name, str):  # a user's task with its own verifier function
            user = f"{type(task).__name__}.reward"
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
    "Combined",
    "Format",
    "FaultWarnings",
    "Isolated",
    "RewardBroken",
    "isolate",
    "reward_label",
    "Math",
    "MathVerifier",
    "Overlong",
    "PerExample",
    "RewardFn",
    "Scored",
    "UserReward",
    "RewardResult",
    "asks_for_boxed",
    "boxed_answers",
    "check_user_rewards",
    "countdown",
    "exact_match",
    "get_reward",
    "math_verify_score",
    "overlong_penalty",
    "reward_entry",
    "reward_parts",
    "reward_names",
    "reward_options",
    "check_reward_params",
    "score_batch",
    "strict_for_task",
    "task_reward",
    "user_reward",
    "accuracy",
    "check_verdicts",
    "greedy_accuracy",
    "rollout_examples",
    "score_rollout",
    "verifier_faults",
    "with_completion_tokens",
]
