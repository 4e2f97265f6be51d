"""Progress over an evaluation's problems: a rich bar on a terminal, plain flushed lines otherwise."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator
from ..records.sinks import HEARTBEAT_S, Heartbeat, _duration, flushed


@contextmanager
def progress(
    enabled: bool, total: int, done: int, stream=None, log=None, every_s: float | None = None
) -> Iterator[Callable[[int], None]]:
    """Progress over problems; yields `advance(count)`. A rich bar on a terminal; plain lines,
    flushed, when stdout is not one (`tether eval ... > log`): one at once, then one every tenth
    of the problems and at least every `every_s` seconds (sinks.HEARTBEAT_S), also mid-batch, as
    `tether train` does. A no-op when disabled."""
    if not enabled:
        yield lambda count: None
        return
    stream = sys.stdout if stream is None else stream
    if not stream.isatty():
        yield from _plain_progress(total, done, log, every_s)
        return
    from rich import progress as rp

    columns = (
        rp.TextColumn("[bold]eval"),
        rp.BarColumn(),
        rp.MofNCompleteColumn(),
        rp.TimeElapsedColumn(),
        rp.TimeRemainingColumn(),
    )
    with rp.Progress(*columns) as bar:
        task = bar.add_task("eval", total=total, completed=done)
        yield lambda count: bar.advance(task, count)


def _plain_progress(total: int, done: int, log=None, every_s: float | None = None) -> Iterator[Callable[[int], None]]:
    log = flushed(print if log is None else log)
    start, tic, state = done, time.perf_counter(), {"done": done}
    every = max(1, (total - done) // 10)

    def line(quiet: float | None = None) -> str:
        elapsed = time.perf_counter() - tic
        rate = (state["done"] - start) / max(elapsed, 1e-9)
        eta = _duration((total - state["done"]) / rate) if rate > 0 else "?"
        now = f"eval {state['done']}/{total} problems  elapsed {_duration(elapsed)}  ETA {eta}"
        return now + (f"  (batch under way: no problem finished in the last {_duration(quiet)})" if quiet else "")

    log(f"eval: {total} problems, {done} already done (resumed)" if done else f"eval: {total} problems")
    beat = Heartbeat(log, line, HEARTBEAT_S if every_s is None else every_s)

    def advance(count: int) -> None:
        before, state["done"] = state["done"], state["done"] + count
        if (state["done"] - start) // every > (before - start) // every or state["done"] == total or beat.due():
            beat.beat()
            log(line())

    try:
        yield advance
    finally:
        beat.close()


__all__ = ["progress"]
