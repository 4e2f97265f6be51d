"""BAPO: PPO's ratio clip whose bounds are searched, batch by batch, until positive-advantage tokens carry a target
share of the loss [BAPO, arXiv 2510.18927].

Xi et al., "BAPO: Stabilizing Off-Policy RL for LLMs via Balanced Policy Optimization with Adaptive Clipping" (2025).
With w_t = pi_theta / pi_old and bounds [c_low, c_high] (explicit ratio bounds, not 1 -/+ eps):

    l_t = -min(w_t A_t, clip(w_t, c_low, c_high) A_t)                         Algorithm 1, line 20 (Eq. 4's clip)

    P(c_high) = sum_{t: A_t > 0} A_t min(w_t, c_high)        the positive tokens' part of the loss   (>= 0)
    M(c_low)  = sum_{t: A_t < 0} |A_t| max(w_t, c_low)       the negative tokens' part               (>= 0)
    rho       = P / (P + M) >= rho_0                         the positive contribution, Eq. 8

(min(w A, clip(w, lo, hi) A) is A min(w, hi) for A > 0 and A max(w, lo) for A < 0, so P reads only c_high and M
only c_low; Eq. 8 writes clip(w, 0, c_high) in its numerator for that reason.) The bounds walk a fixed path from
(a-, a+) and stop at its first point where rho >= rho_0, or at its last point:

    high_first  (Algorithm 1)      c_high += delta_1 up to b+, then c_low += delta_2 up to b-
    low_first   (authors' recipe)  c_low  += delta_2 up to b-, then c_high += delta_1 up to b+

Raising c_high adds positive contribution; raising c_low ADDS negative contribution (a clipped negative token still
counts |A| c_low) while removing the gradient of more low-probability negative tokens, so on either path the walk
goes on to the end of the c_low segment once it is entered without the target met. The paper's values: rho_0 0.4,
[a-, b-] = [0.6, 0.9], [a+, b+] = [1.2, 3.0], delta_1 0.05 (upper), delta_2 0.02 (lower).

No state is carried across steps: every batch starts again from (a-, a+) (Algorithm 1, line 9; the recipe's
`compute_policy_loss_bapo` likewise), so the bounds are a function of the batch alone.

The authors' verl recipe is github.com/WooooDyy/BAPO, recipe/bapo/policy_loss.py at commit 7287044 (the file was
last changed in 3b8389c).

Departures from the paper:
1. Eq. 8 is typeset |sum_{A>0} ...| / |sum_t ...|; the denominator is read as the total size of the loss, P + M
   (the "positive loss contribution" the paper plots lies in [0, 1]), not as |P - M|, which is not a share and is
   not monotone in the bounds. The recipe instead compares P / (M + 1e-8) with its `adv_ratio_target` t: the two
   conditions are the same for t = rho_0 / (1 - rho_0) (the paper's rho_0 0.4 is t = 2/3; the recipe README's
   "rho_0 = 0.5", passed as t, is rho_0 = 1/3), except where P - t M lies within t 1e-8 of 0. Without negative
   contribution (M = 0) the target is met at the start, as the recipe's infinite ratio is.
2. Eq. 8 weighs each token by pi_rollout(y_t): the expectation over sampled tokens, whose Monte-Carlo estimate is
   the plain sum over the batch's tokens (the recipe's too). `weights` is that sum's per-token weight: the loss
   mask, or pi_rollout itself when a caller enumerates every action (the enumeration test does).
3. The last step of a side stops at its maximum, min(c + delta, b) (the recipe); Algorithm 1 never passes b and
   stops one step short of it when b - a is not a multiple of delta. The paper's values are multiples (1.8 = 36 x
   0.05, 0.3 = 15 x 0.02), where both give the same path. Path points are a + k delta, not a running sum, and k
   is counted with a 1e-9 tolerance and the last point is b itself, so that 0.6 + 15 x 0.02 is 0.9 despite
   rounding.
4. Algorithm 1's loop condition asks for room on the lower side (c_low + delta_2 <= b-) even while it raises
   c_high, so with an empty lower range it would not raise c_high either; here each side's steps depend only on its
   own range. The two agree whenever [a-, b-] holds a step, as the paper's does.
5. The sums run over the batch the loss is given: the micro-batch under gradient accumulation, as in the recipe,
   which since commit 3b8389c also sums P and M over data-parallel ranks so that every rank picks the same bounds.
   `contributions` returns P and M at every point of the path so that a data-parallel caller can all-reduce them
   before `choose`; tether's objective runs in one process and does not. The paper says "for each update with a
   batch".
6. Sync-free: P and M are computed at every point of the path at once and the first qualifying point is an argmax;
   the recipe's loop reads each ratio to the host (`.item()`) and stops early. Same bounds.
7. No dual clip by default (`dual_clip_c` None): Algorithm 1's objective has none; the recipe always applies verl's
   dual clip at clip_ratio_c (3.0 by default), which `dual_clip_c: 3.0` reproduces.
8. log w is clamped to [-20, 20] before exp (tether.core.surrogates, departure 1), as the recipe does.
9. A = 0 counts on neither side (the recipe puts it on the c_high side); it contributes 0 either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple, Optional

import torch

from .surrogates import TokenLoss, clip_ratio_loss, log_ratio, per_token

Order = Literal["high_first", "low_first"]
ORDERS = ("high_first", "low_first")
STEP_TOLERANCE = 1e-9  # how far short of a side's maximum a step may land and still count as reaching it


@dataclass(frozen=True)
class BoundSearch:
    """Where the bounds may move and when they stop (tether.objectives.BAPOConfig documents each field, in the
    paper's notation rho_0, a-, b-, delta_2, a+, b+, delta_1)."""

    target: float  # rho_0, the positive share of the loss to reach
    low_start: float  # a-
    low_max: float  # b-
    low_step: float  # delta_2
    high_start: float  # a+
    high_max: float  # b+
    high_step: float  # delta_1
    order: Order = "high_first"

    def path(self) -> tuple[list[float], list[float]]:
        """(c_low, c_high) at each point of the walk, as two lists of P floats; point 0 is (a-, a+)."""
        lows = _steps(self.low_start, self.low_max, self.low_step)
        highs = _steps(self.high_start, self.high_max, self.high_step)
        low_end = lows[-1] if lows else self.low_start
        high_end = highs[-1] if highs else self.high_start
        if self.order == "high_first":
            low = [self.low_start] * (1 + len(highs)) + lows
            high = [self.high_start] + highs + [high_end] * len(lows)
        else:
            low = [self.low_start] + lows + [low_end] * len(highs)
            high = [self.high_start] * (1 + len(lows)) + highs
        return low, high


def _steps(start: float, stop: float, step: float) -> list[float]:
    """The values after `start`: start + k step for k = 1, 2, ..., the last one `stop` itself (departure 3)."""
    if step <= 0 or stop <= start:
        return []
    n = math.ceil((stop - start) / step - STEP_TOLERANCE)
    return [start + k * step for k in range(1, n)] + [stop]


def contributions(
    ratio: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor, low: torch.Tensor, high: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, M), each (P,): the positive and negative parts of the loss at each path point (`low`, `high` (P,)).

    ratio (N, T) detached, advantages (N, T), weights (N, T): the loss mask or per-token weights (departure 2).
    Tokens of weight 0 count nothing, whatever their ratio. Sums are taken in at least float32, in the dtype of
    `low`; the broadcast holds P x N x T values (52 per token on the paper's path)."""
    counted = weights != 0
    w = torch.where(counted, ratio.to(low.dtype), torch.ones_like(ratio, dtype=low.dtype))
    a = torch.where(counted, advantages.to(low.dtype) * weights.to(low.dtype), torch.zeros_like(w))
    pos, neg = a.clamp(min=0.0), (-a).clamp(min=0.0)  # (N, T)
    p = (pos * torch.minimum(w, high[:, None, None])).sum(dim=(1, 2))  # (P, N, T) -> (P,)
    m = (neg * torch.maximum(w, low[:, None, None])).sum(dim=(1, 2))
    return p, m


def met(pos: torch.Tensor, neg: torch.Tensor, target: float) -> torch.Tensor:
    """(P,) bool: rho = P / (P + M) >= rho_0 at each path point, written without the division (departure 1)."""
    return pos >= target * (pos + neg)


def choose(pos: torch.Tensor, neg: torch.Tensor, target: float) -> torch.Tensor:
    """The index of the chosen path point (0-dim int64): the first where the target is met, else the last."""
    ok = met(pos, neg, target)
    ok = torch.cat([ok[:-1], torch.ones_like(ok[-1:])])
    return torch.argmax(ok.to(torch.int64))  # argmax returns the first of equal maxima


def positive_share(pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    """rho = P / (P + M), and 0 where there is no contribution at all."""
    total = pos + neg
    return torch.where(total > 0, pos / torch.where(total > 0, total, torch.ones_like(total)), torch.zeros_like(total))


class Choice(NamedTuple):
    """The bounds a batch chose, all 0-dim and detached."""

    clip_low: torch.Tensor  # c_low
    clip_high: torch.Tensor  # c_high
    positive_share: torch.Tensor  # rho at the chosen bounds
    target_met: torch.Tensor  # bool: rho >= rho_0 there (False: the path ran out)
    steps: torch.Tensor  # int64: the chosen point's index on the path (0: the start bounds)


def bapo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    search: BoundSearch,
    dual_clip_c: Optional[float] = None,
) -> tuple[TokenLoss, Choice]:
    """(PPO-clip TokenLoss (N, T) at the chosen bounds, the Choice). logprobs, old_logprobs (N, T); advantages
    (N,) or (N, T); weights (N, T), the loss mask (or Eq. 8's per-token weights, departure 2)."""
    ratio = torch.exp(log_ratio(logprobs, old_logprobs))
    adv = per_token(advantages, logprobs)
    low_path, high_path = search.path()
    acc = torch.promote_types(ratio.dtype, torch.float32)  # a bf16 sum over a batch's tokens would decide by noise
    low = torch.tensor(low_path, dtype=acc, device=ratio.device)  # (P,)
    high = torch.tensor(high_path, dtype=acc, device=ratio.device)
    pos, neg = contributions(ratio.detach(), adv, weights, low, high)
    k = choose(pos, neg, search.target)
    c_low, c_high = low[k].to(ratio.dtype), high[k].to(ratio.dtype)
    tokens = clip_ratio_loss(ratio, adv, c_low, c_high, dual_clip_c)
    share = positive_share(pos[k], neg[k])
    return tokens, Choice(c_low, c_high, share, met(pos[k], neg[k], search.target), k)
