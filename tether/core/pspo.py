"""PSPO: smooth the policy toward the behaviour policy before taking the ratio, instead of clipping it
[PSPO, arXiv 2509.21282].

    pi~ = (1 - alpha) pi_theta + alpha pi_old,     w~_t = pi~ / pi_old = (1 - alpha) w_t + alpha,     l_t = -w~_t A_t

with no min and no clip (GR-PSPO: GRPO with w~ in place of the clipped ratio). Per state, E_{pi_old}[w~ A] =
sum_a pi~(a) A(a): the loss is the smoothed policy's expected advantage, exactly, however far pi_theta has moved
(tests/objectives/test_aspo_pspo.py enumerates this). Its gradient is -(1 - alpha) w A grad lp: the unclipped
importance-sampled policy gradient times the constant 1 - alpha. The smoothing contracts every divergence of
pi~ from pi_old (the paper's total-variation lemma: TV(pi~, pi_old) = (1 - alpha) TV(pi_theta, pi_old)), but no
factor of the gradient depends on how far w is from 1, so nothing bounds the update of pi_theta itself: with a
constant scale, what PSPO changes against the unclipped surrogate is the step size (largely undone by Adam's
normalisation) and the weight of the policy term next to a KL penalty or entropy bonus.

Departures from the paper:
1. log w is clamped to [-20, 20] before exp (tether.core.surrogates, departure 1); the authors' TRL patch and TRL
   PR #4548 do not clamp.
2. alpha must lie in [0, 1): alpha = 1 makes the loss a constant with no gradient (the authors' config accepts it).
   alpha = 0 is the unclipped ratio surrogate -w A.
3. Token-level ratios, as in the paper; TRL's importance_sampling_level="sequence" would smooth a sequence ratio
   instead, which the PR allows and the paper does not use.
"""

from __future__ import annotations

import torch

from .surrogates import TokenLoss, log_ratio, per_token


def smoothed_ratio(ratio: torch.Tensor, alpha: float) -> torch.Tensor:
    """w~ = (1 - alpha) w + alpha: the ratio of the smoothed policy pi~ to pi_old (elementwise)."""
    return (1.0 - alpha) * ratio + alpha


def pspo(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, alpha: float = 0.1
) -> tuple[TokenLoss, torch.Tensor]:
    """(TokenLoss with no clip flags, the smoothed ratio w~ (N, T) detached). logprobs, old_logprobs (N, T);
    advantages (N,) or (N, T)."""
    ratio = torch.exp(log_ratio(logprobs, old_logprobs))
    adv = per_token(advantages, logprobs)
    smoothed = smoothed_ratio(ratio, alpha)
    none = torch.zeros_like(adv, dtype=torch.bool)
    return TokenLoss(-smoothed * adv, none, none, none), smoothed.detach()
