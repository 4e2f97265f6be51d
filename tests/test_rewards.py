"""tether.rewards: pure verifiers that never raise, math-verify behind a hard timeout."""

from __future__ import annotations

import json
import time

import pytest

from tether.rewards import (
    Combined,
    MathVerifier,
    RewardResult,
    boxed_answers,
    get_reward,
    overlong_penalty,
    reward_names,
    score_batch,
    with_completion_tokens,
)
from tether.tasks import Example, get_task, load_math_dataset

from conftest import MATH_DATA, needs_math_data

ADD = Example("a", "23+58=", "81")
CD = Example("c", "9,8,7=016:", "16", {"numbers": [9, 8, 7], "target": 16})
HUGE = "9" * 10**6
INJECTED = "__import__('os').system('echo pwned')"


def slow_verify(completion: str, gold: str) -> tuple[float, str]:
    """Test-only verifier for MathVerifier: "hang" sleeps far past any timeout."""
    if completion == "hang":
        time.sleep(60)
    if completion == "raise":
        raise RuntimeError("verifier bug")
    return float(completion == gold), ""


def test_registry():
    assert {"exact_match", "countdown", "math", "format", "overlong"} <= set(reward_names())
    with pytest.raises(KeyError, match="exact_match"):
        get_reward("exact_mach")
    with pytest.raises(ValueError, match="no parameters"):
        get_reward("exact_match", strip=False)
    with pytest.raises(ValueError, match="needs parameter"):
        get_reward("overlong", max_tokens=10)
    with pytest.raises(ValueError, match="cache"):
        get_reward("overlong", max_tokens=10, cach=2)
    with pytest.raises(ValueError, match="weight"):
        get_reward({"exact_match": "1"})


@pytest.mark.parametrize(
    "completion, score",
    [
        ("81", 1.0),
        (" 81\n", 1.0),
        ("81 ", 1.0),
        ("081", 0.0),
        ("81 82", 0.0),
        ("8 1", 0.0),
        ("", 0.0),
        ("８１", 0.0),  # full-width digits are not the answer
        (HUGE, 0.0),
        (INJECTED, 0.0),
        ("\\boxed{81}", 0.0),  # exact match is for synthetic tasks: no extraction
        ("81<eos>", 0.0),  # the engine cuts the stop token; a reward does not
    ],
)
def test_exact_match_table(completion, score):
    result = get_reward("exact_match")(completion, ADD)
    assert result.score == score and result.components == {"exact_match": score}
    assert (result.reason == "") == (score == 1.0)


@pytest.mark.parametrize(
    "completion, score, reason",
    [
        ("(9-7)*8", 1.0, ""),
        (" (9 - 7) * 8\n", 1.0, ""),
        ("9+7", 1.0, ""),
        ("8+8", 0.0, "not available"),  # 8 used twice
        ("2*8", 0.0, "not available"),
        ("9+8", 0.0, "value 17"),
        ("16", 0.0, "not available"),
        ("", 0.0, "empty"),
        (HUGE, 0.0, "longer than"),
        (INJECTED, 0.0, "unexpected character"),
        ("9**7", 0.0, "parse"),
        ("(9-7)*8=16", 0.0, "unexpected character"),
        ("8/(9-9)", 0.0, "division by zero"),
        ("((", 0.0, "end of expression"),
    ],
)
def test_countdown_table(completion, score, reason):
    result = get_reward("countdown")(completion, CD)
    assert result.score == score and reason in result.reason


def test_countdown_without_meta_scores_zero():
    assert get_reward("countdown")("1+1", ADD).reason.startswith("example has no meta")


def test_task_default_rewards_accept_reference_solutions():
    for name in ("arithmetic", "countdown"):
        task = get_task(name)
        reward = get_reward(task.reward)
        examples = task.examples("test", 50)
        assert all(r.score == 1.0 for r in score_batch(reward, [task.solution(e) for e in examples], examples))


def test_boxed_answers():
    text = "a \\boxed{1} b \\boxed{\\frac{1}{2}} \\boxed{\\boxed{3}} {\\boxed{x}"
    assert boxed_answers(text) == ["1", "\\frac{1}{2}", "\\boxed{3}", "3", "x"]
    assert boxed_answers("\\boxed{1") == [] and boxed_answers("}{") == [] and boxed_answers("{") == []
    start = time.perf_counter()
    assert boxed_answers("\\boxed{" * 200_000) == []  # linear, not quadratic
    assert len(boxed_answers("\\boxed{" * 100_000 + "}" * 100_000)) == 64  # capped
    assert time.perf_counter() - start < 2.0


@pytest.mark.parametrize(
    "completion, score",
    [
        ("so \\boxed{81}", 1.0),
        ("\\boxed{\\boxed{81}}", 1.0),
        ("\\boxed{}", 0.0),
        ("\\boxed{ }", 0.0),
        ("\\boxed{81", 0.0),
        ("81", 0.0),
        ("", 0.0),
        (HUGE, 0.0),
    ],
)
def test_format_boxed(completion, score):
    assert get_reward("format")(completion, ADD).score == score


def test_format_regex():
    reward = get_reward("format", pattern=r"^\d+$")
    assert reward("81", ADD).score == 1.0 and reward("81a", ADD).score == 0.0


