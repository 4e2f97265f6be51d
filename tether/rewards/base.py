"""The reward contract: pure functions from (completion, example) to a typed result.

A reward never raises on model output: whatever the completion is (empty, huge, unicode,
code), a failure to parse is score 0 with the reason in `RewardResult.reason`. Rewards are
deterministic, so the same verifier serves training and evaluation.

Completion convention: the text a reward receives is what the rollout engine decoded, without
the stop token and cut before any stop string (see `tether.rollout`). Rewards do not cut at
eos markers themselves; they compare the stripped text, so trailing text after an answer makes
it wrong ("81 82" is not "81").
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Sequence, runtime_checkable

from ..plugins import batches, label
from ..tasks import Example

if TYPE_CHECKING:  # the rewards import without torch, which the rollout brings
    from ..rollout import RolloutBatch


@dataclass(frozen=True)
class RewardResult:
    """A scored completion.

    Attributes:
        score: the scalar reward.
        components: named parts, for logging (a single reward reports itself under its name).
        reason: why the score is what it is, when that is not obvious ("" otherwise).
        faults: why the verifier gave up, for the trainer's fault counters (`verifier_faults`):
            "timeout" (a time limit cut it short), "error" (the verifier raised, or its worker
            died); one entry per part of a combined reward that gave up, () when none did.
    """

    score: float
    components: dict[str, float] = field(default_factory=dict)
    reason: str = ""
    faults: tuple[str, ...] = ()


class RewardFn(Protocol):
    """`(completion, example) -> RewardResult`; may also offer `score_batch`. What a user may hand to
    `score_batch`; `as_reward` gives it the whole `Reward` protocol."""

    def __call__(self, completion: str, example: Example) -> RewardResult: ...


@runtime_checkable
class Reward(Protocol):
    """The whole reward protocol: what every reward tether builds offers (`get_reward`, `task_reward`,
    `user_reward`, and each reward class of this package), so that scoring and the trainer ask a reward for
    nothing it might lack. A bare `RewardFn` becomes one through `as_reward`."""

    name: str
    """What messages and warnings call it (`reward_label`)."""
    parts: tuple[tuple[str, float, Reward], ...] | None
    """A weighted combination's (name, weight, reward) triples, in scoring order; None for one reward."""

    def __call__(self, completion: str, example: Example) -> RewardResult: ...

    def score_batch(self, completions: Sequence[str], examples: Sequence[Example]) -> list[RewardResult]:
        """(N,) results of N completions, `examples[i]` the one `completions[i]` answers."""
        ...


@dataclass(frozen=True)
class Adapted:
    """A bare `RewardFn` with the whole `Reward` protocol (`as_reward`): a function scored one completion
    at a time, each guarded (`score_each`), or, when `batched`, an object whose own `score_batch` scores
    the whole batch. tether's plain reward functions (`exact_match`, `countdown`) are registered so."""

    fn: RewardFn
    """The function or object."""
    name: str
    """What messages call it: its `name`, else its function's or class's name (`tether.plugins.label`)."""
    batched: bool = False
    """It has its own `score_batch`."""
    parts: ClassVar[None] = None

    @property
    def __name__(self) -> str:
        """The function's name, for code that names a reward function by `__name__` (a TRL reward function)."""
        return self.name

    def __call__(self, completion: str, example: Example) -> RewardResult:
        return self.fn(completion, example)

    def score_batch(self, completions: Sequence[str], examples: Sequence[Example]) -> list[RewardResult]:
        if self.batched:
            return self.fn.score_batch(completions, examples)  # type: ignore[attr-defined]
        return score_each(self.fn, completions, examples)


def as_reward(reward: RewardFn) -> Reward:
    """`reward` as a `Reward`: itself when it is one (every reward tether builds), else `Adapted`. The
    one place a bare callable is given the protocol; the public scoring functions pass what they are
    given through it, so a function of the user's Python code scores as it always has."""
    if isinstance(reward, Reward):
        return reward
    return Adapted(reward, label(reward), batches(reward))


def score_batch(reward: RewardFn, completions: Sequence[str], examples: Sequence[Example]) -> list[RewardResult]:
    """Score many completions, through the reward's own batched path when it has one.

    `examples[i]` is the example `completions[i]` answers (repeat it for samples of one prompt).
    A completion the reward raises on, or scores with something that is not a finite number, scores
    0 (`score_all`); a reward that does so on every completion of the batch raises `RewardBroken`.
    """
    reward = as_reward(reward)
    results = score_all(reward, completions, examples)
    failed = [r for r in results if r.reason.startswith(REWARD_ERROR)]
    if results and len(failed) == len(results):
        raise RewardBroken(reward.name, failed[0].reason, completions[0])
    return results


def score_all(reward: RewardFn, completions: Sequence[str], examples: Sequence[Example]) -> list[RewardResult]:
    """`score_batch` without its every-completion check: what an isolated reward's worker runs."""
    if len(completions) != len(examples):
        raise ValueError(f"{len(completions)} completions but {len(examples)} examples")
    try:
        results = as_reward(reward).score_batch(completions, examples)
    except RewardBroken:
        raise
    except Exception as err:  # a user's batched reward that raises: every completion of it scores 0
        return [_error(f"{type(err).__name__}: {str(err)[:80]}")] * len(completions)
    if len(results) != len(completions):
        return [_error(f"returned {len(results)} results for {len(completions)} completions")] * len(completions)
    return [_checked(r) for r in results]


def score_each(reward: RewardFn, completions: Sequence[str], examples: Sequence[Example]) -> list[RewardResult]:
    """The `score_batch` of a reward that scores one completion at a time: each call guarded (`_guarded`),
    so one completion it raises on scores 0 and the others are scored."""
    return [_guarded(reward, c, e) for c, e in zip(completions, examples)]


