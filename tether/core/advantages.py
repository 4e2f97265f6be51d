"""Group-relative advantage estimators: rewards R (N,) and group ids (N,) -> advantages (N,).

    grpo      (R - mean_g) / (std_g + 1e-6)      [DeepSeekMath, 2402.03300]; std is the sample std (n - 1)
    dr_grpo   R - mean_g                         [Dr. GRPO, 2503.20783; also RPG Algorithm 2]
    rloo      R - mean of the other samples      [Ahmadian et al., 2402.14740] = G/(G-1) (R - mean_g)
    reinforce_pp  REINFORCE++ with baseline      [REINFORCE++, 2501.03262]:
              a = R - mean_g, then whitened over the whole batch: (a - mean_B a) / sqrt(var_B a + 1e-8),
              mean and (Bessel-corrected) variance weighted by `weights` (default 1 per sequence)
    maxrl     (R - mean_g) / (mean_g + 1e-6), 0 where mean_g <= 0   [MaxRL, 2602.02710]: dividing by the
              pass rate instead of the std makes the gradient that of the maximum-likelihood objective
              log p(success) truncated at order G (for 0/1 rewards a group with pass rate p weighs ~1/p)
    reinforce_pp_no_baseline  REINFORCE++ without the group baseline [REINFORCE++, 2501.03262]: R whitened over
              the whole batch, (R - mean_B R) / sqrt(var_B R + 1e-8), weighted by `weights` as reinforce_pp
              (verl `reinforce_plus_plus`, SkyRL `reinforce++`, slime `reinforce_plus_plus`, NeMo-RL
              `reinforce_plus_plus` with minus_baseline false; their returns-to-go are R on every token for an
              outcome reward with gamma = 1, the only case here)
    grpo_batch_std  (R - mean_g) / (std_B + 1e-6), std_B the sample std of all N rewards: the group's mean,
              the batch's scale [Lite PPO, 2508.08221] (TRL `scale_rewards="batch"`; AReaL `adv_norm` with
              mean_level group, std_level batch)

A group whose rewards are all equal gets advantage exactly 0 (tested by min == max, since a
computed mean can differ from the common value in the last bit). A group of one sample has
no baseline and also gets 0.

`compute_advantages` takes `weights` (N,), the weight of each sequence in batch-level statistics; only
the estimators in `BATCH_WEIGHTED` (`reinforce_pp`, `reinforce_pp_no_baseline`) have any, and only they receive it.
Pass the response
lengths to whiten over tokens, as OpenRLHF and verl (`reinforce_plus_plus_baseline`) do; the default weighs
each sequence once.

Departures of `reinforce_pp` from verl's `reinforce_plus_plus_baseline` (equal elsewhere, tested):
1. A zero-variance group (and a group of one) gets exactly 0, as every tether estimator
   (docs/algorithms/advantages_aggregation.md), after taking part in the batch statistics. verl gives it
   (0 - mean_B) / std_B, which is not 0 when lengths differ; a group of one gets (R - mean_B) / std_B there
   (its baseline is 0).
2. verl computes the Bessel factor n / (n - 1) of its variance in float32 (an integer tensor division), a
   relative error up to ~3e-8 in the advantages; tether's is float64. (verl's "+ 1e-8" in its masked means is
   added to a float32 count and vanishes.)

Departures of `reinforce_pp_no_baseline` from verl's `reinforce_plus_plus` (equal elsewhere, tested):
1. A zero-variance group (and a group of one) gets exactly 0 (docs/algorithms/advantages_aggregation.md),
   after taking part in the batch statistics; verl gives it (R - mean_B) / std_B, so an all-correct group is
   pushed up there. This also means that with one sample per prompt (REINFORCE++'s original setting, which
   tether's trainer does not run: rollout.group_size >= 2) every advantage is 0.
2. Only outcome rewards with gamma = 1 (verl's default): tether's estimators see one reward per sequence.
3. verl's float32 Bessel factor, as for reinforce_pp.

Departures of `grpo_batch_std` from its references (tested):
1. TRL divides by std_B + 1e-4, AReaL by std_B + 1e-5; tether by std_B + 1e-6 (its grpo's eps). tether equals
   TRL's value times (std_B + 1e-4) / (std_B + 1e-6).
2. AReaL's std_B is the sample std of the group-centred rewards R - mean_g over the batch (its
   `_compute_std` around the group means); TRL's, followed here, is the sample std of the rewards themselves,
   as the Lite PPO paper writes it (the batch's reward scale, which does not shrink as groups get flat).

Departures of `maxrl` from its references (equal elsewhere, tested):
1. SkyRL (`maxrl`, skyrl_train/utils/ppo_utils.py) divides by mean_g + 1e-6 with no guard, so a group with a
   negative mean flips its signs and one with a mean near 0 explodes; prime-rl (`max_rl`) divides by mean_g
   exactly and gives 0 when mean_g <= 0. tether divides by mean_g + 1e-6 (SkyRL's) and gives 0 when mean_g <= 0
   (prime-rl's guard; the paper's rewards are 0/1, where an all-zero group has no success to learn from). On a
   group with mean_g > 0 tether equals SkyRL and is prime-rl's value times mean_g / (mean_g + 1e-6).
2. A group of one gets 0 (every tether estimator); SkyRL gives it R (its baseline is 0).
"""

