"""User environment code under the same bounds as user rewards, and tools as plain functions.

A `step` that raises, hangs or returns the wrong thing ends its episode and is counted (never a traceback out
of the trainer); every episode of a run's first batch failing is an error naming the environment; a malformed
tool call is an error result the model reads, and the episode goes on.
"""

import time
from typing import Optional

import pytest
import torch

from tether.envs import EnvironmentBroken, EnvWarnings, EpisodeRunner, Limits, Step, Tools, calculator, tool_schema
from tether.envs.tools import tool_result
from tether.model.loading import load_model
from tether.rollout import SamplingParams

from conftest import Scripted
from tether.tasks import Example

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=4)


def multiply(a: int, b: int, note: Optional[str] = None) -> int:
    """Multiply two integers.

    Args:
        a: the first factor.
        b: the second factor,
            on two lines.
        note: ignored.
    """
    return a * b


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


def test_faults_end_their_episode_are_counted_and_warned_once(tiny):
    from tether.envs import episode_metrics

    runner, examples = _run(tiny, lambda: Faulty(bad=("a",), slow=("b",), junk=()), examples=("a", "b", "c"))
    tic = time.perf_counter()
    batch = runner.run(examples, 2, PARAMS, seed=0)
    assert time.perf_counter() - tic < 2.5, "a hung step must not hold the batch past env.timeout_s"
    faults = [f["faults"] for f in batch.episodes]
    assert all(x and x[0].startswith("error: KeyError") for x in faults[:2])
    assert all(x and x[0].startswith("timeout") for x in faults[2:4])
    assert faults[4:] == [[], []] and all(f["turns"] == 2 for f in batch.episodes[4:])
    assert all(f["turns"] == 1 for f in batch.episodes[:4])  # ended where the fault happened
    m = episode_metrics(batch)
    assert m["env/errors"] == 2 and m["env/timeouts"] == 2
    warn = EnvWarnings("faulty")
    lines = warn.lines(1, batch.episodes)
    assert len(lines) == 2 and "KeyError" in lines[0] and "faulty" in lines[0]
    assert warn.lines(2, batch.episodes) == []  # once per kind per run


def test_a_step_that_returns_no_step_is_a_fault(tiny):
    runner, examples = _run(tiny, lambda: Faulty(junk=("a",)), examples=("a", "b"))
    batch = runner.run(examples, 1, PARAMS, seed=0)
    assert "not a tether.envs.Step" in batch.episodes[0]["faults"][0] and not batch.episodes[1]["faults"]


def test_an_environment_that_fails_every_episode_of_the_first_batch_is_an_error(tiny):
    runner, examples = _run(tiny, lambda: Faulty(bad=("a", "b")), examples=("a", "b"))
    with pytest.raises(EnvironmentBroken, match="the environment faulty failed on every episode.*KeyError"):
        runner.run(examples, 2, PARAMS, seed=0)
    later, examples = _run(tiny, lambda: Faulty(bad=("a",)), examples=("a", "b"))
    later.run(examples, 1, PARAMS, seed=0)  # the first batch: one episode works
    batch = later.run(examples[:1], 2, PARAMS, seed=1)  # a later batch where all fail: counted, not raised
    assert all(f["faults"] for f in batch.episodes)


def test_an_environment_that_cannot_be_built_is_a_fault_of_its_episode(tiny):
    def broken():
        raise RuntimeError("cannot open the board")

    runner, examples = _run(tiny, broken, examples=("a",))
    with pytest.raises(EnvironmentBroken, match="cannot open the board"):
        runner.run(examples, 2, PARAMS, seed=0)


def test_env_tokens_carry_no_loss_and_no_sampler_log_prob(tiny):
    runner, examples = _run(tiny, lambda: Faulty())
    batch = runner.run(examples, 2, PARAMS, seed=3)
    env = batch.mask & ~batch.loss_mask
    assert env.any() and torch.all(batch.sampler_logprobs[env] == 0)
    assert torch.equal(batch.completion_lengths, batch.loss_mask.sum(1))
