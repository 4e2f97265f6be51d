"""tether.rewards: pure verifiers that never raise, math-verify behind a hard timeout."""

from __future__ import annotations

import dataclasses

import json
import time

import pytest
import torch

from tether.rewards import (
    Combined,
    MathVerifier,
    PerExample,
    RewardResult,
    asks_for_boxed,
    boxed_answers,
    get_reward,
    overlong_penalty,
    reward_names,
    score_batch,
    score_rollout,
    strict_for_task,
    verifier_faults,
    with_completion_tokens,
)
from tether.rollout import RolloutBatch
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
    with pytest.raises(ValueError, match="reward 'overlong' has no parameter 'cach'. Did you mean 'cache'"):
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
    start = time.process_time()  # this process's CPU time: the work done, whatever else loads the machine
    assert boxed_answers("\\boxed{" * 200_000) == []  # linear, not quadratic
    assert len(boxed_answers("\\boxed{" * 100_000 + "}" * 100_000)) == 64  # capped
    assert time.process_time() - start < 2.0


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


class Batched:
    """A reward with its own batched path that records each batch it is given."""

    def __init__(self, name, fn, calls):
        self.name, self.fn, self.calls = name, fn, calls

    def __call__(self, completion, example):
        return self.fn(completion, example)

    def score_batch(self, completions, examples):
        self.calls.append((self.name, list(completions)))
        return [self.fn(c, e) for c, e in zip(completions, examples)]


def test_per_example_scores_each_example_with_its_reward_one_batch_per_reward_in_order():
    calls = []
    exact, countdown = Batched("exact", get_reward("exact_match"), calls), Batched("cd", get_reward("countdown"), calls)
    reward = PerExample(lambda ex: countdown if "target" in ex.meta else exact)
    results = score_batch(reward, ["81", "(9-7)*8", "80", "9+8+7"], [ADD, CD, ADD, CD])
    assert [r.score for r in results] == [1.0, 1.0, 0.0, 0.0]  # 81 right, (9-7)*8 = 16 right, 80 wrong, 24 wrong
    assert calls == [("exact", ["81", "80"]), ("cd", ["(9-7)*8", "9+8+7"])]


def test_score_rollout_gives_the_scored_batch_the_trainer_reads():
    # Two prompts x two samples; a stopped sample's length is its text plus the stop token.
    completions, lengths = ["81", "82", "(9-7)*8", "16"], [3, 3, 8, 3]
    mask = torch.arange(8)[None, :] < torch.tensor(lengths)[:, None]
    rollout = RolloutBatch(
        prompt_ids=[[0]] * 4,
        completion_ids=torch.zeros(4, 8, dtype=torch.long),
        sampler_logprobs=torch.zeros(4, 8),
        mask=mask,
        finish_reasons=["stop"] * 4,
        completions=completions,
        prompt_index=[0, 0, 1, 1],
    )
    scored = score_rollout(
        PerExample(lambda ex: get_reward("countdown" if "target" in ex.meta else "exact_match")), rollout, [ADD, CD]
    )
    assert scored.completion_ids is rollout.completion_ids and rollout.results is None  # the same rows, scored
    assert [e.id for e in scored.examples] == ["a", "a", "c", "c"]
    assert [e.meta["completion_tokens"] for e in scored.examples] == lengths  # for overlong
    assert scored.rewards.dtype == torch.float32 and scored.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert scored.group_ids.tolist() == [0, 0, 1, 1]
    # selected and concatenated, the scores travel with their rows; an unscored batch says how to score it
    both = RolloutBatch.concat([scored.select([3, 2]), scored.select([0])], pad_id=0)
    assert both.rewards.tolist() == [0.0, 1.0, 1.0] and [e.id for e in both.examples] == ["c", "c", "a"]
    assert RolloutBatch.concat([scored, rollout], pad_id=0).results is None
    with pytest.raises(ValueError, match="not scored yet: score it with tether.rewards.score_rollout"):
        rollout.rewards
    with pytest.raises(ValueError, match="both examples and results"):
        dataclasses.replace(rollout, results=scored.results)


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


