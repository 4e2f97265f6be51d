"""tether.evaluation and `tether eval`: pass@k and maj@k exact, data specs, metrics of a scripted engine, resume, end to end."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import re
from fractions import Fraction
from pathlib import Path

import pytest
import torch

import tether.evaluation as ev
from tether.cli import build_parser
from tether.evaluation.command import cmd_eval
from tether.evaluation import (
    EvalError,
    EvalOptions,
    EvalSettings,
    evaluate,
    extract_answer,
    load_eval_data,
    maj_at_k,
    majority_vote,
    pass_at_k,
    read_problems,
)
from tether.model.loading import char_tokenizer, init_model, load_model
from tether.rewards import RewardResult
from tether.rollout import RolloutBatch, get_engine
from tether.tasks import Example, get_task

DATA = Path(__file__).resolve().parents[3] / "shared/data/math"


# ---------------------------------------------------------------- pass@k


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (4, 1, 1, 0.25),  # pass@1 = c/n = 1/4
        (10, 3, 5, 11 / 12),  # 1 - C(7,5)/C(10,5) = 1 - 21/252 = 1 - 1/12
        (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (16, 4, 4, 1 - 495 / 1820),  # 1 - C(12,4)/C(16,4) = 1 - 495/1820
        (3, 2, 2, 1.0),  # n - c = 1 < k: every pair holds a correct sample
        (4, 0, 4, 0.0),  # nothing correct
        (1000, 1, 1, 0.001),  # c/n
    ],
)
def test_pass_at_k_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 8])
def test_pass_at_k_equals_enumeration_of_k_subsets(n):
    """Samples 0..c-1 are the correct ones; pass@k = share of k-subsets holding one of them."""
    for c in range(n + 1):
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            hit = Fraction(sum(min(s) < c for s in subsets), len(subsets))
            assert pass_at_k(n, c, k) == pytest.approx(float(hit), rel=1e-12, abs=1e-15), (n, c, k)


def test_pass_at_k_large_n_is_stable():
    # binomials of this size overflow a float; the product form must still match the exact value
    n, c, k = 2000, 50, 1000
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)


def test_pass_at_k_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"1 <= k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match=r"1 <= k <= n"):
        pass_at_k(4, 1, 0)
    with pytest.raises(ValueError, match=r"0 <= c <= n"):
        pass_at_k(4, 5, 1)


# ---------------------------------------------------------------- maj@k and answer extraction


def test_maj_at_k_hand():
    answers, correct = ["1", "2", "2", "1"], [0, 1, 1, 0]
    assert maj_at_k(answers, correct, 1) == 0.0  # {"1": 1} -> "1", wrong
    assert maj_at_k(answers, correct, 2) == 0.0  # {"1": 1, "2": 1}: tie, "1" came first -> wrong
    assert maj_at_k(answers, correct, 3) == 1.0  # {"1": 1, "2": 2} -> "2", right
    assert maj_at_k(answers, correct, 4) == 0.0  # {"1": 2, "2": 2}: tie, "1" came first -> wrong
    # samples without an answer do not vote; no vote at all scores 0
    assert maj_at_k([None, None, "3"], [0, 0, 1], 2) == 0.0
    assert maj_at_k([None, None, "3"], [0, 0, 1], 3) == 1.0
    assert majority_vote([None, "7", None, "7", "8"], 5) == 1  # "7" x2; its first sample is index 1
    # the verdict is the one on the voted answer's first sample
    assert maj_at_k(["5", "5"], [0, 1], 2) == 0.0
    with pytest.raises(ValueError, match="1 <= k <= 2"):
        maj_at_k(["1", "2"], [0, 1], 3)
    with pytest.raises(ValueError, match="2 answers but 1"):
        maj_at_k(["1", "2"], [0], 1)


def test_extract_answer():
    text = "first \\boxed{ \\dfrac{1}{2} } then \\boxed{\\left( 1, 2 \\right)}."
    assert extract_answer(text, "math") == "(1,2)"  # the last box, spaces and \left/\right gone
    assert extract_answer("$\\boxed{\\tfrac{3}{4}.}$", "math") == "\\frac{3}{4}"
    assert extract_answer("the answer is 4", "math") is None
    assert extract_answer("\\boxed{ }", "math") is None
    assert extract_answer("  81 \n", "text") == "81"
    assert extract_answer("  \n", "text") is None


def test_maj_at_k_votes_on_the_lenient_verifiers_plain_text_answer(tmp_path):
    """With a template that asks for the number alone (lenient extraction), votes counted only boxed
    answers: maj@k read 0.000 while avg@1 read 0.395 and 0.910 on the same runs. A completion
    without a box now votes with its last number, the answer the lenient verifier reads."""
    assert extract_answer("The answer is 1,234.", "math", lenient=True) == "1234"
    assert extract_answer("3 + 4 = 7 apples", "math", lenient=True) == "7"
    assert extract_answer("so \\boxed{8}, not 9", "math", lenient=True) == "8"  # a box still wins
    assert extract_answer("The answer is 7.", "math") is None  # strict: only a box votes
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "a", "problem": "What is 3 + 4?", "answer": "7"}) + "\n")
    [problem] = load_eval_data(str(path), None, "{problem}\nAnswer with the number only.")
    engine = ScriptedEngine({problem.prompt: [("7", "stop"), ("It is 7.", "stop"), ("8", "stop")]})
    results = evaluate(
        "scripted",
        [str(path)],
        n=3,
        ks=(1, 3),
        out_dir=tmp_path / "out",
        progress=False,
        engine=engine,
        template="{problem}\nAnswer with the number only.",
    )
    assert results["settings"]["extraction"] == "lenient"
    summary = results["summary"]["p"]
    assert summary["avg@3"] == pytest.approx(2 / 3) and summary["maj@3"] == 1.0  # "7" twice against "8" once


# ---------------------------------------------------------------- data specs


def test_task_spec_is_the_trainers_held_out_split():
    examples = load_eval_data("task:arithmetic")
    assert [e.id for e in examples] == [e.id for e in get_task("arithmetic").examples("test", 200)]
    assert {e.meta["source"] for e in examples} == {"arithmetic"}
    assert {e.meta["task"] for e in examples} == {"arithmetic"}


def test_task_spec_knobs_and_errors():
    examples = load_eval_data("task:arithmetic:digits=1,ops=+", limit=5)
    assert len(examples) == 5 and all(re.fullmatch(r"\d\+\d=", e.prompt) for e in examples)
    assert examples[0].meta["source"] == "arithmetic:digits=1,ops=+"
    cd = load_eval_data("task:countdown:count=4:max_target=99", limit=3)
    assert all(len(e.meta["numbers"]) == 4 and e.meta["target"] <= 99 for e in cd)
    with pytest.raises(EvalError, match="digits"):
        load_eval_data("task:arithmetic:digts=2")
    with pytest.raises(EvalError, match="arithmetic"):
        load_eval_data("task:arithmatic")
    with pytest.raises(EvalError, match="KEY=VALUE"):
        load_eval_data("task:arithmetic:digits")
    with pytest.raises(EvalError, match="JSONL"):
        load_eval_data("task:math")


@pytest.mark.skipif(not DATA.is_dir(), reason="shared math data not present")
def test_real_jsonl_keeps_sources():
    tok = char_tokenizer()
    tok.chat_template = "{% for m in messages %}<user>{{ m['content'] }}{% endfor %}<assistant>"
    aime = load_eval_data(str(DATA / "aime24.jsonl"), tok, "boxed", limit=3)
    assert [e.id for e in aime] == ["aime24-0", "aime24-1", "aime24-2"]
    assert {e.meta["source"] for e in aime} == {"aime24"}
    assert all(e.meta["task"] == "math" for e in aime)
    first = aime[0]
    assert first.prompt.startswith("<user>" + first.meta["problem"]) and first.prompt.endswith("<assistant>")
    assert "\\boxed{}" in first.prompt and first.answer == "540"
    gsm = load_eval_data(str(DATA / "gsm8k_test.jsonl"), None, "boxed", limit=2)
    assert {e.meta["source"] for e in gsm} == {"gsm8k"}  # the rows' field, not the stem gsm8k_test


def test_jsonl_without_source_field_uses_the_stem(tmp_path):
    path = tmp_path / "mini_bench.jsonl"
    path.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    (ex,) = load_eval_data(str(path), None, "qa")
    assert ex.meta["source"] == "mini_bench" and ex.id == "mini_bench-0"
    assert ex.prompt == "Question: 1+1?\nAnswer:"
    with pytest.raises(FileNotFoundError):
        load_eval_data(str(tmp_path / "missing.jsonl"))


def test_parquet_path(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    path = tmp_path / "bench.parquet"
    pq.write_table(pa.table({"problem": ["a?", "b?"], "answer": ["1", "2"]}), path)
    examples = load_eval_data(str(path), limit=1)
    assert len(examples) == 1 and examples[0].meta["source"] == "bench"


def test_hub_name_and_split(monkeypatch):
    calls = []

    def fake_load(name, problem_field, answer_field, split=None, limit=None):
        calls.append((name, split, limit))
        return [Example("r0", "p?", "1", {"problem": "p?"})]

    monkeypatch.setattr(ev.data, "load_math_dataset", fake_load)
    (ex,) = load_eval_data("owner/bench@validation", limit=7)
    assert calls[-1] == ("owner/bench", "validation", 7) and ex.meta["source"] == "owner/bench"
    load_eval_data("owner/bench")
    assert calls[-1] == ("owner/bench", "test", None)


# ---------------------------------------------------------------- a scripted engine


class ScriptedEngine:
    """Returns, for each prompt, the n (text, finish reason) samples scripted for it.

    A stopped sample is len(text) tokens plus the stop token; a truncated one max_new_tokens.
    """

    tokenizer = None

    def __init__(self, script):
        self.script = script
        self.calls: list[list[str]] = []

    def generate(self, prompts, n, params, seed=None):
        self.calls.append(list(prompts))
        samples = [s for p in prompts for s in self.script[p][:n]]
        lengths = [len(t) + 1 if f == "stop" else params.max_new_tokens for t, f in samples]
        width = max(lengths)
        mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
        return RolloutBatch(
            prompt_ids=[[0]] * len(samples),
            completion_ids=torch.zeros(len(samples), width, dtype=torch.long),
            sampler_logprobs=torch.zeros(len(samples), width),
            mask=mask,
            finish_reasons=[f for _, f in samples],
            completions=[t for t, _ in samples],
            prompt_index=[i for i in range(len(prompts)) for _ in range(n)],
        )


def arithmetic_script(examples):
    """Problems 0, 1: always right. 2: wrong, right, right, other wrong. 3: wrong and truncated."""
    script = {}
    for i, ex in enumerate(examples):
        a, w, w2 = ex.answer, ex.answer + "1", ex.answer + "2"
        script[ex.prompt] = [
            [(a, "stop")] * 4,
            [(a, "stop")] * 4,
            [(w, "stop"), (a, "stop"), (a, "stop"), (w2, "stop")],
            [(w, "length")] * 4,
        ][i % 4]
    return script


def test_metrics_of_a_scripted_model(tmp_path):
    arith = load_eval_data("task:arithmetic", limit=4)
    countdown = load_eval_data("task:countdown", limit=4)
    script = arithmetic_script(arith)
    script.update({ex.prompt: [(ex.meta["solution"], "stop")] * 4 for ex in countdown})
    engine = ScriptedEngine(script)
    out = tmp_path / "eval"
    results = evaluate(
        "scripted",
        ["task:arithmetic", "task:countdown"],
        n=4,
        ks=(1, 2, 4, 16),
        max_new_tokens=8,
        out_dir=out,
        progress=False,
        engine=engine,
        batch_prompts=3,
        limit=4,
    )
    assert results["ks"] == [1, 2, 4]  # 16 > n is dropped
    a = results["summary"]["arithmetic"]
    assert a["problems"] == 4
    assert a["avg@4"] == pytest.approx(10 / 16)  # (4 + 4 + 2 + 0) / 16
    assert a["pass@1"] == pytest.approx(10 / 16)  # mean of c/n
    assert a["pass@2"] == pytest.approx(17 / 24)  # (1 + 1 + (1 - C(2,2)/C(4,2)) + 0) / 4 = (2 + 5/6) / 4
    assert a["pass@4"] == pytest.approx(3 / 4)  # (1 + 1 + 1 + 0) / 4
    assert a["maj@1"] == pytest.approx(2 / 4)  # problem 2's first sample is wrong
    assert a["maj@2"] == pytest.approx(2 / 4)  # problem 2: [w, a] tie -> w, wrong
    assert a["maj@4"] == pytest.approx(3 / 4)  # problem 2: a x2 beats w, w2
    assert a["truncated"] == pytest.approx(4 / 16)  # problem 3's four samples
    stopped = [len(ex.answer) + 1 for ex in arith[:2] for _ in range(4)]  # answer + stop token
    stopped += [len(arith[2].answer) + extra for extra in (2, 1, 1, 2)]  # w and w2 are one digit longer
    assert a["len_mean"] == pytest.approx((sum(stopped) + 4 * 8) / 16)
    c = results["summary"]["countdown"]
    assert (c["problems"], c["avg@4"], c["pass@1"], c["maj@4"], c["truncated"]) == (4, 1.0, 1.0, 1.0, 0.0)
    assert results["summary"]["all"]["problems"] == 8
    assert results["summary"]["all"]["avg@4"] == pytest.approx((10 + 16) / 32)

    rows = {p["id"]: p for p in results["problems"]}
    p2 = rows[arith[2].id]
    assert (p2["c"], p2["n"], p2["maj_answer"], p2["maj_correct"]) == (2, 4, arith[2].answer, True)
    assert p2["pass@2"] == pytest.approx(5 / 6)
    p3 = rows[arith[3].id]
    assert (p3["c"], p3["maj_answer"], p3["maj_correct"]) == (0, arith[3].answer + "1", False)

    assert results["out_dir"] == str(out)
    assert json.loads((out / "results.json").read_text()) == json.loads(
        json.dumps({k: v for k, v in results.items() if k != "out_dir"})
    )
    md = (out / "results.md").read_text()
    assert "## Summary" in md and "## Problems" in md
    assert "| arithmetic | 4 | 0.625 | 0.625 | 0.708 | 0.750 | 0.500 | 0.500 | 0.750 |" in md
    a2 = arith[2]
    assert f"| arithmetic | {a2.id} | {a2.answer} | 2/4 | 0.500 | 0.833 | 1.000 | {a2.answer} | yes |" in md
    assert [len(c) for c in engine.calls] == [3, 3, 2]  # 8 problems in batches of 3


def test_math_data_uses_math_verify(tmp_path):
    path = tmp_path / "tiny.jsonl"
    rows = [{"id": "q1", "problem": "1+1?", "answer": "2"}, {"id": "q2", "problem": "half?", "answer": "\\frac{1}{2}"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    examples = load_eval_data(str(path), None, "boxed")
    engine = ScriptedEngine(
        {
            examples[0].prompt: [("so \\boxed{2}", "stop"), ("\\boxed{ 2 }", "stop"), ("\\boxed{3}", "stop")],
            examples[1].prompt: [
                ("\\boxed{3}", "stop"),
                ("$\\boxed{\\dfrac{1}{2}}$", "stop"),
                ("\\boxed{\\frac{1}{2}}", "stop"),
            ],
        }
    )
    results = evaluate("scripted", [str(path)], n=3, ks=(1, 3), out_dir=tmp_path / "out", progress=False, engine=engine)
    s = results["summary"]["tiny"]
    assert s["avg@3"] == pytest.approx(4 / 6)  # q1: 2 of 3, q2: 2 of 3
    assert s["maj@1"] == pytest.approx(1 / 2)  # q1 right, q2's first sample (3) wrong
    assert s["maj@3"] == pytest.approx(1.0)  # q1: "2" x2; q2: "\frac{1}{2}" x2
    assert [p["maj_answer"] for p in results["problems"]] == ["2", "\\frac{1}{2}"]
    assert results["settings"]["max_new_tokens"] == 2048  # math data's default budget


def test_math_extraction_is_strict_by_default_and_stated(tmp_path):
    """Issue 13: `tether eval` uses the trainer's strict extraction and says which it used."""
    path = tmp_path / "two.jsonl"
    path.write_text(json.dumps({"id": "q", "problem": "1+1?", "answer": "2"}) + "\n")
    samples = [("The answer is 2.", "stop"), ("blah 2 blah", "stop"), ("so \\boxed{2}", "stop")]
    runs = {}
    for name, kwargs in (("strict", {}), ("lenient", {"strict": False}), ("plain", {"template": "plain"})):
        examples = load_eval_data(str(path), None, kwargs.get("template", "boxed"))
        engine = ScriptedEngine({examples[0].prompt: samples})
        runs[name] = evaluate(
            "scripted", [str(path)], n=3, ks=(1,), out_dir=tmp_path / name, progress=False, engine=engine, **kwargs
        )
    assert runs["strict"]["settings"]["extraction"] == "strict"
    assert runs["strict"]["problems"][0]["c"] == 1  # only the boxed sample counts
    assert runs["lenient"]["settings"]["extraction"] == "lenient"
    assert runs["lenient"]["problems"][0]["c"] == 3
    assert runs["plain"]["settings"]["extraction"] == "lenient"  # no box was asked for
    assert "extraction=strict" in (tmp_path / "strict" / "results.md").read_text()


