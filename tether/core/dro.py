"""DRO: the policy gradient with a quadratic log-ratio penalty [DRO, Richemond et al., arXiv 2405.19107].

    l_t = -( A_t log pi_theta(y_t) - (beta / 2) (log pi_theta(y_t) - log pi_old(y_t))^2 )

    d l_t / d log pi_theta(y_t) = -(A_t - beta log r_t),     r_t = pi_theta / pi_old

The paper's DRO fits a policy and a value function to single-trajectory rewards with the squared residual
(1/2) (r(x, y) - V(x) - beta log(pi_theta(y|x) / pi_ref(y|x)))^2. Its policy gradient, divided by beta, is
-(A - beta log(pi_theta / pi_ref)) grad log pi_theta with A = r - V: the gradient of l above, which is how
verl 0.9.1 (`dro`, `policy_loss.dro_beta`) and Tinker's `dro` loss ship it. The penalty pulls each token's
log-ratio back to 0 with a force beta log r that grows without bound: a soft trust region around pi_old.

Departures from the paper (all shared with verl 0.9.1's `dro`, whose loss this equals):
1. Per token, online: the anchor is pi_old (the policy that sampled the batch), not a fixed pi_ref, and A is
   the configured group advantage, not r - V with a learned V.
2. The penalty is on each token's log-ratio, not on the sequence's log-ratio.
3. log r is not clamped (unlike tether.core.surrogates, departure 1): the penalty is the trust region, and a
   clamp would switch off its restoring force exactly where the ratio is furthest from 1. The padding's
   log-probs are zeroed by the caller, so log r is finite there.
4. The penalty acts on every counted token, A = 0 included (as in verl and Tinker): the loss is never 0 off-policy.
"""

from __future__ import annotations

import torch

from .surrogates import TokenLoss, per_token


def dro(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, beta: float) -> TokenLoss:
    """The per-token DRO loss (N, T), no clip flags; logprobs, old_logprobs (N, T), advantages (N,) or (N, T)."""
    adv = per_token(advantages, logprobs)
    log_r = logprobs - old_logprobs.detach()  # departure 3: unclamped
    none = torch.zeros_like(adv, dtype=torch.bool)
    return TokenLoss(-(adv * logprobs - 0.5 * beta * log_r**2), none, none, none)