@pytest.fixture(scope="module")
def lenient_math():
    reward = get_reward("math", strict=False)
    yield reward
    reward.close()


TWO = Example("two", "What is 1 + 1?", "2")


@pytest.mark.parametrize(
    "completion, gold, strict, lenient",
    [
        ("The answer is $\\boxed{81}$.", ADD, 1.0, 1.0),
        ("\\boxed{\\frac{162}{2}}", ADD, 1.0, 1.0),
        ("\\boxed{\\boxed{81}}", ADD, 1.0, 1.0),
        ("so 81", ADD, 0.0, 1.0),  # strict: a number outside the box is no answer
        # The reward-hacking examples: lenient extraction finds a "2" in any noise.
        ("2Z*xr9{sliUC/", TWO, 0.0, 1.0),
        ("blah 2 blah", TWO, 0.0, 1.0),
        ("The answer is 2.", TWO, 0.0, 1.0),
        ("\\boxed{blah 2 blah}", TWO, 0.0, 0.0),  # the box holds noise, not 2
        # Strict reads the final answer: the last box and the boxes joined to it by separators.
        ("\\boxed{80} and \\boxed{81}", ADD, 0.0, 0.0),  # one answer {80, 81}, not 81
        ("A step gives \\boxed{80}. Correcting the carry, the answer is \\boxed{81}.", ADD, 1.0, 0.0),
        ("\\boxed{81}. Check: 80 + 1 = 81.", ADD, 1.0, 1.0),
        ("\\boxed{81.0001}", ADD, 0.0, 0.0),
        ("\\boxed{}", ADD, 0.0, 0.0),
        ("", ADD, 0.0, 0.0),
        ("\\boxed{", ADD, 0.0, 0.0),
        ("８１", ADD, 0.0, 0.0),
        (INJECTED, ADD, 0.0, 0.0),
        (HUGE, ADD, 0.0, 0.0),
    ],
)
def test_math_table_strict_and_lenient(math_reward, lenient_math, completion, gold, strict, lenient):
    for reward, score in ((math_reward, strict), (lenient_math, lenient)):
        result = reward(completion, gold)
        assert (result.score, result.components) == (score, {"math": score}), (reward.strict, result)
        assert (result.reason == "") == (score == 1.0)
    if strict == 0.0 and "\\boxed" not in completion:
        assert "no \\boxed{} answer" in math_reward(completion, gold).reason


PERCENT, PERCENT_PLAIN = Example("p", "p", "28\\%"), Example("q", "q", "62.5%")


@pytest.mark.parametrize(
    "completion, gold, strict, lenient",
    [
        # A trailing percent is dropped on both sides: the number written is compared.
        ("\\boxed{28}", PERCENT, 1.0, 1.0),
        ("\\boxed{28\\%}", PERCENT, 1.0, 1.0),
        ("\\boxed{28 \\%}", PERCENT, 1.0, 1.0),
        ("\\boxed{28 percent}", PERCENT, 1.0, 1.0),
        ("\\boxed{28\\text{ percent}}", PERCENT, 1.0, 1.0),
        ("$\\boxed{28}$ %", PERCENT, 1.0, 1.0),
        ("28 percent", PERCENT, 0.0, 1.0),
        ("28 %", PERCENT, 0.0, 1.0),
        ("$28$ %", PERCENT, 0.0, 1.0),
        ("\\boxed{62.5\\%}", PERCENT_PLAIN, 1.0, 1.0),
        ("\\boxed{62.5}", PERCENT_PLAIN, 1.0, 1.0),
        ("\\boxed{29\\%}", PERCENT, 0.0, 0.0),
        ("\\boxed{0.28}", PERCENT, 0.0, 0.0),  # 28% is compared as 28 (documented)
        ("\\boxed{0.625}", PERCENT_PLAIN, 0.0, 0.0),
    ],
)
def test_math_percent_golds(math_reward, lenient_math, completion, gold, strict, lenient):
    assert math_reward(completion, gold).score == strict
    assert lenient_math(completion, gold).score == lenient


