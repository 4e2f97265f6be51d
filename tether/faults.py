"""Deterministic fault injection, for the reliability tests and for users checking their setup.

    TETHER_KILL_AT="<point>:<n>"   SIGKILL this process the n-th time it reaches <point>

Points, in the order a training step reaches them:
    rollout       completions generated, rewards not yet computed
    update        a micro-batch's backward pass done, its optimiser step not yet taken
    logged        a step's metrics written, its checkpoint (if any) not yet
    checkpoint    a checkpoint's weights written, its state, manifest and rename not yet
A kill at any of them must leave a run that `tether train --resume RUN_DIR` continues exactly
(tests/trainer/test_kill_and_resume_match_an_uninterrupted_run.py). With the variable unset, `point` costs one
dictionary lookup.
"""

from __future__ import annotations

import os
import signal

POINTS = ("rollout", "update", "logged", "checkpoint")
_reached: dict[str, int] = {}


def point(name: str) -> None:
    spec = os.environ.get("TETHER_KILL_AT")
    if not spec:
        return
    target, _, nth = spec.partition(":")
    if target != name:
        return
    _reached[name] = _reached.get(name, 0) + 1
    if _reached[name] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
