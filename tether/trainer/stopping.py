"""A clean stop on SIGINT (Ctrl-C) and SIGTERM (what schedulers send before they kill a job).

While the training loop runs, the first signal sets a flag. Before the step under way has
changed the weights (sampling, scoring, log-probs: `StopSignals.droppable`), it also raises
`StopNow` at once, and the loop drops that step, as if it had not begun (its prompts and random
state are put back, so the resume redoes it exactly). Once the step has taken an optimiser
step, the loop finishes it. Either way it then writes a checkpoint of the last finished step, the
summary and the plots, and raises `Interrupted`, which the CLI turns into the message
`interrupted at step N; resume with: ...` and the exit code a shell expects (130 for SIGINT,
143 for SIGTERM). A second Ctrl-C stops at once (KeyboardInterrupt); everything before the last
checkpoint is still safe, since checkpoints are written atomically (tether.records.checkpoint).
A step that could not finish (`rollout.max_new_tokens=100000`) is still stopped by the first signal.

A phase that changes nothing worth keeping (the step-0 evaluation, the held-out evaluation after a step) runs
within `abandoning(what)`: the first signal stops it at once (`StopNow`), and the message says what was
abandoned and what is kept. (Was: during the step-0 evaluation the first SIGTERM printed "stopping after the step
under way has finished (it has updated the weights)", untrue, and the evaluation went on for minutes.)

Python drops an exception raised where it cannot propagate: a signal handled while a weakref
callback or a `__del__` runs (torch.dynamo's caches run such callbacks during a compiled decode)
prints "Exception ignored in ..." and goes on. So a raised `StopNow` stays pending until the loop
has caught it, and `before_update`, which runs before each optimiser step, raises it again there:
the step is still dropped before it changes the weights (was: the stop fell back to "after the step").
"""

from __future__ import annotations

import contextlib
import signal
import threading
from types import FrameType
from typing import Optional

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """Training stopped on a signal after a clean checkpoint; `exit_code` is 128 + the signal."""

    def __init__(self, signum: int, step: int, run_dir: str, before_any_step: bool = False):
        self.signum, self.step, self.run_dir = signum, step, run_dir
        if before_any_step:
            message = (
                f"interrupted during the step-0 evaluation, before any step (nothing to lose); resume with: tether "
                f"train --resume {run_dir}"
            )
        else:
            message = f"interrupted at step {step}; resume with: tether train --resume {run_dir}"
        super().__init__(message)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopNow(BaseException):
    """The first signal arrived while the step under way could still be dropped (`StopSignals.droppable`).
    A BaseException, as KeyboardInterrupt is, so that no `except Exception` on the way swallows it."""


class StopSignals:
    """Within the block, SIGINT and SIGTERM set `signum` instead of stopping the process, and raise
    `StopNow` while `droppable` is set (module docstring); a second SIGINT raises KeyboardInterrupt.

    Outside the main thread (where Python cannot install handlers) it does nothing.
    """

    def __init__(self, log=None):
        self.signum: Optional[int] = None
        self.droppable = False
        self.pending = False  # StopNow raised, not yet caught by the loop (perhaps swallowed: module docstring)
        self.abandon: Optional[tuple[str, str]] = None  # (phase, what stopping now keeps): `abandoning`
        self._log = log
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.signum = signum
        if self.abandon is not None:
            what, kept = self.abandon
            self.abandon = None
            if self._log is not None:
                self._log(f"{signal.Signals(signum).name}: stopping now, during {what}; {kept}")
            raise StopNow(signum)
        if self.droppable:
            self.droppable, self.pending = False, True
            raise StopNow(signum)
        if self._log is not None:
            self._log(
                f"{signal.Signals(signum).name}: stopping after the step under way has finished (it has "
                f"updated the weights); Ctrl-C again to stop at once"
            )

    @contextlib.contextmanager
    def abandoning(self, what: str, kept: str):
        """Within, a signal stops the phase `what` at once (`StopNow`), logging `kept` (what stopping keeps); a
        signal that came before the phase began stops it before it starts."""
        if self.signum is not None:
            raise StopNow(self.signum)
        self.abandon = (what, kept)
        try:
            yield
        finally:
            self.abandon = None

    def before_update(self) -> None:
        """Run before each optimiser step of a droppable step: a `StopNow` raised and swallowed on its
        way (module docstring) is raised again here, before the weights change; after it the step
        is no longer droppable."""
        self.droppable = False
        if self.pending:
            self.pending = False
            raise StopNow(self.signum)

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