def test_cli_states_the_extraction_first(tmp_path, capsys, monkeypatch):
    calls = []

    def fake_evaluate(*args, **kwargs):
        print("eval: 40 problems")  # what evaluate's progress prints first
        calls.append(kwargs["strict"])
        return {
            "settings": {"extraction": "strict" if kwargs["strict"] else "lenient"},
            "ks": [1],
            "summary": {},
            "problems": [],
            "out_dir": kwargs["out_dir"],
        }

    import tether.evaluation.command as command

    monkeypatch.setattr(command, "evaluate", fake_evaluate)
    monkeypatch.setattr(command, "summary_markdown", lambda results: "")
    for flags, word in (([], "strict"), (["--lenient"], "lenient")):
        args = eval_parser().parse_args(["eval", "m", "d.jsonl", "--out", str(tmp_path), *flags])
        assert args.func(args) == 0
        # First, before the progress lines (docs/eval.md); was after them (issue 32, item 9).
        assert capsys.readouterr().out.startswith(f"math answer extraction: {word}")
    assert calls == [True, False]


def test_settings_json_is_exactly_the_settings_object_the_run_passes(tmp_path):
    """Issue 25: what settings.json records is the frozen EvalSettings, field for field, in order."""
    arith = load_eval_data("task:arithmetic", limit=1)
    engine = ScriptedEngine({arith[0].prompt: [(arith[0].answer, "stop")]})
    results = evaluate(
        "m",
        ["task:arithmetic"],
        n=1,
        ks=(1,),
        limit=1,
        out_dir=tmp_path,
        progress=False,
        engine=engine,
        stop_strings=("\n",),
    )
    recorded = json.loads((tmp_path / "settings.json").read_text())
    fields = [f.name for f in dataclasses.fields(EvalSettings)]
    assert list(recorded) == [f for f in fields if f not in ("engine", "env")]  # engine and env only when set
    assert recorded == results["settings"] and recorded["stop_strings"] == ["\n"]
    settings = EvalSettings(**{**recorded, "engine": None, "stop_strings": tuple(recorded["stop_strings"])})
    assert settings.to_json() == recorded
    vllm = EvalSettings.of("m", ["task:arithmetic"], EvalOptions(engine="vllm")).to_json()
    assert list(vllm) == [f for f in fields if f != "env"] and vllm["engine"] == "vllm"
    episodes = EvalSettings.of("m", ["task:arithmetic"], EvalOptions(env={"name": "retry"})).to_json()
    assert list(episodes) == [f for f in fields if f != "engine"] and episodes["env"] == {"name": "retry"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.n = 2


def test_threads_follow_the_trainers_rule_and_are_not_a_setting(tmp_path, monkeypatch, capsys):
    """`tether eval` had no threads setting: torch took every core (18x slower than 1 thread on a loaded
    2-core CPU, docs/performance.md). --threads N sets them; 0 (the default) is trainer.threads' auto."""
    import torch

    arith = load_eval_data("task:arithmetic", limit=1)
    engine = ScriptedEngine({arith[0].prompt: [(arith[0].answer, "stop")]})
    kwargs = dict(n=1, ks=(1,), limit=1, out_dir=tmp_path, progress=False, engine=engine)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(n))
    calls = []
    evaluate("m", ["task:arithmetic"], threads=1, **kwargs)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(6)))
    evaluate("m", ["task:arithmetic"], **kwargs)  # auto: 6 cores -> 3; the same settings (resumed)
    assert calls == [1, 3] and "torch threads: 3 of 6 cores" in capsys.readouterr().err
    evaluate("m", ["task:arithmetic"], threads=-1, **kwargs)  # torch's default: left alone
    assert calls == [1, 3]
    with pytest.raises(EvalError, match="threads: got -2"):
        evaluate("m", ["task:arithmetic"], threads=-2, **kwargs)
    assert eval_parser().parse_args(["eval", "m", "d", "--threads", "2"]).threads == 2


