"""A persistent worker process that scores items under a hard time limit each: the one piece of
process handling behind `MathVerifier` (math-verify, `_math_worker.py`) and `Isolated` (a user's
reward, `_reward_worker.py`).

- The worker is a plain `subprocess` running a script by file path, not a `multiprocessing`
  spawn (spawn re-imports the parent's `__main__`, which breaks or re-runs scripts without an
  `if __name__ == "__main__":` guard and code piped through stdin). The two ends talk over a
  `socket.socketpair` wrapped in a `multiprocessing.connection.Connection`, the worker's end
  passed by file descriptor (so POSIX only).
- Start-up: the parent sends the subclass's first message (`_hello`); the worker answers "ready"
  or ("error", message). No answer within `start_timeout_s`, or an error, kills the worker and
  raises RuntimeError "<who> failed to start: <why>" (the machine or the code being imported is
  at fault, not the item).
- Scoring (`run`): the parent sends the items left and waits at most `limit` seconds for each
  reply in turn, a reply being `(index, *result)`. When one does not arrive ("timeout") or the
  worker dies ("died"), that item is the failure, the worker is killed (`restarts`) and a fresh
  one takes the items after it. So a call with n items makes at most one start per item.
- `close()` asks the worker to stop (it is sent None) and kills it after 1 s; `close(False)`
  kills it at once.

A subclass is a dataclass that defines `start_timeout_s` and the hooks `_script` (the worker's
file), `_args` (its command-line arguments after the socket's descriptor), `_hello` and `_who`.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable, Sequence


@dataclass
class Worker:
    """The worker process and its counters (module docstring); subclasses give what it runs.

    Attributes:
        restarts: how many times a worker was killed (timeouts and crashes).
        starts: how many workers were started.
        start_s: seconds spent starting them, in all.
        last_start_s: seconds the latest worker start took (0 before the first).
    """

    restarts: int = field(default=0, init=False)
    starts: int = field(default=0, init=False)
    start_s: float = field(default=0.0, init=False)
    last_start_s: float = field(default=0.0, init=False)
    _proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _conn: Connection | None = field(default=None, init=False, repr=False)
    # A subclass's own field `start_timeout_s: float`: the longest a worker start may take. (Not
    # declared here: a field redeclared by a subclass keeps its place, first in the arguments.)

    def _script(self) -> Path:
        """The worker script to run."""
        raise NotImplementedError

    def _args(self) -> list[str]:
        """The worker's command-line arguments after the socket's file descriptor."""
        return []

    def _hello(self) -> Any:
        """The first message sent to a new worker."""
        raise NotImplementedError

    def _who(self) -> str:
        """The worker as the start-up error names it ("... failed to start")."""
        raise NotImplementedError

    def start(self) -> Connection:
        """The live worker's connection, starting a worker first when none is alive."""
        if self._conn is not None and self._proc is not None and self._proc.poll() is None:
            return self._conn
        self.close()
        began = time.perf_counter()
        ours, theirs = socket.socketpair()
        self._proc = subprocess.Popen(
            [sys.executable, str(self._script()), str(theirs.fileno()), *self._args()],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self._conn = Connection(ours.detach())
        self._conn.send(self._hello())
        reply: Any = None
        if self._conn.poll(max(0.0, self.start_timeout_s - (time.perf_counter() - began))):
            try:
                reply = self._conn.recv()
            except (EOFError, OSError):
                reply = ("error", "the worker exited during start-up")
        if reply != "ready":
            self.close(graceful=False)
            detail = reply[1] if isinstance(reply, tuple) else f"no reply within {self.start_timeout_s} s"
            raise RuntimeError(f"{self._who()} failed to start: {detail}")
        self.starts += 1
        self.last_start_s = time.perf_counter() - began
        self.start_s += self.last_start_s
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

    def kill(self) -> None:
        """Kill the worker and count it in `restarts`."""
        self.restarts += 1
        self.close(graceful=False)

    def run(
        self,
        items: Sequence[Any],
        limit: float,
        on_reply: Callable[[int, list[Any]], None],
        on_failure: Callable[[int, str], None],
    ) -> None:
        """Score `items` in the worker: `on_reply(index, result)` for each reply (`result`: the
        reply without its index), or `on_failure(index, why)` for an item with no reply within
        `limit` seconds (why "timeout") or whose worker died ("died"), after which the worker is
        killed and a fresh one takes the items after it. Raises only when a start fails."""
        start = 0
        while start < len(items):
            conn = self.start()
            conn.send(list(items[start:]))
            index = start
            for index in range(start, len(items)):
                failure = None
                if not conn.poll(limit):
                    failure = "timeout"
                else:
                    try:
                        i, *result = conn.recv()
                    except (EOFError, OSError):
                        failure = "died"
                    else:
                        on_reply(start + i, result)
                if failure is not None:
                    on_failure(index, failure)
                    self.kill()
                    break
            start = index + 1

    def __del__(self) -> None:
        if self._proc is not None:
            self.close(graceful=False)
