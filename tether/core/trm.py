"""TRM: Trust Region Masking, a sequence mask on the largest token divergence [TRM, arXiv 2512.23075].

Li, Liu, Xu, Tong, Li, Liu, Wang, "Trust Region Masking for Long-Horizon LLM Reinforcement Learning" (2025).
Every bound on the surrogate's error the paper derives depends on the LARGEST per-token divergence of a sequence,
which no per-token clip controls, so a sequence leaves the loss as a whole once any of its tokens leaves the
trust region. With d_t = log rho_t, rho_t = pi_theta(y_t | c_t) / pi_roll(y_t | c_t), the sample-based detectors
(the paper's Appendix on k2 and k3) are

    k2_t = d_t^2 / 2                   symmetric in rho and 1 / rho: the detector for the max criterion
    k3_t = rho_t - 1 - d_t             E_roll[k3] = KL(pi_roll || pi_theta): the estimator for the average

    M_i = 1[max_t k2_t <= delta_max] * 1[(1 / |o_i|) sum_t k3_t <= delta_avg]     (either factor may be off)

    L_masked = (1 / N) sum_i M_i A_i sum_t rho_t        Algorithm 1: 1 / N over every sequence, masked or not

so the per-token loss is l_t = -M_i A_i rho_t, whose gradient on a kept sequence is -A_i rho_t grad log pi_theta
(the paper's backward pass) and 0 on a masked one.

Departures:
1. The paper's guarantee needs the exact per-context KL over the vocabulary from stored rollout logits; an
   objective here sees only the sampled token, so the mask uses the paper's sample-based detectors (its
   recommended k2 for the max and k3 for the average; k3 for the max and k2 for the average are verl's other
   `seq_max_*` / `seq_mean_*` options). The paper says these are heuristics, not a bound on D_KL^tok,max.
2. What d_t measures is the caller's (`tether.objectives.TRMConfig.against`): log(pi_theta / pi_old), the paper's
   rho when pi_old is the rollout policy (verl's bypass mode), or log(pi_old / pi_sampler), fixed per rollout batch
   (verl's decoupled mode, where the rejection runs once before the updates).
3. The normaliser counts the masked sequences (the paper's 1 / N): the mask zeroes their loss and leaves the
   batch's mask alone. verl's `rollout_rs` (verl-project/verl#4544) instead removes the rejected tokens from
   `response_mask`, so its token-mean (or seq-mean) divides by the kept tokens (or sequences) only: verl's loss is
   this one times counted / kept.
4. Optionally a PPO clip of rho on the kept sequences (`eps_low`, `eps_high`: verl's bypass `ppo_clip` with
   `rollout_rs`); the paper's Algorithm 1 has none.
5. A sequence is kept at equality (k <= delta), as in the paper and in verl. d_t is clamped to [-20, 20] before any
   exp, as verl's `log_ratio_safe` is (tether.core.surrogates, departure 1).
6. The statistic is per sequence, so splitting a mini-batch into micro-batches does not change the mask (unlike
   M2PO's batch statistic).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .kl import k3_of_log
from .masked import seq_mean
from .surrogates import LOG_RATIO_CLAMP, TokenLoss, clip_ratio_loss, log_ratio, per_token


def k2_of_log(d: torch.Tensor) -> torch.Tensor:
    """k2(rho) = (log rho)^2 / 2 from d = log rho."""
    return 0.5 * d**2


ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"k2": k2_of_log, "k3": k3_of_log}
"""The per-token detectors a criterion may use, each a function of d = log rho."""


def seq_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence masked max, (N, T) -> (N,); 0 for a sequence with no counted token (verl's convention)."""
    m = mask.bool()
    v = torch.where(m, x, torch.full_like(x, float("-inf"))).max(-1).values
    return torch.where(m.any(-1), v, torch.zeros_like(v))


def statistics(
    d: torch.Tensor, mask: torch.Tensor, max_estimator: str = "k2", avg_estimator: str = "k3"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(max_t k_max(d_t), mean_t k_avg(d_t)) per sequence, each (N,), detached; d (N, T) is log rho."""
    d = d.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return seq_max(ESTIMATORS[max_estimator](d), mask), seq_mean(ESTIMATORS[avg_estimator](d), mask)


def trm_keep(
    d: torch.Tensor,
    mask: torch.Tensor,
    max_delta: Optional[float],
    avg_delta: Optional[float],
    max_estimator: str = "k2",
    avg_estimator: str = "k3",
) -> torch.Tensor:
    """(N,) bool: the sequences inside the trust region, for log-ratios d (N, T); a criterion whose delta is None
    is off. A sequence with no counted token is kept (it has no loss either way)."""
    seq_max_stat, seq_avg_stat = statistics(d, mask, max_estimator, avg_estimator)
    keep = torch.ones(d.shape[0], dtype=torch.bool, device=d.device)
    if max_delta is not None:
        keep = keep & (seq_max_stat <= max_delta)
    if avg_delta is not None:
        keep = keep & (seq_avg_stat <= avg_delta)
    return keep


def trm(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    keep: torch.Tensor,
    eps_low: Optional[float] = None,
    eps_high: Optional[float] = None,
) -> TokenLoss:
    """TRM's per-token loss -M_i A rho (N, T), rho = pi_theta / pi_old differentiable and M = `keep` (N,); with
    `eps_low` (and `eps_high`, default `eps_low`), -M_i min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A).

    Flags: clip_high / clip_low mark the tokens of masked sequences with A > 0 / A < 0 (their gradient is removed),
    and the tokens of kept sequences whose gradient the clip removed."""
    rho = torch.exp(log_ratio(logprobs, old_logprobs))
    adv = per_token(advantages, logprobs)
    kept = keep[:, None].expand_as(rho)  # (N, T)
    dropped = ~kept
    if eps_low is None:
        loss = torch.where(kept, -adv * rho, torch.zeros_like(rho))
        return TokenLoss(loss, dropped & (adv < 0), dropped & (adv > 0), torch.zeros_like(kept))
    clipped = clip_ratio_loss(rho, adv, 1.0 - eps_low, 1.0 + (eps_low if eps_high is None else eps_high))
    return TokenLoss(
        torch.where(kept, clipped.loss, torch.zeros_like(rho)),
        dropped & (adv < 0) | kept & clipped.clip_low,
        dropped & (adv > 0) | kept & clipped.clip_high,
        torch.zeros_like(kept),
    )
