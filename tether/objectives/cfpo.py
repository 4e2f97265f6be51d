"""CFPO [arXiv 2601.22801]: a convex quadratic penalty in place of the ratio clip.

    l_t = -( w_t A_t - |A_t| (w_t - 1)^2 / (2 eps) )

The math and the departures from the paper are in `tether.core.cfpo`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core import cfpo as _cfpo
from ..core.masked import masked_fraction, masked_mean
from .base import ObjectiveConfig, check_positive, objective
from .batch import TokenBatch


@dataclass
class CFPOConfig(ObjectiveConfig):
    """CFPO [arXiv 2601.22801]: -(w A - |A| (w - 1)^2 / (2 eps)) per token; the surrogate peaks at PPO's clip
    boundary w = 1 + eps sign(A) and pulls back beyond it, so no token's gradient is cut."""

    eps: float = 0.2
    """The clip range the penalty replaces: the surrogate's maximum is at w = 1 + eps for A > 0 and 1 - eps for
    A < 0, the penalty's curvature is |A| / eps. The paper adds no hyperparameter and reuses the base method's clip
    range; 0.2 is the default of all three of the authors' pull requests (OpenRLHF's clip_eps_low, verl's
    clip_ratio, TRL's epsilon_high)."""

    def __post_init__(self):
        super().__post_init__()
        check_positive(self, "eps")


@objective("cfpo", CFPOConfig)
def _cfpo_loss(cfg: CFPOConfig, b: TokenBatch, lp, old):
    out, penalty, past = _cfpo.cfpo(lp, old, b.advantages, cfg.eps)
    metrics = {
        "cfpo/penalty_mean": masked_mean(penalty, b.loss_mask),
        "cfpo/past_optimum_frac": masked_fraction(past, b.loss_mask),
    }
    return out, metrics
