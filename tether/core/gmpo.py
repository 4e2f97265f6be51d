"""GMPO: maximise the geometric mean of the token-level clipped ratios [GMPO, arXiv 2507.20673].

    J_i = A_i * prod_t |min(w_t sgn(A_i), clip(w_t, e^-eps_low, e^eps_high) sgn(A_i))|^(1 / |o_i|)
        = A_i * exp( (1 / |o_i|) sum_t sgn(A_i) min(sgn(A_i) log w_t, sgn(A_i) clip(log w_t, -eps_low, eps_high)) )

    l_i = -J_i, put on every token of sequence i (so `seq-mean-token-mean` averages l_i over sequences)

The clip acts per token in log space, one-sided by the sign of A as in PPO (A > 0: log w > eps_high loses its
gradient; A < 0: log w < -eps_low does), before the geometric mean, so an outlier token moves the sequence
weight by only a 1/|o_i| power. The paper's clip range is (e^-0.4, e^0.4), wider than GRPO's (0.8, 1.2).

Departures from the paper:
1. The sequence loss is written on every token, so the objective composes with any aggregation mode:
   `seq-mean-token-mean` (the default) gives the paper's mean over sequences; `token-mean` weights each
   sequence by its length. verl's `geo_mean` takes a plain mean over all rows (fully padded rows included)
   and ignores loss_agg_mode; tether counts only sequences with a token, as every seq-mean mode does.
2. A per-token advantage is reduced to the sequence's mean advantage (as verl does); GMPO defines it for
   sequence-level advantages only.
3. log w is clamped to [-20, 20] (tether.core.surrogates, departure 1); verl leaves it unclamped here.
4. `mask` is the set of tokens in the loss: a token that `rollout_correction` masks arrives here as padding
   (`tether.objectives.Objective.terms`), so it leaves the geometric mean: its log-ratio is not in it and it
   has no gradient.
"""

from __future__ import annotations

import torch

from .surrogates import TokenLoss, log_ratio, per_token


def gmpo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.4,
    eps_high: float = 0.4,
) -> tuple[TokenLoss, torch.Tensor]:
    """(TokenLoss whose (N, T) loss holds l_i on every token, the sequence ratio (N,) detached)."""
    log_w = log_ratio(logprobs, old_logprobs)  # (N, T)
    adv = per_token(advantages, logprobs)
    sgn = torch.sign(adv)
    clipped = torch.clamp(log_w, -eps_low, eps_high)
    log_w_min = sgn * torch.minimum(sgn * log_w, sgn * clipped)  # one-sided clip in log space
    m = mask.to(logprobs.dtype)
    n = m.sum(-1).clamp(min=1.0)  # (N,)
    seq_log_ratio = (log_w_min * m).sum(-1) / n  # (N,)
    seq_adv = (adv * m).sum(-1) / n  # (N,)
    seq_ratio = torch.exp(seq_log_ratio)
    loss = (-seq_adv * seq_ratio)[:, None].expand_as(logprobs)  # (N, T)
    w = log_w.detach()
    flags = TokenLoss(
        loss, (adv < 0) & (w < -eps_low), (adv > 0) & (w > eps_high), torch.zeros_like(adv, dtype=torch.bool)
    )
    return flags, seq_ratio.detach()