from __future__ import annotations

from typing import Optional

import torch

from .masked import group_summary
from .registry import Registry

ADVANTAGES: Registry = Registry("advantage estimator")
BATCH_WEIGHTED = frozenset({"reinforce_pp", "reinforce_pp_no_baseline"})
"""Estimators with batch-level statistics, which read `weights`."""


def _finish(adv: torch.Tensor, stats: dict[str, torch.Tensor]) -> torch.Tensor:
    flat = (stats["max"] == stats["min"]) | (stats["count"] < 2)
    return torch.where(flat, torch.zeros_like(adv), adv)


@ADVANTAGES.register("grpo")
def grpo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    s = group_summary(rewards, group_ids)
    n = s["count"]
    std = torch.sqrt(s["var"] * n / (n - 1).clamp(min=1))
    return _finish((rewards - s["mean"]) / (std + 1e-6), s)


@ADVANTAGES.register("dr_grpo")
def dr_grpo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    s = group_summary(rewards, group_ids)
    return _finish(rewards - s["mean"], s)


@ADVANTAGES.register("rloo")
def rloo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    s = group_summary(rewards, group_ids)
    n = s["count"]
    return _finish((rewards - s["mean"]) * n / (n - 1).clamp(min=1), s)


@ADVANTAGES.register("reinforce_pp")
def reinforce_pp(
    rewards: torch.Tensor, group_ids: torch.Tensor, weights: Optional[torch.Tensor] = None
) -> torch.Tensor:
    s = group_summary(rewards, group_ids)
    return _finish(_whiten(rewards - s["mean"], weights), s)


def _whiten(a: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
    """(a - mean_B) / sqrt(var_B + 1e-8) over the batch, mean and (Bessel-corrected) variance weighted by
    `weights` (N,) (default 1 per sequence): verl's `masked_whiten` over tokens when the weights are lengths."""
    w = torch.ones_like(a) if weights is None else weights.to(a.dtype)
    total = w.sum()
    mean = (w * a).sum() / total
    var = (w * (a - mean) ** 2).sum() / total * total / (total - 1.0).clamp(min=1e-12)  # Bessel, as verl
    return (a - mean) * torch.rsqrt(var + 1e-8)


@ADVANTAGES.register("reinforce_pp_no_baseline")
def reinforce_pp_no_baseline(
    rewards: torch.Tensor, group_ids: torch.Tensor, weights: Optional[torch.Tensor] = None
) -> torch.Tensor:
    return _finish(_whiten(rewards, weights), group_summary(rewards, group_ids))


@ADVANTAGES.register("grpo_batch_std")
def grpo_batch_std(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    s = group_summary(rewards, group_ids)
    n = rewards.new_tensor(rewards.numel())
    std_b = torch.sqrt(((rewards - rewards.mean()) ** 2).sum() / (n - 1).clamp(min=1))
    return _finish((rewards - s["mean"]) / (std_b + 1e-6), s)


MAXRL_EPS = 1e-6
"""MaxRL's denominator guard mean_g + eps (SkyRL's epsilon)."""


@ADVANTAGES.register("maxrl")
def maxrl(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    s = group_summary(rewards, group_ids)
    mean = s["mean"]
    live = mean > 0  # no success in the group: nothing to reweigh (departure 1)
    adv = (rewards - mean) / torch.where(live, mean + MAXRL_EPS, torch.ones_like(mean))
    return _finish(torch.where(live, adv, torch.zeros_like(adv)), s)


def compute_advantages(
    name: str, rewards: torch.Tensor, group_ids: torch.Tensor, weights: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Advantages (N,) of estimator `name`; `weights` (N,) weigh sequences in batch statistics (reinforce_pp)."""
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(
            f"rewards and group_ids must both be (N,); got {tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    if weights is not None and weights.shape != rewards.shape:
        raise ValueError(f"weights must be (N,) like rewards; got {tuple(weights.shape)}")
    fn = ADVANTAGES.get(name)
    return fn(rewards, group_ids) if weights is None or name not in BATCH_WEIGHTED else fn(rewards, group_ids, weights)


def zero_variance_fraction(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Share of groups (each counted once) whose rewards are all equal: `adv/zero_var_frac`."""
    s = group_summary(rewards, group_ids)
    per_group = 1.0 / s["count"]
    flat = (s["max"] == s["min"]).to(rewards.dtype)
    return (flat * per_group).sum() / per_group.sum()
