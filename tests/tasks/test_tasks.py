"""tether.tasks: determinism, disjoint splits, the safe expression parser, dataset loading."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from tether.tasks import (
    Countdown,
    DataError,
    Example,
    ExpressionError,
    check_countdown,
    evaluate,
    get_task,
    load_math_dataset,
    render_prompt,
    solve_all,
    task_names,
)

from conftest import MATH_DATA, needs_math_data


def test_registry():
    assert {"arithmetic", "countdown", "math"} <= set(task_names())
    with pytest.raises(KeyError, match="Valid: .*arithmetic"):
        get_task("arithmetc")
    with pytest.raises(ValueError, match="task 'arithmetic' has no knob 'digitz'. Did you mean 'digits'"):
        get_task("arithmetic", digitz=2)  # the config's wording (tasks.check_task_knobs), without its key


@pytest.mark.parametrize("name", ["arithmetic", "countdown"])
def test_deterministic_by_seed(name):
    a = get_task(name, seed=1).examples("train", 50)
    b = get_task(name, seed=1).examples("train", 50)
    c = get_task(name, seed=2).examples("train", 50)
    assert a == b
    assert [e.prompt for e in a] != [e.prompt for e in c]
    assert get_task(name).examples("train", 50, seed=1) == a  # seed argument == seed knob


@pytest.mark.parametrize(
    "name, knobs", [("arithmetic", {"digits": 1, "ops": "+"}), ("arithmetic", {}), ("countdown", {})]
)
def test_splits_are_disjoint_across_seeds(name, knobs):
    task = get_task(name, **knobs)
    n_test = 10 if knobs.get("digits") == 1 else 200
    test = {e.prompt for s in (0, 1) for e in task.examples("test", n_test, seed=s)}
    train = {e.prompt for s in (0, 1, 2) for e in task.examples("train", 80, seed=s, unique=False)}
    assert test and train and not test & train


def test_unique_and_exhaustion():
    task = get_task("arithmetic", digits=1, ops="+")  # 100 problems, about 10 held out
    test = task.examples("test", 10)
    assert len({e.prompt for e in test}) == 10
    with pytest.raises(ValueError, match="distinct test problems"):
        task.examples("test", 60)
    assert len(task.examples("test", 60, unique=False)) == 60
    with pytest.raises(ValueError, match="split"):
        task.examples("valid", 5)  # type: ignore[arg-type]


def test_arithmetic_answers_and_knobs():
    task = get_task("arithmetic", digits=3, ops="+-*")
    for ex in task.examples("train", 300):
        a, op, b = ex.meta["a"], ex.meta["op"], ex.meta["b"]
        assert ex.prompt == f"{a}{op}{b}="
        assert int(ex.answer) == {"+": a + b, "-": a - b, "*": a * b}[op]
        assert int(ex.answer) >= 0  # allow_negative=False
        assert task.solution(ex) == ex.answer
    negatives = get_task("arithmetic", ops="-", allow_negative=True).examples("train", 100)
    assert any(e.answer.startswith("-") for e in negatives)
    with pytest.raises(ValueError, match="ops"):
        get_task("arithmetic", ops="+/")


def test_countdown_instances_are_solvable_with_reference():
    task = get_task("countdown", count=4, max_number=12, max_target=200)
    for ex in task.examples("train", 200):
        nums, target = ex.meta["numbers"], ex.meta["target"]
        assert ex.prompt == f"{','.join(map(str, nums))}={target:03d}:"
        assert 1 <= target <= 200 and target not in nums  # min_used=2 excludes given numbers
        assert check_countdown(task.solution(ex), nums, target) == (True, "")


def test_countdown_prompt_format_matches_notes():
    ex = Countdown().examples("train", 1)[0]
    assert ex.prompt.count(",") == 2 and ex.prompt.endswith(":") and len(ex.prompt.split("=")[1]) == 4


def test_solve_all_small_case():
    # From (2, 3): 2, 3, 2+3=5, 2*3=6, 3-2=1 (3/2 is not an integer).
    assert set(solve_all((2, 3))) == {1, 2, 3, 5, 6}
    assert solve_all((2, 3))[6] == ("2*3", 2)


@pytest.mark.parametrize(
    "text, value, numbers",
    [
        ("(9-7)*8", 16, (9, 7, 8)),
        ("8/3*3", 8, (8, 3, 3)),  # exact fractions, no float rounding
        ("1+2*3", 7, (1, 2, 3)),
        ("(1+2)*3", 9, (1, 2, 3)),
        ("10-4-3", 3, (10, 4, 3)),  # left-associative
        ("8/4/2", 1, (8, 4, 2)),
        (" ( 2 + 3 ) \n", 5, (2, 3)),
        ("0", 0, (0,)),
    ],
)
def test_evaluate_valid(text, value, numbers):
    result = evaluate(text)
    assert result.value == Fraction(value) and result.numbers == numbers


@pytest.mark.parametrize(
    "text, reason",
    [
        ("__import__('os')", "unexpected character"),
        ("1e9", "unexpected character"),
        ("9**99", "expected a number"),
        ("((", "end of expression"),
        ("", "empty"),
        ("   ", "empty"),
        ("1/0", "division by zero"),
        ("5/(3-3)", "division by zero"),
        ("-5+6", "expected a number"),
        ("2 3", "after a complete expression"),
        ("(1+2", "end of expression"),
        ("1+2)", "after a complete expression"),
        ("07+1", "after a complete expression"),  # "0" then "7": leading zeros are not numbers
        ("1.5*2", "unexpected character"),
        ("１+２", "unexpected character"),  # full-width digits
        ("²+1", "unexpected character"),
        ("9" * 7, "longer than 6 digits"),
        ("1+" * 200 + "1", "longer than 256"),
        ("(" * 40 + "1" + ")" * 40, "nested deeper"),
        ("x" * 10**6, "longer than"),
    ],
)
def test_evaluate_rejects_adversarial(text, reason):
    with pytest.raises(ExpressionError, match=reason):
        evaluate(text)


def test_check_countdown():
    assert check_countdown("(9-7)*8", [9, 8, 7], 16) == (True, "")
    assert check_countdown("8*2", [9, 8, 7], 16)[1].startswith("uses numbers not available")
    ok, reason = check_countdown("8+8", [9, 8, 7], 16)  # reuses 8
    assert not ok and "[8]" in reason
    assert check_countdown("8+8", [8, 8, 1], 16) == (True, "")  # two 8s given
    assert check_countdown("9+7", [9, 8, 7], 16) == (True, "")  # not all numbers needed
    assert "value 15" in check_countdown("8+7", [9, 8, 7], 16)[1]
    assert check_countdown("__import__('os').system('x')", [9, 8, 7], 16)[1].startswith("parse")


@needs_math_data
def test_load_math_jsonl_fields_and_limit():
    rows = load_math_dataset(MATH_DATA / "math500.jsonl", limit=5)
    assert len(rows) == 5 and rows[0].id == "math500-0"
    assert rows[0].answer == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert rows[0].prompt == rows[0].meta["problem"] and "level" in rows[0].meta
    gsm = load_math_dataset(MATH_DATA / "gsm8k_test.jsonl", problem_field="solution", answer_field="answer", limit=2)
    assert gsm[0].prompt.startswith("Janet sells") and gsm[0].answer == "18"
    with pytest.raises(ValueError, match="fields are"):
        load_math_dataset(MATH_DATA / "math500.jsonl", problem_field="question", limit=1)


def test_load_math_dataset_errors_and_own_file(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"q": "1+1?", "a": 2}) + "\n\n" + json.dumps({"q": "2+2?", "a": "4"}) + "\n")
    rows = load_math_dataset(path, problem_field="q", answer_field="a")
    assert [(r.id, r.prompt, r.answer) for r in rows] == [("d-0", "1+1?", "2"), ("d-1", "2+2?", "4")]
    with pytest.raises(FileNotFoundError):
        load_math_dataset(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="split"):
        load_math_dataset(path, split="test")


def test_templates_and_chat_template():
    class Chat:
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert tokenize is False and add_generation_prompt is True
            return f"<user>{messages[0]['content']}</user><assistant>"

    assert render_prompt(None, "plain", "1+1?") == "1+1?"
    boxed = render_prompt(None, "boxed", "1+1?")
    assert boxed.startswith("1+1?\n") and boxed.endswith("within \\boxed{}.")
    assert render_prompt(Chat(), "plain", "1+1?") == "<user>1+1?</user><assistant>"
    assert render_prompt(None, "Q: {problem} A:", "hi") == "Q: hi A:"
    with pytest.raises(ValueError, match="valid names"):
        render_prompt(None, "boxd", "x")


@needs_math_data
def test_math_task_splits():
    with pytest.raises(DataError, match="train split is empty"):  # every train problem is also a test problem
        get_task("math", train=str(MATH_DATA / "gsm8k_test.jsonl"), test=str(MATH_DATA / "gsm8k_test.jsonl"), limit=50)
    held = get_task("math", train=str(MATH_DATA / "math500.jsonl"), template="boxed")
    train, test = held.examples("train"), held.examples("test")
    assert len(train) + len(test) == 500 and 20 < len(test) < 80
    assert not {e.meta["problem"] for e in train} & {e.meta["problem"] for e in test}
    assert test[0].prompt.endswith("\\boxed{}.")
    assert held.examples("test", 5, seed=1) == held.examples("test", 5, seed=1)
    assert held.solution(Example("x", "p", "7")) == "The answer is \\boxed{7}."


def test_a_task_that_needs_a_tokenizer_says_so_when_built_without_one(tmp_path, monkeypatch):
    # A user task whose factory has no default for `tokenizer` (the trainer passes the model's): built by
    # get_task (as `tether eval task:` does) without one, the error names the missing tokenizer and the fix,
    # instead of the factory's own TypeError.
    (tmp_path / "tok_task_mod.py").write_text(
        "from tether.tasks import get_task\n"
        "def make(tokenizer, digits: int = 2):\n"
        "    return get_task('arithmetic', digits=digits)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from tether.schema import ConfigError
    from tether.tasks import get_task

    with pytest.raises(ConfigError, match=r"task 'tok_task_mod:make' needs a tokenizer .*tokenizer=\.\.\."):
        get_task("tok_task_mod:make")
    assert get_task("tok_task_mod:make", tokenizer=None, digits=2) is not None


def test_problem_files_shipped_with_tether_are_found_from_anywhere(tmp_path, monkeypatch):
    """`tether:NAME` is tether/tasks/data/NAME whatever the working directory (configs/real_model.yaml's data);
    an unknown name lists the shipped files. word1's held-out file is disjoint from its train and test files."""
    from tether.tasks.base import DataError
    from tether.tasks.math import load_math_dataset

    monkeypatch.chdir(tmp_path)
    rows = {name: load_math_dataset(f"tether:word1_{name}.jsonl") for name in ("train", "test", "heldout")}
    assert [len(r) for r in rows.values()] == [400, 100, 400]
    problems = {name: {e.prompt for e in r} for name, r in rows.items()}
    assert not problems["heldout"] & (problems["train"] | problems["test"])
    with pytest.raises(
        DataError, match="tether ships no such problem file; the shipped ones: .*tether:word1_test.jsonl"
    ):
        load_math_dataset("tether:word9.jsonl")
