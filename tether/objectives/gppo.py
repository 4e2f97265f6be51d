"""GPPO [arXiv 2508.07629] and CE-GPPO [arXiv 2509.20712]: PPO-clip whose clipped tokens keep a bounded gradient.

    l_t = -beta_low (1 - eps_low) (w_t / SG(w_t)) A_t      (A < 0, w < 1 - eps_low)
    l_t = -beta_high (1 + eps_high) (w_t / SG(w_t)) A_t    (A > 0, w > 1 + eps_high)
    l_t = -w_t A_t                                         otherwise

GPPO is beta_low = beta_high = 1. The math and the departures from the papers are in `tether.core.gppo`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..core import gppo as _gppo
from .base import ClipRange, check_at_least_zero, check_dual, objective
from .batch import TokenBatch


@dataclass
class GPPOConfig(ClipRange):
    """GPPO [arXiv 2508.07629, Eq. 11]: PPO-clip's value; a clipped token's gradient is -(1 -/+ eps) A grad log pi."""

    eps_high: float = 0.28
    """Upper clip: the ratio may rise to 1 + eps_high for positive advantages (the paper's Clip-Higher 0.28)."""
    dual_clip_c: Optional[float] = None
    """Dual clip: for A < 0 the loss is capped at -c A (c > 1), which removes the gradient where it binds; null
    disables it (the paper's equation). The authors' code always has it (10.0 in their scripts)."""

    def __post_init__(self):
        super().__post_init__()
        check_dual(self.dual_clip_c)


@objective("gppo", GPPOConfig)
def _gppo_loss(cfg: GPPOConfig, b: TokenBatch, lp, old):
    return _gppo.gppo(lp, old, b.advantages, cfg.eps_low, cfg.eps_high, cfg.dual_clip_c), {}


@dataclass
class CEGPPOConfig(GPPOConfig):
    """CE-GPPO [arXiv 2509.20712; GPPO's general form, 2508.07629 Eq. 17]: the clipped tokens' gradient
    -beta (1 -/+ eps) A grad log pi, with its own beta on each side."""

    eps_high: float = 0.2
    """Upper clip; CE-GPPO's released runs clip symmetrically (0.2 / 0.2)."""
    beta_low: float = 0.75
    """beta_1: scale of the kept gradient of tokens with A < 0 and w < 1 - eps_low (NA&LP); below 1 it damps
    their entropy-lowering push. 0.75 is the authors' README default and 7B run, 0.5 their 1.5B run."""
    beta_high: float = 1.0
    """beta_2: scale of the kept gradient of tokens with A > 0 and w > 1 + eps_high (PA&LP, exploration); the
    authors' runs use 1."""

    def __post_init__(self):
        super().__post_init__()
        check_at_least_zero(self, "beta_low", "beta_high")


@objective("ce_gppo", CEGPPOConfig)
def _ce_gppo_loss(cfg: CEGPPOConfig, b: TokenBatch, lp, old):
    out = _gppo.ce_gppo(lp, old, b.advantages, cfg.eps_low, cfg.eps_high, cfg.beta_low, cfg.beta_high, cfg.dual_clip_c)
    return out, {}
