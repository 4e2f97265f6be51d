"""CFPO: a convex quadratic penalty in place of the ratio clip [CFPO, arXiv 2601.22801].

    l_t = -( w_t A_t - |A_t| (w_t - 1)^2 / (2 eps) ),      w_t = pi_theta(y_t) / pi_old(y_t)

    d l_t / d w_t = -( A_t - |A_t| (w_t - 1) / eps ),       d l_t / d log pi_theta(y_t) = w_t d l_t / d w_t

Per token the surrogate w A - |A| (w - 1)^2 / (2 eps) is a concave parabola in w whose maximum sits exactly at
PPO's clip boundary, w* = 1 + eps sign(A): inside it the gradient points the way A pushes (at w = 1 it is the
plain policy gradient -A grad log pi), at it the gradient is 0, and past it the gradient points back towards
w = 1 with a force that grows linearly in w - w*. Nothing is clipped, so no token loses its gradient. The paper
derives the penalty from a total-variation divergence constraint; the same surrogate is SPO's (Simple Policy
Optimization, arXiv 2401.16025). eps is the clip range of the method CFPO replaces, so CFPO adds
no hyperparameter.

The authors' OpenRLHF, verl and TRL pull requests (OpenRLHF #1184, verl #5252, TRL #5027) compute this l_t; they
differ only in which clip range they read for eps (OpenRLHF: clip_eps_low; verl: clip_ratio; TRL: epsilon_high).

Departures from the paper:
1. log w is clamped to [-20, 20] before exp (tether.core.surrogates, departure 1), as the verl pull request does
   (the OpenRLHF one does not clamp). Beyond the clamp the token's gradient is 0, where the unclamped restoring
   gradient |A| w (w - 1) / eps would be above |A| e^40 / eps: a token that far out is lost either way.
2. A = 0 gives loss and gradient 0, as in every public implementation (the penalty is weighted by |A|).
"""

from __future__ import annotations

import torch

from .surrogates import TokenLoss, log_ratio, per_token


def cfpo(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, eps: float = 0.2
) -> tuple[TokenLoss, torch.Tensor, torch.Tensor]:
    """(TokenLoss (N, T) with no clip flags, the penalty |A| (w - 1)^2 / (2 eps) (N, T) detached, and the (N, T)
    flags of the tokens past the surrogate's maximum w* = 1 + eps sign(A), where the gradient points back to 1).

    logprobs, old_logprobs: (N, T); advantages: (N,) or (N, T)."""
    ratio = torch.exp(log_ratio(logprobs, old_logprobs))
    adv = per_token(advantages, logprobs)
    penalty = adv.abs() * (ratio - 1.0) ** 2 / (2.0 * eps)
    loss = -(ratio * adv - penalty)
    w = ratio.detach()
    past = ((adv > 0) & (w > 1.0 + eps)) | ((adv < 0) & (w < 1.0 - eps))
    none = torch.zeros_like(adv, dtype=torch.bool)
    return TokenLoss(loss, none, none, none), penalty.detach(), past
