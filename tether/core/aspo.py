"""ASPO: GRPO's clip mask with the ratio of positive-advantage tokens flipped, and a soft dual clip
[ASPO, arXiv 2510.06062].

    w_t = pi_theta / pi_old.   Step 1 (token masking, GRPO's clip): no gradient where A_t > 0 and w_t > 1 + eps_high,
    or A_t < 0 and w_t < 1 - eps_low.   Step 2 (weight flipping, Eq. 3): for A_t > 0 the ratio is
        r^_t = pi_old pi_theta / SG(pi_theta)^2          value 1 / w_t, gradient (1 / w_t) grad lp_t  (Eq. 12)
    and r^_t = w_t for A_t < 0.   Step 3 (soft dual clip, CISPO's truncation): a token whose weight exceeds c keeps
    its gradient at weight c:  l_t = -A_t c lp_t.   Elsewhere l_t = -A_t r^_t.

So d l_t / d lp_t = -A_t m_t min(w^_t, c) with w^ = 1 / w (A > 0) or w (A < 0) and m_t GRPO's clip mask (the
paper's Prop. 4.1 with the weight flipped). Within the unclipped region the expected loss is the gradient of
    -J(theta),   J = sum_{a: A < 0} A(a) pi_theta(a) - sum_{a: A > 0} A(a) pi_old(a)^2 / pi_theta(a)
(per state, under pi_old): a positive token's push grows as 1 / pi_theta, so a lagging one catches up
(tests/objectives/test_aspo_pspo.py enumerates this). On-policy (w = 1) ASPO is the plain policy gradient.

Departures from the paper:
1. log w is clamped to [-20, 20] before exp (tether.core.surrogates, departure 1), as the released code does.
2. The loss VALUES follow the released code (wizard-III/Archer2.0, `compute_policy_loss_archer`): a masked token
   carries the constant -A (1 - eps_low) (A < 0) or -A / (1 + eps_high) (A > 0), a dual-clipped one -A c lp. The
   paper defines only their gradients (0 and -A c grad lp).
3. c = 3.0 for both signs, the released code's value; the paper gives none. c = None drops the dual clip (the
   paper's "w/o Dual Clip" ablation): the flipped weight 1 / w is then unbounded as pi_theta -> 0.
4. A = 0 takes the positive branch, as the released code does; its loss and gradient are 0 either way. The clip
   flags count A > 0 and A < 0 only (the released `pg_clipfrac_upper` also counts A = 0 tokens above 1 + eps).
5. The released code (its `dp_actor.py`) always widens the clip range of the tokens whose entropy is above the 0.8
   quantile of their own sequence's entropies (Archer's dual-token constraint, arXiv 2507.15778: 0.4 there, 0.2
   for the others); the paper states one range, eps = 0.2. tether takes scalar or per-token bounds, and
   `high_entropy_tokens` picks those tokens as the released code does (entropy detached, linear interpolation).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch

from .surrogates import TokenLoss, log_ratio, per_token

Bound = Union[float, torch.Tensor]


class ASPOTerms(NamedTuple):
    tokens: TokenLoss
    """The per-token loss (N, T); clip flags: low = A < 0 below 1 - eps_low, high = A > 0 above 1 + eps_high,
    dual = the soft dual clip acted (either sign)."""
    weight: torch.Tensor
    """(N, T) detached: the factor of -A grad lp, m min(w^, c) (0 on masked tokens; the positive branch at A = 0)."""
    dual_pos: torch.Tensor
    """(N, T) bool: A > 0 and 1 / w > c (the flipped weight was truncated)."""
    dual_neg: torch.Tensor
    """(N, T) bool: A < 0 and w > c."""


def high_entropy_tokens(entropy: torch.Tensor, mask: torch.Tensor, quantile: float = 0.8) -> torch.Tensor:
    """(N, T) bool: counted tokens whose entropy is above the `quantile` of their own sequence's counted entropies
    (torch.nanquantile, linear interpolation; a tie with the quantile is not above it). Entropy is detached; a
    sequence with no counted token has none."""
    counted = mask.bool()
    e = torch.where(counted, entropy.detach(), torch.full_like(entropy, float("nan")))
    q = torch.nanquantile(e, quantile, dim=-1, keepdim=True)  # (N, 1); NaN for a row with no counted token
    return counted & (e > q)


def aspo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: Bound = 0.2,
    eps_high: Bound = 0.2,
    dual_clip_c: Optional[float] = 3.0,
) -> ASPOTerms:
    """ASPO's per-token loss. logprobs, old_logprobs (N, T); advantages (N,) or (N, T); eps_low / eps_high floats
    or (N, T) tensors (per-token ranges, departure 5); dual_clip_c > 1 or None (departure 3)."""
    ratio = torch.exp(log_ratio(logprobs, old_logprobs))
    adv = per_token(advantages, logprobs)
    low = torch.as_tensor(1.0 - eps_low, dtype=ratio.dtype, device=ratio.device)
    high = torch.as_tensor(1.0 + eps_high, dtype=ratio.dtype, device=ratio.device)
    neg_w = torch.clamp(ratio, min=low)  # GRPO's clip for A < 0: a constant (no gradient) below 1 - eps_low
    pos_w = torch.clamp(ratio, max=high)  # ... and for A > 0 above 1 + eps_high
    flipped = pos_w / pos_w.detach().square()  # Eq. 3: pi_old pi_theta / SG(pi_theta)^2 = 1 / w in value
    neg_loss, pos_loss = -adv * neg_w, -adv * flipped
    w = ratio.detach()
    neg_weight = torch.where(w < low, torch.zeros_like(w), w)
    pos_weight = torch.where(w > high, torch.zeros_like(w), 1.0 / w)
    no = torch.zeros_like(adv, dtype=torch.bool)
    dual_n, dual_p = no, no
    if dual_clip_c is not None:
        c = dual_clip_c
        truncated = -adv * c * logprobs  # weight c, gradient kept (CISPO's soft clip; value as released)
        dual_n, dual_p = neg_w.detach() > c, 1.0 / pos_w.detach() > c
        neg_loss = torch.where(dual_n, truncated, neg_loss)
        pos_loss = torch.where(dual_p, truncated, pos_loss)
        neg_weight, pos_weight = neg_weight.clamp(max=c), pos_weight.clamp(max=c)
    negative, positive = adv < 0, adv > 0
    loss = torch.where(negative, neg_loss, pos_loss)
    weight = torch.where(negative, neg_weight, pos_weight)
    dual_neg, dual_pos = negative & dual_n, positive & dual_p
    flags = TokenLoss(loss, negative & (w < low), positive & (w > high), dual_neg | dual_pos)
    return ASPOTerms(flags, weight, dual_pos, dual_neg)
