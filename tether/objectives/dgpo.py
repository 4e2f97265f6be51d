"""DGPO [arXiv 2603.14389]: outside the clip range the gradient decays continuously instead of vanishing.

    l_t = -A w SG(decay),  decay = (w / (1 - eps_low))^n on A < 0, w < 1 - eps_low;
                           ((1 + eps_high) / w)^(1/m) on A > 0, w > 1 + eps_high;  1 elsewhere

The math and the departures from the paper are in `tether.core.dgpo`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core import dgpo as _dgpo
from ..core.masked import masked_mean
from .base import ObjectiveConfig, check, check_positive, objective
from .batch import TokenBatch


@dataclass
class DGPOConfig(ObjectiveConfig):
    """DGPO [arXiv 2603.14389]: bilateral decoupled decay of the probability-gradient weight beyond the clip bounds."""

    aggregation: str = "token-mean"
    """The paper's 1 / sum_i |o_i| (verl's default token-mean, which the authors' script keeps)."""
    eps_low: float = 0.2
    """The left boundary 1 - eps_low: below it, tokens with A < 0 get the polynomial decay (verl's clip_ratio_low,
    0.2 in the authors' script)."""
    eps_high: float = 0.2
    """The right boundary 1 + eps_high: above it, tokens with A > 0 get the reciprocal-radical decay (verl's
    clip_ratio_high, 0.2 in the authors' script)."""
    n: float = 1.0
    """Left decay exponent: the weight falls as (w / (1 - eps_low))^n (the paper's n in Z+; 1 is its default, 2 its
    suggestion for 1.5B models; verl's dgpo_n)."""
    m: float = 2.0
    """Right decay root: the weight falls as ((1 + eps_high) / w)^(1/m) (the paper's m in Z+, default 2; verl's
    dgpo_m)."""

    def __post_init__(self):
        super().__post_init__()
        check(0 <= self.eps_low < 1, "eps_low", self.eps_low, "a number in [0, 1) (the left boundary 1 - eps_low > 0)")
        check(self.eps_high >= 0, "eps_high", self.eps_high, "a number >= 0")
        check_positive(self, "n", "m")


@objective("dgpo", DGPOConfig)
def _dgpo_loss(cfg: DGPOConfig, b: TokenBatch, lp, old):
    out, decay = _dgpo.dgpo(lp, old, b.advantages, cfg.eps_low, cfg.eps_high, cfg.n, cfg.m)
    return out, {"dgpo/decay_mean": masked_mean(decay, b.loss_mask)}
