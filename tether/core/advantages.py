"""Group-relative advantage estimators: rewards R (N,) and group ids (N,) -> advantages (N,).

    grpo      (R - mean_g) / (std_g + 1e-6)      [DeepSeekMath, 2402.03300]; std is the sample std (n - 1)
    dr_grpo   R - mean_g                         [Dr. GRPO, 2503.20783; also RPG Algorithm 2]
    rloo      R - mean of the other samples      [Ahmadian et al., 2402.14740] = G/(G-1) (R - mean_g)

A group whose rewards are all equal gets advantage exactly 0 (tested by min == max, since a
computed mean can differ from the common value in the last bit). A group of one sample has
no baseline and also gets 0.
"""

from __future__ import annotations

import torch

from .masked import group_stats
from .registry import Registry

ADVANTAGES: Registry = Registry("advantage estimator")


def _finish(adv: torch.Tensor, stats: dict[str, torch.Tensor]) -> torch.Tensor:
    flat = (stats["max"] == stats["min"]) | (stats["count"] < 2)
    return torch.where(flat, torch.zeros_like(adv), adv)


@ADVANTAGES.register("grpo")
def grpo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    s = group_stats(rewards, group_ids)
    n = s["count"]
    std = torch.sqrt(s["var"] * n / (n - 1).clamp(min=1))
    return _finish((rewards - s["mean"]) / (std + 1e-6), s)


@ADVANTAGES.register("dr_grpo")
def dr_grpo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    s = group_stats(rewards, group_ids)
    return _finish(rewards - s["mean"], s)


@ADVANTAGES.register("rloo")
def rloo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    s = group_stats(rewards, group_ids)
    n = s["count"]
    return _finish((rewards - s["mean"]) * n / (n - 1).clamp(min=1), s)


def compute_advantages(name: str, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(f"rewards and group_ids must both be (N,); got {tuple(rewards.shape)} and {tuple(group_ids.shape)}")
    return ADVANTAGES.get(name)(rewards, group_ids)


def zero_variance_fraction(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Share of groups (each counted once) whose rewards are all equal: `adv/zero_var_frac`."""
    s = group_stats(rewards, group_ids)
    per_group = 1.0 / s["count"]
    flat = (s["max"] == s["min"]).to(rewards.dtype)
    return (flat * per_group).sum() / per_group.sum()
