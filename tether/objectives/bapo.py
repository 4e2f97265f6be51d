"""BAPO [arXiv 2510.18927]: PPO's ratio clip with bounds [c_low, c_high] searched on each batch until the
positive-advantage tokens carry a share rho_0 of the loss.

    l_t = -min(w_t A_t, clip(w_t, c_low, c_high) A_t),    rho = P / (P + M) >= rho_0      (Algorithm 1, Eq. 8)

The math, the search and the departures from the paper are in `tether.core.bapo`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..core import bapo as _bapo
from .base import ObjectiveConfig, check, check_at_least_zero, check_dual, objective
from .batch import TokenBatch


@dataclass
class BAPOConfig(ObjectiveConfig):
    """BAPO [arXiv 2510.18927]: adaptive clip bounds that balance the positive and negative parts of the loss."""

    target: float = 0.4
    """rho_0: the share P / (P + M) of the loss that positive-advantage tokens must reach (the paper's 0.4). The
    authors' verl recipe compares P / M with its adv_ratio_target t instead: t = rho_0 / (1 - rho_0), so t = 0.5
    (its README and run script) is target 1/3 and t = 1 (its yaml) is target 0.5."""
    low_start: float = 0.6
    """a-: the lower ratio bound c_low each batch starts from (an explicit bound, not 1 - eps; the paper's 0.6)."""
    low_max: float = 0.9
    """b-: the highest c_low may go (the paper's 0.9)."""
    low_step: float = 0.02
    """delta_2: c_low's step (the paper's 0.02; the recipe's script 0.05); 0 keeps c_low at low_start."""
    high_start: float = 1.2
    """a+: the upper ratio bound c_high each batch starts from (the paper's 1.2)."""
    high_max: float = 3.0
    """b+: the highest c_high may go (the paper's 3.0)."""
    high_step: float = 0.05
    """delta_1: c_high's step (the paper's 0.05; the recipe's script 0.1); 0 keeps c_high at high_start."""
    order: _bapo.Order = "high_first"
    """high_first (the paper's Algorithm 1): raise c_high to high_max first, then c_low; low_first (the authors'
    verl recipe): raise c_low to low_max first, then c_high."""
    dual_clip_c: Optional[float] = None
    """Dual clip: for A < 0 the loss is capped at -c A (c > 1); null (the paper's objective) disables it. The
    recipe always applies verl's clip_ratio_c, 3.0 by default."""

    def __post_init__(self):
        super().__post_init__()
        check(0 <= self.target <= 1, "target", self.target, "a share in [0, 1] (the paper's rho_0: 0.4)")
        check(
            0 < self.low_start <= self.low_max <= 1,
            "low_start/low_max",
            (self.low_start, self.low_max),
            "0 < low_start <= low_max <= 1 (the paper's 0.6 and 0.9), so that an on-policy token is never clipped",
        )
        check(
            1 <= self.high_start <= self.high_max,
            "high_start/high_max",
            (self.high_start, self.high_max),
            "1 <= high_start <= high_max (the paper's 1.2 and 3.0)",
        )
        check_at_least_zero(self, "low_step", "high_step")
        check(self.order in _bapo.ORDERS, "order", self.order, f"one of {', '.join(_bapo.ORDERS)}")
        check_dual(self.dual_clip_c)
        self.search = _bapo.BoundSearch(
            target=self.target,
            low_start=self.low_start,
            low_max=self.low_max,
            low_step=self.low_step,
            high_start=self.high_start,
            high_max=self.high_max,
            high_step=self.high_step,
            order=self.order,
        )


@objective("bapo", BAPOConfig)
def _bapo_loss(cfg: BAPOConfig, b: TokenBatch, lp, old):
    tokens, c = _bapo.bapo(lp, old, b.advantages, b.loss_mask, cfg.search, cfg.dual_clip_c)
    return tokens, {
        "bapo/clip_low": c.clip_low,
        "bapo/clip_high": c.clip_high,
        "bapo/positive_share": c.positive_share,
        "bapo/target_met": c.target_met.to(lp.dtype),
        "bapo/steps": c.steps.to(lp.dtype),
    }