def test_overlong_penalty_values():
    # max 64, cache 16: free up to 48 tokens, then -(L - 48) / 16, -1 at 64 and beyond.
    assert [overlong_penalty(n, 64, 16) for n in (0, 48, 49, 56, 64, 100)] == [0.0, 0.0, -1 / 16, -0.5, -1.0, -1.0]
    reward = get_reward("overlong", max_tokens=64, cache=16)
    assert reward("x" * 56, ADD).score == -0.5  # characters when no token count is given
    [counted] = with_completion_tokens([ADD], [60])
    assert reward("short", counted).score == -0.75  # meta["completion_tokens"] wins
    assert ADD.meta == {}  # the caller's example is not mutated
    with pytest.raises(ValueError, match="cache"):
        get_reward("overlong", max_tokens=8, cache=9)


def test_combined_weights_components_and_reasons():
    reward = get_reward({"exact_match": 1.0, "format": 0.1, "overlong": {"weight": 0.5, "max_tokens": 10, "cache": 5}})
    assert isinstance(reward, Combined)
    good = reward("81", ADD)  # exact 1, no box 0, 2 chars: no penalty
    assert good.score == pytest.approx(1.0)
    assert good.components == {"exact_match": 1.0, "format": 0.0, "overlong": 0.0}
    boxed = reward("\\boxed{81}", ADD)  # 10 chars: penalty -1 * 0.5; box 0.1; not an exact match
    assert boxed.score == pytest.approx(0.1 - 0.5)
    assert "exact_match: expected" in boxed.reason and "overlong:" in boxed.reason
    batch = score_batch(reward, ["81", "\\boxed{81}"], [ADD, ADD])
    assert batch == [good, boxed]


def test_rewards_are_deterministic_and_pure():
    rewards = [get_reward("exact_match"), get_reward("countdown"), get_reward("format")]
    completions = ["81", "(9-7)*8", "\\boxed{81}", "", INJECTED, "é" * 1000]
    first = [[r(c, ex) for c in completions] for r in rewards for ex in (ADD, CD)]
    second = [[r(c, ex) for c in completions] for r in rewards for ex in (ADD, CD)]
    assert first == second
    assert all(isinstance(x, RewardResult) for row in first for x in row)
    assert CD.meta == {"numbers": [9, 8, 7], "target": 16}


@pytest.fixture(scope="module")
def math_reward():
    reward = get_reward("math")
    yield reward
    reward.close()


@pytest.mark.parametrize(
    "completion, score",
    [
        ("The answer is $\\boxed{81}$.", 1.0),
        ("\\boxed{\\frac{162}{2}}", 1.0),
        ("\\boxed{\\boxed{81}}", 1.0),
        ("so 81", 1.0),
        ("\\boxed{80} and \\boxed{81}", 0.0),  # two answers is not one right answer
        ("\\boxed{81.0001}", 0.0),
        ("", 0.0),
        ("\\boxed{", 0.0),
        ("８１", 0.0),
        (INJECTED, 0.0),
        (HUGE, 0.0),
    ],
)
def test_math_table(math_reward, completion, score):
    result = math_reward(completion, ADD)
    assert result.score == score and result.components == {"math": score}
    assert (result.reason == "") == (score == 1.0)


@needs_math_data
def test_math_on_real_rows(math_reward):
    rows = load_math_dataset(MATH_DATA / "math500.jsonl", limit=40)
    right = [f"Thus the answer is $\\boxed{{{ex.answer}}}$." for ex in rows]
    # A wrong answer: the next row's gold, skipping pairs where one gold ends with the other
    # (math-verify rightly counts "x=5" and "5" as the same answer).
    pairs = [(a, b) for a, b in zip(rows, rows[1:]) if not a.answer.endswith(b.answer) and not b.answer.endswith(a.answer)]
    assert len(pairs) > 30
    wrong = [f"Thus the answer is $\\boxed{{{b.answer}}}$." for _, b in pairs]
    assert [r.score for r in math_reward.score_batch(right, rows)] == [1.0] * len(rows)
    assert [r.score for r in math_reward.score_batch(wrong, [a for a, _ in pairs])] == [0.0] * len(pairs)

    with (MATH_DATA / "gsm8k_test.jsonl").open() as f:
        raw = [json.loads(next(f)) for _ in range(20)]
    gsm = load_math_dataset(MATH_DATA / "gsm8k_test.jsonl", limit=20)
    right = [f"{row['solution']}\nThe answer is {row['answer']}." for row in raw]
    wrong = [f"{row['solution']}\nThe answer is {int(row['answer']) + 1}." for row in raw]
    assert [r.score for r in math_reward.score_batch(right, gsm)] == [1.0] * 20
    assert [r.score for r in math_reward.score_batch(wrong, gsm)] == [0.0] * 20


def test_math_timeout_kills_and_recovers():
    verifier = MathVerifier(timeout_s=1.0, verify_fn=slow_verify)
    try:
        assert verifier.score_batch(["a", "raise"], ["a", "a"]) == [(1.0, ""), (0.0, "verifier error: RuntimeError: verifier bug")]
        start = time.perf_counter()
        assert verifier.score_batch(["hang"], ["a"]) == [(0.0, "timeout")]
        assert time.perf_counter() - start < 1.0 + 0.5  # the timeout plus a small margin
        assert verifier.restarts == 1
        # The rest of a batch after a hang is scored by a fresh worker.
        start = time.perf_counter()
        assert verifier.score_batch(["a", "hang", "b", "a"], ["a", "a", "a", "a"]) == [
            (1.0, ""), (0.0, "timeout"), (0.0, ""), (1.0, "")
        ]
        assert verifier.restarts == 2
        assert time.perf_counter() - start < 2 * 1.0 + 2 * 10  # two timeouts of 1 s + two worker starts
        assert verifier.score_batch(["b"], ["b"]) == [(1.0, "")]
    finally:
        verifier.close()