def test_non_binary_reward_is_refused(tmp_path):
    arith = load_eval_data("task:arithmetic", limit=1)
    engine = ScriptedEngine({arith[0].prompt: [(arith[0].answer, "stop")]})
    with pytest.raises(ValueError, match="0/1 verifier"):
        evaluate(
            "scripted",
            ["task:arithmetic"],
            n=1,
            ks=(1,),
            limit=1,
            out_dir=tmp_path,
            progress=False,
            engine=engine,
            reward=half_credit,
        )


def half_credit(completion, example):
    return RewardResult(0.5)


# ---------------------------------------------------------------- resume


def test_resume_generates_only_new_problems(tmp_path):
    arith = load_eval_data("task:arithmetic", limit=4)
    engine = ScriptedEngine(arithmetic_script(arith))
    kwargs = dict(n=4, ks=(1, 4), max_new_tokens=8, out_dir=tmp_path, progress=False, engine=engine)
    evaluate("scripted", ["task:arithmetic"], limit=2, **kwargs)
    assert engine.calls == [[ex.prompt for ex in arith[:2]]]
    results = evaluate("scripted", ["task:arithmetic"], limit=4, **kwargs)
    assert engine.calls[1:] == [[ex.prompt for ex in arith[2:]]]  # only the two new problems
    assert results["summary"]["arithmetic"]["problems"] == 4
    assert len((tmp_path / "problems.jsonl").read_text().splitlines()) == 4
    again = evaluate("scripted", ["task:arithmetic"], limit=4, **kwargs)
    assert len(engine.calls) == 2 and again == results  # nothing left to generate
    fewer = evaluate("scripted", ["task:arithmetic"], limit=1, **kwargs)
    assert fewer["summary"]["arithmetic"]["problems"] == 1 and len(engine.calls) == 2
    with pytest.raises(EvalError, match=r"temperature: 0.6 there, 1.0 now"):
        evaluate("scripted", ["task:arithmetic"], limit=4, **{**kwargs, "engine": engine}, temperature=1.0)
    with pytest.raises(EvalError, match=r"n: 4 there, 2 now.*max_new_tokens: 8 there, 16 now"):
        evaluate("scripted", ["task:arithmetic"], limit=4, **{**kwargs, "n": 2, "max_new_tokens": 16})


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("model"), hidden_size=64, num_layers=2, num_heads=2)


