"""M2PO: a second-moment trust region, a batch-level mask on the squared token log-ratios [M2PO, arXiv 2510.01161].

Zheng, Zhao, Chen, "Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale Data on LLMs?" (2025).
With d_t = log r_t the token log-ratio and B the batch's counted tokens,

    M2_hat = (1 / |B|) sum_{t in B} d_t^2                      the second moment of log r (>= 0 per token)

    M_t = 0 for the k tokens with the largest d_t^2, 1 for the others, k the smallest number for which the
          mean of d_t^2 over the kept tokens is below tau_M2 (the paper's threshold 0.04)

    J = (1 / sum_i |o_i|) sum_i sum_t M_t r_t A_t               the paper's objective: no clip, and the
                                                                 normaliser counts every token, kept or not

so l_t = -A_t * w_t * M_t, whose gradient on a kept token is -A_t w_t grad lp_t. Unlike a batch KL estimate
(sum of log r, where positive and negative terms cancel), every token adds d_t^2 >= 0, and removing the few
largest outliers brings the batch back inside the region while the rest of the stale batch keeps its gradient.

`m2_keep` is AReaL's `_apply_m2po_masking` rule (areal/trainer/ppo/actor.py, `m2_threshold`): sort the counted
tokens by d^2 descending, drop the first k where k is the first index whose suffix mean is < tau, and if no
suffix is below tau keep only the token with the smallest d^2.

AReaL (areal 1.0.4, `grpo_loss_fn` and `ppo_actor_loss_fn` in areal/utils/functional/functional.py) differs from
the paper's objective in two more ways, each offered here as an option (tether.objectives.M2POConfig):
- it applies M to its `loss_mask`, so its token mean divides by the KEPT tokens of the micro-batch,
  (1 / sum_t M_t) sum_t M_t l_t, then weights the micro-batch by its counted tokens: `normaliser: kept_tokens`
  multiplies each l_t by |B| / sum_t M_t (`kept_scale`), which is exactly that under token-mean aggregation;
- it keeps PPO's clip of r = pi_theta / pi_prox at [1 - eps_clip, 1 + eps_clip_higher]: `eps_low`/`eps_high`,
  l_t = -M_t min(r_t A_t, clip(r_t) A_t).

Departures:
1. Strictly below tau (AReaL's `<`; the paper says "falls below"). Ties in d^2 are broken by position (a
   stable sort), so the mask is deterministic; AReaL's unstable sort may drop a different one of equal values.
2. The statistic is over the batch the loss is given: the micro-batch when the trainer splits a mini-batch,
   as AReaL (per micro-batch in its loss function) and the authors' verl code (per micro-batch) compute it; the
   loss is then not a sum over micro-batches (like Clip-Cov and KL-Cov, tether.core.covariance departure 2).
3. What d_t measures is the caller's choice (`tether.objectives.M2POConfig.against`): log(pi_theta / pi_old),
   the paper's r with pi_old the behaviour policy (tether's bypass anchoring, trainer.old_logprobs=sampler),
   recomputed at every update; or log(pi_old / pi_sampler), fixed for the rollout batch (AReaL, which measures
   its behaviour policy against the recomputed proximal one).
4. The authors' released code (Infini-AI-Lab/M2PO, verl 0.4 fork, `compute_m2po_policy_loss`) differs from the
   paper: it computes a clip bound tau from d^2 of the tokens the advantage pushes outwards only, caps d^2 at it
   (rather than dropping tokens) to meet the budget, and never clips tighter than [0.7, 1.5]. tether follows the
   paper and AReaL (a mask), not that code.
5. log w is clamped to [-20, 20] before exp (tether.core.surrogates, departure 1).
"""

from __future__ import annotations

from typing import Optional

import torch

from .surrogates import TokenLoss, clip_ratio_loss, log_ratio, per_token


def m2_keep(d: torch.Tensor, mask: torch.Tensor, tau: float) -> torch.Tensor:
    """(N, T) bool: the counted tokens M2PO keeps, for log-ratios `d` (N, T) and threshold `tau`.

    The fewest tokens with the largest d^2 are dropped so that the mean of d^2 over the rest is < tau
    (departure 1); when no suffix qualifies, only the smallest d^2 is kept. Padding is never kept."""
    m = mask.bool()
    sq = (d.detach() ** 2)[m]  # (K,) the counted tokens, in row-major order
    keep = torch.zeros_like(m)
    if sq.numel() == 0:
        return keep
    order = torch.sort(sq, descending=True, stable=True).indices  # (K,)
    sorted_sq = sq[order]
    k = sorted_sq.numel()
    suffix_mean = sorted_sq.flip(0).cumsum(0).flip(0) / torch.arange(k, 0, -1, dtype=sq.dtype, device=sq.device)
    below = suffix_mean < tau
    # the first index whose suffix mean is below tau (k - 1 when none is: keep the smallest only)
    n_drop = torch.where(below.any(), below.to(torch.int64).argmax(), torch.tensor(k - 1, device=sq.device))
    kept_sorted = torch.arange(k, device=sq.device) >= n_drop  # (K,)
    kept = torch.empty_like(kept_sorted)
    kept[order] = kept_sorted
    keep[m] = kept
    return keep


def second_moment(d: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """M2_hat = mean of d^2 over the counted tokens of `mask` (0 when there are none)."""
    m = mask.to(d.dtype)
    return ((d.detach() ** 2) * m).sum() / m.sum().clamp(min=1.0)


def kept_scale(mask: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """|B| / sum_t M_t, a scalar: the factor that turns a mean over all counted tokens into AReaL's mean over the
    kept ones (1 when nothing is kept, where every loss is 0 anyway)."""
    n = mask.detach().to(torch.float64).sum()
    return n / keep.to(torch.float64).sum().clamp(min=1.0)


def m2po(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    keep: torch.Tensor,
    eps_low: Optional[float] = None,
    eps_high: Optional[float] = None,
) -> TokenLoss:
    """M2PO's per-token loss -A w M (N, T) with w = pi_theta / pi_old differentiable and M = `keep`; with
    `eps_low`/`eps_high`, AReaL's PPO clip -M min(w A, clip(w, 1 - eps_low, 1 + eps_high) A).

    Flags: clip_high / clip_low mark dropped tokens with A > 0 / A < 0 (their gradient is removed), and kept
    tokens whose gradient the clip removed."""
    w = torch.exp(log_ratio(logprobs, old_logprobs))
    adv = per_token(advantages, logprobs)
    dropped = ~keep
    if eps_low is None:
        loss = -adv * w * keep.to(logprobs.dtype)
        return TokenLoss(loss, dropped & (adv < 0), dropped & (adv > 0), torch.zeros_like(keep))
    clipped = clip_ratio_loss(w, adv, 1.0 - eps_low, 1.0 + (eps_low if eps_high is None else eps_high))
    loss = clipped.loss * keep.to(logprobs.dtype)
    return TokenLoss(
        loss,
        dropped & (adv < 0) | keep & clipped.clip_low,
        dropped & (adv > 0) | keep & clipped.clip_high,
        torch.zeros_like(keep),
    )
