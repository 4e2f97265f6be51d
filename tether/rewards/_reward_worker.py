"""The worker process a user's reward runs in (`tether.rewards.isolated`), started as a script
by file path (no torch through `tether/__init__`; the user's module and `tether.rewards` are
imported when the reward is unpickled). Protocol, over one socket wrapped in a `Connection`:

    parent -> worker  (sys_path, pickled callable)     once, at start
    worker -> parent  "ready" | ("error", message)
    parent -> worker  [args, ...]                      a batch, or None to stop
    worker -> parent  (index, callable(*args))         one message per item

The callable is `isolated.score_in_worker` bound to the reward (`base.score_all`): it never
raises (a raising reward is a result with a reason), so the worker only dies when the reward
kills the process.
"""

from __future__ import annotations

import pickle
import sys
from multiprocessing.connection import Connection


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    megabytes = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    if megabytes > 0:
        import resource  # lazy: POSIX only, and only when a memory cap is set

        resource.setrlimit(resource.RLIMIT_AS, (megabytes << 20, megabytes << 20))
    sys_path, pickled = conn.recv()
    sys.path[:] = sys_path
    try:
        fn = pickle.loads(pickled)
    except Exception as err:  # the user's module failed to import here: tell the parent, do not die silently
        conn.send(("error", f"{type(err).__name__}: {err}"))
        return
    conn.send("ready")
    while True:
        try:
            batch = conn.recv()
        except (EOFError, OSError):
            return
        if batch is None:
            return
        for i, args in enumerate(batch):
            conn.send((i, fn(*args)))


if __name__ == "__main__":
    main()
