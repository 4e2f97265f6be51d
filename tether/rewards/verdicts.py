"""Accuracy: the share of completions a task's 0/1 verifier accepts, and held-out greedy accuracy.

One definition serves the trainer's `eval/accuracy`, the supervised warm start's stopping rule and
`tether eval` (whose verdicts are checked the same way): a shaped or weighted reward is refused,
since accuracy is a verdict, not a score.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..tasks import Example
from .answers import answer_kind, extract_answer
from .base import RewardFn, RewardResult, score_rollout


def check_verdicts(results: Sequence[RewardResult], verifier: object, examples: Sequence[Example] = ()) -> None:
    """Raise unless every score is 0 or 1: accuracy is a 0/1 verifier's verdict, never a shaped reward."""
    for i, r in enumerate(results):
        if r.score not in (0.0, 1.0):
            on = f" on {examples[i].id!r}" if i < len(examples) else ""
            raise ValueError(
                f"accuracy needs a 0/1 verifier; {verifier!r} scored {r.score}{on} "
                "(use the task's verifier, not a shaped or weighted reward)"
            )


SOLVED = 1.0
"""The score of a solved completion: a 0/1 verifier's 1, and a shaped reward's full marks."""


def solved(score):
    """THE test of a solved completion (a float, or a tensor of them elementwise): its score reaches SOLVED. Accuracy
    is the share of solved completions under the task's 0/1 verifier; `reward/pass_rate` under the training reward."""
    return score >= SOLVED


def accuracy(results: Sequence[RewardResult], verifier: object = "the verifier") -> float:
    """THE definition of accuracy: the share of completions the task's 0/1 verifier accepts (`solved`)."""
    check_verdicts(results, verifier)
    return sum(bool(solved(r.score)) for r in results) / max(len(results), 1)


def greedy_accuracy(
    engine: Any,
    examples: Sequence[Example],
    verifier: RewardFn,
    max_new_tokens: int,
    stop_strings: Sequence[str] = (),
    seed: int = 0,
    batch_size: int | None = None,
) -> dict[str, float]:
    """Held-out accuracy as the trainer measures it (`greedy_evaluation`'s metrics, without the per-problem
    outcomes)."""
    metrics, _ = greedy_evaluation(engine, examples, verifier, max_new_tokens, stop_strings, seed, batch_size)
    return metrics


def greedy_evaluation(
    engine: Any,
    examples: Sequence[Example],
    verifier: RewardFn,
    max_new_tokens: int,
    stop_strings: Sequence[str] = (),
    seed: int = 0,
    batch_size: int | None = None,
    lenient: bool = False,
) -> tuple[dict[str, float], dict[str, list]]:
    """Held-out accuracy as the trainer measures it: one greedy completion per example of `engine`
    (a `tether.rollout.RolloutEngine`), scored by the task's 0/1 `verifier` (`accuracy`, never a
    shaped training reward), and the mean completion length in tokens: {"eval/accuracy", "eval/len_mean"}.
    `batch_size` examples per `generate` call (None: all at once; `trainer.eval_batch_size`). On an
    `EpisodeRunner` (multi-turn) each example plays one greedy episode, the verifier scores its last model
    turn, and the episodes' metrics come too (`eval/turns`, `eval/reward_turn_1`, ...: `episode_summary`).

    Also returns the per-problem outcomes, columns in the order of `examples`: {"id": [...], "correct": [0/1],
    "answer": [the extracted answer or None: `answers.extract_answer`, lenient as the verifier reads],
    "length": [completion tokens]}: what a comparison needs to measure how much of its spread is the choice of
    held-out problems (tether.reports.heldout)."""
    import torch

    from ..rollout import SamplingParams, draw, episode_summary  # lazy: torch; rewards import without it

    if not examples:
        raise ValueError("no examples to evaluate")
    params = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens, stop_strings=tuple(stop_strings))
    size = batch_size or len(examples)
    results, lengths, episodes, answers = [], [], [], []
    for start in range(0, len(examples), size):
        chunk = list(examples[start : start + size])
        with torch.no_grad():
            rollout = draw(engine, chunk, 1, params, seed)
        results += score_rollout(verifier, rollout, chunk).results
        lengths += rollout.completion_lengths.tolist()
        episodes += rollout.episodes or []
        answers += [extract_answer(c, answer_kind(ex), lenient) for c, ex in zip(rollout.completions, chunk)]
    metrics = {"eval/accuracy": accuracy(results, verifier), "eval/len_mean": sum(lengths) / len(lengths)}
    if episodes:
        metrics.update({f"eval/{k.split('/', 1)[1]}": v for k, v in episode_summary(episodes).items()})
    outcomes = {
        "id": [str(ex.id) for ex in examples],
        "correct": [int(solved(r.score)) for r in results],
        "answer": answers,
        "length": [int(n) for n in lengths],
    }
    return metrics, outcomes


__all__ = ["SOLVED", "accuracy", "check_verdicts", "greedy_accuracy", "greedy_evaluation", "solved"]
