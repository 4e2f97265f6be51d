"""tether's math reward against Math-Verify's own parametrised test cases (issue 13).

tests/data/math_verify_cases.jsonl transcribes, as data, the (gold, pred, expected) cases of
huggingface/Math-Verify's test suite (commit 5d148cfaaf99, each row's "source" names the file
and test function) whose comparison uses math-verify's default options: LaTeX plus expression
extraction, float_rounding 6, strict variable comparison, no set-relation comparison. Cases
that call with other options (expression-only or LaTeX-only extraction, precision 4 or 5,
strict=False, allow_set_relation_comp) are left out. No code or file of theirs is copied.

Two questions, each answered with a rate that the test prints:
1. Agreement: does tether's lenient reward (math-verify's own extraction) give the verdict of
   math-verify called directly with default options (`verify(parse(gold), parse(pred))`)? It
   must on at least 99% of the cases. Where tether departs (percent, zero-led commas, the gold
   read as `\\boxed{gold}`: `_math_worker.py`'s header) the rate shows what that costs.
2. On the cases whose prediction has a `\\boxed{}` answer, how often strict extraction (only the
   final boxed answer) agrees too: reported, and held above 90%, since strict is meant to
   differ where the final box is not the whole answer.
"""

import json
from pathlib import Path


from tether.rewards import get_reward
from tether.tasks import Example

CASES = [json.loads(line) for line in (Path(__file__).resolve().parents[1] / "data" / "math_verify_cases.jsonl").open()]


def _direct(gold: str, pred: str) -> float:
    from math_verify import parse, verify

    return float(bool(verify(parse(gold), parse(pred))))


def _tether(strict: bool, cases: list[dict]) -> list[float]:
    reward = get_reward("math", strict=strict, timeout_s=10.0)
    try:
        examples = [Example(id=str(i), prompt="", answer=c["gold"]) for i, c in enumerate(cases)]
        return [r.score for r in reward.score_batch([c["pred"] for c in cases], examples)]
    finally:
        reward.close()


def test_the_transcription_is_what_it_says():
    assert len(CASES) >= 140
    assert all(set(c) == {"gold", "pred", "expected", "source"} for c in CASES)
    assert all(c["source"].startswith("huggingface/Math-Verify@5d148cfaaf99 tests/") for c in CASES)
    assert {c["expected"] for c in CASES} == {0, 1}


def test_lenient_reward_agrees_with_math_verify_called_directly():
    direct = [_direct(c["gold"], c["pred"]) for c in CASES]
    ours = _tether(False, CASES)
    disagree = [
        (c["source"].rsplit("::", 1)[1], c["gold"][:60], c["pred"][-60:], d, o)
        for c, d, o in zip(CASES, direct, ours)
        if d != o
    ]
    rate = 1 - len(disagree) / len(CASES)
    print(f"\nagreement with math-verify (default options): {len(CASES) - len(disagree)}/{len(CASES)} = {rate:.1%}")
    assert rate >= 0.99, disagree
    # And with the verdicts Math-Verify's own tests expect.
    assert sum(o == c["expected"] for o, c in zip(ours, CASES)) / len(CASES) >= 0.99


def test_strict_reward_on_cases_with_a_boxed_prediction():
    boxed = [c for c in CASES if "\\boxed" in c["pred"]]
    direct = [_direct(c["gold"], c["pred"]) for c in boxed]
    ours = _tether(True, boxed)
    agree = sum(d == o for d, o in zip(direct, ours))
    print(f"\nstrict agreement on boxed predictions: {agree}/{len(boxed)} = {agree / len(boxed):.1%}")
    assert len(boxed) >= 50 and agree / len(boxed) >= 0.9
    # Strict never rewards what math-verify rejects: it only reads less of the completion.
    assert not [c["pred"][-60:] for c, d, o in zip(boxed, direct, ours) if o > d]
