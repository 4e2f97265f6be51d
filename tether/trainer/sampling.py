"""Where a step's batch is sampled from, behind one interface: `Sampler`, chosen once per run by `make_sampler`.

    on-policy    (trainer.staleness: 0)    the policy samples its own step's batch
    stale        (trainer.staleness: s)    the policy of step t - s samples step t's batch (`tether.trainer.staleness`)
    overlapped   (trainer.overlap: true)   as stale, with step t+1's batch sampled in a background thread while step t
                                           trains (`tether.trainer.overlap`)

A step uses every sampler the same way (`tether.trainer.step.rl_step`): within `sampling(step)` it calls
`generate` (through `collect`), then adds `metrics(...)` to the step's metrics; a checkpoint stores `state()`;
the loop calls `close()` at the end. None of them changes what is sampled for a given policy, prompts and seed.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator, Optional, Protocol, runtime_checkable

import torch

from ..config.sections import Config
from ..envs import EpisodeRunner
from ..rollout import RolloutBatch, RolloutEngine, SamplingParams, draw
from ..tasks import Example
from .data import PromptStream
from .overlap import OverlappedSampler
from .staleness import StalePolicies, stale_metrics


@runtime_checkable
class Sampler(Protocol):
    """What a step asks of its sampler (module docstring)."""

    droppable: bool
    """Whether a first signal may drop a step before its first optimiser step, to be redone on resume (the
    stale FIFO has moved on and the overlap's thread has taken the next prompts: those finish the step)."""

    def sampling(self, step: int) -> ContextManager[int]:
        """Within the block `generate` samples step `step`; yields the step whose policy samples it."""

    def generate(
        self, examples: list[Example], n: int, params: SamplingParams, seed: Optional[int] = None
    ) -> RolloutBatch:
        """The batch `collect` asks for: n samples of each example's prompt, or n episodes of it (tether.envs.draw)."""

    def metrics(
        self, lag: int, sampler_logprobs: torch.Tensor, old_logprobs: Optional[torch.Tensor], mask: torch.Tensor
    ) -> dict[str, float]:
        """This step's sampler metrics, `lag` = step - the sampler's step; log-probs and mask (N, T)."""

    def state(self) -> Optional[dict]:
        """What a checkpoint must hold to resume this sampler exactly (None: nothing)."""

    def close(self) -> None:
        """Release what the sampler holds (the overlap's thread and a batch under way)."""


class OnPolicySampler:
    """The engine samples with the policy as it is: step t's batch by the policy of step t."""

    droppable = True

    def __init__(self, engine: RolloutEngine):
        self.engine = engine

    def sampling(self, step: int) -> ContextManager[int]:
        return contextlib.nullcontext(step)

    def generate(
        self, examples: list[Example], n: int, params: SamplingParams, seed: Optional[int] = None
    ) -> RolloutBatch:
        return draw(self.engine, examples, n, params, seed)

    def metrics(self, lag, sampler_logprobs, old_logprobs, mask) -> dict[str, float]:
        return {}

    def state(self) -> Optional[dict]:
        return None

    def close(self) -> None:
        pass


class StaleSampler:
    """The engine samples step t's batch with the policy of step max(1, t - s), swapped into the model for the
    call and swapped back bitwise (`StalePolicies.sampling`)."""

    droppable = False

    def __init__(self, engine: RolloutEngine, model: Any, stale: StalePolicies):
        self.engine, self.model, self.stale = engine, model, stale

    @contextlib.contextmanager
    def sampling(self, step: int) -> Iterator[int]:
        with self.stale.sampling(self.model, step) as sampler_step:
            yield sampler_step

    def generate(
        self, examples: list[Example], n: int, params: SamplingParams, seed: Optional[int] = None
    ) -> RolloutBatch:
        return draw(self.engine, examples, n, params, seed)

    def metrics(self, lag, sampler_logprobs, old_logprobs, mask) -> dict[str, float]:
        return stale_metrics(lag, sampler_logprobs, old_logprobs, mask)

    def state(self) -> Optional[dict]:
        return self.stale.state()

    def close(self) -> None:
        pass


def make_sampler(
    cfg: Config,
    engine: RolloutEngine,
    model: Any,
    tokenizer: Any,
    stream: PromptStream,
    params: SamplingParams,
    precision: Callable[[], ContextManager],
    saved: Optional[dict] = None,
) -> Sampler:
    """The run's sampler: on-policy for `trainer.staleness` 0, else stale, overlapped with `trainer.overlap`;
    `saved` is a checkpoint's `state()` (the stale policies) on resume. `engine` is an engine or, for
    multi-turn episodes, an `EpisodeRunner` on one (the overlap's own engine then plays the same episodes)."""
    t = cfg.trainer
    if not t.staleness:
        return OnPolicySampler(engine)
    stale = StalePolicies(model, t.staleness, saved)
    if t.overlap:
        episodes = engine.on if isinstance(engine, EpisodeRunner) else (lambda own: own)
        return OverlappedSampler(cfg, model, tokenizer, stale, stream, params, precision, episodes)
    return StaleSampler(engine, model, stale)
