"""Train-inference mismatch correction (rollout correction): importance weights between the
policy the trainer scores (pi_old, recomputed) and the sampler that produced the tokens.

The sampler's log-probs can differ from the trainer's for the same weights: a bf16 decode, a
different kernel (vLLM, SGLang), top-p/top-k truncation. With d_t = lp_old_t - lp_sampler_t (the log of
pi_old / pi_sampler for token t) and S the sequence's counted tokens, the ratio r_t is, by `level`,

    token               r_t = exp(d_t)
    sequence            r_t = exp(sum_{s in S} d_s)           the product of the token ratios, on every token
    sequence_geometric  r_t = exp(sum_{s in S} d_s / |S|)     their geometric mean, on every token

and a `mode` turns it into the weight c_t:

    truncate  (TIS)          c_t = clamp(r_t, low, high)             (low = 0: only the top is cut)
    mask (MIS / IcePop)      c_t = r_t if low <= r_t <= high else 0  (the token leaves the loss)
    mask by a divergence     c_t = 1 if D_t <= delta else 0          ({mode: mask, measure, delta})

where D_t is a tether divergence measure D (`tether.core.divergences`: kl3, kl2, chi2, ...) of the ratio:
    token               D_t = D(exp(d_t))
    sequence            D_t = mean_{s in S} D(exp(d_s))           (verl's seq_mean_k3 with D = kl3)
    sequence_geometric  D_t = D(exp(sum_{s in S} d_s / |S|))
or a binary measure B of the two log-probs (`divergences.BINARY_MEASURES`: binary_tv, binary_kl, binary_kl_max),
token and sequence levels only (there is no ratio to average geometrically):
    token               D_t = B(lp_old_t, lp_sampler_t)
    sequence            D_t = mean_{s in S} B(lp_old_s, lp_sampler_s)
With binary_kl_max this is KPop (AReaL's rejection_sampling `metric: binary_kl`, `action: mask`):
    D_t = max(KL(Ber(p_old) || Ber(p_sampler)), KL(Ber(p_sampler) || Ber(p_old)))     kept iff D_t <= delta
(AReaL's `upper` is delta; its sequence level with `agg: mean` is the sequence level here.)
A divergence mask is a 0/1 rejection: a kept token is NOT weighted by r. The objective's per-token loss
becomes SG(c_t) * l_t, and a masked token (c_t = 0) also leaves the objective's own sequence statistics
(`tether.objectives`: GMPO's geometric mean, GSPO's sequence ratio), so its gradient is exactly 0.

The definitions are verl 0.9.1's (`rollout_corr_helper.py`: `rollout_is="token"|"sequence"` with a
threshold (TIS) or a "lower_upper" threshold (IcePop); `rollout_rs="token_k3"|"seq_mean_k3"`) and TRL 1.16's
(`vllm_importance_sampling_mode`: token_truncate, token_mask, sequence_truncate, sequence_mask, all with
the sequence ratio exp(sum_t d_t)). Papers: TIS (Yao et al., "Your efficient RL framework secretly brings
you off-policy RL training", 2025), MIS and IcePop (the same line of work), "When Speed Kills Stability"
(Liu et al., 2025; verl's rejection presets).

Departures:
1. One weight per token, multiplied into whatever per-token loss the objective has (PPO clip,
   RPG, ...), as TRL and verl apply their sampler correction; the objective's own ratio is
   pi_theta / pi_old, unchanged.
2. With identical log-probs (trainer.old_logprobs=sampler) every weight is 1: a no-op, tested.
3. The log-ratio that is exponentiated (d_t, its sum or its mean) is clamped to [-20, 20] first, as verl
   does (TRL does not clamp): a product over many tokens cannot overflow, and bounds inside
   [e^-20, e^20] decide exactly as unclamped ones would.
4. A masked or rejected token stays in the aggregation's token count (the normaliser, computed by the
   caller from the mask alone), as in TRL and verl's IcePop; verl's rejection (`rollout_rs`) also removes
   it from `response_mask`, so under token-mean verl divides by the kept tokens only.
6. A missing (NaN) sampler log-prob counts as pi_sampler = pi_old, no mismatch (TRL's rule for its importance
   weights); AReaL's KPop computes its metric from the raw log-probs, so a NaN there is NaN and the token is
   rejected. tether's trainer never passes one (`tether.trainer.step.finite_sampler_tokens`).
5. `sequence` is the product of the token ratios (verl's and TRL's), the geometric mean is
   `sequence_geometric`; `{mode: mask, measure, delta}` is verl's k3 rejection (kept tokens weighted 1), not
   the ratio band {r : D(r) <= delta} with kept tokens weighted by r.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .divergences import BINARY_MEASURES
from .divergences import value as divergence
from .masked import seq_mean

LEVELS = ("token", "sequence", "sequence_geometric")
MODES = ("truncate", "mask")
SAFETY_BOUND = 20.0  # |log r| is clamped to this before exp (departure 3)


class Correction(NamedTuple):
    weights: torch.Tensor  # (N, T) c_t, detached, 0 at padding
    truncated: torch.Tensor  # (N, T) bool: r_t was cut to a bound
    masked: torch.Tensor  # (N, T) bool: the token left the loss
    log_ratio: torch.Tensor  # (N, T) lp_old - lp_sampler, 0 at padding (the mismatch)


def level_log_ratio(diff: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """log r_t (N, T) at `level` from the token log-ratios `diff` (N, T), 0 at padding: d_t, the
    sequence's sum (the product of the ratios), or its mean (their geometric mean), on every token."""
    if level == "token":
        return diff
    if level == "sequence_geometric":
        return seq_mean(diff, mask)[:, None].expand_as(diff)
    return diff.sum(-1, keepdim=True).expand_as(diff)


