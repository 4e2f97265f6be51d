"""Train-inference mismatch correction (rollout correction): importance weights between the
policy the trainer scores (pi_old, recomputed) and the sampler that produced the tokens.

The sampler's log-probs can differ from the trainer's for the same weights: a bf16 decode, a
different kernel (vLLM, SGLang), top-p/top-k truncation. With r the ratio pi_old / pi_sampler,

    token level     r_t = exp(lp_old_t - lp_sampler_t)
    sequence level  r_t = exp(mean_t (lp_old_t - lp_sampler_t))     (geometric mean, every token of a sequence)

    truncate  (TIS)        c_t = clamp(r_t, low, high)              (low = 0: only the top is cut)
    mask (MIS / IcePop)    c_t = r_t if low <= r_t <= high else 0   (the token leaves the loss)

and the objective's per-token loss becomes SG(c_t) * l_t. The bounds are given directly, or as
{measure, delta}: the interval [low, high] where D(r) <= delta for any tether divergence measure
(`tether.core.divergences`), so `{measure: kl3, delta: ...}` is a k3 rejection as verl's presets
have it. Papers: TIS (Yao et al., "Your efficient RL framework secretly brings you off-policy RL
training", 2025), MIS and IcePop (the same line of work; IcePop masks tokens whose ratio leaves a
band), verl's rollout-correction presets.

Departures:
1. One weight per token, multiplied into whatever per-token loss the objective has (PPO clip,
   RPG, ...), as TRL and verl apply their sampler correction; the objective's own ratio is
   pi_theta / pi_old, unchanged.
2. With identical log-probs (trainer.old_logprobs=sampler) every weight is 1: a no-op, tested.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

LEVELS = ("token", "sequence")
MODES = ("truncate", "mask")


class Correction(NamedTuple):
    weights: torch.Tensor  # (N, T) c_t, detached, 0 at padding
    truncated: torch.Tensor  # (N, T) bool: r_t was cut to a bound
    masked: torch.Tensor  # (N, T) bool: the token left the loss
    log_ratio: torch.Tensor  # (N, T) lp_old - lp_sampler, 0 at padding (the mismatch)


def rollout_correction(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor,
                       level: str = "token", mode: str = "truncate", low: float = 0.0,
                       high: float = 2.0) -> Correction:
    """Weights c_t (N, T) that correct pi_sampler's tokens towards pi_old (module docstring)."""
    if level not in LEVELS or mode not in MODES:
        raise ValueError(f"level must be one of {LEVELS} and mode one of {MODES}; got {level!r}, {mode!r}")
    m = mask.bool()
    diff = torch.where(m, old_logprobs.detach() - sampler_logprobs.detach(), torch.zeros_like(old_logprobs))
    diff = torch.nan_to_num(diff, nan=0.0)  # a sampler log-prob that is missing (NaN) means no correction
    if level == "sequence":
        n = m.sum(-1, keepdim=True).clamp(min=1)
        diff_used = (diff.sum(-1, keepdim=True) / n).expand_as(diff)  # (N, T): the sequence's mean
    else:
        diff_used = diff
    r = torch.exp(diff_used.clamp(-20.0, 20.0))
    outside = (r < low) | (r > high)
    if mode == "truncate":
        w, truncated, masked = r.clamp(low, high), outside & m, torch.zeros_like(m)
    else:
        w, truncated, masked = torch.where(outside, torch.zeros_like(r), r), torch.zeros_like(m), outside & m
    return Correction(torch.where(m, w, torch.zeros_like(w)), truncated, masked, diff)
