"""DPPO: a trust-region MASK from a divergence of the sampled token's distribution [DPPO, arXiv 2602.04879].

    l_t = -A_t * SG(min(w_t, c)) * lp_t * valid_t              w = pi_theta / pi_old, c the TIS cap

    valid_t = D_t <= delta_high  or  the token moved down     when A_t > 0
              D_t <= delta_low   or  the token moved up       when A_t <= 0

Its gradient is -A min(w, c) grad lp on valid tokens and 0 elsewhere: the gradient of -A w where the update
has not left the trust region in the direction the advantage pushes (for w <= c). D comes in two kinds:

- a divergence of the two Bernoulli distributions {sampled token, everything else} under pi_old and pi_theta
  (the paper's "Binary" approximation), with p = pi_theta(o_t), p_old = pi_old(o_t):
      binary_tv   |p - p_old|                                             (the paper's TV threshold 0.15)
      binary_kl   p_old log(p_old / p) + (1 - p_old) log((1 - p_old) / (1 - p))   (KL threshold 0.05)
  In ratio terms binary_tv is p_old |w - 1|: the region [1 - delta/p_old, 1 + delta/p_old] is wide for a
  rare token and narrow for a confident one, which is the paper's point against ratio clipping.
- any tether ratio measure D(w) (`tether.core.divergences`: kl3, chi2, ... or a user's callable). D(w) <= delta
  is an interval [l, u], so the mask is `w <= u` for A > 0 and `w >= l` for A <= 0. That is exactly the set of
  tokens whose gradient ATR-GRPO's divergence clip with the same measure removes ([ATR] Thm 4.1), so
  DPPO with a ratio measure has the divergence clip's gradient wherever w <= c: the two differ only in the
  loss value (-A SG(w) lp here, -min(w A, clip(w) A) there) and in the TIS cap c (the divergence clip has the
  optional dual clip instead).

Departures from the paper:
1. The paper's Top-K approximation (the divergence over the K most likely tokens) needs the full logits;
   tether's objectives see only the sampled token's log-probs, so only the Binary measures (and ratio measures)
   are offered.
2. binary_kl adds 1e-8 inside the second log, as the authors' and verl's code do, so that p -> 1 gives a
   finite value; it changes only the mask, never a gradient.
3. log w is clamped to [-20, 20] before exp (tether.core.surrogates, departure 1), as verl does here.
4. The cap c is off by default (`truncation_c: null`), as in the authors' runs (their verl script sets
   clip_ratio_c = 10000; verl's code notes that a large cap avoids the truncation bias, the paper's Section 5.4).
   verl's `dppo_tv`/`dppo_kl` read `actor.clip_ratio_c`, whose default is 3.0 (verl 0.9.1 `ActorConfig`; the
   20 in its code is only the fallback for a config without the key): `truncation_c: 3.0` is verl's default.
"""

from __future__ import annotations

from typing import Optional

import torch

# The Binary measures live with the other divergence measures; D(old, new) = binary_kl(old, new) is
# KL(Ber(p_old) || Ber(p)) (departure 2 is tether.core.divergences departure 3).
from .divergences import BINARY_MEASURES, BinaryMeasure, binary_kl, binary_tv  # noqa: F401  (re-exported)
from .surrogates import TokenLoss, log_ratio, per_token


def binary_valid(
    measure: str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    delta_low: float,
    delta_high: float,
) -> torch.Tensor:
    """(N, T) bool: the token is inside the Binary trust region on the side its advantage pushes."""
    lp, old = logprobs.detach(), old_logprobs.detach()
    d = BINARY_MEASURES.get(measure)(old, lp)
    p, p_old = torch.exp(lp), torch.exp(old)
    adv = per_token(advantages, lp)
    return torch.where(adv > 0, (d <= delta_high) | (p <= p_old), (d <= delta_low) | (p >= p_old))


def interval_valid(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, low: float, high: float
) -> torch.Tensor:
    """(N, T) bool for a ratio measure with interval [low, high] = {w : D(w) <= delta}."""
    w = torch.exp(log_ratio(logprobs, old_logprobs)).detach()
    adv = per_token(advantages, w)
    return torch.where(adv > 0, w <= high, w >= low)


def dppo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    truncation_c: Optional[float] = None,
) -> tuple[TokenLoss, torch.Tensor]:
    """DPPO's masked, truncated-IS policy gradient; returns (TokenLoss, truncated (N, T) bool).

    `valid` from `binary_valid` or `interval_valid`. Flags: clip_high/clip_low mark masked tokens with
    A > 0 / A < 0 (their gradient is removed); `truncated` marks valid tokens whose weight c capped.
    """
    w = torch.exp(log_ratio(logprobs, old_logprobs)).detach()
    weight = w if truncation_c is None else w.clamp(max=truncation_c)
    adv = per_token(advantages, logprobs)
    keep = valid.to(logprobs.dtype)
    loss = -adv * weight * logprobs * keep
    dropped = ~valid
    truncated = valid & (w > truncation_c) if truncation_c is not None else torch.zeros_like(valid)
    flags = TokenLoss(loss, dropped & (adv < 0), dropped & (adv > 0), torch.zeros_like(valid))
    return flags, truncated