@pytest.mark.parametrize(
    "completion, gold, score",
    [
        # "1,22" is the list {1, 22} (as datasets write several solutions: "11,13", "-2,1").
        ("\\boxed{1,22}", "1,22", 1.0),
        ("\\boxed{22, 1}", "1,22", 1.0),
        ("\\boxed{1}, \\boxed{22}", "1,22", 1.0),
        ("\\boxed{1.22}", "1,22", 0.0),  # never a decimal comma
        ("\\boxed{122}", "1,22", 0.0),
        # Three-digit groups after a non-zero lead are a thousands separator.
        ("\\boxed{1220}", "1,220", 1.0),
        ("\\boxed{1,220}", "1220", 1.0),
        ("\\boxed{1,234,567}", "1234567", 1.0),
        ("\\boxed{1, 220}", "1,220", 0.0),
        # A zero lead is not a thousands number: a list (math-verify alone reads 0.111).
        ("\\boxed{0,111}", "0, 111", 1.0),
        ("\\boxed{0.111}", "0,111", 0.0),
    ],
)
def test_math_commas_between_digits(math_reward, completion, gold, score):
    assert math_reward(completion, Example("c", "c", gold)).score == score


def test_gold_that_parses_only_as_a_string_falls_back_to_another_reading(math_reward):
    # "\\boxed{28\\%}" alone is only a string to math-verify 0.9; "10/9" boxed is fine.
    assert math_reward("\\boxed{\\frac{10}{9}}", Example("f", "f", "10/9")).score == 1.0
    assert math_reward("\\boxed{28}", Example("g", "g", "$28\\%$")).score == 1.0


def test_gold_parse_cut_short_by_a_time_limit_is_retried_not_cached(monkeypatch):
    """Issue 13, item 10: the gold's parse is made slow once; that completion scores 0 as a
    timeout (counted in reward/timeouts) and the next one re-parses the gold and scores 1."""
    import math_verify.parser as parser

    from tether.rewards import _math_worker as worker
    from tether.rewards.math_verifier import _faults

    real, calls = parser.extract_target_from_pred, []

    def slow_once(pred, *args, **kwargs):
        calls.append(pred)
        if len(calls) == 1:
            time.sleep(5)  # interrupted by math-verify's own 1 s alarm: the next line never runs
            calls.append("slept 5 s")
        return real(pred, *args, **kwargs)

    monkeypatch.setattr(parser, "extract_target_from_pred", slow_once)
    monkeypatch.setattr(worker, "INNER_TIMEOUT_S", 1)
    gold = "\\frac{7}{13}"  # not parsed before in this process
    worker._GOLD_CACHE.pop(gold, None)
    assert worker.math_verify_score("\\boxed{\\frac{14}{26}}", gold) == (0.0, "timeout")
    assert calls[0] == f"\\boxed{{{gold}}}" and "slept 5 s" not in calls  # the alarm cut the sleep short
    assert gold not in worker._GOLD_CACHE
    assert worker.math_verify_score("\\boxed{\\frac{14}{26}}", gold) == (1.0, "")
    assert gold in worker._GOLD_CACHE
    # The reason maps to the fault the trainer counts in reward/timeouts.
    assert verifier_faults([RewardResult(0.0, {}, "timeout", _faults("timeout"))]) == {
        "reward/timeouts": 1.0,
        "reward/errors": 0.0,
    }


