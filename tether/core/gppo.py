"""GPPO and CE-GPPO: PPO-clip's forward value, with the clipped tokens' gradient kept at a bounded size
[GPPO (Klear-Reasoner), arXiv 2508.07629, Eqs. 11-12 and 17-18; CE-GPPO, arXiv 2509.20712].

    l_t = -beta_low  (1 - eps_low)  w_t / SG(w_t) A_t    if A_t < 0 and w_t < 1 - eps_low     (clipped low)
    l_t = -beta_high (1 + eps_high) w_t / SG(w_t) A_t    if A_t > 0 and w_t > 1 + eps_high    (clipped high)
    l_t = -w_t A_t                                       otherwise (where PPO's min(w A, clip(w) A) is w A)

w / SG(w) has value 1 and gradient (grad w) / w = grad log pi, so the token's gradient is
-beta (1 -/+ eps) A grad log pi where PPO-clip's is 0, and -w A grad log pi elsewhere (PPO-clip's). GPPO is
beta_low = beta_high = 1 (Eq. 11): its forward value is PPO-clip's exactly, only the backward pass differs.
CE-GPPO (the "general form", Eq. 17 of 2508.07629; the objective of 2509.20712) scales the two clipped sides
separately, and then the clipped tokens' forward value is beta times PPO-clip's: beta_low < 1 damps the
negative-advantage tokens pushed below 1 - eps_low (the papers' NA&LP tokens, whose gradient drives entropy
down), beta_high the positive-advantage tokens above 1 + eps_high (PA&LP, exploration). The authors' code
(Kwai-Klear/KlearReasoner and Kwai-Klear/CE-GPPO, `compute_gppo_loss_general_beta`) also applies verl's dual
clip: for A < 0 the loss is capped at -c A (no gradient where the cap binds).

Departures from the papers:
1. The clipped branch's factor is exp(lp - SG(lp)), not the authors' w / SG(w): the same value (1) and
   gradient, but no 0/0 or inf/inf when w under- or overflows (the authors' loss is NaN there). The rest
   follows `tether.core.surrogates` (departure 1): log w is clamped to [-20, 20] for the unclipped branch's
   ratio and for deciding which tokens are clipped (the bounds lie well inside e^-20..e^20, so the decision
   is unchanged); an unclipped token beyond that range gets no gradient.
2. The dual clip is optional (`dual_clip_c`, None: off): the papers' equations have none; the authors' code
   always has one (verl's clip_ratio_c, 10.0 in their scripts), and the presets set it.
3. Klear-Reasoner trains with an added SFT (negative log-likelihood) loss on correct responses (Eqs. 13-14,
   alpha = 0.1; both repositories' scripts set positive_loss_coeff=0.1). It is a separate term with its own
   normaliser over the correct responses, not part of this per-token loss; tether does not add it.
4. A = 0 takes the unclipped branch (the authors' "otherwise"): loss and gradient 0.
"""

from __future__ import annotations

from typing import Optional

import torch

from .surrogates import TokenLoss, log_ratio, per_token


def ce_gppo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    beta_low: float = 0.75,
    beta_high: float = 1.0,
    dual_clip_c: Optional[float] = None,
) -> TokenLoss:
    """CE-GPPO's per-token loss (N, T) from log-probs (N, T) and advantages (N,) or (N, T). The flags mark the
    tokens whose weight a bound replaced by beta (1 -/+ eps) (their gradient is kept, scaled) and, for the
    dual clip, the tokens whose gradient the cap -c A removed."""
    ratio = torch.exp(log_ratio(logprobs, old_logprobs))
    adv = per_token(advantages, logprobs)
    w = ratio.detach()
    low, high = 1.0 - eps_low, 1.0 + eps_high
    clip_low = (adv < 0) & (w < low)
    clip_high = (adv > 0) & (w > high)
    unit = torch.exp(logprobs - logprobs.detach())  # value 1, d unit / d lp = 1 (departure 1)
    surrogate = torch.where(
        clip_low,
        (beta_low * low) * unit * adv,
        torch.where(clip_high, (beta_high * high) * unit * adv, ratio * adv),
    )
    clip_dual = torch.zeros_like(clip_low)
    if dual_clip_c is not None:
        floor = dual_clip_c * adv
        clip_dual = (adv < 0) & (surrogate.detach() < floor)
        surrogate = torch.where(adv < 0, torch.maximum(surrogate, floor), surrogate)
    return TokenLoss(-surrogate, clip_low, clip_high, clip_dual)


def gppo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip_c: Optional[float] = None,
) -> TokenLoss:
    """GPPO (Eq. 11): CE-GPPO with beta_low = beta_high = 1; the value is PPO-clip's, a clipped token's
    gradient is -(1 -/+ eps) A grad log pi (Eq. 12) instead of 0."""
    return ce_gppo(logprobs, old_logprobs, advantages, eps_low, eps_high, 1.0, 1.0, dual_clip_c)
