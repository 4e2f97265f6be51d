"""Elastic Trust Regions (ETR) [Zhang et al., arXiv 2601.03723] -- a RECONSTRUCTION.

The paper replaces one static clip range by per-sample ranges that widen (micro level) with
the advantage magnitude and (macro level) for groups whose reward variance is high (pass rate
near 1/2). Its exact functional forms were not available to us; this module implements the
documented family of SPEC section 3, every factor switchable:

    eps_i(side) = clamp(eps_base(side) * micro_i * macro_g, eps_min, eps_max)
    micro_i     = 1 + alpha tanh(|A_i|)                           (alpha = 0: off)
    macro_g     = 1 + eta (nu_g - mean_{g: nu_g > 0} nu_g)        (eta = 0 or macro = "off": off)
    nu_g        = var_g(R) / var_max,  var_max = (R_max - R_min)^2 / 4   (0/1 rewards: 4 p (1 - p))

`implicit` macro mode: eta = 0, and micro uses the un-normalised |R - mean_g(R)|, whose size
already grows with the group's spread. The surrogate is PPO clip with these per-token bounds.

Departures (all ours, since the paper's forms are reconstructed):
1. R_min, R_max default to the batch's observed reward range (configurable as `reward_range`);
   a batch with a single reward value has nu = 0 everywhere.
2. The mean over groups is over the groups present in the batch (or micro-batch) given.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .masked import group_stats

MACRO_MODES = ("explicit", "implicit", "off")


class ETRBounds(NamedTuple):
    eps_low: torch.Tensor  # (N,) or (N, T)
    eps_high: torch.Tensor  # (N,) or (N, T)
    nu: torch.Tensor  # (N,) reward-variance share of the sample's group, in [0, 1]
    pass_rate: torch.Tensor  # (N,) group mean reward scaled to [0, 1]


def etr_bounds(
    advantages: torch.Tensor,
    rewards: Optional[torch.Tensor],
    group_ids: Optional[torch.Tensor],
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    alpha: float = 0.5,
    eta: float = 0.5,
    eps_min: float = 0.05,
    eps_max: float = 0.5,
    macro: str = "explicit",
    reward_range: Optional[tuple[float, float]] = None,
) -> ETRBounds:
    """Per-sample clip ranges. advantages (N,) or (N, T); rewards, group_ids (N,) unless macro="off"."""
    if macro not in MACRO_MODES:
        raise ValueError(f"ETR macro must be one of {MACRO_MODES}, got {macro!r}")
    adv = advantages.detach()
    if macro == "off":
        nu = torch.zeros(adv.shape[0], dtype=adv.dtype, device=adv.device)
        pass_rate = torch.full_like(nu, float("nan"))
        magnitude = adv.abs()
        macro_factor = torch.ones_like(nu)
    else:
        r = rewards.detach().to(adv.dtype)
        stats = group_stats(r, group_ids)
        if reward_range is None:
            r_min, r_max = r.min(), r.max()
        else:
            r_min, r_max = (torch.as_tensor(v, dtype=r.dtype, device=r.device) for v in reward_range)
        span = r_max - r_min
        var_max = span**2 / 4.0
        nu = torch.where(var_max > 0, stats["var"] / var_max.clamp(min=1e-12), torch.zeros_like(r)).clamp(0.0, 1.0)
        pass_rate = torch.where(span > 0, (stats["mean"] - r_min) / span.clamp(min=1e-12), torch.zeros_like(r))
        if macro == "implicit":
            magnitude = (r - stats["mean"]).abs()
            macro_factor = torch.ones_like(nu)
        else:
            magnitude = adv.abs()
            # Mean over groups (each group weighted once) among groups with nu > 0.
            live = (nu > 0).to(r.dtype) / stats["count"]
            nu_bar = (nu * live).sum() / live.sum().clamp(min=1e-12)
            macro_factor = 1.0 + eta * (nu - nu_bar)
    micro = 1.0 + alpha * torch.tanh(magnitude)
    scale = micro * (macro_factor[:, None] if micro.dim() == 2 else macro_factor)
    low = (eps_low * scale).clamp(eps_min, eps_max)
    high = (eps_high * scale).clamp(eps_min, eps_max)
    return ETRBounds(low, high, nu, pass_rate)