def test_time_limits_are_detected_with_the_math_verify_logger_at_error(monkeypatch, caplog):
    """Issue 22, item 7: with the `math_verify` logger at ERROR, math-verify's "Timeout ..." warning
    never comes. latex2sympy is slowed past the (1 s) limit: the gold's first reading,
    `\\boxed{\\frac{3}{56} + 0}`, is cut short, and the parse must say so rather than go on to a
    weaker reading (the gold as written, where only the plain-expression extractor finds "0") and
    cache [0, '0']. A comparison cut short the same way is a timeout, not a wrong answer."""
    import logging

    import math_verify.grader as grader
    import math_verify.parser as parser

    from tether.rewards import _math_worker as worker

    caplog.set_level(logging.ERROR, logger="math_verify")  # restored after the test
    monkeypatch.setattr(worker, "INNER_TIMEOUT_S", 1)
    real = parser.latex2sympy

    def slow(*args, **kwargs):
        time.sleep(1.5)  # past the 1 s alarm, which interrupts the sleep
        return real(*args, **kwargs)

    gold = "\\frac{3}{56} + 0"  # not parsed before in this process (math-verify caches latex parses)
    worker._GOLD_CACHE.pop(gold, None)
    with monkeypatch.context() as slowed:
        slowed.setattr(parser, "latex2sympy", slow)
        assert worker.parse_gold(gold) == ([], True)
        assert worker.math_verify_score("\\boxed{\\frac{3}{56}}", gold) == (0.0, "timeout")
    assert gold not in worker._GOLD_CACHE
    # With time enough the gold parses as 3/56: the right answer scores 1, and "0" (what the cut-short
    # parse would have cached) scores 0.
    assert worker.math_verify_score("\\boxed{\\frac{3}{56}}", gold) == (1.0, "")
    assert float(worker._GOLD_CACHE[gold][0]) == 3 / 56
    assert worker.math_verify_score("\\boxed{0}", gold)[0] == 0.0

    real_eq = grader.sympy_expr_eq

    def slow_eq(*args, **kwargs):
        time.sleep(1.5)
        return real_eq(*args, **kwargs)

    monkeypatch.setattr(grader, "sympy_expr_eq", slow_eq)
    assert worker.math_verify_score("\\boxed{\\frac{6}{112}}", gold) == (0.0, "timeout")


def test_weighted_config_passes_timeout_and_strict_to_its_math_part():
    """Issue 13, item 12: `reward.weights` built the math part with its default 5 s."""
    reward = get_reward({"math": 1.0, "format": 0.1}, timeout_s=7.5, strict=False)
    (_, _, math), (_, _, fmt) = reward.parts
    assert (math.timeout_s, math.strict) == (7.5, False) and fmt == get_reward("format")
    assert math.verifier.timeout_s == 7.5 and math.verifier.strict is False
    own = get_reward({"math": {"weight": 1.0, "timeout_s": 2.0}}, timeout_s=7.5)
    assert own.parts[0][2].timeout_s == 2.0  # a part's own setting wins
    assert get_reward({"exact_match": 1.0}, timeout_s=7.5, strict=True).parts[0][2] is get_reward("exact_match")
    with pytest.raises(ValueError, match="no reward takes the option 'timeout'. Did you mean 'timeout_s'"):
        get_reward({"math": 1.0}, timeout=3)


def test_combined_reward_reports_the_math_part_timeout():
    """A timeout inside a weighted reward is counted (its reason is "math: timeout")."""
    from tether.rewards import Math

    math = Math(timeout_s=1.0)
    math._verifier = MathVerifier(timeout_s=1.0, verify_fn=slow_verify)
    reward = Combined((("math", 1.0, math), ("format", 0.1, get_reward("format"))))
    try:
        results = score_batch(reward, ["hang", "a", "raise"], [Example("x", "p", "a")] * 3)
    finally:
        math.close()
    assert [r.faults for r in results] == [("timeout",), (), ("error",)]
    assert results[0].reason.startswith("math: timeout")
    assert verifier_faults(results) == {"reward/timeouts": 1.0, "reward/errors": 1.0}


