"""ABC-GRPO: four unconditional clip bounds, two per advantage sign [ABC-GRPO, arXiv 2601.03895].

Liu, Chen, "Adaptive-Boundary-Clipping GRPO: Ensuring Bounded Ratios for Stable and Generalizable Training" (2026).
GRPO's min(w A, clip(w) A) bounds w only on the side the advantage pushes: for A < 0 a large w (the paper's Q4) and
for A > 0 a small w (Q2) keep their gradient. ABC-GRPO clips the ratio itself, on both sides, for either sign:

    w~_t = clip(w_t, 1 - eps2, 1 + eps1)   if A > 0             (eps1: Q1, the upper bound; eps2: Q2, the lower)
    w~_t = clip(w_t, 1 - eps4, 1 + eps3)   if A <= 0            (eps3: Q4, the upper bound; eps4: Q3, the lower)

    l_t = -w~_t A                                               (the paper's Algorithm 1, line 9)

so a token outside its interval has no gradient whatever the sign of A (Eq. 12), and inside it has -A w grad log pi.
GRPO is the special case eps3 -> inf with eps2 >= 1 (a lower bound <= 0 never binds).

Departures:
1. A bound may be None: that side is unbounded (eps3 None with eps2 >= 1 is GRPO's clip, tested).
2. Flags mark the tokens with A != 0 whose ratio a bound cut (A = 0 has no gradient to remove): clip_low below
   the lower bound (Q2 for A > 0, Q3 for A < 0), clip_high above the upper (Q1, Q4).
3. log w is clamped to [-20, 20] before exp (tether.core.surrogates, departure 1).
"""

from __future__ import annotations

from typing import Optional

import torch

from .surrogates import TokenLoss, log_ratio, per_token


def _bound(eps: Optional[float], sign: float) -> float:
    """1 + sign * eps, or +-inf when eps is None (that side unbounded)."""
    return sign * float("inf") if eps is None else 1.0 + sign * eps


def abc_grpo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_pos_high: Optional[float] = 0.2,
    eps_pos_low: Optional[float] = 0.2,
    eps_neg_high: Optional[float] = 0.2,
    eps_neg_low: Optional[float] = 0.2,
) -> tuple[TokenLoss, dict[str, torch.Tensor]]:
    """(TokenLoss of -clip(w, low, high) A, the (N, T) bool masks of the four quadrants' clip events q1..q4).

    The bounds are eps1..eps4 of the paper: (eps_pos_high, eps_pos_low) for A > 0, (eps_neg_high, eps_neg_low) for
    A <= 0."""
    ratio = torch.exp(log_ratio(logprobs, old_logprobs))
    adv = per_token(advantages, logprobs)
    w = ratio.detach()
    pos, neg = adv > 0, adv < 0
    low = torch.where(pos, torch.full_like(w, _bound(eps_pos_low, -1.0)), torch.full_like(w, _bound(eps_neg_low, -1.0)))
    high = torch.where(
        pos, torch.full_like(w, _bound(eps_pos_high, 1.0)), torch.full_like(w, _bound(eps_neg_high, 1.0))
    )
    clipped = torch.minimum(torch.maximum(ratio, low), high)  # (N, T), the paper's w~
    below, above = w < low, w > high
    quadrants = {"q1": pos & above, "q2": pos & below, "q3": neg & below, "q4": neg & above}
    flags_low, flags_high = quadrants["q2"] | quadrants["q3"], quadrants["q1"] | quadrants["q4"]
    return TokenLoss(-clipped * adv, flags_low, flags_high, torch.zeros_like(pos)), quadrants