def rejection_statistic(
    diff: torch.Tensor, mask: torch.Tensor, level: str, measure: str, old_logprobs: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """D_t (N, T) of the module docstring: the divergence `measure` of the ratio at `level`
    (at `sequence`, the mean of the token divergences over the counted tokens). A binary measure also reads
    `old_logprobs` (N, T): pi_sampler's log-prob is then lp_old - diff."""
    if measure in BINARY_MEASURES:
        if level == "sequence_geometric" or old_logprobs is None:
            raise ValueError(
                f"the binary measure {measure!r} compares two log-probs: it needs old_logprobs and "
                f"level token or sequence; got level {level!r}"
            )
        old = torch.where(mask, old_logprobs.detach(), torch.zeros_like(diff))
        d = BINARY_MEASURES.get(measure)(old, old - diff)
        return d if level == "token" else seq_mean(d, mask)[:, None].expand_as(diff)
    if level != "sequence":
        return divergence(measure, torch.exp(level_log_ratio(diff, mask, level).clamp(-SAFETY_BOUND, SAFETY_BOUND)))
    d = divergence(measure, torch.exp(diff.clamp(-SAFETY_BOUND, SAFETY_BOUND)))
    return seq_mean(d, mask)[:, None].expand_as(diff)


def rollout_correction(
    old_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    mask: torch.Tensor,
    level: str = "token",
    mode: str = "truncate",
    low: float = 0.0,
    high: float = 2.0,
    measure: Optional[str] = None,
    delta: Optional[float] = None,
) -> Correction:
    """Weights c_t (N, T) that correct pi_sampler's tokens towards pi_old (module docstring); with
    `measure` and `delta` (mode "mask" only) a 0/1 rejection by D_t <= delta, and `low`, `high` unused."""
    if level not in LEVELS or mode not in MODES:
        raise ValueError(f"level must be one of {LEVELS} and mode one of {MODES}; got {level!r}, {mode!r}")
    if measure is not None and (mode != "mask" or delta is None):
        raise ValueError(
            f"a divergence measure ({measure!r}) rejects tokens: it needs mode 'mask' and a delta; "
            f"got mode {mode!r}, delta {delta!r}"
        )
    m = mask.bool()
    diff = torch.where(m, old_logprobs.detach() - sampler_logprobs.detach(), torch.zeros_like(old_logprobs))
    diff = torch.nan_to_num(diff, nan=0.0)  # a sampler log-prob that is missing (NaN) means no correction
    none = torch.zeros_like(m)
    if measure is not None:
        rejected = rejection_statistic(diff, m, level, measure, old_logprobs) > delta
        w, truncated, masked = (~rejected).to(diff.dtype), none, rejected & m
    else:
        r = torch.exp(level_log_ratio(diff, m, level).clamp(-SAFETY_BOUND, SAFETY_BOUND))
        outside = (r < low) | (r > high)
        if mode == "truncate":
            w, truncated, masked = r.clamp(low, high), outside & m, none
        else:
            w, truncated, masked = torch.where(outside, torch.zeros_like(r), r), none, outside & m
    return Correction(torch.where(m, w, torch.zeros_like(w)), truncated, masked, diff)


def off_policy_sequence_mask(
    logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, delta: float
) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (DeepSeek-V3.2 report, 2025; TRL's `off_policy_mask_threshold`): (N, T)
    bool,
    True where a token leaves the loss,

        masked_{i,t} = A_{i,t} < 0  and  (1 / |o_i|) sum_{s in o_i} log(pi_behaviour(o_s) / pi_theta(o_s)) > delta

    a sequence that the policy is pushed away from AND that drifted far from the policy that sampled it (the k1
    estimate of KL(pi_behaviour || pi_theta) over its tokens). `logprobs` (N, T) are pi_theta's (detached here),
    `behaviour_logprobs` (N, T) the sampler's; `advantages` (N,) or (N, T). As TRL: the mean over the sequence's
    counted tokens (at least 1), a strict `>`, A = 0 kept, and a NaN log-ratio (a token the sampler could not
    score) counted as 0, no drift, before the mean, as TRL (`torch.nan_to_num(kl, nan=0.0)`, which also maps
    +-inf to the dtype's largest finite values). tether's trainer never passes a non-finite sampler log-prob
    (`tether.trainer.step.finite_sampler_tokens` takes such tokens out of the mask)."""
    m = mask.bool()
    d = torch.where(m, behaviour_logprobs.detach() - logprobs.detach(), torch.zeros_like(logprobs))
    d = torch.nan_to_num(d, nan=0.0)
    seq_kl = seq_mean(d, m)[:, None]  # (N, 1)
    adv = advantages if advantages.dim() == 2 else advantages[:, None]
    return (adv < 0) & (seq_kl > delta) & m
