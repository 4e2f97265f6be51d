"""Hostile model output: every verifier scores each of 30+ pathological completions within a
bounded time, never hangs and never raises, and the trainer's fault metrics count what the
math verifier gave up on."""

import time

import pytest

from tether.rewards import RewardResult, get_reward, score_batch
from tether.rewards.math_verifier import Math
from tether.tasks import Example
from tether.train import verifier_faults

MB = 1 << 20

HOSTILE = {
    # Huge numbers: an evaluating verifier would never finish (or fill memory).
    "power tower": "\\boxed{9^{9^{9^{9}}}}",
    "power tower, plain": "The answer is 9^9^9^9",
    "python power tower": "9**9**9**9",
    "factorial tower": "\\boxed{((100!)!)!}",
    "factorial of huge": "\\boxed{(10^{100})!}",
    "tetration by exponent": "\\boxed{10^{10^{10^{10^{10}}}}}",
    "huge binomial": "\\boxed{\\binom{10^{12}}{10^{6}}}",
    "many-digit number": "\\boxed{" + "9" * 200_000 + "}",
    # Sizes.
    "1 MB of text": "x" * MB,
    "1 MB of digits then an answer": "7" * MB + " so \\boxed{81}",
    "100k boxes": "\\boxed{1}" * 100_000,
    "boxes everywhere": " ".join(f"\\boxed{{{i}}}" for i in range(5000)),
    # Nesting.
    "5000 nested braces": "\\boxed{" + "{" * 5000 + "81" + "}" * 5000 + "}",
    "unbalanced braces": "\\boxed{" + "{" * 5000 + "81",
    "deep fraction": "\\boxed{" + "\\frac{1}{" * 2000 + "2" + "}" * 2000 + "}",
    "deep sqrt": "\\boxed{" + "\\sqrt{" * 3000 + "2" + "}" * 3000 + "}",
    "deep parentheses": "\\boxed{" + "(" * 5000 + "1" + ")" * 5000 + "}",
    "nested boxes": "\\boxed{" * 3000 + "81" + "}" * 3000,
    # Malformed LaTeX.
    "unterminated box": "\\boxed{",
    "stray closers": "}}}}\\boxed}}{{{",
    "bad command": "\\boxed{\\frac{1}}",
    "undefined macros": "\\boxed{\\foo\\bar{\\baz}}",
    "left without right": "\\boxed{\\left( 3, 4}",
    "environment soup": "\\begin{pmatrix}\\begin{cases}1\\end{pmatrix}\\end{cases}\\boxed{1&2\\\\3}",
    "dollar storm": "$" * 10_001 + "81",
    "comment and escape": "\\boxed{81 % \\end{document}}\\\\\\\\",
    # Bytes and Unicode.
    "NUL bytes": "\\boxed{8\x001}\x00\x00",
    "control characters": "".join(chr(i) for i in range(32)) + "\\boxed{81}",
    "lone surrogates": "\\boxed{\ud800\udfff81}",
    "right-to-left marks": "\u202e\\boxed{18}\u202c",
    "zero-width joiners": "\\boxed{8\u200d1}",
    "fullwidth digits": "\\boxed{８１}",
    "combining marks": "\\boxed{8" + "\u0301" * 10_000 + "1}",
    "emoji": "\\boxed{\U0001F600}" * 1000,
    # Things that look like code.
    "python injection": "\\boxed{__import__('os').system('echo pwned')}",
    "sympy injection": "\\boxed{\\text{exec('1')}}",
    "many equations": "x = " + " = ".join(str(i) for i in range(20_000)),
    "huge matrix": "\\boxed{\\begin{pmatrix}" + "\\\\".join("&".join(["1"] * 200) for _ in range(200)) + "\\end{pmatrix}}",
}

GOLD = Example(id="hostile", prompt="What is 9 * 9?", answer="81")


def test_the_suite_is_large_and_varied():
    assert len(HOSTILE) >= 30
    assert max(len(c) for c in HOSTILE.values()) >= MB


@pytest.fixture(scope="module")
def math_reward():
    reward = Math(timeout_s=3.0)
    yield reward
    reward.close()


def test_math_verifier_scores_every_hostile_completion_in_bounded_time(math_reward):
    results, faults = {}, {"reward/timeouts": 0.0, "reward/errors": 0.0}
    for name, completion in HOSTILE.items():
        restarts = math_reward.verifier.restarts
        start = time.perf_counter()
        [result] = math_reward.score_batch([completion], [GOLD])
        elapsed = time.perf_counter() - start
        # At most the hard timeout, plus a fresh worker's start when the last item killed one.
        assert elapsed < math_reward.timeout_s + 0.5 + 10.0 * (restarts > 0), (name, elapsed)
        assert isinstance(result, RewardResult) and result.score in (0.0, 1.0), name
        results[name] = result
        for key, value in verifier_faults([result]).items():
            faults[key] += value
    # Nothing hostile is rewarded except an honest answer after noise.
    rewarded = {n for n, r in results.items() if r.score == 1.0}
    assert rewarded <= {"1 MB of digits then an answer", "nested boxes", "control characters",
                        "comment and escape", "NUL bytes", "zero-width joiners"}, rewarded
    # Every item math-verify (or the hard limit) gave up on is counted, and there were some.
    gave_up = [n for n, r in results.items() if r.reason == "timeout"]
    assert faults["reward/timeouts"] == len(gave_up) >= 3, gave_up
    assert faults["reward/errors"] == sum("error" in r.reason or "died" in r.reason for r in results.values())
    # The worker still works afterwards.
    assert math_reward("so \\boxed{81}", GOLD).score == 1.0


@pytest.mark.parametrize("reward_name, params", [
    ("exact_match", {}), ("countdown", {}), ("format", {}), ("overlong", {"max_tokens": 8, "cache": 4}),
])
def test_simple_rewards_score_every_hostile_completion_quickly(reward_name, params):
    reward = get_reward(reward_name, **params)
    examples = [Example(id="hostile", prompt="p", answer="81", meta={"numbers": [9, 9], "target": 81, "completion_tokens": 4})]
    for name, completion in HOSTILE.items():
        start = time.perf_counter()
        [result] = score_batch(reward, [completion], examples)
        assert time.perf_counter() - start < 2.0, (reward_name, name)
        assert isinstance(result, RewardResult) and -1e9 < result.score < 1e9, (reward_name, name)


def test_a_raising_reward_is_counted_not_fatal():
    calls = []

    def fragile(completion, example):
        calls.append(completion)
        if "boom" in completion:
            raise ValueError("cannot parse")
        return RewardResult(1.0, {"fragile": 1.0})

    results = score_batch(fragile, ["ok", "boom", "ok"], [GOLD] * 3)
    assert [r.score for r in results] == [1.0, 0.0, 1.0]
    assert results[1].reason.startswith("reward error: ValueError: cannot parse")
    assert verifier_faults(results)["reward/errors"] == 1.0
    with pytest.raises(RuntimeError, match="every completion in the batch"):
        score_batch(fragile, ["boom", "boom"], [GOLD] * 2)
