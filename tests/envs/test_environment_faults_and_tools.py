"""User environment code under the same bounds as user rewards, and tools as plain functions.

A `step` that raises, hangs or returns the wrong thing ends its episode and is counted (never a traceback out
of the trainer); every episode of a run's first batch failing is an error naming the environment; a malformed
tool call is an error result the model reads, and the episode goes on.
"""

import json
import re
import time
from typing import Optional

import pytest
import torch

from tether.envs import EnvironmentBroken, EnvWarnings, EpisodeRunner, Limits, Step, Tools, calculator, tool_schema
from tether.envs.tools import ToolReturnError, tool_result
from tether.model.loading import load_model
from tether.rollout import SamplingParams

from conftest import Scripted
from tether.tasks import Example

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=4)


def multiply(a: int, b: int, note: Optional[str] = None) -> str:
    """Multiply two integers.

    Args:
        a: the first factor.
        b: the second factor,
            on two lines.
        note: ignored.
    """
    return str(a * b)


def test_a_functions_hints_and_docstring_are_its_schema():
    f = tool_schema(multiply)["function"]
    assert f["name"] == "multiply" and f["description"] == "Multiply two integers."
    assert f["parameters"]["required"] == ["a", "b"]
    assert f["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first factor."}
    assert f["parameters"]["properties"]["b"]["description"] == "the second factor, on two lines."
    assert f["parameters"]["properties"]["note"]["type"] == "string"

    def undocumented(x: int) -> int:
        return x

    def untyped(x):
        """Has no hint."""

    with pytest.raises(ValueError, match="no docstring"):
        tool_schema(undocumented)
    with pytest.raises(ValueError, match="no type hint"):
        tool_schema(untyped)


@pytest.mark.parametrize(
    "call, expected, error",
    [
        ('{"name": "multiply", "arguments": {"a": 6, "b": 7}}', "42", False),
        ('{"name": "multiply", "arguments": "{\\"a\\": 2, \\"b\\": 3}"}', "6", False),  # arguments as a string
        ('{"name": "multiply", "arguments": {"a": 6}}', "error: multiply: missing a required argument: 'b'", True),
        ('{"name": "divide", "arguments": {}}', "error: no tool 'divide'; the tools: multiply", True),
        ("{name: multiply}", "error: the tool call is not JSON", True),
        ('["multiply"]', 'error: a tool call is {"name": TOOL', True),
        ('{"name": "multiply", "arguments": {"a": "x", "b": null}}', "error: multiply raised TypeError", True),
    ],
)
def test_a_malformed_call_is_an_error_result_never_an_exception(call, expected, error):
    text, is_error = tool_result({"multiply": multiply}, call)
    assert text.startswith(expected) and is_error == error


@pytest.mark.parametrize("returned, shown", [(None, "None (NoneType)"), (42, "42 (int)")])
def test_a_tool_that_returns_no_string_is_an_error_naming_the_tool_and_what_it_returned(tiny, returned, shown):
    """Issue 49, defect 7: str() made `<tool_response>None</tool_response>` of a tool without `return`, a
    successful call. It is an error of the tool: the episode's fault names the tool and the value."""

    def lookup(city: str) -> str:
        """The population of a town.

        Args:
            city: the town.
        """
        return returned

    with pytest.raises(ToolReturnError, match=f"the tool lookup returned {re.escape(shown)}, not a str"):
        tool_result({"lookup": lookup}, '{"name": "lookup", "arguments": {"city": "Bralwick"}}')
    model, tok = tiny
    call = '<tool_call>{"name": "lookup", "arguments": {"city": "B"}}</tool_call>'
    runner = EpisodeRunner(
        Scripted(tok, (call,)), tok, lambda: Tools([lookup]), Limits(2, 80, 400), "t", tools=[lookup]
    )
    runner.first_batch = False
    batch = runner.run([Example("a", "1+1=", "2")], 1, PARAMS, seed=0)
    (fault,) = batch.episodes[0]["faults"]
    assert fault.startswith(f"error: step raised ToolReturnError: the tool lookup returned {shown}, not a str")


