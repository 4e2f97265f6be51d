"""The ratio-clip family: PPO/GRPO/DAPO/Dr. GRPO clip the ratio w = pi_theta / pi_old to
[1 - eps_low, 1 + eps_high]; ATR-GRPO clips by a divergence, keeping tokens with D(w) <= delta.

    l_t = -min(w_t A, clip(w_t, low, high) A)        (optionally dual-clipped at -c A for A < 0)

PPO [arXiv 1707.06347], GRPO [2402.03300], DAPO [2503.14476], Dr. GRPO [2503.20783] are presets of
`ppo_clip`; ATR-GRPO is `divergence_clip` with kl3. The math is `tether.core.surrogates`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..core import divergences as _div
from ..core import surrogates as _sur
from .base import ClipRange, ObjectiveConfig, check, check_dual, check_measure, objective
from .batch import TokenBatch


@dataclass
class PPOClipConfig(ClipRange):
    """PPO/GRPO/DAPO ratio clipping with bounds [1 - eps_low, 1 + eps_high]."""

    dual_clip_c: Optional[float] = None
    """Dual clip: for A < 0 the loss is capped at -c A (c > 1); null disables it."""

    def __post_init__(self):
        super().__post_init__()
        check_dual(self.dual_clip_c)


@objective("ppo_clip", PPOClipConfig)
def _ppo_clip(cfg: PPOClipConfig, b: TokenBatch, lp, old):
    return _sur.ppo_clip(lp, old, b.advantages, cfg.eps_low, cfg.eps_high, cfg.dual_clip_c), {}


@dataclass
class DivergenceClipConfig(ObjectiveConfig):
    """Clip by a policy divergence: keep tokens with D(w) <= delta (ATR-GRPO with kl3)."""

    measure: Any = "kl3"
    """Divergence measure: ratio, log_ratio, kl2, kl3, kl3_reverse, chi2, hellinger, or a callable D(w)."""
    delta: float = 0.0231
    """Trust-region size; kl3 with 0.0231 gives [0.800, 1.231] (PPO's lower bound, wider upper)."""
    dual_clip_c: Optional[float] = None
    """Dual clip bound c > 1 for negative advantages; null disables it."""

    def __post_init__(self):
        super().__post_init__()
        check_measure(self.measure)
        check(self.delta > 0, "delta", self.delta, "a number > 0")
        check_dual(self.dual_clip_c)
        self.bounds = _div.interval(self.measure, self.delta)


@objective("divergence_clip", DivergenceClipConfig)
def _divergence_clip(cfg: DivergenceClipConfig, b: TokenBatch, lp, old):
    low, high = cfg.bounds
    out = _sur.divergence_clip(lp, old, b.advantages, low, high, cfg.dual_clip_c)
    ref = torch.ones((), dtype=lp.dtype, device=lp.device)
    return out, {"policy/clip_bound_low": ref * low, "policy/clip_bound_high": ref * high}
