"""VESPO: a gamma-shaped, detached weight on the sequence importance ratio [VESPO, arXiv 2602.10693].

    log w_i = clamp( sum_t clamp(log r_it, -20, 20) + sum_t log rho_it,  log 1e-8,  20 )
    phi(w)  = w^k exp(lambda (1 - w)) = exp(lambda + k log w - lambda w)       (phi(1) = 1, peak at w = k / lambda)
    l_it    = -SG(phi(w_i)) A_it log pi_theta(y_it)
    (k, lambda) = (k_pos, lambda_pos) if A_it >= 0, else (k_neg, lambda_neg)

r_it = pi_theta / pi_old per token and w_i their product over the sequence (the true sequence ratio, not GSPO's
geometric mean, and no length normalisation). rho_it are the rollout-correction weights pi_old / pi_sampler
(TIS-truncated or MIS-masked, `tether.core.correction`): they are folded into w, which then measures
pi_theta / pi_sampler, instead of multiplying the token's loss (TRL's `get_gamma_weights` and the authors'
verl recipe both do this; a masked token has rho = 0, so log rho is clamped to log 1e-8 and its sequence's
phi all but vanishes). The gradient is -phi(w_i) A grad log pi: REINFORCE with a smooth, asymmetric
sequence weight in place of a clip. phi rises from 0 as w^k below w = 1 and decays as e^(-lambda w) above:
k says how hard a sequence the policy now finds unlikely is down-weighted, lambda how hard an over-likely one.

Departures from the paper, and which code this follows:
1. (k, lambda) default to (2, 3) for A >= 0 and (3, 2) for A < 0: the values TRL 1.16's `GRPOConfig`
   (`vespo_*`) and the code of the authors' verl recipe (recipe/vespo/code/core_algos.py) run. That recipe's
   docstring lists (2, 1.5) and (4, 2.5), which its code does not use; the defaults that ran are followed.
2. The per-token log rho is clamped to [log 1e-8, 20] and the combined sequence log-ratio to [log 1e-8, 20], as
   TRL does. The authors' recipe clamps the sum to [-20, 20] and then takes log max(w, 1e-8): the same log w,
   and a w that differs only below 1e-8, where phi < e^3 1e-16 either way.
3. The per-token log r is clamped to [-20, 20] before the sum (tether.core.surrogates, departure 1; both
   references do the same).
4. phi is non-finite only for extreme inputs; such a phi is set to 0, as both references do.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .surrogates import TokenLoss, per_token

LOG_W_MIN = math.log(1e-8)
LOG_W_MAX = 20.0


def sequence_log_weight(
    log_ratio: torch.Tensor, mask: torch.Tensor, rollout_weights: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """log w_i (N,) from the token log-ratios log(pi_theta / pi_old) (N, T) and the rollout-correction weights
    rho (N, T) (None: all 1), summed over the counted tokens and clamped (departures 2, 3)."""
    m = mask.bool()
    zero = torch.zeros_like(log_ratio)
    total = torch.where(m, log_ratio.clamp(-20.0, 20.0), zero).sum(-1)
    if rollout_weights is not None:
        log_rho = torch.log(rollout_weights.to(log_ratio.dtype)).clamp(LOG_W_MIN, LOG_W_MAX)
        total = total + torch.where(m, log_rho, zero).sum(-1)
    return total.clamp(LOG_W_MIN, LOG_W_MAX)


def gamma_weight(log_w: torch.Tensor, k: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """phi(w) = exp(lambda + k log w - lambda w), elementwise; non-finite values become 0 (departure 4)."""
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


def vespo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
    rollout_weights: Optional[torch.Tensor] = None,
) -> tuple[TokenLoss, torch.Tensor, torch.Tensor]:
    """(TokenLoss with no clip flags, phi (N, T) detached, log w (N,) detached).

    logprobs, old_logprobs, mask, rollout_weights: (N, T); advantages (N,) or (N, T). phi is chosen per token by
    the sign of its advantage (one value per sequence for sequence-level advantages)."""
    with torch.no_grad():
        log_w = sequence_log_weight(logprobs.detach() - old_logprobs.detach(), mask, rollout_weights)  # (N,)
        adv = per_token(advantages, logprobs)  # (N, T)
        nonneg = adv >= 0
        k = torch.where(nonneg, torch.full_like(adv, k_pos), torch.full_like(adv, k_neg))
        lam = torch.where(nonneg, torch.full_like(adv, lambda_pos), torch.full_like(adv, lambda_neg))
        phi = gamma_weight(log_w[:, None].expand_as(adv), k, lam)  # (N, T)
    none = torch.zeros_like(adv, dtype=torch.bool)
    return TokenLoss(-phi * adv * logprobs, none, none, none), phi, log_w