REWARD_ERROR = "reward error"


class RewardBroken(RuntimeError):
    """A reward failed (raised, or gave no finite number) on every completion of a batch: a bug in the
    reward, not hostile output. The trainer turns it into a one-line `error:` (exit 2) at a run's first
    step, when nothing has been learned yet (docs/reliability.md)."""

    def __init__(self, reward: str, reason: str, completion: str):
        self.reward, self.reason, self.completion = reward, reason, completion
        super().__init__(
            f"the reward {reward} failed on every completion of the batch ({reason}; one "
            f"completion: {brief(completion, 60)}): that is a bug in the reward, not hostile output; "
            f"fix the reward"
        )


def _error(detail: str, *extra: str) -> RewardResult:
    return RewardResult(0.0, {}, f"{REWARD_ERROR}: {detail}", ("error", *extra))


def _checked(result: Any) -> RewardResult:
    """`result` when it is a RewardResult with a finite score, else a score of 0 with the reason."""
    if not isinstance(result, RewardResult):
        return _error(f"returned {type(result).__name__} {result!r:.40}, not a RewardResult")
    if not isinstance(result.score, numbers.Real):
        return _error(f"returned a score of type {type(result.score).__name__} {result.score!r:.40}")
    if not math.isfinite(result.score):
        return _error(f"returned a non-finite score ({result.score})", "nonfinite")
    return result


def _guarded(reward: RewardFn, completion: str, example: Example) -> RewardResult:
    """One completion's reward; a reward that raises (a user's, on odd output) or returns no finite
    number scores 0, and the trainer counts it in `reward/errors`, instead of ending the run."""
    try:
        return _checked(reward(completion, example))
    except Exception as err:
        return _error(f"{type(err).__name__}: {str(err)[:80]}")


def reward_label(reward: RewardFn) -> str:
    """The name a message calls a reward by (`Reward.name`): a combination's part names joined by " + ",
    else its `name`, else its function's or class's name."""
    return as_reward(reward).name


def with_completion_tokens(examples: Sequence[Example], num_tokens: Sequence[int]) -> list[Example]:
    """Copies of `examples` with `meta["completion_tokens"]` set, for `Overlong`.

    Typical use: `with_completion_tokens(examples, batch.mask.sum(1).tolist())`.
    """
    if len(examples) != len(num_tokens):
        raise ValueError(f"{len(examples)} examples but {len(num_tokens)} lengths")
    return [replace(ex, meta={**ex.meta, "completion_tokens": int(n)}) for ex, n in zip(examples, num_tokens)]


def rollout_examples(rollout: RolloutBatch, examples: Sequence[Example]) -> list[Example]:
    """The example of each sample of `rollout` (a `tether.rollout.RolloutBatch`): its prompt's
    (`rollout.prompt_index`), with its completion length in tokens attached for length-aware rewards, and a
    multi-turn episode's facts as `meta["episode"]` (the `episode` reward's)."""
    per_sample = with_completion_tokens(
        [examples[i] for i in rollout.prompt_index], [int(n) for n in rollout.completion_lengths.tolist()]
    )
    if rollout.episodes is None:
        return per_sample
    return [replace(ex, meta={**ex.meta, "episode": facts}) for ex, facts in zip(per_sample, rollout.episodes)]


def score_rollout(reward: RewardFn, rollout: RolloutBatch, examples: Sequence[Example]) -> RolloutBatch:
    """THE scoring path of training, SFT and `tether eval`: each completion of `rollout` against the example of its
    prompt (`rollout_examples`); the batch comes back scored (`RolloutBatch.examples`, `.results`, `.rewards`)."""
    per_sample = rollout_examples(rollout, examples)
    return rollout.scored(per_sample, score_batch(reward, list(rollout.completions), per_sample))


def verifier_faults(results: Sequence[RewardResult]) -> dict[str, float]:
    """`reward/timeouts`: completions a verifier gave up on for lack of time (scored 0);
    `reward/errors`: completions a verifier failed on (it raised, or its worker died). A
    completion counts once per kind, whichever part of a combined reward gave up."""
    return {
        "reward/timeouts": float(sum("timeout" in r.faults for r in results)),
        "reward/errors": float(sum("error" in r.faults for r in results)),
    }


def brief(text: str, limit: int = 40) -> str:
    """`text` shortened for a reason string."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


FAULT_WORDS = {
    "timeout": ("timed out", "reward/timeouts"),
    "nonfinite": ("returned a non-finite score", "reward/errors"),
    "error": ("failed", "reward/errors"),
}


@dataclass
class FaultWarnings:
    """`warning:` lines for a reward's faults, rate-limited: one the first time each kind (an error,
    a time-out, a non-finite score) occurs in a run, naming the reward, the reason and one offending
    completion; later ones are only counted (`verifier_faults`, in metrics.jsonl)."""

    reward: str
    """The reward's name (`reward_label`)."""
    seen: set[str] = field(default_factory=set)

    def lines(self, step: int, completions: Sequence[str], results: Sequence[RewardResult]) -> list[str]:
        out = []
        for completion, result in zip(completions, results):
            for kind in result.faults:
                if kind in self.seen or kind not in FAULT_WORDS:
                    continue
                if kind == "error" and "nonfinite" in result.faults:
                    continue  # said once, as a non-finite score
                self.seen.add(kind)
                what, metric = FAULT_WORDS[kind]
                out.append(
                    f"warning: step {step}: reward {self.reward} {what} on a completion, scored 0 "
                    f"({result.reason}); the completion: {brief(completion, 80)}. Further ones are counted "
                    f"in {metric} (metrics.jsonl) without a warning"
                )
        return out
