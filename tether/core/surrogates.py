"""Clipped policy-gradient surrogates, as per-token losses l (N, T).

    PPO / GRPO / DAPO   l = -min(w A, clip(w, low, high) A), optionally dual-clipped:
                        for A < 0, l = -max(min(w A, clip(w) A), c A)          [PPO, 1707.06347; dual clip 1912.09729]
    divergence clip     the same with [low, high] = {w : D(w) <= delta}        [ATR, 2602.05494, Thm 4.1]
    GSPO                w_i = exp(mean_t (lp - lp_old)) per sequence, token factor SG(w_i) exp(lp - SG(lp)) [2507.18071]
    CISPO               l = -SG(clip(w, 1 - eps_low, 1 + eps_high)) A lp     [MiniMax-M1, 2506.13585]
    REINFORCE           l = -A lp (or -SG(w) A lp with importance weighting)

w = exp(lp - lp_old). Bounds may be Python floats or tensors broadcastable to (N, T), so
per-token ranges (ETR) use the same code. Each function returns a `TokenLoss`: the
per-token loss and boolean (N, T) flags of where a bound acted, for the clip-fraction
metrics. Flags mark tokens whose gradient a bound removed (PPO family) or whose weight a
bound truncated (CISPO, where no gradient is removed).

Departures from the papers:
1. log w is clamped to [-20, 20] before exponentiation so a stale token cannot give inf/NaN;
   beyond that range the gradient is zero (a ratio of e^20 is far outside any trust region).
2. GSPO's clip acts on the sequence ratio, so its flags mark every token of a clipped sequence.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch

from .masked import seq_mean

Bound = Union[float, torch.Tensor]
LOG_RATIO_CLAMP = 20.0


class TokenLoss(NamedTuple):
    loss: torch.Tensor  # (N, T)
    clip_low: torch.Tensor  # (N, T) bool
    clip_high: torch.Tensor  # (N, T) bool
    clip_dual: torch.Tensor  # (N, T) bool


def per_token(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Advantages (N,) or (N, T) -> (N, T), detached (an advantage never carries gradient)."""
    adv = advantages.detach().to(like.dtype)
    if adv.dim() == 1:
        adv = adv[:, None]
    return adv.expand_as(like)


def log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """log w = lp - lp_old, clamped to [-20, 20] (see departure 1)."""
    return (logprobs - old_logprobs.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _no_flags(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like, dtype=torch.bool)


def clip_ratio_loss(
    ratio: torch.Tensor, adv: torch.Tensor, low: Bound, high: Bound, dual_clip_c: Optional[float] = None
) -> TokenLoss:
    """-min(w A, clip(w, low, high) A) [, dual-clipped], given the ratio w (with gradient)."""
    low_t = torch.as_tensor(low, dtype=ratio.dtype, device=ratio.device)
    high_t = torch.as_tensor(high, dtype=ratio.dtype, device=ratio.device)
    clipped = torch.minimum(torch.maximum(ratio, low_t), high_t)
    surrogate = torch.minimum(ratio * adv, clipped * adv)  # (N, T)
    w = ratio.detach()
    clip_high = (adv > 0) & (w > high_t)
    clip_low = (adv < 0) & (w < low_t)
    clip_dual = _no_flags(ratio)
    if dual_clip_c is not None:
        floor = dual_clip_c * adv
        dual = (adv < 0) & (surrogate < floor)
        surrogate = torch.where(adv < 0, torch.maximum(surrogate, floor), surrogate)
        clip_dual = dual.detach()
    return TokenLoss(-surrogate, clip_low, clip_high, clip_dual)


def ppo_clip(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: Bound = 0.2,
    eps_high: Bound = 0.2,
    dual_clip_c: Optional[float] = None,
) -> TokenLoss:
    """PPO/GRPO/DAPO clip with ratio bounds [1 - eps_low, 1 + eps_high] (scalars or (N, T))."""
    ratio = torch.exp(log_ratio(logprobs, old_logprobs))
    adv = per_token(advantages, logprobs)
    return clip_ratio_loss(ratio, adv, 1.0 - eps_low, 1.0 + eps_high, dual_clip_c)


def divergence_clip(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    low: float,
    high: float,
    dual_clip_c: Optional[float] = None,
) -> TokenLoss:
    """Clip by {w : D(w) <= delta} = [low, high] (from `divergences.interval`)."""
    ratio = torch.exp(log_ratio(logprobs, old_logprobs))
    return clip_ratio_loss(ratio, per_token(advantages, logprobs), low, high, dual_clip_c)


def gspo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> TokenLoss:
    """GSPO-token: every token carries its sequence's ratio value, and its own gradient path."""
    seq_log_w = seq_mean(log_ratio(logprobs, old_logprobs), mask).detach()  # (N,)
    token_log_w = seq_log_w[:, None] + logprobs - logprobs.detach()  # (N, T), value = seq ratio
    ratio = torch.exp(token_log_w)
    return clip_ratio_loss(ratio, per_token(advantages, logprobs), 1.0 - eps_low, 1.0 + eps_high)


def cispo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float = 1.0,
    eps_high: float = 0.28,
) -> TokenLoss:
    """CISPO: truncate the importance weight, never the gradient."""
    w = torch.exp(log_ratio(logprobs, old_logprobs)).detach()
    low, high = 1.0 - eps_low, 1.0 + eps_high
    w_bar = w.clamp(min=low, max=high)
    adv = per_token(advantages, logprobs)
    return TokenLoss(-w_bar * adv * logprobs, w < low, w > high, _no_flags(w))


def reinforce(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    importance_weight: bool = False,
) -> TokenLoss:
    """-A lp; with `importance_weight`, -SG(w) A lp (unbiased off-policy, unbounded variance)."""
    adv = per_token(advantages, logprobs)
    weight = torch.exp(log_ratio(logprobs, old_logprobs)).detach() if importance_weight else 1.0
    flags = _no_flags(logprobs)
    return TokenLoss(-weight * adv * logprobs, flags, flags, flags)
