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
Every reward built here has the whole `Reward` protocol (`name`, `parts`, `score_batch`); a bare
function handed to `score_batch` is given it there (`as_reward`).

Wherever a reward is named, an import path `module:name` names a user's reward instead
(tether.plugins): a function (completion, example) -> float | RewardResult, or a class whose
instances are one. A number it returns becomes `RewardResult(score)` (`UserReward`). The trainer
runs a user's reward in a worker process under `reward.timeout_s` (`task_reward(isolated=True)`,
`isolate`, `Isolated`), and every scoring path turns a raise, a non-number or a non-finite score
into 0 with a reason (`base.score_all`).

`PerExample(pick)` scores each example with its own reward (a benchmark of several tasks). Scoring
a rollout is `score_rollout` (`base`); accuracy, held-out greedy accuracy included, is `verdicts`.

The modules: `base` (the contract and the one scoring path), `simple` and `math_verifier` (the
verifiers), `combined` (weighted sums, one reward per example), `user` and `isolated` (a user's
reward, in a worker), `registry` (names to rewards: `get_reward`, `task_reward`), `verdicts`.
"""

from __future__ import annotations

from .base import (
    Adapted,
    FaultWarnings,
    Reward,
    RewardBroken,
    RewardFn,
    RewardResult,
    as_reward,
    reward_label,
    rollout_examples,
    score_batch,
    score_rollout,
    verifier_faults,
    with_completion_tokens,
)
from .combined import Combined, PerExample, reward_parts
from .isolated import PROBE_FAULTS, Isolated, check_user_rewards, isolate
from .math_verifier import Math, MathVerifier, asks_for_boxed, math_verify_score, strict_for_task
from .registry import (
    REWARDS,
    check_reward_params,
    get_reward,
    reward_entry,
    reward_names,
    reward_options,
    task_reward,
)
from .simple import Format, Overlong, boxed_answers, countdown, exact_match, overlong_penalty
from .user import UserReward, user_reward
from .verdicts import SOLVED, accuracy, check_verdicts, greedy_accuracy, greedy_evaluation, solved

__all__ = [
    "PROBE_FAULTS",
    "REWARDS",
    "Adapted",
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
    "Reward",
    "RewardFn",
    "UserReward",
    "RewardResult",
    "as_reward",
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
    "greedy_evaluation",
    "solved",
    "SOLVED",
    "rollout_examples",
    "score_rollout",
    "verifier_faults",
    "with_completion_tokens",
]
