"""Real overlap of sampling and training (`trainer.overlap`, with `trainer.staleness: s >= 1`).

With a lag s >= 1 the sampler of RL step t+1 is the policy of step t+1-s, which is already in the FIFO of
stale policies (`tether.trainer.staleness`) when step t starts. So step t+1's batch can be sampled while step t
trains, in a background thread, as an asynchronous trainer with a fixed lag does; torch releases the GIL
inside its ops, so on two cores the decode and the update run at the same time. The bound is the same s:
one batch is prefetched, by a policy exactly s steps older than the one it trains.

How, per step t (`sampling(t)` around the trainer's `collect`):
  1. the current policy joins the FIFO and the oldest leaves it (`StalePolicies.advance`, as without
     overlap): that is step t's sampler; the sampler copy already holds it when its batch was prefetched;
  2. `collect` asks `generate` for the first round of step t: the prefetched batch when there is one (the
     trainer waits for it, `time/overlap_wait_s`), else it is sampled now (the first step of a run or of a
     resume); dynamic sampling's refill rounds, which depend on the rewards, are sampled now, by the copy;
  3. on leaving, the FIFO's oldest (step t+1's sampler) is loaded into the copy, and step t+1's first round
     starts in the background: its prompts are those the prompt stream will hand out next (read from a copy
     of the stream, so the stream's position, which a checkpoint records, moves only when step t+1 takes
     them) and its seed is `seeds.rollout`, the one step t+1 would sample with anyway.

The background thread only decodes. Rewards, the prompt stream and the fault points stay on the trainer's
thread (the math verifier's worker process serves held-out accuracy too, and is not to be shared between
threads), and the thread never reads the policy model: it samples with its own copy (eval mode) holding the
FIFO's stale weights, through its own engine and its own tokenizer (a fast tokenizer must not be used from
two threads at once). The copy keeps the policy's `requires_grad` flags: they pick the kernels even under
inference mode (a copy without them sampled the same tokens with log-probs 5e-7 apart). Memory: one more
copy of the whole model, on the policy's device.

Why it is bitwise the sequential lag: the batch of step t+1 is a pure function of step t+1's sampler
weights (the same tensors, copied into a model with the same frozen weights), its prompts (the same stream
position) and its seed; the `hf` engine draws from its own seeded `torch.Generator`, never from the global
random stream that training uses, and an eval-mode forward draws nothing. The copy's forward runs the same
kernels with the same number of threads (torch sets every thread's intra-op count from one setting). So an
overlapped run has the same tokens, rewards, metrics (`time/*` aside) and weights as the same run without
overlap (tests/trainer/test_overlapped_sampling.py), and a checkpoint needs nothing more: the prefetched batch is
dropped on a
kill and sampled again on resume from the saved FIFO.

Departure: the `vllm` engine is not supported (config validation says so). Its `generate` saves and restores
the process-wide random streams and torch's thread count around every call (`vllm_compat.
preserved_process_state`), which from a second thread would rewind the trainer's own random stream mid-update,
and a second in-process vLLM engine (the copy's) has not been tried.
"""

from __future__ import annotations

import contextlib
import copy
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch

from ..config.sections import Config
from ..rollout import RolloutBatch, SamplingParams, draw, get_engine
from ..tasks import Example
from . import seeds
from .staleness import StalePolicies, load_trainable, stale_metrics


@dataclass(frozen=True)
class _Request:
    """One `generate` call, as `collect` will make it."""

    examples: tuple[Example, ...]
    n: int
    params: SamplingParams
    seed: int


@dataclass
class _Pending:
    request: _Request
    sampler_step: int
    result: "Future[RolloutBatch]"