def test_strict_applies_when_the_template_asks_for_a_box(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{i}+1?", "answer": str(i + 1)}) + "\n" for i in range(20)))
    assert asks_for_boxed("boxed") and not asks_for_boxed("plain") and not asks_for_boxed("qa")
    assert asks_for_boxed("Solve {problem}. Answer in \\boxed{}.")
    assert strict_for_task(get_task("math", train=str(data))) is True
    assert strict_for_task(get_task("math", train=str(data)), strict=False) is False
    assert strict_for_task(get_task("math", train=str(data), template="qa")) is False
    assert strict_for_task(get_task("arithmetic")) is False


@needs_math_data
def test_math_on_real_rows(math_reward):
    rows = load_math_dataset(MATH_DATA / "math500.jsonl", limit=40)
    right = [f"Thus the answer is $\\boxed{{{ex.answer}}}$." for ex in rows]
    # A wrong answer: the next row's gold, skipping pairs where one gold ends with the other
    # (math-verify rightly counts "x=5" and "5" as the same answer).
    pairs = [
        (a, b) for a, b in zip(rows, rows[1:]) if not a.answer.endswith(b.answer) and not b.answer.endswith(a.answer)
    ]
    assert len(pairs) > 30
    wrong = [f"Thus the answer is $\\boxed{{{b.answer}}}$." for _, b in pairs]
    assert [r.score for r in math_reward.score_batch(right, rows)] == [1.0] * len(rows)
    assert [r.score for r in math_reward.score_batch(wrong, [a for a, _ in pairs])] == [0.0] * len(pairs)


@needs_math_data
def test_gsm8k_answers_strict_and_lenient(math_reward, lenient_math):
    with (MATH_DATA / "gsm8k_test.jsonl").open() as f:
        raw = [json.loads(next(f)) for _ in range(20)]
    gsm = load_math_dataset(MATH_DATA / "gsm8k_test.jsonl", limit=20)
    plain = [f"{row['solution']}\nThe answer is {row['answer']}." for row in raw]
    boxed = [f"{row['solution']}\nThe answer is \\boxed{{{row['answer']}}}." for row in raw]
    wrong = [f"{row['solution']}\nThe answer is \\boxed{{{int(row['answer']) + 1}}}." for row in raw]
    assert [r.score for r in lenient_math.score_batch(plain, gsm)] == [1.0] * 20
    assert [r.score for r in math_reward.score_batch(plain, gsm)] == [0.0] * 20  # strict: no box, no answer
    assert [r.score for r in math_reward.score_batch(boxed, gsm)] == [1.0] * 20
    assert [r.score for r in math_reward.score_batch(wrong, gsm)] == [0.0] * 20
    assert [r.score for r in lenient_math.score_batch(wrong, gsm)] == [0.0] * 20


def test_math_timeout_kills_and_recovers():
    """The time bound, per item: the timeout plus at most one worker start. What is checked is that
    the code enforces it (a hanging item ends as "timeout", the worker is killed and restarted once)
    and not the wall-clock time, which a loaded machine stretches (issue 32, item 7)."""
    verifier = MathVerifier(timeout_s=1.0, verify_fn=slow_verify)
    try:
        assert verifier.score_batch(["a", "raise"], ["a", "a"]) == [
            (1.0, ""),
            (0.0, "verifier error: RuntimeError: verifier bug"),
        ]
        assert verifier.starts == 1
        assert verifier.score_batch(["hang"], ["a"]) == [(0.0, "timeout")]
        assert (verifier.restarts, verifier.starts) == (1, 1)  # the worker was alive: no start
        # The rest of a batch after a hang is scored by a fresh worker.
        assert verifier.score_batch(["a", "hang", "b", "a"], ["a", "a", "a", "a"]) == [
            (1.0, ""),
            (0.0, "timeout"),
            (0.0, ""),
            (1.0, ""),
        ]
        assert (verifier.restarts, verifier.starts) == (2, 3)  # one start for the call, one after the hang
        assert verifier.score_batch(["b"], ["b"]) == [(1.0, "")]
    finally:
        verifier.close()


def test_recorded_start_time_is_what_a_start_takes():
    verifier, recorded = MathVerifier(), []
    try:
        for _ in range(2):
            verifier.close()
            start = time.perf_counter()
            verifier.start()
            took = time.perf_counter() - start
            assert 0.0 < verifier.last_start_s <= took
            recorded.append(verifier.last_start_s)
        assert verifier.starts == 2 and verifier.start_s == pytest.approx(sum(recorded))
    finally:
        verifier.close()


def test_a_worker_that_does_not_start_in_time_is_an_error_not_a_hang():
    verifier = MathVerifier(start_timeout_s=0.01)
    with pytest.raises(RuntimeError, match="failed to start"):
        verifier.score_batch(["\\boxed{1}"], ["1"])
    assert verifier._proc is None  # killed, not left running
