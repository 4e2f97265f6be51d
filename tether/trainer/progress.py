"""Where a training run is: `Counters` (saved in every checkpoint as a whole) and `Progress` (what changes each
step: the counters, the last checkpoint, the best held-out accuracy)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class Counters:
    """Where a run is: the part of every checkpoint's state that is not a tensor store. `Run.save`
    writes it whole and `start_run` reads it back whole (a field missing from an older checkpoint
    takes its default), so what a resume continues from cannot drift from what was saved."""

    step: int = 0  # the last finished RL step
    position: int = 0  # examples the prompt stream has handed out (`PromptStream.position`)
    opt_steps: int = 0  # optimiser steps taken (skipped non-finite updates not counted)
    ref_updates: int = 0  # reference refreshes (`step.refresh_reference`)
    kl_window: list[float] = dataclasses.field(default_factory=list)  # the last `kl/ref` values (KL_WINDOW)
    flat_streak: int = 0  # rollout steps in a row with no reward variance (`loop.flat_streak`)
    entropy_coef: Optional[float] = None  # adaptive entropy control's c for the next step; None: not started

    def state(self) -> dict[str, Any]:
        """Plain Python for `state.pt` (read with `torch.load(weights_only=True)`), one key per field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Counters":
        return cls(**{f.name: state[f.name] for f in dataclasses.fields(cls) if f.name in state})


@dataclass
class Progress:
    """What changes as a run goes: where it is, its last checkpoint and the best accuracy one holds."""

    counters: Counters  # saved in every checkpoint
    start: int  # the step the run resumed after (0 for a new run)
    saved_step: int = -1  # the step of the last checkpoint
    best_accuracy: float = -math.inf  # the best held-out accuracy a checkpoint holds