def test_samples_record_the_prompt_the_model_saw_with_the_tools(tiny):
    """Issue 49, defect 6: samples.jsonl recorded the task's prompt without the tools' description the model saw
    (and copied). The episode keeps its prompt, and write_samples records it."""
    import io

    from tether.records.summary import write_samples

    model, tok = tiny
    runner = EpisodeRunner(
        Scripted(tok, ("4",)), tok, lambda: Tools([multiply]), Limits(2, 8, 40), "t", tools=[multiply]
    )
    example = Example("a", "3+4=", "7")
    batch = runner.run([example], 1, PARAMS, seed=0)
    assert batch.episodes[0]["prompt"].startswith("3+4=") and "You can use these tools" in batch.episodes[0]["prompt"]
    out = io.StringIO()
    write_samples(out, 1, batch, [example], torch.tensor([0.0]), 1)
    assert json.loads(out.getvalue())["prompt"] == batch.episodes[0]["prompt"]


def test_the_plain_text_format_teaches_by_one_concrete_call_never_a_placeholder():
    """Issue 49: the format showed `{"name": "TOOL", "arguments": {...}}`, which SmolLM2 copied. It shows one real
    call of the first tool: its docstring's Example:, else a value of each required parameter's type; the
    example is a call the environment answers."""
    from tether.envs.tools import plain_instructions, tool_example

    text = plain_instructions([calculator, multiply])
    assert "TOOL" not in text and "{...}" not in text and "..." not in text
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 7"}}</tool_call>'
    assert call in text and "- multiply(a: integer, b: integer, note: string): Multiply two integers." in text
    assert tool_example(multiply) == {"a": 3, "b": 3}  # no Example: section: a value of each required type
    env = Tools([calculator, multiply])
    env.reset(Example("a", "p", "84"))
    assert env.step(call).observation == "<tool_response>84</tool_response>"  # the example is a working call

    def bad(x: int) -> str:
        """A tool.

        Example:
            {"y": 1}
        """
        return str(x)

    with pytest.raises(ValueError, match="must be a JSON object of its arguments"):
        tool_example(bad)


def test_the_tools_environment_answers_calls_and_ends_on_a_reply_without_one():
    env = Tools([multiply, calculator])
    env.reset(Example("a", "p", "42"))
    step = env.step('Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}')
    assert not step.done and step.role == "tool" and step.observation == "<tool_response>42</tool_response>"
    assert step.info == {"tool_calls": 1, "tool_errors": 0}
    bad = env.step(
        '<tool_call>not json</tool_call><tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 2}}</tool_call>'
    )
    assert bad.info == {"tool_calls": 2, "tool_errors": 1} and "error:" in bad.observation and "4" in bad.observation
    assert env.step("The answer is 42.").done and env.step("42").info == {"tool_calls": 0, "tool_errors": 0}


def test_the_calculator_is_exact_and_evaluates_nothing_but_arithmetic():
    assert calculator("(12 + 30) * 7") == "294" and calculator("7 / 2") == "3.5" and calculator("-3 % 5") == "2"
    for bad in ("__import__('os')", "2 ** 10", "x + 1", "1" * 201):
        with pytest.raises((ValueError, SyntaxError)):
            calculator(bad)


class Faulty:
    """Raises on the prompts listed in `bad`, sleeps on those in `slow`, returns junk on `junk`."""

    def __init__(self, bad=(), slow=(), junk=()):
        self.bad, self.slow, self.junk = bad, slow, junk

    def reset(self, example):
        self.id = example.id

    def step(self, reply):
        if self.id in self.bad:
            raise KeyError("no such board")
        if self.id in self.slow:
            time.sleep(3)
        if self.id in self.junk:
            return 1.0
        return Step(observation="more", reward=0.5)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    model, tok = load_model(tiny_dir)
    return model.eval(), tok


def _run(tiny, env, examples=("a", "b", "c"), timeout_s=0.5):
    model, tok = tiny
    engine = Scripted(tok)  # every turn ends on eos, so every episode reaches its environment
    runner = EpisodeRunner(engine, tok, env, Limits(2, 4, 40, timeout_s=timeout_s), "faulty")
    return runner, [Example(i, f"{k}+1=", "1") for k, i in enumerate(examples)]


