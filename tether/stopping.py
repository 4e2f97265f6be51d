"""A clean stop on SIGINT (Ctrl-C) and SIGTERM (what schedulers send before they kill a job).

While the training loop runs, the first signal only sets a flag; the loop finishes the step it
is in, writes a checkpoint of that step, the summary and the plots, and raises `Interrupted`,
which the CLI turns into the message `interrupted at step N; resume with: ...` and the exit code
a shell expects (130 for SIGINT, 143 for SIGTERM). A second Ctrl-C stops at once
(KeyboardInterrupt); everything before the last checkpoint is still safe, since checkpoints are
written atomically (tether.checkpoint).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Optional

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """Training stopped on a signal after a clean checkpoint; `exit_code` is 128 + the signal."""

    def __init__(self, signum: int, step: int, run_dir: str):
        self.signum, self.step, self.run_dir = signum, step, run_dir
        super().__init__(f"interrupted at step {step}; resume with: tether train --resume {run_dir}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopSignals:
    """Within the block, SIGINT and SIGTERM set `signum` instead of stopping the process.

    Outside the main thread (where Python cannot install handlers) it does nothing.
    """

    def __init__(self):
        self.signum: Optional[int] = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.signum = signum

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
