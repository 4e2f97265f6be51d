"""Bounded-lag rollouts (`trainer.staleness: s`): the batch of RL step t is sampled by the policy of step t - s.

An asynchronous trainer (TRL's AsyncGRPOTrainer `max_staleness`, verl's one-step-off and fully-async trainers,
prime-rl's `max_async_level`, AReaL's `max_head_offpolicyness`) trains on rollouts that a policy several updates
old produced. tether reproduces that lag exactly and deterministically on one process: it keeps the trainable
weights of the last s policies (CPU copies, a FIFO), and before sampling step t it loads the weights of step
t - s into the model, samples, and puts the current weights back (bitwise: `copy_` of the saved tensors).
"The policy of step t" is the one step t's updates start from; step t samples with that of step max(1, t - s), so
the first s + 1 steps sample with the initial policy (the policy of step 1), as the M2PO paper's stale-k runs
start. Under LoRA the trainable weights are the adapters, so only they are copied.

The three policies then stay apart:
    pi_sampler   the stale policy; its log-probs come from the engine (`RolloutBatch.sampler_logprobs`)
    pi_old       the trust region's anchor: `trainer.old_logprobs: recompute` (decoupled: the current policy,
                 recomputed before the updates; the sampler mismatch is left to `objective.rollout_correction`)
                 or `sampler` (bypass: pi_old = pi_sampler, the region is measured against the stale policy)
    pi_theta     the policy being updated
and `stale/lag`, `stale/kl_k1`, `stale/kl_k3` (KL(pi_sampler || pi_old) from the sampled tokens) are logged.

The FIFO is part of every checkpoint (`state()`), so a run killed and resumed with s > 0 continues exactly.
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Iterator, Optional

import torch

from ..core.kl import k3_of_log
from ..core.masked import masked_mean


def _trainable(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def load_trainable(model, weights: dict[str, torch.Tensor]) -> None:
    """Copy `weights` (a FIFO entry: name -> tensor) into the model's trainable parameters, bitwise. The
    policy (`StalePolicies.sampling`) and the overlap's sampler copy, which keeps the policy's
    requires_grad flags and so its trainable names, load them the same way."""
    trainable = _trainable(model)
    if trainable.keys() != weights.keys():
        raise RuntimeError(
            f"the model has {len(trainable)} trainable tensors, the stale policy {len(weights)}, not the same names"
        )
    with torch.no_grad():
        for n, p in trainable.items():
            p.copy_(weights[n])


class StalePolicies:
    """The weights of the last s policies, oldest first, each with the RL step whose policy it is."""

    def __init__(self, model, staleness: int, saved: Optional[dict] = None):
        if staleness < 1:
            raise ValueError(f"staleness must be >= 1 to keep policies; got {staleness}")
        self.staleness = staleness
        if saved is None:  # a new run: steps 1 - s .. 0 are the initial policy (one copy, shared)
            initial = self._copy(model)
            self.weights, self.steps = deque([initial] * staleness), deque([1] * staleness)
        else:
            if len(saved["weights"]) != staleness:
                raise ValueError(
                    f"the checkpoint holds {len(saved['weights'])} stale policies, the config says "
                    f"trainer.staleness={staleness}"
                )
            self.weights, self.steps = deque(saved["weights"]), deque(int(s) for s in saved["steps"])

    @staticmethod
    def _copy(model) -> dict[str, torch.Tensor]:
        return {n: p.detach().to("cpu", copy=True) for n, p in _trainable(model).items()}

    @contextlib.contextmanager
    def sampling(self, model, step: int) -> Iterator[int]:
        """Within the block `model` holds the policy of step max(1, step - s); yields that step. On exit the
        current weights are back, bitwise, and the current policy joins the FIFO."""
        stale, stale_step = self.advance(model, step)
        current = self.weights[-1]  # the copy `advance` just made
        load_trainable(model, stale)
        try:
            yield stale_step
        finally:
            load_trainable(model, current)

    def advance(self, model, step: int) -> tuple[dict[str, torch.Tensor], int]:
        """The current policy (that of `step`) joins the FIFO and the oldest leaves it: returns the sampler of
        `step`, its weights and its step. `sampling` swaps it into the model; `tether.trainer.overlap` into a copy."""
        self.weights.append(self._copy(model))
        self.steps.append(step)
        return self.weights.popleft(), self.steps.popleft()

    def next_sampler(self) -> tuple[dict[str, torch.Tensor], int]:
        """The sampler of the step after the last `advance` (the FIFO's oldest), already known now."""
        return self.weights[0], self.steps[0]

    def state(self) -> dict:
        """The FIFO for a checkpoint (tensors and ints only: `torch.load(weights_only=True)` reads it)."""
        return {"weights": list(self.weights), "steps": list(self.steps)}


def stale_metrics(
    lag: int, sampler_logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """`stale/lag` and KL(pi_sampler || pi_old) estimated on the sampled tokens (N, T): k1 = mean(lp_sampler -
    lp_old), k3 = mean(r - 1 - log r) with r = pi_old / pi_sampler (never negative). 0 under bypass anchoring."""
    d = torch.where(mask.bool(), old_logprobs - sampler_logprobs, torch.zeros_like(old_logprobs))
    return {
        "stale/lag": float(lag),
        "stale/kl_k1": masked_mean(-d, mask).item(),
        "stale/kl_k3": masked_mean(k3_of_log(d), mask).item(),
    }
