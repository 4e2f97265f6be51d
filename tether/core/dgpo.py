"""DGPO: decoupled decay of the probability-gradient weight outside the clip range [DGPO, arXiv 2603.14389].

Fu et al., "From log pi to pi: Taming Divergence in Soft Clipping via Bilateral Decoupled Decay of Probability
Gradient Weight" (2026), Decoupled Gradient Policy Optimization. The objective is written in the probability
gradient, J = (1 / sum_i |o_i|) sum_{i,t} W_t A_i pi_theta(o_t), with w = pi_theta / pi_old and

    W_t = 1 / pi_old                                          inside: the plain policy gradient A w grad log pi
    W_t = C_left  SG(pi_theta^n)                              LN: A < 0 and w < 1 - eps_low
    W_t = C_right SG(pi_theta^(-1/m))                         HP: A > 0 and w > 1 + eps_high

C_left = (1 - eps_low)^-n pi_old^-(n+1) and C_right = (1 + eps_high)^(1/m) pi_old^(1/m - 1) make W continuous at
the bounds. In log-probability terms the gradient of a decayed token is -A w decay(w) grad log pi with

    decay = (w / (1 - eps_low))^n        on LN (polynomial: -> 0 as pi_theta -> 0, where CISPO's weight diverges)
    decay = ((1 + eps_high) / w)^(1/m)   on HP (reciprocal radical: a gentle slow-down of a rising token)

and decay = 1 elsewhere, so l_t = -A w SG(decay): its value, w^(n+1) / (1 - eps_low)^n on LN and
(1 + eps_high)^(1/m) w^(1 - 1/m) on HP, is the paper's J term by term, and unlike PPO's clip no token loses its
gradient. The other two quadrants (A > 0, w < 1 - eps_low; A < 0, w > 1 + eps_high) keep -A w, as PPO does.

Departures:
1. The decay is computed in log space from the clamped log-ratio, exp(n (log w - log(1 - eps_low))), which equals
   the authors' exp(lp + n SG(lp) - (n + 1) lp_old) / (1 - eps_low)^n; the authors use the unclamped lp there (and
   the clamped ratio for the region test), so the two differ only where |log w| > 20 (tether.core.surrogates,
   departure 1).
2. No dual clip: the authors' `dgpo` branch (DGPO-RL, verl/trainer/ppo/core_algos.py, `compute_policy_loss`) skips
   verl's dual clip, so A < 0 with a large w keeps -A w, as here.
3. n and m may be any positive numbers; the paper takes them in Z+ (default n = 1, m = 2).
"""

from __future__ import annotations

import math

import torch

from .surrogates import TokenLoss, log_ratio, per_token


def dgpo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    n: float = 1.0,
    m: float = 2.0,
) -> tuple[TokenLoss, torch.Tensor]:
    """(TokenLoss, decay (N, T) detached): l = -A w SG(decay). Flags: clip_low marks the LN tokens (A < 0,
    w < 1 - eps_low), clip_high the HP tokens (A > 0, w > 1 + eps_high), whose gradient is decayed, not removed."""
    log_w = log_ratio(logprobs, old_logprobs)
    w = torch.exp(log_w)
    adv = per_token(advantages, logprobs)
    lw = log_w.detach()
    left = (adv < 0) & (lw.exp() < 1.0 - eps_low)
    right = (adv > 0) & (lw.exp() > 1.0 + eps_high)
    zero = torch.zeros_like(lw)
    log_decay = torch.where(left, n * (lw - math.log1p(-eps_low)), zero)
    log_decay = torch.where(right, (math.log1p(eps_high) - lw) / m, log_decay)
    decay = torch.exp(log_decay)
    return TokenLoss(-adv * w * decay, left, right, torch.zeros_like(left)), decay
