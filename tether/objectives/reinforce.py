"""The policy-gradient family without a clipped gradient: every token keeps its gradient.

    REINFORCE:                l_t = -A log pi_theta(y_t)        (optionally times SG(w_t))
    CISPO [arXiv 2506.13585]: l_t = -SG(clip(w_t, 1 - eps_low, 1 + eps_high)) A log pi_theta(y_t)
    DRO   [arXiv 2405.19107]: l_t = -(A log pi_theta(y_t) - (beta / 2) (log w_t)^2)   (a quadratic pull to pi_old)

The math is `tether.core.surrogates` and `tether.core.dro`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core import dro as _dro
from ..core import surrogates as _sur
from .base import ClipRange, ObjectiveConfig, check_positive, objective
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


@dataclass
class DROConfig(ObjectiveConfig):
    """DRO [arXiv 2405.19107], as verl 0.9.1's `dro` and Tinker's `dro`: l = -(A lp - beta/2 (log w)^2), every
    token's gradient kept and its log-ratio pulled back to 0 with force beta log w."""

    beta: float = 0.05
    """Coefficient of the quadratic log-ratio penalty (verl's policy_loss.dro_beta, which has no default; 0.05 is
    the value in the usage example of the verl PR that added it). Must be > 0."""

    def __post_init__(self):
        super().__post_init__()
        check_positive(self, "beta")


@objective("dro", DROConfig)
def _dro_loss(cfg: DROConfig, b: TokenBatch, lp, old):
    return _dro.dro(lp, old, b.advantages, cfg.beta), {}
