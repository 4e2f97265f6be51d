"""KL-to-reference penalty estimators, per token (N, T), added to the loss times a coefficient.

With r = pi_ref / pi_theta and w = pi_theta / pi_old, and samples from pi_old:

    k1     lp - lp_ref                 expected gradient: 0 on-policy (the score function has mean 0);
                                       it estimates KL(pi_theta || pi_ref) but does not minimise it.
    k2     (lp - lp_ref)^2 / 2         on-policy: grad KL(pi_theta || pi_ref) (reverse KL).
    k3     r - 1 - log r               GRPO's term, no importance weight. On-policy its gradient is
                                       grad KL(pi_ref || pi_theta) (the FORWARD KL, not the reverse KL
                                       it estimates); off-policy it is the gradient of no KL at all.
    k3_iw  w (r - 1 - log r)           the corrected term [RPG section 2.2; docs/algorithms/rpg.md]: the gradient of
                                       UKL(pi_theta || pi_ref) exactly, on- or off-policy; for
                                       normalised policies that is grad KL(pi_theta || pi_ref).
                                       Identical to RPG's `urkl` term with anchor = ref.
    abs    |lp - lp_ref|               verl's and SkyRL's `abs`: a bounded-slope penalty; its gradient
                                       sign(lp - lp_ref) grad lp is the gradient of no KL.
    k3_clamped  clamp(k3, -10, 10), log r clamped to [-20, 20] first: verl's `low_var_kl` (and its
                                       `k3`), SkyRL's and slime's k3. Equal to k3 wherever k3 <= 10; a
                                       token with k3 > 10 (log r > 2.53 or < -10.99) gets no KL gradient.

Reference: [RPG] Zhang et al., arXiv 2505.17508, section 2.2 (the GRPO KL term and its correction).
Departure: none; these are the textbook estimators (Schulman, "Approximating KL divergence"). `k3` is not
clamped (the value that verl, SkyRL and slime clamp at 10 keeps its gradient here); `k3_clamped` is theirs.

The squared log-ratio to the sampler (Kimi K2.5, arXiv 2602.02276; prime-rl's `kl_tau` term), added to any
objective's loss as `sampler_kl_coef` x its aggregation:

    s_t = (log pi_theta(y_t) - log pi_sampler(y_t))^2,     d s_t / d log pi_theta = 2 log(pi_theta / pi_sampler)

On samples from pi_sampler, E[s] / 2 is the k2 estimate of the KL between pi_theta and pi_sampler (either
direction: they agree to second order). Its gradient pulls every token's log-prob back towards the one the
sampler (the inference engine) gave it, so it bounds both the staleness drift and the train-inference mismatch.
prime-rl adds tau s_t on every
token of its loss mask (the ones its DPPO mask drops included) and divides the sum by the batch's loss tokens:
tether's `token-mean`. Departure: none (no factor 1/2, no clamp, as prime-rl).
"""

from __future__ import annotations

import torch

from .registry import Registry
from .surrogates import log_ratio

KL_ESTIMATORS: Registry = Registry("KL estimator")


def k3_of_log(log_y: torch.Tensor) -> torch.Tensor:
    """k3(y) = y - 1 - log y, from log y (stable: never forms y / y)."""
    return torch.expm1(log_y) - log_y


@KL_ESTIMATORS.register("k1")
def k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    return logprobs - ref_logprobs.detach()


@KL_ESTIMATORS.register("k2")
def k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    return (logprobs - ref_logprobs.detach()) ** 2 / 2.0


@KL_ESTIMATORS.register("k3")
def k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    return k3_of_log(ref_logprobs.detach() - logprobs)


@KL_ESTIMATORS.register("k3_iw")
def k3_iw(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    w = torch.exp(log_ratio(logprobs, old_logprobs))
    return w * k3_of_log(ref_logprobs.detach() - logprobs)


def squared_log_ratio(logprobs: torch.Tensor, sampler_logprobs: torch.Tensor) -> torch.Tensor:
    """s_t = (lp - lp_sampler)^2 per token (N, T), with gradient through lp only."""
    return (logprobs - sampler_logprobs.detach()) ** 2


@KL_ESTIMATORS.register("abs")
def abs_(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    return (logprobs - ref_logprobs.detach()).abs()


@KL_ESTIMATORS.register("k3_clamped")
def k3_clamped(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    return k3_of_log((ref_logprobs.detach() - logprobs).clamp(-20.0, 20.0)).clamp(-10.0, 10.0)


def kl_penalty(
    estimator: str, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, old_logprobs: torch.Tensor
) -> torch.Tensor:
    """Per-token penalty (N, T) of the named estimator."""
    return KL_ESTIMATORS.get(estimator)(logprobs, ref_logprobs, old_logprobs)
