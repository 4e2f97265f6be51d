"""Elastic Trust Regions (ETR) [Zhang et al., arXiv 2601.03723] -- a RECONSTRUCTION.

The paper replaces one static clip range by per-sample ranges that widen (micro level) with
the advantage magnitude and (macro level) for groups whose reward variance is high (pass rate
near 1/2). Its exact functional forms were not available to us; this module implements the
documented family of docs/algorithms/etr.md, every factor switchable:

    eps_i(side) = clamp(eps_base(side) * micro_i * macro_g, eps_min, eps_max)
    micro_i     = 1 + alpha tanh(|A_i|)                           (alpha = 0: off)
    macro_g     = 1 + eta (nu_g - mean_{g: nu_g > 0} nu_g)        (eta = 0 or macro = "off": off)
    nu_g        = var_g(R) / var_max,  var_max = (R_max - R_min)^2 / 4   (0/1 rewards: 4 p (1 - p))

`implicit` macro mode: eta = 0, and micro uses the un-normalised |R - mean_g(R)|, whose size
already grows with the group's spread. The surrogate is PPO clip with these per-token bounds.

The group statistics (nu_g, nu_bar, the pass rate, |R - mean_g R|) are computed ONCE per rollout
batch by `etr_group_stats` and handed, per sequence, to every micro-batch (`etr_bounds` reads only
per-sequence values): with one group per micro-batch, a per-micro-batch nu_bar would equal nu_g and
the macro factor would vanish (docs/algorithms/etr.md, departure 3). tether's trainer, the TRL
adapter and the verl plugin all use this one path.

Departures (all ours, since the paper's forms are reconstructed):
1. R_min, R_max default to the rollout batch's observed reward range (configurable as
   `reward_range`); a batch with a single reward value has nu = 0 everywhere.
2. nu_bar is the mean over the groups of the rollout batch given to `etr_group_stats` (each group
   once, among groups with nu > 0), never over a micro-batch's groups, which would make the macro
   factor depend on `trainer.micro_batch_size`: a micro-batch (`TokenBatch.loss_norm` set) without
   `group_stats` is refused (`tether.objectives`) rather than given statistics of its own rows.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .masked import group_summary, seq_mean

MACRO_MODES = ("explicit", "implicit", "off")


class GroupStats(NamedTuple):
    """Per-sequence statistics of each sample's group over a whole rollout batch, all (N,): the one
    type in which every trainer carries them to the loss. Rows go with `select` (tether's trainer),
    batch columns with `columns` / `from_columns` (TRL shuffles and splits them with the rows), and
    `nu_shift` rides a per-token slot with `to_tokens` / `from_tokens` (verl's `returns`)."""

    nu_shift: torch.Tensor  # nu_g - nu_bar
    nu: Optional[torch.Tensor] = None  # reward-variance share of the group, in [0, 1]
    pass_rate: Optional[torch.Tensor] = None  # group mean reward scaled to [0, 1]
    spread: Optional[torch.Tensor] = None  # |R - mean_g(R)|, the implicit mode's magnitude

    def select(self, idx: torch.Tensor) -> "GroupStats":
        return GroupStats(*(None if t is None else t[idx] for t in self))

    def columns(self) -> dict[str, torch.Tensor]:
        """The statistics present, by name, each (N,)."""
        return {name: t for name, t in self._asdict().items() if t is not None}

    @classmethod
    def from_columns(cls, columns: dict[str, torch.Tensor]) -> "GroupStats":
        return cls(**columns)

    def to_tokens(self, mask: torch.Tensor) -> torch.Tensor:
        """(N, T) `nu_shift` on every counted token of `mask` (N, T), 0 elsewhere."""
        return self.nu_shift[:, None] * mask

    @classmethod
    def from_tokens(cls, per_token: torch.Tensor, mask: torch.Tensor) -> "GroupStats":
        """The `nu_shift` (N,) that `to_tokens` spread over each sequence's counted tokens: their mean."""
        return cls(nu_shift=seq_mean(per_token, mask))


class ETRBounds(NamedTuple):
    eps_low: torch.Tensor  # (N,) or (N, T)
    eps_high: torch.Tensor  # (N,) or (N, T)


def etr_group_stats(
    rewards: torch.Tensor, group_ids: torch.Tensor, reward_range: Optional[tuple[float, float]] = None
) -> GroupStats:
    """nu_g, nu_g - nu_bar, pass rate and |R - mean_g R| of each sample; rewards, group_ids (N,)."""
    r = rewards.detach()
    stats = group_summary(r, group_ids)
    if reward_range is None:
        r_min, r_max = r.min(), r.max()
    else:
        r_min, r_max = (torch.as_tensor(v, dtype=r.dtype, device=r.device) for v in reward_range)
    span = r_max - r_min
    var_max = span**2 / 4.0
    nu = torch.where(var_max > 0, stats["var"] / var_max.clamp(min=1e-12), torch.zeros_like(r)).clamp(0.0, 1.0)
    pass_rate = torch.where(span > 0, (stats["mean"] - r_min) / span.clamp(min=1e-12), torch.zeros_like(r))
    # Mean over groups (each group weighted once) among groups with nu > 0.
    live = (nu > 0).to(r.dtype) / stats["count"]
    nu_bar = (nu * live).sum() / live.sum().clamp(min=1e-12)
    return GroupStats(nu - nu_bar, nu, pass_rate, (r - stats["mean"]).abs())


def etr_bounds(
    advantages: torch.Tensor,
    stats: Optional[GroupStats],
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    alpha: float = 0.5,
    eta: float = 0.5,
    eps_min: float = 0.05,
    eps_max: float = 0.5,
    macro: str = "explicit",
) -> ETRBounds:
    """Per-sample clip ranges. advantages (N,) or (N, T); `stats` from `etr_group_stats` (its rows
    selected like the advantages' rows) unless macro="off"."""
    if macro not in MACRO_MODES:
        raise ValueError(f"ETR macro must be one of {MACRO_MODES}, got {macro!r}")
    adv = advantages.detach()
    if macro == "off":
        magnitude, macro_factor = adv.abs(), torch.ones(adv.shape[0], dtype=adv.dtype, device=adv.device)
    elif macro == "implicit":
        magnitude, macro_factor = stats.spread.to(adv.dtype), torch.ones_like(stats.spread, dtype=adv.dtype)
    else:
        magnitude, macro_factor = adv.abs(), 1.0 + eta * stats.nu_shift.to(adv.dtype)
    micro = 1.0 + alpha * torch.tanh(magnitude)
    if micro.dim() == 2 and macro_factor.dim() == 1:
        macro_factor = macro_factor[:, None]
    scale = micro * macro_factor
    low = (eps_low * scale).clamp(eps_min, eps_max)
    high = (eps_high * scale).clamp(eps_min, eps_max)
    return ETRBounds(low, high)