class OverlappedSampler:
    """Samples step t+1's first round in a background thread while step t trains (module docstring).

    A `tether.trainer.sampling.Sampler`: the trainer's `collect` calls its `generate` within `sampling(step)`.

    Args:
        cfg: the run's config: its rollout section (engine, compile, prompts_per_step, group_size), the sampling
            root (`seeds.sampling_root`: trainer.sampling_seed, else trainer.seed) and trainer.total_steps
            (nothing is prefetched past the last step).
        model: the policy; copied once, never read by the background thread.
        tokenizer: its tokenizer; copied once for the background engine.
        stale: the run's FIFO of stale policies (the checkpoint's, on resume).
        stream: the run's prompt stream (read through a copy; only `collect` moves it).
        params: how the run samples.
        precision: a new autocast context for a forward pass (autocast is per thread).
        episodes: puts an `EpisodeRunner` on the background engine for multi-turn episodes (identity: none).
    """

    droppable = False  # the thread has already taken the next batch's prompts: a stop finishes the step

    def __init__(
        self,
        cfg: Config,
        model: Any,
        tokenizer: Any,
        stale: StalePolicies,
        stream: Any,
        params: SamplingParams,
        precision: Callable[[], ContextManager],
        episodes: Callable[[Any], Any] = lambda engine: engine,
    ):
        rollout = cfg.rollout
        self.model, self.stale, self.stream, self.params, self.precision = model, stale, stream, params, precision
        self.want, self.n = rollout.prompts_per_step, rollout.group_size
        self.seed, self.total_steps = seeds.sampling_root(cfg.trainer), cfg.trainer.total_steps
        # eval mode; `requires_grad` flags kept as the policy's: under inference mode they still pick the kernels
        # (a copy with requires_grad off gave log-probs 5e-7 apart), and the engine runs without gradients anyway
        self.sampler = copy.deepcopy(model).eval()
        self.engine = episodes(
            get_engine(rollout.engine, model=self.sampler, tokenizer=copy.deepcopy(tokenizer), compile=rollout.compile)
        )
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tether-overlap")
        self.pending: Optional[_Pending] = None
        self.waited = 0.0  # seconds the trainer waited for this step's prefetched batch

    @contextlib.contextmanager
    def sampling(self, step: int) -> Iterator[int]:
        """Within the block `generate` samples step `step` by the policy of step max(1, step - s); yields that
        step. On leaving, step + 1's first round starts in the background (none after the last step)."""
        weights, sampler_step = self.stale.advance(self.model, step)
        if self.pending is None:  # nothing prefetched: the first step of a run or of a resume
            load_trainable(self.sampler, weights)
        elif self.pending.sampler_step != sampler_step:
            raise RuntimeError(
                f"step {step}: prefetched by the policy of step {self.pending.sampler_step}, "
                f"the FIFO says {sampler_step}"
            )
        self.waited = 0.0
        try:
            yield sampler_step
        finally:
            self._drop()  # a prefetch `collect` did not take (it raised): wait for it, discard it
        if step < self.total_steps:
            self._prefetch(step + 1)

    def generate(
        self, examples: list[Example], n: int, params: SamplingParams, seed: Optional[int] = None
    ) -> RolloutBatch:
        """The prefetched batch when this is the call it was made for, else a batch sampled now by the copy."""
        pending, self.pending = self.pending, None
        if pending is None:
            return draw(self.engine, examples, n, params, seed)
        if pending.request != _Request(tuple(examples), n, params, seed):
            raise RuntimeError(
                f"the prefetched batch was sampled for {pending.request.seed=} and other prompts than "
                f"this call's (seed {seed}); the overlap no longer follows the trainer's collect"
            )
        tic = time.perf_counter()
        batch = pending.result.result()
        self.waited = time.perf_counter() - tic
        return batch

    def metrics(
        self, lag: int, sampler_logprobs: torch.Tensor, old_logprobs: Optional[torch.Tensor], mask: torch.Tensor
    ) -> dict[str, float]:
        """The stale sampler's metrics (`stale_metrics`) and `time/overlap_wait_s`: how long this step waited
        for its prefetched batch (0: it was ready)."""
        return {**stale_metrics(lag, sampler_logprobs, old_logprobs, mask), "time/overlap_wait_s": self.waited}

    def state(self) -> Optional[dict]:
        """The FIFO of stale policies (a prefetched batch is not saved: a resume samples it again)."""
        return self.stale.state()

    def close(self) -> None:
        """Wait for a batch under way and stop the thread."""
        self._drop()
        self.pool.shutdown(wait=True)

    def _prefetch(self, step: int) -> None:
        weights, sampler_step = self.stale.next_sampler()
        load_trainable(self.sampler, weights)
        examples = tuple(copy.copy(self.stream).take(self.want))  # the stream does not move
        request = _Request(examples, self.n, self.params, seeds.rollout(self.seed, step))
        self.pending = _Pending(request, sampler_step, self.pool.submit(self._sample, request))

    def _sample(self, request: _Request) -> RolloutBatch:
        with self.precision():
            return draw(self.engine, list(request.examples), request.n, request.params, request.seed)

    def _drop(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result.exception()  # waits; an error of a batch nobody takes is not raised
