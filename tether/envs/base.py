"""The environment contract: what an episode asks of the code that answers the model.

    class Retry:                                      # any class with these two methods
        def reset(self, example) -> str | None:       # a new episode: None keeps the task's prompt,
            self.answer, self.turn = example.answer, 0  #   a string is the first user message instead
        def step(self, reply: str) -> Step:           # the model's turn, decoded -> what comes next
            self.turn += 1
            if reply.strip() == self.answer:
                return Step(reward=1.0, done=True)
            return Step(observation="That is not correct. Try again.", reward=0.0)

An episode: the prompt, then turns of the model and of the environment until the environment says `done`,
the model runs out of turns (`env.max_turns`) or of tokens (`env.max_turn_tokens`, `env.max_episode_tokens`).
Each environment object plays one episode: the runner builds a fresh one per episode (its class or factory
called with `env.args`), so an environment may keep whatever state it likes. A single-turn task is the
special case of one turn (`SingleTurn`). Tools (`tether.envs.tools`) are an environment too.

The rewards: under `env.reward=task` (the default) the task's reward scores the model's last turn, as for a
single-turn task; under `env.reward=env` the episode's reward is the sum of the rewards its steps returned
(None counts 0). `Step.info` holds numbers the runner sums per episode into metrics (`env/<key>`: the tools
environment reports `tool_calls` and `tool_errors`).

Faults: a `step` or `reset` that raises or outlasts `env.timeout_s` ends its episode (the tokens so far stay,
the reward is what the rule above gives them), is counted (`env/errors`, `env/timeouts`) and named in a
rate-limited `warning:`; an environment that fails on every episode of a run's first batch is an `error:`
(`EnvironmentBroken`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol, runtime_checkable

from ..tasks import Example


@dataclass(frozen=True)
class Step:
    """What the environment answers to one model turn.

    Attributes:
        observation: text for the model's next turn (None: nothing; with done False the episode ends).
        reward: this turn's reward (None: none), summed over the episode under `env.reward=env`.
        done: whether the episode is over.
        role: the chat role the observation is written as ("user", or "tool" for a tool's result where the
            chat template has that role; tether.envs.episodes falls back to "user" where it does not).
        info: numbers to sum over the episode into metrics (`env/<key>`), e.g. {"tool_calls": 1}.
    """

    observation: Optional[str] = None
    reward: Optional[float] = None
    done: bool = False
    role: str = "user"
    info: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """An episode's other side (module docstring). Optional: `tools` (a list of functions whose schemas the
    prompt shows, `tether.envs.tools`)."""

    def reset(self, example: Example) -> Optional[str]:
        """Start an episode on `example`: None keeps the task's prompt; a string is the first user message,
        rendered with the model's chat template (and the environment's tools)."""

    def step(self, reply: str) -> Step:
        """The model's turn `reply` (decoded, without its stop token) -> the next observation, reward, done."""


class SingleTurn:
    """One model turn and done: a single-turn task as an environment (the task's reward scores the reply)."""

    def reset(self, example: Example) -> None:
        return None

    def step(self, reply: str) -> Step:
        return Step(done=True)


class EnvironmentBroken(RuntimeError):
    """An environment failed (raised or timed out) on every episode of a run's first batch: a bug in the
    environment. The trainer turns it into a one-line `error:` (exit 2), as it does a broken reward; the message
    ends with the first failure's traceback (the run directory, and so its errors.log, is removed)."""

    def __init__(self, name: str, reason: str, trace: str = ""):
        self.name, self.reason = name, reason
        tail = f"\n{trace.rstrip()}" if trace else ""
        super().__init__(
            f"the environment {name} failed on every episode of the first batch ({reason}): that is a bug in the "
            f"environment (or env.timeout_s is too short for it); fix it and run again{tail}"
        )
