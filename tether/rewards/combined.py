"""Rewards made of rewards: a weighted sum (`Combined`), and one reward per example (`PerExample`).

A combination's score is sum_k w_k * score_k; its components are each part's unweighted score under
its name (and the part's own sub-components as "name/key"). GDPO's `reward_aggregation:
normalize_then_sum` reads the parts' scores and weights (`reward_parts`) instead of the sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence

from ..tasks import Example
from .base import RewardFn, RewardResult, as_reward, score_batch


@dataclass(frozen=True)
class Combined:
    """A weighted sum of named rewards.

    Attributes:
        parts: (name, weight, reward) triples, scored in this order.
    """

    parts: tuple[tuple[str, float, RewardFn], ...]

    @property
    def name(self) -> str:
        """What messages call it: its parts' names, "math + format"."""
        return " + ".join(name for name, _, _ in self.parts)

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
    name: ClassVar[str] = "PerExample"  # what messages call it (`Reward.name`): the class's name
    parts: ClassVar[None] = None

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
    a reward that is not a weighted combination (`Reward.parts` None) is its own single part, weight 1.
    GDPO's `reward_aggregation: normalize_then_sum` reads them."""
    import torch

    from ..core.multi_reward import (
        RewardParts,
    )  # lazy: torch; rewards import without it (a config error is reported first)

    parts = as_reward(reward).parts
    if parts is None:
        scores = [[r.score] for r in results]
        return RewardParts(
            torch.tensor(scores, dtype=torch.float64).reshape(len(results), 1), torch.ones(1, dtype=torch.float64)
        )
    names = [name for name, _, _ in parts]
    scores = [[r.components.get(n, float("nan")) for n in names] for r in results]
    return RewardParts(
        torch.tensor(scores, dtype=torch.float64).reshape(len(results), len(names)),
        torch.tensor([w for _, w, _ in parts], dtype=torch.float64),
    )