class DiesAfter:
    """Wraps an engine; the call after the first `calls` raises, as a killed process would stop."""

    def __init__(self, engine, calls):
        self.engine, self.tokenizer, self.left = engine, engine.tokenizer, calls

    def generate(self, *args, **kwargs):
        if self.left == 0:
            raise RuntimeError("killed")
        self.left -= 1
        return self.engine.generate(*args, **kwargs)


def test_killed_and_resumed_matches_uninterrupted(tiny_model, tmp_path):
    model, tok = load_model(tiny_model)
    engine = get_engine("hf", model=model, tokenizer=tok)
    kwargs = dict(n=2, ks=(1, 2), temperature=1.0, max_new_tokens=6, limit=5, batch_prompts=2, progress=False)
    whole = evaluate(tiny_model, ["task:arithmetic"], out_dir=tmp_path / "a", engine=engine, **kwargs)
    with pytest.raises(RuntimeError, match="killed"):
        evaluate(tiny_model, ["task:arithmetic"], out_dir=tmp_path / "b", engine=DiesAfter(engine, 1), **kwargs)
    with (tmp_path / "b/problems.jsonl").open("a") as f:
        f.write('{"source": "arithm')  # a line cut short by the kill
    resumed = evaluate(tiny_model, ["task:arithmetic"], out_dir=tmp_path / "b", engine=engine, **kwargs)
    assert read_problems(tmp_path / "a/problems.jsonl") == read_problems(tmp_path / "b/problems.jsonl")
    assert {**resumed, "out_dir": None} == {**whole, "out_dir": None}


