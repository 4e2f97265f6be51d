"""How a reward's K weighted parts become the one reward (N,) an advantage estimator reads.

    sum                 R_i = sum_k w_k r_ik                                   (every trainer's default)
    normalize_then_sum  R_i = sum_k w_k (r_ik - mean_gk) / (std_gk + 1e-6)      [GDPO, arXiv 2601.05242]

r (N, K) holds each part's unweighted score, w (K,) the weights, g the sample's group; mean_gk and std_gk
(the sample std, G - 1) are part k's over the group. GDPO normalises each part within its group before
summing, so a part with a large spread (a length penalty) no longer drowns a 0/1 correctness part, and two
outcomes that sum to the same total (correct but badly formatted, wrong but well formatted) stop collapsing
into one advantage. The paper then normalises the sum over the batch: that is the advantage estimator's
job here, so GDPO is `normalize_then_sum` with `reinforce_pp` (group mean, then whitened over the batch's
tokens), and any other estimator composes with it the same way.

A part whose scores are all equal within a group gets exactly 0 there (tested by min == max, as in
`advantages`), and so does a group of one. A NaN score (a part that does not apply to a sample, TRL's
reward function returning None) takes no part in its group's mean and std and adds 0 to the sum.

Departures from the references (equal elsewhere, tested):
1. verl (`adv_estimator=gdpo`, 0.9.1) runs its GRPO estimator per part (eps 1e-6, as here) and then
   `masked_whiten` over the batch's tokens, which tether's `reinforce_pp` equals up to verl's float32 Bessel
   factor (see `advantages`); a group of one gets r / (1 + 1e-6) there, 0 here.
2. TRL (`multi_objective_aggregation="normalize_then_sum"`, 1.16) divides by std_gk + 1e-4, and then
   whitens the sum per sequence, (R - mean_B) / (std_B + 1e-4); tether's eps is verl's and GRPO's 1e-6
   (`eps` of `normalize_then_sum` takes 1e-4 for TRL's), and its batch step is the estimator's.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .registry import Registry


class RewardParts(NamedTuple):
    """A weighted reward's parts: `scores` (N, K), each part's unweighted score (NaN: the part does
    not apply to that sample); `weights` (K,)."""

    scores: torch.Tensor
    weights: torch.Tensor


RewardAggregation = Callable[[RewardParts, torch.Tensor], torch.Tensor]
REWARD_AGGREGATIONS: Registry[RewardAggregation] = Registry("reward aggregation")

GDPO_EPS = 1e-6
"""The std guard of `normalize_then_sum` (verl's GRPO epsilon; TRL's is 1e-4)."""


def _weighted(normalised: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    w = weights.to(normalised.dtype)
    return torch.where(torch.isnan(normalised), torch.zeros_like(normalised), normalised * w).sum(-1)


@REWARD_AGGREGATIONS.register("sum")
def weighted_sum(parts: RewardParts, group_ids: torch.Tensor) -> torch.Tensor:
    """sum_k w_k r_ik over the parts that apply (a NaN score adds 0)."""
    return _weighted(parts.scores, parts.weights)


def group_normalise(x: torch.Tensor, group_ids: torch.Tensor, eps: float = GDPO_EPS) -> torch.Tensor:
    """(x - mean_g) / (std_g + eps) of x (N,) within each group, the std the sample std (G - 1); NaN
    entries are left out of their group's statistics and get 0, as do flat groups and groups of one."""
    valid = ~torch.isnan(x)
    same = (group_ids[:, None] == group_ids[None, :]) & valid[None, :]  # (N, N): j is in i's group and scored
    w = same.to(x.dtype)
    xv = torch.where(valid, x, torch.zeros_like(x))
    n = w.sum(-1)
    mean = w @ xv / n.clamp(min=1)
    dev = torch.where(same, xv[None, :] - mean[:, None], torch.zeros_like(w))  # (N, N)
    std = torch.sqrt((dev**2).sum(-1) / (n - 1).clamp(min=1))
    vmin = torch.where(same, xv[None, :], torch.full_like(w, float("inf"))).min(-1).values
    vmax = torch.where(same, xv[None, :], torch.full_like(w, float("-inf"))).max(-1).values
    out = (xv - mean) / (std + eps)
    dead = ~valid | (n < 2) | (vmin == vmax)
    return torch.where(dead, torch.zeros_like(out), out)


@REWARD_AGGREGATIONS.register("normalize_then_sum")
def normalize_then_sum(parts: RewardParts, group_ids: torch.Tensor, eps: float = GDPO_EPS) -> torch.Tensor:
    """GDPO's decoupled normalisation: each part normalised within its group (`group_normalise`), then
    weighted and summed."""
    normalised = torch.stack(
        [group_normalise(parts.scores[:, k], group_ids, eps) for k in range(parts.scores.shape[1])], -1
    )  # (N, K)
    return _weighted(normalised, parts.weights)


def aggregate_rewards(name: str, parts: RewardParts, group_ids: torch.Tensor) -> torch.Tensor:
    """The reward (N,) that reward aggregation `name` makes of `parts` (scores (N, K), weights (K,))."""
    scores, weights = parts
    if scores.dim() != 2 or scores.shape[0] != group_ids.shape[0] or weights.shape != scores.shape[1:]:
        raise ValueError(
            f"reward parts must be scores (N, K) with weights (K,) and group_ids (N,); got "
            f"{tuple(scores.shape)}, {tuple(weights.shape)} and {tuple(group_ids.shape)}"
        )
    return REWARD_AGGREGATIONS.get(name)(parts, group_ids)
