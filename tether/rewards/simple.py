"""Rewards that need no worker process: exact match, countdown, format, DAPO overlong penalty, and an
episode's environment rewards.

Overlong penalty (DAPO, arXiv 2503.14476, eq. 13), with L = completion tokens, L_max the
generation limit and C the soft "cache" band before it:

    R_len(L) = 0                       if L <= L_max - C
             = -(L - (L_max - C)) / C  if L_max - C < L <= L_max
             = -1                      if L > L_max

Departure from the paper: DAPO applies it to truncated samples together with overlong
filtering; here it is one more weighted component, combined by the caller's config.
The completion length comes from `example.meta["completion_tokens"]` when the caller put it
there (exact: `with_completion_tokens` does it from a rollout's mask); otherwise the number of
characters is used, which is exact for tether's character-level tiny models only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar, Sequence

from ..tasks import Example, check_countdown
from ._math_worker import boxed_answers  # one scanner, shared with the math worker
from .base import RewardResult, brief, score_each


def exact_match(completion: str, example: Example) -> RewardResult:
    """1 if the stripped completion equals the stripped gold answer, else 0."""
    got, want = completion.strip(), example.answer.strip()
    if got == want:
        return RewardResult(1.0, {"exact_match": 1.0})
    return RewardResult(0.0, {"exact_match": 0.0}, f"expected {brief(want)}, got {brief(got)}")


def countdown(completion: str, example: Example) -> RewardResult:
    """1 if the stripped completion is an expression reaching the target, each number used at most once."""
    numbers, target = example.meta.get("numbers"), example.meta.get("target")
    if numbers is None or target is None:
        return RewardResult(0.0, {"countdown": 0.0}, "example has no meta['numbers'] / meta['target']")
    ok, reason = check_countdown(completion.strip(), numbers, target)
    return RewardResult(float(ok), {"countdown": float(ok)}, reason)


def episode(completion: str, example: Example) -> RewardResult:
    """The environment's rewards over a multi-turn episode, summed (`env.reward=env`, tether.envs): the
    `meta["episode"]` facts `rollout_examples` attaches."""
    facts = example.meta.get("episode")
    if facts is None:
        raise ValueError("the episode reward needs a multi-turn episode (set env.name or env.tools)")
    return RewardResult(float(facts["reward"]), {"episode": float(facts["reward"])})


@dataclass(frozen=True)
class Format:
    """1 if the completion has the required format, else 0."""

    pattern: str | None = None
    """A regular expression that must match somewhere in the completion (`re.search`); None means
    "contains a non-empty, brace-balanced \\boxed{...}"."""
    name: ClassVar[str] = "Format"  # what messages call it (`Reward.name`): the class's name
    parts: ClassVar[None] = None

    def score_batch(self, completions: Sequence[str], examples: Sequence[Example]) -> list[RewardResult]:
        return score_each(self, completions, examples)

    def __call__(self, completion: str, example: Example) -> RewardResult:
        if self.pattern is None:
            ok = any(answer.strip() for answer in boxed_answers(completion))
            reason = "" if ok else "no non-empty \\boxed{} answer"
        else:
            ok = re.search(self.pattern, completion) is not None
            reason = "" if ok else f"no match for {self.pattern!r}"
        return RewardResult(float(ok), {"format": float(ok)}, reason)


def overlong_penalty(num_tokens: int, max_tokens: int, cache: int) -> float:
    """DAPO's soft overlong penalty in [-1, 0] (module docstring)."""
    threshold = max_tokens - cache
    if num_tokens <= threshold:
        return 0.0
    return -min(1.0, (num_tokens - threshold) / cache)


@dataclass(frozen=True)
class Overlong:
    """DAPO's overlong penalty as a reward component."""

    max_tokens: int
    """The generation limit L_max, normally rollout.max_new_tokens."""
    cache: int
    """Length C of the linear penalty band ending at max_tokens, 0 < cache <= max_tokens."""
    name: ClassVar[str] = "Overlong"  # what messages call it (`Reward.name`): the class's name
    parts: ClassVar[None] = None

    def __post_init__(self) -> None:
        if not 0 < self.cache <= self.max_tokens:
            raise ValueError(f"need 0 < cache <= max_tokens, got cache={self.cache}, max_tokens={self.max_tokens}")

    def score_batch(self, completions: Sequence[str], examples: Sequence[Example]) -> list[RewardResult]:
        return score_each(self, completions, examples)

    def __call__(self, completion: str, example: Example) -> RewardResult:
        num_tokens = example.meta.get("completion_tokens")
        source = "meta"
        if not isinstance(num_tokens, int):
            num_tokens, source = len(completion), "characters"
        score = overlong_penalty(num_tokens, self.max_tokens, self.cache)
        reason = f"{num_tokens} tokens ({source}) > {self.max_tokens - self.cache}" if score else ""
        return RewardResult(score, {"overlong": score}, reason)
