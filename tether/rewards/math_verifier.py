"""Math answer verification with math-verify, in a worker process with a hard time bound.

math-verify (`parse` + `verify`, sympy underneath) is accurate but can take unbounded time on
adversarial LaTeX, and its own timeouts use `signal.alarm`, which works only on a main thread.
So verification runs in a persistent worker process that serves many batches. The parent sends
a whole batch and waits at most `timeout_s` for each result in turn; when one does not arrive,
the worker is killed, that completion scores 0 with reason "timeout", and a fresh worker takes
the rest of the batch.

The time bound, per item: `timeout_s` plus at most one worker start. A call with n items
returns within n * timeout_s plus the worker starts it makes, and it makes at most one per item
(the first start when no worker is alive, then one after each item that killed the worker and
left items to score), plus the milliseconds of sending, receiving and killing. A start takes
what importing math-verify takes (under a second on an idle machine; seconds on a loaded one;
`MathVerifier.last_start_s` records it) and is itself bounded: a worker that is not ready within
`start_timeout_s` is killed and the call raises RuntimeError (the machine, not the model output,
is at fault). It never hangs. (Before, this header promised "timeout_s per item plus a worker
start, about 1 s", and the tests did not count the start inside a call: on a 16-core machine a
3 s timeout took 5.38 s.)

The worker is a plain `subprocess` running `_math_worker.py`, not a `multiprocessing` spawn:
spawn re-imports the parent's `__main__`, which breaks (or re-runs) scripts without an
`if __name__ == "__main__":` guard and code piped through stdin. POSIX only (it passes a
socket by file descriptor). The process handling (start, handshake, kill, the score loop) is
`worker.Worker`, shared with a user's isolated reward (`isolated.Isolated`).

What is compared, and how (strict or lenient extraction, percent and comma normalisation, how
the gold is parsed and cached), is described in `_math_worker.py`'s header. Strict extraction
is the default: only the completion's final `\\boxed{}` answer counts (lenient extraction lets
any number in the completion count: "blah 2 blah" scores 1 against gold "2").
"""

from __future__ import annotations

import pickle
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Sequence

from ..tasks import Example, Task
from ._math_worker import math_verify_score
from .base import RewardResult
from .worker import Worker
from ..tasks.math import apply_template


def _faults(reason: str) -> tuple[str, ...]:
    """`RewardResult.faults` of a worker's reason: a time limit (the hard one, or math-verify's
    own) or a verifier failure (it raised, or its worker died)."""
    if reason == "timeout":
        return ("timeout",)
    if reason == "verifier worker died" or reason.startswith("verifier error"):
        return ("error",)
    return ()


VerifyFn = Callable[[str, str], tuple[float, str]]
_WORKER = Path(__file__).with_name("_math_worker.py")


@dataclass
class MathVerifier(Worker):
    """A persistent verification worker with a per-item hard time bound (module docstring).

    Attributes:
        timeout_s: the longest one item may take before the worker is killed and replaced.
        strict: only the completion's final `\\boxed{}` answer counts; False: math-verify's
            lenient extraction of any answer in the completion (`_math_worker` header).
        verify_fn: `(completion, gold) -> (score, reason)` run in the worker instead of
            math-verify; None means `math_verify_score` with `strict`. Must be a top-level
            function of an importable module (tests inject a slow one to exercise the timeout).
        start_timeout_s: the longest a fresh worker may take to start (else RuntimeError).
        memory_limit_mb: the worker's address-space cap (0: none); an answer that would need
            more (sympy evaluating 9^9^9^9) fails with MemoryError, reason "verifier error".
        restarts, starts, start_s, last_start_s: workers killed (timeouts and crashes), workers
            started, seconds spent starting them in all, and the latest start's (`Worker`).
    """

    timeout_s: float = 5.0
    strict: bool = True
    verify_fn: VerifyFn | None = None
    start_timeout_s: float = 120.0
    memory_limit_mb: int = 4096

    def _script(self) -> Path:
        return _WORKER

    def _args(self) -> list[str]:
        return [str(self.memory_limit_mb)]

    def _hello(self) -> Any:
        fn = None if self.verify_fn is None else pickle.dumps(self.verify_fn)
        return (list(sys.path), fn, self.strict)

    def _who(self) -> str:
        return "math verification worker"

    def score_batch(self, completions: Sequence[str], golds: Sequence[str]) -> list[tuple[float, str]]:
        """(score, reason) for each completion against its gold; never hangs, never raises on input."""
        if len(completions) != len(golds):
            raise ValueError(f"{len(completions)} completions but {len(golds)} golds")
        pairs = [(str(c), str(g)) for c, g in zip(completions, golds)]
        results: list[tuple[float, str]] = [(0.0, "not scored")] * len(pairs)

        def scored(index: int, reply: list[Any]) -> None:
            results[index] = (reply[0], reply[1])

        def failed(index: int, why: str) -> None:
            results[index] = (0.0, "timeout" if why == "timeout" else "verifier worker died")

        self.run(pairs, self.timeout_s, scored, failed)
        return results


@dataclass
class Math:
    """1 if math-verify judges the completion's final answer equal to `example.answer`, else 0."""

    timeout_s: float = 5.0
    """Per-completion hard limit in seconds; an item over it scores 0 with reason "timeout"."""
    strict: bool = True
    """Only the final `\\boxed{}` answer counts (the default, for templates that ask for one);
    False: lenient extraction, any answer math-verify finds in the completion. Use
    `strict_for_task` to decide from a task's template."""
    _verifier: MathVerifier | None = field(default=None, init=False, repr=False)
    name: ClassVar[str] = "Math"  # what messages call it (`Reward.name`): the class's name
    parts: ClassVar[None] = None

    @property
    def verifier(self) -> MathVerifier:
        """The worker, started on first use."""
        if self._verifier is None:
            self._verifier = MathVerifier(timeout_s=self.timeout_s, strict=self.strict)
        return self._verifier

    def score_batch(self, completions: Sequence[str], examples: Sequence[Example]) -> list[RewardResult]:
        scored = self.verifier.score_batch(completions, [ex.answer for ex in examples])
        return [RewardResult(score, {"math": score}, reason, _faults(reason)) for score, reason in scored]

    def __call__(self, completion: str, example: Example) -> RewardResult:
        return self.score_batch([completion], [example])[0]

    def close(self) -> None:
        """Stop the worker process."""
        if self._verifier is not None:
            self._verifier.close()


def asks_for_boxed(template: str) -> bool:
    """Whether a math prompt template (a `TEMPLATES` name or a literal) asks for a `\\boxed{}`
    answer: strict extraction applies only then."""

    return "\\boxed{}" in apply_template(template, "")


def strict_for_task(task: Task, strict: bool = True) -> bool:
    """The `strict` to build a task's math reward with: `strict` when the task's prompt template
    asks for `\\boxed{}` (math tasks' default "boxed"), else False, since a prompt that asks for
    no box cannot be held to one (synthetic tasks have no template: their answers are bare)."""
    return bool(strict) and task.template is not None and asks_for_boxed(task.template)


__all__ = ["Math", "MathVerifier", "asks_for_boxed", "math_verify_score", "strict_for_task"]
