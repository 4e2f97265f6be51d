"""ABC-GRPO [arXiv 2601.03895]: the ratio itself clipped on both sides, with a bound pair per advantage sign.

    l_t = -clip(w, 1 - eps_pos_low, 1 + eps_pos_high) A     (A > 0)
    l_t = -clip(w, 1 - eps_neg_low, 1 + eps_neg_high) A     (A <= 0)

The math and the departures from the paper are in `tether.core.abc_grpo`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..core import abc_grpo as _abc
from ..core.masked import masked_fraction
from .base import ObjectiveConfig, check, objective
from .batch import TokenBatch

_BOUNDS = ("eps_pos_high", "eps_pos_low", "eps_neg_high", "eps_neg_low")


@dataclass
class ABCGRPOConfig(ObjectiveConfig):
    """ABC-GRPO [arXiv 2601.03895]: four unconditional clip bounds, eps1..eps4, one per quadrant of (w, A)."""

    aggregation: str = "seq-mean-token-mean"
    """The paper's objective (Eq. 6): (1 / G) sum_i (1 / |y_i|) sum_t w~ A_i."""
    eps_pos_high: Optional[float] = 0.2
    """eps1, A > 0: w is clipped at 1 + eps1 (Q1, as GRPO). The paper's runs: 0.2; null: unbounded."""
    eps_pos_low: Optional[float] = 0.2
    """eps2, A > 0: w is clipped at 1 - eps2 (Q2, where GRPO does not clip). The paper's runs: 0.2; null (or >= 1):
    unbounded."""
    eps_neg_high: Optional[float] = 0.2
    """eps3, A <= 0: w is clipped at 1 + eps3 (Q4, GRPO's unbounded quadrant). The paper's runs: 0.2; null:
    unbounded (GRPO's eps3 -> inf)."""
    eps_neg_low: Optional[float] = 0.2
    """eps4, A <= 0: w is clipped at 1 - eps4 (Q3, as GRPO). The paper's runs: 0.2; null (or >= 1): unbounded."""

    def __post_init__(self):
        super().__post_init__()
        for key in _BOUNDS:
            value = getattr(self, key)
            check(value is None or value >= 0, key, value, "a number >= 0, or null for no bound on that side")


@objective("abc_grpo", ABCGRPOConfig)
def _abc_grpo_loss(cfg: ABCGRPOConfig, b: TokenBatch, lp, old):
    out, quadrants = _abc.abc_grpo(lp, old, b.advantages, **{k: getattr(cfg, k) for k in _BOUNDS})
    return out, {f"abc_grpo/clipfrac_{q}": masked_fraction(v, b.loss_mask) for q, v in quadrants.items()}
