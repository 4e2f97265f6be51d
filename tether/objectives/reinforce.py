"""The policy-gradient family without a clipped gradient: every token keeps its gradient.

    REINFORCE:                l_t = -A log pi_theta(y_t)        (optionally times SG(w_t))
    CISPO [arXiv 2506.13585]: l_t = -SG(clip(w_t, 1 - eps_low, 1 + eps_high)) A log pi_theta(y_t)

The math is `tether.core.surrogates`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core import surrogates as _sur
from .base import ClipRange, ObjectiveConfig, objective
from .batch import TokenBatch


@dataclass
class ReinforceConfig(ObjectiveConfig):
    """Plain REINFORCE: l = -A lp."""

    importance_weight: bool = False
    """Multiply by SG(w) (unbiased off-policy; unbounded variance)."""

    def has_trust_region(self) -> bool:
        return False


@objective("reinforce", ReinforceConfig)
def _reinforce(cfg: ReinforceConfig, b: TokenBatch, lp, old):
    return _sur.reinforce(lp, old, b.advantages, cfg.importance_weight), {}


@dataclass
class CISPOConfig(ClipRange):
    """CISPO: clip the importance weight (stop-gradient), keep every token's gradient."""

    eps_low: float = 1.0
    """Lower truncation of the weight at 1 - eps_low (1.0: no lower bound, as in MiniMax-M1)."""
    eps_high: float = 0.28
    """Upper truncation of the weight at 1 + eps_high."""


@objective("cispo", CISPOConfig)
def _cispo(cfg: CISPOConfig, b: TokenBatch, lp, old):
    return _sur.cispo(lp, old, b.advantages, cfg.eps_low, cfg.eps_high), {}
