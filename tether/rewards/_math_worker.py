"""The math verification worker process (run as a script by `tether.rewards.math_verifier`).

Standard library plus math-verify only, and started by file path rather than `-m`, so a
worker (re)start does not pay for importing torch through `tether/__init__`. It talks to the
parent over one socket wrapped in `multiprocessing.connection.Connection`:

    parent -> worker  (sys_path, pickled verify_fn or None)   once, at start
    worker -> parent  "ready" | ("error", message)
    parent -> worker  [(completion, gold), ...]                a batch, or None to stop
    worker -> parent  (index, score, reason)                   one message per item
"""

from __future__ import annotations

import logging
import pickle
import sys
from functools import lru_cache
from multiprocessing.connection import Connection
from typing import Any, Callable

INNER_TIMEOUT_S = 2  # math-verify's own (signal-based) parse / verify limits, per call


class _TimeoutWatch(logging.Handler):
    """math-verify reports its own time limits only as log warnings ("Timeout during parsing",
    "Timeout during comparison") and returns "no match"; this handler notices them, so that such
    a completion is reported as a timeout (counted in `reward/timeouts`), and keeps the
    warning, which quotes the whole and possibly megabyte-long input, off the terminal."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen = False

    def emit(self, record: logging.LogRecord) -> None:
        self.seen = self.seen or record.getMessage().startswith("Timeout")


@lru_cache(maxsize=1)
def _watch() -> _TimeoutWatch:
    watch = _TimeoutWatch()
    logger = logging.getLogger("math_verify")
    logger.addHandler(watch)
    logger.propagate = False
    return watch


@lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> Any:
    from math_verify import parse

    # A box is math-verify's strongest extraction anchor for bare LaTeX golds.
    text = gold if "\\boxed" in gold else f"\\boxed{{{gold}}}"
    return parse(text, parsing_timeout=INNER_TIMEOUT_S)


def math_verify_score(completion: str, gold: str) -> tuple[float, str]:
    """(1.0, "") if math-verify finds the completion's answer equal to `gold`, else (0.0, reason).

    The reason is "timeout" when one of math-verify's own time limits cut the work short.
    """
    from math_verify import parse, verify

    watch = _watch()
    watch.seen = False
    gold_parsed = _parse_gold(gold)
    if not gold_parsed:
        return 0.0, f"gold answer {gold[:40]!r} did not parse"
    answer = parse(completion, parsing_timeout=INNER_TIMEOUT_S)
    if not answer:
        return 0.0, "timeout" if watch.seen else "no answer found in completion"
    if verify(gold_parsed, answer, timeout_seconds=INNER_TIMEOUT_S):
        return 1.0, ""
    if watch.seen:
        return 0.0, "timeout"
    return 0.0, f"answer {str(answer[-1])[:40]!r} != gold {gold[:40]!r}"


def serve(conn: Connection, verify_fn: Callable[[str, str], tuple[float, str]]) -> None:
    """Answer batches until the parent sends None or goes away."""
    while True:
        try:
            batch = conn.recv()
        except (EOFError, OSError):
            return
        if batch is None:
            return
        for i, (completion, gold) in enumerate(batch):
            try:
                score, reason = verify_fn(completion, gold)
            except Exception as err:  # a verifier bug on odd input must not kill the worker
                score, reason = 0.0, f"verifier error: {type(err).__name__}: {str(err)[:80]}"
            conn.send((i, float(score), str(reason)))


def limit_memory(megabytes: int) -> None:
    """Cap this process's address space, so that an answer like 9^9^9^9 that sympy tries to
    build fails with MemoryError (reason "verifier error") instead of exhausting the machine."""
    if megabytes > 0:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (megabytes << 20, megabytes << 20))


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    limit_memory(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    sys_path, pickled_fn = conn.recv()
    sys.path[:] = sys_path
    try:
        import math_verify  # noqa: F401  (imported before "ready": its cost is not billed to an item)

        verify_fn = math_verify_score if pickled_fn is None else pickle.loads(pickled_fn)
    except Exception as err:  # report any start-up failure to the parent instead of dying silently
        conn.send(("error", f"{type(err).__name__}: {err}"))
        return
    conn.send("ready")
    serve(conn, verify_fn)


if __name__ == "__main__":
    main()
