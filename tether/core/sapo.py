"""SAPO: a soft, temperature-controlled gate in place of the hard clip [SAPO (Qwen), arXiv 2511.20347].

    l_t = -f_tau(w_t) A_t,   f_tau(w) = (4 / tau) sigmoid(tau (w - 1)),   tau = tau_pos if A_t > 0 else tau_neg

d f / d w = 4 sigmoid(tau (w - 1)) (1 - sigmoid(tau (w - 1))) is 1 at w = 1 (on-policy SAPO is the plain policy
gradient) and decays smoothly as w leaves 1, faster for larger tau: the gradient of a far off-policy token is
attenuated instead of cut. tau_neg > tau_pos (1.05 > 1.0 in the paper) damps negative-advantage updates,
which raise the logits of many unsampled tokens, faster.

Departures from the paper:
1. log w is clamped to [-20, 20] before exp (tether.core.surrogates, departure 1), as verl does.
2. A = 0 takes tau_neg (verl's convention); its loss and gradient are 0 either way.
3. The paper aggregates seq-mean-token-mean; that is the `sapo` config's default aggregation, and any other
   mode composes (verl's `sapo` always uses seq-mean-token-mean, whatever loss_agg_mode says).
"""

from __future__ import annotations

import torch

from .surrogates import TokenLoss, log_ratio, per_token


def sapo_gate(ratio: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """f_tau(w) = (4 / tau) sigmoid(tau (w - 1)); elementwise, tau broadcastable to w."""
    return torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)


def sapo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[TokenLoss, torch.Tensor]:
    """(TokenLoss with no clip flags, the gate's slope d f / d w (N, T) detached): the slope is the factor
    by which SAPO scales each token's plain policy-gradient weight w A."""
    ratio = torch.exp(log_ratio(logprobs, old_logprobs))
    adv = per_token(advantages, logprobs)
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    loss = -sapo_gate(ratio, tau) * adv
    s = torch.sigmoid(tau * (ratio.detach() - 1.0))
    none = torch.zeros_like(adv, dtype=torch.bool)
    return TokenLoss(loss, none, none, none), 4.0 * s * (1.0 - s)
