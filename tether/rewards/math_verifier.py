"""Math answer verification with math-verify, in a worker process with a hard timeout.

math-verify (`parse` + `verify`, sympy underneath) is accurate but can take unbounded time on
adversarial LaTeX, and its own timeouts use `signal.alarm`, which works only on a main thread.
So verification runs in a persistent worker process that serves many batches. The parent sends
a whole batch and waits at most `timeout_s` for each result in turn; when one does not arrive,
the worker is killed, that completion scores 0 with reason "timeout", and a fresh worker takes
the rest of the batch. A call is delayed by at most about `timeout_s` per item plus a worker
start (about 1 s); it never hangs.

The worker is a plain `subprocess` running `_math_worker.py`, not a `multiprocessing` spawn:
spawn re-imports the parent's `__main__`, which breaks (or re-runs) scripts without an
`if __name__ == "__main__":` guard and code piped through stdin. POSIX only (it passes a
socket by file descriptor).

Gold answers are strings, often bare LaTeX ("\\frac{1}{2}", "\\left( 3, \\frac{\\pi}{2} \\right)").
They are parsed as `\\boxed{gold}`: on the MATH-500, Minerva and the first 200 OlympiadBench
golds this parsed and self-verified 972/972, against 971/972 for `$gold$`. The parse is cached
per gold, since G samples share one.
"""

from __future__ import annotations

import pickle
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable, Sequence

from ..tasks import Example
from ._math_worker import math_verify_score
from .base import RewardResult

VerifyFn = Callable[[str, str], tuple[float, str]]
_WORKER = Path(__file__).with_name("_math_worker.py")


@dataclass
class MathVerifier:
    """A persistent verification worker with a per-item hard timeout.

    Attributes:
        timeout_s: the longest one item may take before the worker is killed and replaced.
        verify_fn: `(completion, gold) -> (score, reason)` run in the worker instead of
            math-verify; None means `math_verify_score`. Must be a top-level function of an
            importable module (tests inject a slow one to exercise the timeout).
        start_timeout_s: the longest a fresh worker may take to start.
        memory_limit_mb: the worker's address-space cap (0: none); an answer that would need
            more (sympy evaluating 9^9^9^9) fails with MemoryError, reason "verifier error".
        restarts: how many times a worker was killed (timeouts and crashes).
    """

    timeout_s: float = 5.0
    verify_fn: VerifyFn | None = None
    start_timeout_s: float = 120.0
    memory_limit_mb: int = 4096
    restarts: int = field(default=0, init=False)
    _proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _conn: Connection | None = field(default=None, init=False, repr=False)

    def _start(self) -> Connection:
        if self._conn is not None and self._proc is not None and self._proc.poll() is None:
            return self._conn
        self.close()
        ours, theirs = socket.socketpair()
        self._proc = subprocess.Popen(
            [sys.executable, str(_WORKER), str(theirs.fileno()), str(self.memory_limit_mb)],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self._conn = Connection(ours.detach())
        fn = None if self.verify_fn is None else pickle.dumps(self.verify_fn)
        self._conn.send((list(sys.path), fn))
        reply: Any = None
        if self._conn.poll(self.start_timeout_s):
            try:
                reply = self._conn.recv()
            except (EOFError, OSError):
                reply = ("error", "worker exited during start-up")
        if reply != "ready":
            self.close(graceful=False)
            detail = reply[1] if isinstance(reply, tuple) else f"no reply within {self.start_timeout_s} s"
            raise RuntimeError(f"math verification worker failed to start: {detail}")
        return self._conn

    def close(self, graceful: bool = True) -> None:
        """Stop the worker (a later call starts a new one)."""
        if self._conn is not None:
            if graceful:
                try:
                    self._conn.send(None)
                except OSError:
                    pass
            self._conn.close()
        if self._proc is not None:
            if graceful:
                try:
                    self._proc.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    pass
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
        self._proc, self._conn = None, None

    def _kill(self) -> None:
        self.restarts += 1
        self.close(graceful=False)

    def score_batch(self, completions: Sequence[str], golds: Sequence[str]) -> list[tuple[float, str]]:
        """(score, reason) for each completion against its gold; never hangs, never raises on input."""
        if len(completions) != len(golds):
            raise ValueError(f"{len(completions)} completions but {len(golds)} golds")
        pairs = [(str(c), str(g)) for c, g in zip(completions, golds)]
        results: list[tuple[float, str]] = [(0.0, "not scored")] * len(pairs)
        start = 0
        while start < len(pairs):
            conn = self._start()
            conn.send(pairs[start:])
            for index in range(start, len(pairs)):
                failure = None
                if not conn.poll(self.timeout_s):
                    failure = "timeout"
                else:
                    try:
                        i, score, reason = conn.recv()
                        results[start + i] = (score, reason)
                    except (EOFError, OSError):
                        failure = "verifier worker died"
                if failure is not None:
                    results[index] = (0.0, failure)
                    self._kill()
                    break
            start = index + 1
        return results

    def __del__(self) -> None:
        if self._proc is not None:
            self.close(graceful=False)


@dataclass
class Math:
    """1 if math-verify judges the completion's final answer equal to `example.answer`, else 0.

    Attributes:
        timeout_s: per-completion hard limit; an item over it scores 0 with reason "timeout".
    """

    timeout_s: float = 5.0
    _verifier: MathVerifier | None = field(default=None, init=False, repr=False)

    @property
    def verifier(self) -> MathVerifier:
        """The worker, started on first use."""
        if self._verifier is None:
            self._verifier = MathVerifier(timeout_s=self.timeout_s)
        return self._verifier

    def score_batch(self, completions: Sequence[str], examples: Sequence[Example]) -> list[RewardResult]:
        scored = self.verifier.score_batch(completions, [ex.answer for ex in examples])
        return [RewardResult(score, {"math": score}, reason) for score, reason in scored]

    def __call__(self, completion: str, example: Example) -> RewardResult:
        return self.score_batch([completion], [example])[0]

    def close(self) -> None:
        """Stop the worker process."""
        if self._verifier is not None:
            self._verifier.close()


__all__ = ["Math", "MathVerifier", "math_verify_score"]