# ---------------------------------------------------------------- command line, end to end


def eval_parser() -> argparse.ArgumentParser:
    return build_parser()  # the `tether` parser: `eval` is one of its subcommands


def test_cli_defaults_and_bad_k():
    args = eval_parser().parse_args(["eval", "some/model", "task:arithmetic", "bench.jsonl"])
    assert (args.model, args.data) == ("some/model", ["task:arithmetic", "bench.jsonl"])
    assert (args.n, args.k) == (16, [1, 4, 16])
    assert (args.temperature, args.top_p, args.max_new_tokens, args.out) == (0.6, 0.95, None, None)
    assert (args.template, args.limit, args.seed, args.func) == ("boxed", None, 0, cmd_eval)
    assert args.lenient is False  # strict math extraction unless asked
    with pytest.raises(SystemExit):
        eval_parser().parse_args(["eval", "m", "d", "--k", "1,x"])


def test_cli_end_to_end_on_a_tiny_model(tiny_model, tmp_path, capsys):
    out = tmp_path / "out"
    argv = [
        "eval",
        str(tiny_model),
        "task:arithmetic",
        "--n",
        "2",
        "--k",
        "1,2",
        "--limit",
        "3",
        "--max-new-tokens",
        "6",
        "--out",
        str(out),
        "--no-progress",
    ]
    args = eval_parser().parse_args(argv)
    assert args.func(args) == 0
    assert "| arithmetic | 3 |" in capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    s = results["summary"]["arithmetic"]
    assert list(s) == ["problems", "avg@2", "pass@1", "pass@2", "maj@1", "maj@2", "len_mean", "truncated"]
    assert s["problems"] == 3 and 1 <= s["len_mean"] <= 6
    assert all(0.0 <= s[k] <= 1.0 for k in s if k not in ("problems", "len_mean"))
    assert len(results["problems"]) == 3 and all(0 <= p["c"] <= 2 for p in results["problems"])
    records = read_problems(out / "problems.jsonl")
    assert len(records) == 3 and all(len(r["completions"]) == 2 for r in records.values())
    assert (out / "results.md").read_text().startswith("# Evaluation of ")
    args = eval_parser().parse_args([*argv, "--n", "3"])  # same dir, other settings
    assert args.func(args) == 2
    assert "n: 2 there, 3 now" in capsys.readouterr().err


