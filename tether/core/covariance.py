"""Clip-Cov and KL-Cov: entropy control aimed at the tokens with the largest covariance between log-prob and
advantage [The Entropy Mechanism of RL for Reasoning LMs, Cui et al., arXiv 2505.22617].

The paper shows that, under policy gradient, the step change of the policy entropy is about
-Cov(log pi(y), A(y)), so a few tokens with a large positive covariance drive entropy collapse. Per token of
the (micro-)batch, with means over its counted tokens:

    cov_t = (A_t - mean A) (lp_t - mean lp)                       (detached; selection only)

    Clip-Cov   l_t = PPO-clip loss (eps_low, eps_high), except that a uniformly random choice of
               k = max(floor(r N_tok), 1) tokens among those with cov_lb < cov_t < cov_ub that the ratio clip
               did not already clip gets loss 0 (no gradient)                  (paper: r 2e-4, bounds 1 and 5)
    KL-Cov     l_t = -A_t w_t, plus kl_coef |log w_t| on the k = max(floor(r N_tok), 1) tokens of largest
               cov_t                                                  (paper: r 2e-3 (7B), 2e-4 (32B), coef 1)

Departures from the paper:
1. The random choice is sync-free: each candidate gets a uniform random key and the k smallest keys win
   (ranks by one argsort, k kept as a tensor), so no `.item()` or `nonzero` reaches the host. It draws a
   uniformly random k-subset, as the authors' and verl's `randperm` over the candidates does, but from
   different random numbers: the two agree exactly only when the choice is forced (k >= the number of
   candidates, or none). KL-Cov's top-k has no randomness (ties aside) and agrees with verl's exactly.
2. The statistics (the means, N_tok and therefore k) are those of the batch the loss is given, as in the
   authors' code and verl, which compute them per micro-batch: with gradient accumulation the selection
   depends on the micro-batch size (the loss is not a sum over micro-batches, unlike every other tether
   objective). The means cannot be taken over the whole mini-batch before its forward passes, because
   cov_t uses the current log-probs.
3. log w is clamped to [-20, 20] (tether.core.surrogates, departure 1); verl leaves it unclamped here.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .masked import masked_mean
from .surrogates import TokenLoss, clip_ratio_loss, log_ratio, per_token


class CovLoss(NamedTuple):
    tokens: TokenLoss
    selected: torch.Tensor  # (N, T) bool: tokens detached (Clip-Cov) or KL-penalised (KL-Cov)
    candidates: torch.Tensor  # (N, T) bool: tokens that could have been selected


def token_covariance(advantages: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(A_t - mean A)(lp_t - mean lp) over the counted tokens, (N, T), detached."""
    lp = logprobs.detach()
    adv = per_token(advantages, lp)
    return (adv - masked_mean(adv, mask)) * (lp - masked_mean(lp, mask))


def select_count(mask: torch.Tensor, frac: float) -> torch.Tensor:
    """k = max(floor(frac * N_tok), 1) as a 0-dim tensor (no host sync)."""
    n = mask.bool().sum().to(torch.float64)
    return torch.clamp(torch.floor(n * frac), min=1.0)


def top_k(scores: torch.Tensor, eligible: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """(N, T) bool: the k eligible entries with the largest scores (all of them when fewer than k)."""
    s = torch.where(eligible, scores, torch.full_like(scores, float("-inf"))).flatten()
    order = torch.argsort(s, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return eligible & (rank.view_as(eligible) < k)


def clip_cov(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    select_frac: float = 2e-4,
    cov_lb: float = 1.0,
    cov_ub: float = 5.0,
    generator: Optional[torch.Generator] = None,
) -> CovLoss:
    """Clip-Cov (see the module docstring); `generator` draws the random choice (default: torch's global RNG)."""
    ratio = torch.exp(log_ratio(logprobs, old_logprobs))
    adv = per_token(advantages, logprobs)
    base = clip_ratio_loss(ratio, adv, 1.0 - eps_low, 1.0 + eps_high)
    cov = token_covariance(adv, logprobs, mask)
    clipped = base.clip_low | base.clip_high
    candidates = mask.bool() & ~clipped & (cov > cov_lb) & (cov < cov_ub)
    keys = torch.rand(cov.shape, generator=generator, dtype=torch.float64, device=cov.device)
    selected = top_k(-keys, candidates, select_count(mask, select_frac))  # the k smallest keys
    loss = torch.where(selected, torch.zeros_like(base.loss), base.loss)
    return CovLoss(base._replace(loss=loss), selected, candidates)


def kl_cov(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    select_frac: float = 2e-3,
    kl_coef: float = 1.0,
) -> CovLoss:
    """KL-Cov (see the module docstring): no clip; |log w| penalty on the top-k covariance tokens."""
    log_w = log_ratio(logprobs, old_logprobs)
    adv = per_token(advantages, logprobs)
    pg = -adv * torch.exp(log_w)
    cov = token_covariance(adv, logprobs, mask)
    eligible = mask.bool()
    selected = top_k(cov, eligible, select_count(mask, select_frac))
    loss = torch.where(selected, pg + kl_coef * log_w.abs(), pg)
    none = torch.zeros_like(eligible)
    return CovLoss(TokenLoss(loss, none, none, none), selected, eligible)
