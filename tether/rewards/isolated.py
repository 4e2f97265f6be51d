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
  counted in `reward/errors`; `base.score_all`).
- The bound for a call with n completions is n x timeout_s plus the worker starts it makes (at
  most one per completion, after a kill), each bounded by `start_timeout_s` (else RuntimeError:
  the machine or the reward's module is at fault, not the model output).

The reward reaches the worker by pickling, so it must be importable by name: a function or
class defined at the top level of a module (an import path always is). `isolate` puts every user
part of a reward in a worker, and refuses one that does not pickle (a lambda, a function defined
inside another) with a ConfigError naming the fix. `check_user_rewards` probes the user's parts
before a run.
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
from typing import Any, ClassVar, Sequence

from ..plugins import is_import_path
from ..schema import ConfigError
from ..tasks import Example
from .base import REWARD_ERROR, Reward, RewardFn, RewardResult, score_all
from .combined import Combined
from .user import UserReward
from .worker import Worker

_WORKER = Path(__file__).with_name("_reward_worker.py")


def score_in_worker(reward: RewardFn, completions: Sequence[str], examples: Sequence[Example]) -> list[RewardResult]:
    """What the worker runs for one message: `score_all` (never raises on a reward's failure)."""
    return score_all(reward, completions, examples)


@dataclass
class Isolated(Worker):
    """`reward` scored in a worker process, each completion within `timeout_s` (module docstring).

    Attributes:
        reward: the user's reward (`UserReward`; picklable: a top-level function or class instance).
        name: what the warnings and reasons call it (the import path, or the task's reward).
        timeout_s: the longest one completion may take before the worker is killed.
        start_timeout_s: the longest a worker start may take (importing the reward's module).
        restarts: workers killed (timeouts, crashes); starts / start_s / last_start_s: workers
            started, seconds spent starting them, the latest start's seconds (`Worker`).
    """

    reward: UserReward
    name: str
    timeout_s: float = 5.0
    start_timeout_s: float = 120.0
    parts: ClassVar[None] = None

    def _script(self) -> Path:
        return _WORKER

    def _hello(self) -> Any:
        return (list(sys.path), pickle.dumps(partial(score_in_worker, self.reward)))

    def _who(self) -> str:
        return f"the worker of reward {self.name}"

    def score_batch(self, completions: Sequence[str], examples: Sequence[Example]) -> list[RewardResult]:
        """Each completion's result, within `timeout_s` each; never hangs, never raises on a reward's failure."""
        if self.reward.batched:  # the user's own batching: one message, n x timeout_s
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


PROBE_FAULTS = ("wrongtype", "nonfinite")
"""What `check_user_rewards` refuses before a run: a result that is no number, or is not finite."""


def check_user_rewards(reward: Reward, example: Example) -> None:
    """Score an empty completion and the example's own answer with every user reward in `reward`
    (a weighted one's parts, isolated ones, included) before a run starts: a return of the wrong
    type, or a score that is not a finite number (NaN, which would reach the loss), is a ConfigError
    then, not a reward error on every completion of the first step. A reward that raises or times
    out on a probe is left to the scoring path, which scores that completion 0. A reward with its own
    `score_batch` is not probed."""

    parts = [part for _, _, part in reward.parts] if reward.parts is not None else [reward]
    for part in parts:
        user = part.reward if isinstance(part, Isolated) else part
        if isinstance(user, UserReward) and not user.batched:
            probes = ["", example.answer]
            for completion, result in zip(probes, score_all(part, probes, [example] * 2)):
                if any(fault in result.faults for fault in PROBE_FAULTS):
                    probe = f"the example's answer {completion!r:.40}" if completion else "an empty completion"
                    raise ConfigError(
                        f"reward {part.name} {result.reason.removeprefix(REWARD_ERROR + ': ')} "
                        f"(called on {probe} before training): a reward returns a finite number or a "
                        "RewardResult with one; fix the reward"
                    )


def isolate(reward: Reward, timeout_s: float, name: str = "") -> Reward:
    """`reward` with every part from the user's code (an import path `module:name`, or the task's own
    function: `name` is then given, or the part's name in a weighted reward is the import path) run in
    a worker process under `timeout_s` per completion (`Isolated`); a part that cannot be sent to a
    worker (it does not pickle: a lambda, a function defined inside another) is a ConfigError naming
    the fix. tether's own rewards bound their own time (linear scanners, the math verifier's worker)."""
    if isinstance(reward, Combined):
        return Combined(
            tuple(
                (part, weight, isolate(fn, timeout_s, part if is_import_path(part) else ""))
                for part, weight, fn in reward.parts
            )
        )
    if not name:
        return reward

    try:
        pickle.dumps(reward)
    except Exception as err:  # pickling a closure raises AttributeError, PicklingError or TypeError
        raise ConfigError(
            f"reward {name} cannot run in a worker process with a time limit: it does not pickle "
            f"({type(err).__name__}: {err}). Define it at the top level of a module (an import "
            "path MODULE:NAME always is), or set reward.isolate=false to run it in the trainer's "
            "process without reward.timeout_s"
        ) from None
    return Isolated(reward, name, timeout_s)
