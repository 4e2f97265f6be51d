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

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol, Sequence

from ..tasks import Example


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
    """`(completion, example) -> RewardResult`; may also offer `score_batch`."""

    def __call__(self, completion: str, example: Example) -> RewardResult: ...


def score_batch(
    reward: RewardFn, completions: Sequence[str], examples: Sequence[Example]
) -> list[RewardResult]:
    """Score many completions, through the reward's own batched path when it has one.

    `examples[i]` is the example `completions[i]` answers (repeat it for samples of one prompt).
    """
    if len(completions) != len(examples):
        raise ValueError(f"{len(completions)} completions but {len(examples)} examples")
    batched = getattr(reward, "score_batch", None)
    if batched is not None:
        return batched(completions, examples)
    results = [_guarded(reward, c, e) for c, e in zip(completions, examples)]
    failed = [r for r in results if r.reason.startswith(REWARD_ERROR)]
    if results and len(failed) == len(results):
        raise RuntimeError(
            f"the reward {getattr(reward, '__name__', type(reward).__name__)} raised on every completion in "
            f"the batch ({failed[0].reason}): that is a bug in the reward, not hostile output; fix the reward"
        )
    return results


REWARD_ERROR = "reward error"


def _guarded(reward: RewardFn, completion: str, example: Example) -> RewardResult:
    """One completion's reward; a reward that raises (a user's, on odd output) scores 0, and the
    trainer counts it in `reward/errors`, instead of ending the run."""
    try:
        return reward(completion, example)
    except Exception as err:
        return RewardResult(0.0, {}, f"{REWARD_ERROR}: {type(err).__name__}: {str(err)[:80]}", ("error",))


@dataclass(frozen=True)
class Scored:
    """A rollout's N completions scored, in the rollout's row order: what `score_rollout` returns
    to training, SFT and `tether eval`, and what the trainer carries through a step."""

    rollout: Any
    """The `tether.rollout.RolloutBatch` (N rows)."""
    examples: list[Example]
    """(N,) the example each sample answers, with its completion length in tokens (for `overlong`)."""
    results: list[RewardResult]
    """(N,) each sample's reward."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Rollout and reward metrics on the host (the trainer's `collect` fills them)."""

    @cached_property
    def rewards(self) -> Any:
        """(N,) float32 tensor of the scores."""
        import torch

        return torch.tensor([r.score for r in self.results], dtype=torch.float32)

    @cached_property
    def group_ids(self) -> Any:
        """(N,) int64 tensor: the prompt group of each sample (`rollout.prompt_index`)."""
        import torch

        return torch.tensor(self.rollout.prompt_index)


def rollout_examples(rollout: Any, examples: Sequence[Example]) -> list[Example]:
    """The example of each sample of `rollout` (a `tether.rollout.RolloutBatch`): its prompt's
    (`rollout.prompt_index`), with its completion length in tokens attached for length-aware rewards."""
    from .simple import with_completion_tokens

    return with_completion_tokens([examples[i] for i in rollout.prompt_index],
                                  [int(n) for n in rollout.mask.sum(1).tolist()])


def score_rollout(reward: RewardFn, rollout: Any, examples: Sequence[Example]) -> Scored:
    """THE scoring path of training, SFT and `tether eval`: each completion of `rollout` against
    the example of its prompt (`rollout_examples`)."""
    per_sample = rollout_examples(rollout, examples)
    return Scored(rollout, per_sample, score_batch(reward, list(rollout.completions), per_sample))


def verifier_faults(results: Sequence[RewardResult]) -> dict[str, float]:
    """`reward/timeouts`: completions a verifier gave up on for lack of time (scored 0);
    `reward/errors`: completions a verifier failed on (it raised, or its worker died). A
    completion counts once per kind, whichever part of a combined reward gave up."""
    return {"reward/timeouts": float(sum("timeout" in r.faults for r in results)),
            "reward/errors": float(sum("error" in r.faults for r in results))}


def brief(text: str, limit: int = 40) -> str:
    """`text` shortened for a reason string."""
    return repr(text if len(text) <= limit else text[:limit] + "...")
