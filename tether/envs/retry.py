"""Retry on feedback: a wrong answer is told so and the model tries again, up to `env.max_turns` turns.

    env: {name: retry, reward: env, max_turns: 3}

Turn k's reply is judged by the run's reward (the task's verifier: `judge`, given by the episode runner to
an environment that takes one); a correct reply ends the episode with reward 1 - penalty x (k - 1) (floored
at 0), a wrong one gets `feedback` as the next user turn, and the last allowed turn's wrong reply ends it with
reward 0. With the default penalty 0.25 a first-turn answer scores 1, a second-turn one 0.75 and a third-turn
one 0.5, so under `env.reward=env` the policy gains from answering right at once, and `reward/pass_rate`
(rewards of 1) is first-turn accuracy. `env/solved_turn_<k>` counts the episodes solved at turn k.
"""

from __future__ import annotations

from typing import Callable, Optional

from ..tasks import Example
from .base import Step

FEEDBACK = "That is not correct. Try again."


class Retry:
    """The retry-on-feedback environment (module docstring)."""

    def __init__(
        self,
        judge: Callable[[str, Example], float],
        max_turns: int = 3,
        feedback: str = FEEDBACK,
        penalty: float = 0.25,
    ):
        if not 0 <= penalty <= 1:
            raise ValueError(f"retry: penalty must be in [0, 1], got {penalty}")
        self.judge, self.max_turns, self.feedback, self.penalty = judge, max_turns, feedback, penalty

    def reset(self, example: Example) -> Optional[str]:
        self.example, self.turn = example, 0
        return None

    def step(self, reply: str) -> Step:
        self.turn += 1
        if self.judge(reply, self.example) >= 1.0:
            reward = max(0.0, 1.0 - self.penalty * (self.turn - 1))
            return Step(reward=reward, done=True, info={f"solved_turn_{self.turn}": 1.0})
        if self.turn >= self.max_turns:
            return Step(reward=0.0, done=True)
        return Step(observation=self.feedback, reward=0.0)
