"""A user's reward in a worker process with a hard per-completion time limit (`reward.timeout_s`).

A reward from the user's code (an import path `module:name`, or a task's own function) gets the
guarantees tether's math verifier has: it is scored in bounded time and a failure is a score of
0 with a reason, never a hang or a crash of the trainer.

- It runs in a persistent worker process (`_reward_worker.py`) that serves every batch. The
  parent sends a batch and waits at most `timeout_s` for each completion's result in turn; when
  one does not arrive, the worker is killed, that completion scores 0 with reason
  "timeout: ..." (fault "timeout", counted in `reward/timeouts`), and a fresh worker scores the
  rest of the batch. A reward with its own `score_batch` is sent the whole batch at once, with
  `timeout_s` per completion as the batch's limit; on expiry every completion of it scores 0.
- In the worker, a reward that raises, returns something other than a number or a
  `RewardResult`, or returns a non-finite score, scores 0 with the reason (fault "error",
  counted in `reward/errors`; `base.score_guarded`).
- The bound for a call with n completions is n x timeout_s plus the worker starts it makes (at
  most one per completion, after a kill), each bounded by `start_timeout_s` (else RuntimeError:
  the machine or the reward's module is at fault, not the model output).

The reward reaches the worker by pickling, so it must be importable by name: a function or
class defined at the top level of a module (an import path always is). `isolate` refuses one
that is not (a lambda, a function defined inside another) with a ConfigError naming the fix.
`reward.isolate=false` runs user rewards in the trainer's process instead, without a time limit.
The per-step cost of the worker is measured in docs/performance.md ("Reward isolation").
The process handling (start, handshake, kill, the score loop) is `worker.Worker`, shared with
the math verifier (`math_verifier.MathVerifier`).
"""

from __future__ import annotations

import pickle
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Sequence

from ..tasks import Example
from .base import RewardFn, RewardResult, score_all
from .worker import Worker

_WORKER = Path(__file__).with_name("_reward_worker.py")


def score_in_worker(reward: RewardFn, completions: Sequence[str], examples: Sequence[Example]) -> list[RewardResult]:
    """What the worker runs for one message: `score_all` (never raises on a reward's failure)."""
    return score_all(reward, completions, examples)


@dataclass
class Isolated(Worker):
    """`reward` scored in a worker process, each completion within `timeout_s` (module docstring).

    Attributes:
        reward: the user's reward (picklable: a top-level function or class instance).
        name: what the warnings and reasons call it (the import path, or the task's reward).
        timeout_s: the longest one completion may take before the worker is killed.
        start_timeout_s: the longest a worker start may take (importing the reward's module).
        restarts: workers killed (timeouts, crashes); starts / start_s / last_start_s: workers
            started, seconds spent starting them, the latest start's seconds (`Worker`).
    """

    reward: RewardFn
    name: str
    timeout_s: float = 5.0
    start_timeout_s: float = 120.0

    def _script(self) -> Path:
        return _WORKER

    def _hello(self) -> Any:
        return (list(sys.path), pickle.dumps(partial(score_in_worker, self.reward)))

    def _who(self) -> str:
        return f"the worker of reward {self.name}"

    def score_batch(self, completions: Sequence[str], examples: Sequence[Example]) -> list[RewardResult]:
        """Each completion's result, within `timeout_s` each; never hangs, never raises on a reward's failure."""
        if hasattr(self.reward, "score_batch"):  # the user's own batching: one message, n x timeout_s
            items = [(list(completions), list(examples))]
            limit = self.timeout_s * max(1, len(completions))
        else:
            items = [([c], [e]) for c, e in zip(completions, examples)]
            limit = self.timeout_s
        done: list[list[RewardResult]] = [[] for _ in items]

        def scored(index: int, reply: list[Any]) -> None:
            done[index] = reply[0]

        def failed(index: int, why: str) -> None:
            if why == "timeout":
                failure = RewardResult(
                    0.0,
                    {},
                    f"timeout: reward {self.name} took longer than reward.timeout_s={self.timeout_s:g} s",
                    ("timeout",),
                )
            else:
                failure = RewardResult(0.0, {}, f"reward error: the worker of reward {self.name} died", ("error",))
            done[index] = [failure] * len(items[index][0])

        self.run(items, limit, scored, failed)
        return [result for results in done for result in results]

    def __call__(self, completion: str, example: Example) -> RewardResult:
        return self.score_batch([completion], [example])[0]
