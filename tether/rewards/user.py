"""A reward from the user's code, given the whole reward protocol once, where it is loaded.

An import path `module:name` (tether.plugins) names a function (completion, example) -> float |
RewardResult, or a class whose instances are one; a task of the user's may bring its own such
function as its `reward`. `user_reward` checks its signature and wraps it in a `UserReward`: a
number it returns becomes `RewardResult(score)`, anything else that is not a RewardResult scores 0
with a reason, and it has the `name`, `parts` and `score_batch` the trainer reads. A reward with
its own `score_batch` keeps it, for whole batches. `isolated.isolate` then runs it in a worker
process under `reward.timeout_s`, and `isolated.check_user_rewards` probes it before a run.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence

from ..plugins import REWARD_SHAPE, batches, check_call, label
from ..tasks import Example
from .base import REWARD_ERROR, RewardResult, score_each


@dataclass(frozen=True)
class UserReward:
    """A reward from a user's code (an import path, or a task's own function): a number it returns
    is the score (reported under `name`), a RewardResult passes as it is; anything else scores 0
    with fault "wrongtype" (and "error": counted in `reward/errors`), as an exception does."""

    fn: Callable[[str, Example], Any]
    """The user's function, or an instance of the user's class."""
    name: str
    """What messages and components call it: the import path (or `TaskClass.reward`); for one with
    its own `score_batch`, its own name (`tether.plugins.label`)."""
    batched: bool = False
    """It has its own `score_batch`, which scores whole batches (in a worker: one message per batch)."""
    parts: ClassVar[None] = None

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

    def score_batch(self, completions: Sequence[str], examples: Sequence[Example]) -> list[RewardResult]:
        if self.batched:
            return self.fn.score_batch(completions, examples)  # type: ignore[attr-defined]
        return score_each(self, completions, examples)


def user_reward(fn: Any, name: str) -> UserReward:
    """`fn` (completion, example) -> float | RewardResult as a `UserReward` named `name`, its signature
    checked (ConfigError); one with its own `score_batch` keeps it, and its own name."""

    check_call(fn, ("", Example("", "", "")), {}, f"reward {name!r}", REWARD_SHAPE)
    if batches(fn):
        return UserReward(fn, label(fn), batched=True)
    return UserReward(fn, name)


__all__ = ["UserReward", "user_reward"]
