"""PSPO [arXiv 2509.21282]: the ratio of the smoothed policy (1 - alpha) pi_theta + alpha pi_old to pi_old, unclipped.

    l_t = -((1 - alpha) w_t + alpha) A_t

The math and the departures from the paper are in `tether.core.pspo`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core import pspo as _pspo
from ..core.kl import k3_of_log
from ..core.masked import masked_mean
from .base import ObjectiveConfig, check, objective
from .batch import TokenBatch


@dataclass
class PSPOConfig(ObjectiveConfig):
    """PSPO [arXiv 2509.21282]: GRPO with the probability-smoothed ratio (1 - alpha) w + alpha in place of the clip."""

    alpha: float = 0.1
    """Smoothing strength in [0, 1) (the paper's and TRL PR #4548's `smoothing_alpha`, 0.1): pi~ = (1 - alpha)
    pi_theta + alpha pi_old. 0: the unclipped ratio surrogate -w A; the gradient is that one's times 1 - alpha."""

    def __post_init__(self):
        super().__post_init__()
        check(
            0 <= self.alpha < 1,
            "alpha",
            self.alpha,
            "a number in [0, 1) (the paper's 0.1; 1 would leave no gradient, 0 is the unclipped ratio)",
        )

    def has_trust_region(self) -> bool:
        # The gradient -(1 - alpha) w A grad lp has no factor that depends on how far w is from 1: nothing limits
        # the update of pi_theta (only the smoothed pi~ is closer to pi_old), so a trainer's warnings about an
        # inactive trust region do not apply (docs/algorithms/pspo.md).
        return False


@objective("pspo", PSPOConfig)
def _pspo_loss(cfg: PSPOConfig, b: TokenBatch, lp, old):
    out, smoothed = _pspo.pspo(lp, old, b.advantages, cfg.alpha)
    # UKL(pi_old || pi~) estimated by k3 of the smoothed ratio: how far the smoothed policy moved (policy/kl_old's
    # twin).
    return out, {
        "pspo/smoothed_ratio_mean": masked_mean(smoothed, b.loss_mask),
        "pspo/smoothed_kl_old": masked_mean(k3_of_log(smoothed.log()), b.loss_mask),
    }