def test_default_output_folders_are_named_after_model_data_and_settings(tmp_path, monkeypatch):
    # Issue 17, item 5: the same checkpoint on another dataset, or with another --n, gets its own
    # folder instead of a refusal; the same evaluation resumes its folder.
    monkeypatch.chdir(tmp_path)
    arith = load_eval_data("task:arithmetic", limit=2)
    engine = ScriptedEngine({ex.prompt: [(ex.answer, "stop")] * 4 for ex in arith})
    common = dict(ks=(1,), limit=2, progress=False, engine=engine)
    a = evaluate("ckpt/model", ["task:arithmetic"], n=2, **common)
    b = evaluate("ckpt/model", ["task:arithmetic"], n=4, **common)
    c = evaluate("ckpt/model", ["task:arithmetic"], n=2, **common)
    assert a["out_dir"] != b["out_dir"] and a["out_dir"] == c["out_dir"]
    assert Path(a["out_dir"]).name.startswith("ckpt_model__task_arithmetic__n2-")


def test_a_settings_clash_names_out_and_a_failed_start_leaves_no_folder(tmp_path):
    arith = load_eval_data("task:arithmetic", limit=1)
    engine = ScriptedEngine({arith[0].prompt: [(arith[0].answer, "stop")] * 2})
    out = tmp_path / "eval"
    evaluate("m", ["task:arithmetic"], n=1, ks=(1,), limit=1, out_dir=out, progress=False, engine=engine)
    with pytest.raises(EvalError, match="--out DIR"):
        evaluate("m", ["task:arithmetic"], n=2, ks=(1,), limit=1, out_dir=out, progress=False, engine=engine)
    fresh = tmp_path / "fresh"
    with pytest.raises(Exception):
        evaluate("m", [str(tmp_path / "missing.jsonl")], n=1, ks=(1,), out_dir=fresh, progress=False, engine=engine)
    assert not fresh.exists()  # no folder holding only settings.json


