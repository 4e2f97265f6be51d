"""Elastic Trust Regions [ETR, arXiv 2601.03723], a reconstruction: PPO clip with per-sample bounds
that widen with |A| (micro) and with the group's reward variance (macro):

    eps_i = clamp(eps_base * (1 + alpha tanh|A_i|) * (1 + eta (nu_g - nu_bar)), eps_min, eps_max)

The only objective that reads group statistics over the whole rollout batch (`needs_group_stats`).
The math and the departures are in `tether.core.etr`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch

from ..core import etr as _etr
from ..core import surrogates as _sur
from ..core.masked import masked_mean
from .base import ClipRange, check, check_at_least_zero, check_dual, objective
from .batch import Extra, Mean, TokenBatch


@dataclass
class ETRConfig(ClipRange):
    """Elastic Trust Regions (reconstruction; see tether.core.etr)."""

    eps_low: float = 0.2
    """Base lower clip before scaling."""
    eps_high: float = 0.28
    """Base upper clip before scaling."""
    alpha: float = 0.5
    """Micro factor 1 + alpha tanh(|A|); 0 turns it off."""
    eta: float = 0.5
    """Macro factor 1 + eta (nu_g - mean nu); 0 turns it off."""
    eps_min: float = 0.05
    """Floor of the per-sample eps."""
    eps_max: float = 0.5
    """Ceiling of the per-sample eps."""
    macro: Literal["explicit", "implicit", "off"] = "explicit"
    """explicit: group-variance factor; implicit: un-normalised |R - mean| in micro, eta = 0; off: micro only."""
    reward_range: Optional[tuple[float, float]] = None
    """(R_min, R_max) for var_max; null: the batch's observed range."""
    dual_clip_c: Optional[float] = None
    """Dual clip bound c > 1; null disables it."""

    def __post_init__(self):
        super().__post_init__()
        check_at_least_zero(self, "alpha", "eta", "eps_min")
        check(self.eps_max >= self.eps_min, "eps_max", self.eps_max, f"a number >= eps_min ({self.eps_min})")
        check_dual(self.dual_clip_c)
        if self.reward_range is not None:
            check(
                len(self.reward_range) == 2 and self.reward_range[1] > self.reward_range[0],
                "reward_range",
                self.reward_range,
                "[R_min, R_max] with R_max > R_min",
            )

    def needs_group_stats(self) -> bool:
        return self.macro != "off"

    def group_stats_needed(self) -> tuple[str, ...]:
        return {"explicit": ("nu_shift",), "implicit": ("spread",), "off": ()}[self.macro]

    def group_stats(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> Optional[_etr.GroupStats]:
        return _etr.etr_group_stats(rewards, group_ids, self.reward_range) if self.needs_group_stats() else None

    def group_stats_options(self) -> dict:
        return {} if self.reward_range is None else {"reward_range": self.reward_range}


_PASS_BUCKETS = ((0.0, 0.25), (0.25, 0.5), (0.5, 0.75), (0.75, 1.0001))


@objective("etr", ETRConfig)
def _etr_loss(cfg: ETRConfig, b: TokenBatch, lp, old):
    stats = b.group_stats  # set by Objective.terms when the config needs it
    bounds = _etr.etr_bounds(
        b.advantages, stats, cfg.eps_low, cfg.eps_high, cfg.alpha, cfg.eta, cfg.eps_min, cfg.eps_max, cfg.macro
    )
    eps_low, eps_high = (e[:, None] if e.dim() == 1 else e for e in (bounds.eps_low, bounds.eps_high))
    out = _sur.ppo_clip(lp, old, b.advantages, eps_low, eps_high, cfg.dual_clip_c)
    m = b.loss_mask
    extra: Extra = {
        "etr/eps_low_mean": masked_mean(eps_low.expand_as(lp), m),
        "etr/eps_high_mean": masked_mean(eps_high.expand_as(lp), m),
    }
    n_seq = torch.tensor(float(lp.shape[0]), dtype=lp.dtype, device=lp.device)
    if stats is not None and stats.nu is not None:
        extra["etr/nu_mean"] = Mean(stats.nu.to(lp.dtype).mean(), n_seq)
    if stats is not None and stats.pass_rate is not None:
        extra.update(_pass_rate_buckets(eps_high.expand_as(lp), m, stats.pass_rate, lp.dtype))
    return out, extra


def _pass_rate_buckets(eps_high: torch.Tensor, m: torch.Tensor, pass_rate: torch.Tensor, dtype: torch.dtype) -> Extra:
    """The effective upper eps (N, T) per pass-rate bucket of the groups: where the update budget goes."""
    seq_eps_high = (eps_high * m).sum(-1) / m.sum(-1).clamp(min=1)  # (N,)
    extra: Extra = {}
    for lo, hi in _PASS_BUCKETS:
        inb = ((pass_rate >= lo) & (pass_rate < hi)).to(dtype)
        name = f"etr/eps_high_pass_{int(lo * 100)}-{min(int(hi * 100), 100)}"
        extra[name] = Mean((seq_eps_high * inb).sum() / inb.sum().clamp(min=1), inb.sum())
    return extra