def test_faults_end_their_episode_are_counted_and_warned_once(tiny, tmp_path):
    from tether.envs import episode_metrics

    runner, examples = _run(tiny, lambda: Faulty(bad=("a",), slow=("b",), junk=()), examples=("a", "b", "c"))
    tic = time.perf_counter()
    batch = runner.run(examples, 2, PARAMS, seed=0)
    assert time.perf_counter() - tic < 2.5, "a hung step must not hold the batch past env.timeout_s"
    faults = [f["faults"] for f in batch.episodes]
    # each fault names the method that failed (issue 49, defect 9), and one that raised keeps its traceback
    assert all(x and x[0].startswith("error: step raised KeyError: 'no such board'") for x in faults[:2])
    assert all(x and x[0].startswith("timeout: step gave no answer within env.timeout_s") for x in faults[2:4])
    traces = [f["tracebacks"] for f in batch.episodes]
    assert all("Traceback" in t[0] and 'raise KeyError("no such board")' in t[0] for t in traces[:2])
    assert all(t == [""] for t in traces[2:4])
    assert faults[4:] == [[], []] and all(f["turns"] == 2 for f in batch.episodes[4:])
    assert all(f["turns"] == 1 for f in batch.episodes[:4])  # ended where the fault happened
    m = episode_metrics(batch)
    assert m["env/errors"] == 2 and m["env/timeouts"] == 2
    log_file = tmp_path / "errors.log"
    warn = EnvWarnings("faulty", log_file=log_file)
    lines = warn.lines(1, batch.episodes)
    assert len(lines) == 2 and "faulty: error: step raised KeyError" in lines[0]
    assert f"its traceback is in {log_file}" in lines[0]
    assert warn.lines(2, batch.episodes) == []  # once per kind per run
    warn.write_tracebacks(1, batch.episodes)  # every fault, with its traceback, in the run's errors.log
    text = log_file.read_text()
    assert text.count("step 1, episode") == 4 and text.count("Traceback (most recent call last)") == 2


def test_a_step_that_returns_no_step_is_a_fault(tiny):
    runner, examples = _run(tiny, lambda: Faulty(junk=("a",)), examples=("a", "b"))
    batch = runner.run(examples, 1, PARAMS, seed=0)
    assert "not a tether.envs.Step" in batch.episodes[0]["faults"][0] and not batch.episodes[1]["faults"]


def test_an_environment_that_fails_every_episode_of_the_first_batch_is_an_error(tiny):
    runner, examples = _run(tiny, lambda: Faulty(bad=("a", "b")), examples=("a", "b"))
    with pytest.raises(EnvironmentBroken, match="the environment faulty failed on every episode.*KeyError") as err:
        runner.run(examples, 2, PARAMS, seed=0)
    assert "step raised KeyError" in str(err.value) and "Traceback (most recent call last)" in str(err.value)
    later, examples = _run(tiny, lambda: Faulty(bad=("a",)), examples=("a", "b"))
    later.run(examples, 1, PARAMS, seed=0)  # the first batch: one episode works
    batch = later.run(examples[:1], 2, PARAMS, seed=1)  # a later batch where all fail: counted, not raised
    assert all(f["faults"] for f in batch.episodes)


def test_an_environment_that_cannot_be_built_is_a_fault_of_its_episode(tiny):
    def broken():
        raise RuntimeError("cannot open the board")

    runner, examples = _run(tiny, broken, examples=("a",))
    with pytest.raises(EnvironmentBroken, match="building faulty raised RuntimeError: cannot open the board"):
        runner.run(examples, 2, PARAMS, seed=0)


def test_a_reset_that_raises_is_named_as_reset(tiny):
    class BadReset(Faulty):
        def reset(self, example):
            raise ValueError("no board for this example")

    runner, examples = _run(tiny, BadReset, examples=("a", "b"))
    runner.first_batch = False  # a later batch: counted, not raised
    batch = runner.run(examples, 1, PARAMS, seed=0)
    assert batch.episodes[0]["faults"] == ["error: reset raised ValueError: no board for this example"]


def test_env_tokens_carry_no_loss_and_no_sampler_log_prob(tiny):
    runner, examples = _run(tiny, lambda: Faulty())
    batch = runner.run(examples, 2, PARAMS, seed=3)
    env = batch.mask & ~batch.policy_mask
    assert env.any() and torch.all(batch.sampler_logprobs[env] == 0)
    assert torch.equal(batch.completion_lengths, batch.policy_mask.sum(1))