@pytest.mark.slow  # a one-step LoRA run on the warm-started tiny model, then an evaluation through the CLI
def test_a_lora_checkpoint_evaluated_on_its_runs_held_out_set_reproduces_the_runs_number(
    default_warm_start_cache, tmp_path
):
    """`tether eval RUN/checkpoints/step_N/model run:RUN` takes a LoRA run's checkpoint (an adapter directory: its
    base with the adapter merged) and scores exactly the problems the trainer scored, so greedy decoding with
    the trainer's batch size gives the run's own held-out accuracy. (Before: the adapter directory was refused,
    "Unrecognized model ... model_type", and `--limit 40` took the first rows, not the trainer's draw.) The
    answer budget is the run's own rollout.max_new_tokens without --max-new-tokens (issue 49: it was 2048)."""
    from conftest import metrics_rows
    from tether.config.loading import load_config
    from tether.trainer.loop import train

    cfg = load_config(
        None,
        [
            f"output_dir={tmp_path / 'run'}",
            f"warm_start.cache_dir={default_warm_start_cache}",
            "model.lora.r=4",
            "model.lora.alpha=8",
            "rollout.max_new_tokens=7",
            "trainer.total_steps=1",
            "trainer.eval_every=1",
            "trainer.eval_batch_size=16",
            "data.eval_size=40",
            "trainer.progress=false",
            "trainer.plots=false",
            "trainer.tensorboard=false",
            "trainer.threads=1",
        ],
    )
    run = train(cfg, log=lambda *_: None)
    want = [r["eval/accuracy"] for r in metrics_rows(run) if r["step"] == 1 and "eval/accuracy" in r][0]
    assert want > 0.05  # a model that solves some problems: the comparison can fail
    model = run / "checkpoints" / "step_000001" / "model"
    assert (model / "adapter_config.json").is_file()
    argv = ["eval", str(model), f"run:{run}", "--n", "1", "--k", "1", "--temperature", "0", "--threads", "1"]
    argv += ["--batch-prompts", "16"]
    argv += ["--out", str(tmp_path / "eval"), "--no-progress"]
    assert cmd_eval(build_parser().parse_args(argv)) == 0
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    (source,) = results["summary"]
    assert source == "run:run" and results["summary"][source]["problems"] == 40
    assert results["summary"][source]["avg@1"] == want
    assert json.loads((tmp_path / "eval" / "settings.json").read_text())["max_new_tokens"] == 7
