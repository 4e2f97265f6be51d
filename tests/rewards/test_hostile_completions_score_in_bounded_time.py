"""Hostile model output: every verifier scores each of 30+ pathological completions within a
bounded time, never hangs and never raises, and the trainer's fault metrics count what the
math verifier gave up on. No test here reads the wall clock (issue 32, item 7: a bound of
timeout + measured start + 0.5 s failed on a loaded machine, 4.19 s against 4.14 s). The math
verifier's bound is enforced by its own code, so what is checked is that the code enforced it:
each item ends with a result, at most one worker start per item, and every item the hard limit
cut short reported as a timeout. The simple rewards' bound is their work: CPU seconds of this
process, which another process on the machine does not stretch."""

import time

import pytest

from tether.rewards import RewardBroken, RewardResult, get_reward, score_batch, verifier_faults
from tether.rewards.math_verifier import Math
from tether.tasks import Example

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
    "emoji": "\\boxed{\U0001f600}" * 1000,
    # Things that look like code.
    "python injection": "\\boxed{__import__('os').system('echo pwned')}",
    "sympy injection": "\\boxed{\\text{exec('1')}}",
    "many equations": "x = " + " = ".join(str(i) for i in range(20_000)),
    "huge matrix": "\\boxed{\\begin{pmatrix}"
    + "\\\\".join("&".join(["1"] * 200) for _ in range(200))
    + "\\end{pmatrix}}",
}

GOLD = Example(id="hostile", prompt="What is 9 * 9?", answer="81")


def test_the_suite_is_large_and_varied():
    assert len(HOSTILE) >= 30
    assert max(len(c) for c in HOSTILE.values()) >= MB


# Rewarded despite the noise: an honest final boxed 81 (strict and lenient), plus, under lenient
# extraction only, whatever math-verify finds in the rest.
HONEST = {
    "1 MB of digits then an answer",
    "nested boxes",
    "control characters",
    "comment and escape",
    "NUL bytes",
    "zero-width joiners",
}


@pytest.fixture(scope="module", params=[True, pytest.param(False, marks=pytest.mark.slow)], ids=["strict", "lenient"])
def math_reward(request):
    reward = Math(timeout_s=3.0, strict=request.param)
    yield reward
    reward.close()


def test_math_verifier_scores_every_hostile_completion_in_bounded_time(math_reward):
    verifier = math_reward.verifier
    results, faults = {}, {"reward/timeouts": 0.0, "reward/errors": 0.0}
    for name, completion in HOSTILE.items():
        starts, restarts = verifier.starts, verifier.restarts
        [result] = math_reward.score_batch([completion], [GOLD])
        # The stated guarantee for one item: the timeout plus at most one worker start (the first
        # call and the call after a kill start one; the others do not), and a kill is a timeout.
        assert verifier.starts - starts <= 1, name
        if verifier.restarts > restarts:
            assert result.reason in ("timeout", "verifier worker died"), (name, result.reason)
        assert isinstance(result, RewardResult) and result.score in (0.0, 1.0), name
        results[name] = result
        for key, value in verifier_faults([result]).items():
            faults[key] += value
    rewarded = {n for n, r in results.items() if r.score == 1.0}
    if math_reward.strict:
        assert rewarded <= HONEST, rewarded
        assert rewarded >= {"1 MB of digits then an answer", "control characters"}, rewarded
    else:
        assert rewarded <= HONEST | {"many equations", "huge matrix"}, rewarded
    # Every item math-verify (or the hard limit) gave up on is counted, and there were some.
    gave_up = [n for n, r in results.items() if r.reason == "timeout"]
    assert faults["reward/timeouts"] == len(gave_up) >= 3, gave_up
    assert faults["reward/errors"] == sum("error" in r.reason or "died" in r.reason for r in results.values())
    # The worker still works afterwards.
    assert math_reward("so \\boxed{81}", GOLD).score == 1.0


def test_an_answer_outside_the_box_scores_zero_when_strict():
    # The reward-hacking strings of issue 13: the gold answer anywhere but in \boxed{...}.
    reward = Math(timeout_s=3.0)
    two = Example(id="two", prompt="What is 1 + 1?", answer="2")
    try:
        hacks = ["2Z*xr9{sliUC/", "blah 2 blah", "The answer is 2.", "2", "$2$", "\\(2\\)", "x = 2", "2 \\boxed{}"]
        assert [r.score for r in reward.score_batch(hacks, [two] * len(hacks))] == [0.0] * len(hacks)
    finally:
        reward.close()


@pytest.mark.parametrize(
    "reward_name, params",
    [
        ("exact_match", {}),
        ("countdown", {}),
        ("format", {}),
        ("overlong", {"max_tokens": 8, "cache": 4}),
    ],
)
def test_simple_rewards_score_every_hostile_completion_quickly(reward_name, params):
    reward = get_reward(reward_name, **params)
    examples = [
        Example(id="hostile", prompt="p", answer="81", meta={"numbers": [9, 9], "target": 81, "completion_tokens": 4})
    ]
    for name, completion in HOSTILE.items():
        start = time.process_time()  # CPU seconds of this process: the work, not the machine's load
        [result] = score_batch(reward, [completion], examples)
        assert time.process_time() - start < 2.0, (reward_name, name)
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
    with pytest.raises(RewardBroken, match="the reward fragile failed on every completion of the batch"):
        score_batch(fragile, ["boom", "boom"], [GOLD] * 2)
