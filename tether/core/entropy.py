"""Two uses of the policy's token entropy H_t = -sum_v pi(v | ctx_t) log pi(v | ctx_t).

    High-entropy tokens only [arXiv 2506.01939, "Beyond the 80/20 Rule", its objective on forking tokens]:
        l_t <- 1[H_t >= tau_rho] l_t,   tau_rho the entropy of the ceil(rho n)-th highest-entropy counted token
        of the batch, n its counted tokens (the paper: rho = 0.2); the normaliser is unchanged.
    Adaptive entropy control [arXiv 2505.22312, Skywork-OR1, the loss function's "Adaptive Entropy Control"]:
        alpha_k = c_k 1[e_k <= target]                                 the bonus coefficient of step k
        c_{k+1} = clip(c_k + Delta sign(target - e_k), c_min, c_max)   (unchanged when e_k = target)
        e_k the entropy of the current policy estimated from step k's rollout, -mean_m(log pi_old(y_t)).

Where this departs from the papers and their code, and why:
1. The threshold is an order statistic, not an interpolated quantile: at least ceil(rho n) tokens are kept (all of
   them tied at the threshold), never none, so a hand count says which tokens train. TRL's `top_entropy_quantile`
   takes `torch.quantile` (linear interpolation) and keeps the tokens at or above it: the same count in the
   common case (n = 10, rho = 0.2: 2 tokens), one fewer in some (n = 3, rho = 0.45: 1 where this keeps 2).
2. The controller's numbers are the authors' released training scripts' (SkyworkAI/Skywork-OR1 64e96af,
   or1_scripts/train/*.sh: c_0 = 0, target 0.2, Delta 1e-4, c clipped to [0, 0.005] by `EntController`);
   TRL's defaults are Delta 0.005 and [0, 1].
3. alpha_k gates on e_k, the entropy of the step's own rollout, which exists before the step's update. The
   authors' `EntController` and TRL's `use_adaptive_entropy` both gate step k on the entropy measured at step
   k - 1 (their first step always applies c_0, TRL's none), and the released code moves c up only when e < target
   (down at e = target, where this leaves c as it is).

Plain functions: the mask and the estimate are tensors (no host sync); the controller is scalar arithmetic.
"""

from __future__ import annotations

import math

import torch

from .masked import masked_sum


def top_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, frac: float) -> torch.Tensor:
    """(N, T) bool: the counted tokens whose entropy is among the ceil(frac n) highest of the batch's n counted
    tokens (ties at the threshold all kept; all False when n = 0). entropy, mask (N, T); 0 < frac <= 1."""
    m = mask.bool()
    n = m.sum().to(torch.float64)
    k = torch.ceil(torch.round(n * frac, decimals=6)).long().clamp(min=1)  # round: 0.7 * 10 = 7.000000000000001
    ranked = torch.where(m, entropy, torch.full_like(entropy, float("-inf"))).flatten().sort(descending=True).values
    threshold = ranked.gather(0, (k - 1).reshape(1))  # (1,): the k-th highest; -inf when nothing counts
    return m & (entropy >= threshold)


def sampled_entropy(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """-mean_m(log pi(y_t)) in float64: the Monte Carlo estimate of the policy's mean token entropy from tokens it
    sampled, E_{y ~ pi}[-log pi(y)] = H(pi) at each position; NaN when no token counts. logprobs, mask (N, T)."""
    m = mask.bool()
    n = m.sum().to(torch.float64)
    total = masked_sum(logprobs.to(torch.float64), m)
    return torch.where(n > 0, -total / n.clamp(min=1), torch.full_like(total, float("nan")))


def adaptive_entropy_coef(
    coef: float, entropy: float, target: float, step: float, low: float, high: float
) -> tuple[float, float]:
    """(alpha_k, c_{k+1}) of Skywork-OR1's adaptive entropy control (module docstring) from c_k = `coef` and the
    step's entropy e_k = `entropy`: the bonus acts only at or below the target, and c moves by `step` towards
    more bonus below the target, less above it, clipped to [low, high]. A NaN entropy (no counted token) applies
    no bonus and leaves c as it is."""
    alpha = coef if entropy <= target else 0.0
    if math.isnan(entropy) or entropy == target:
        return alpha, coef
    moved = coef + step if entropy < target else coef - step
    return alpha, min(max(moved, low), high)
