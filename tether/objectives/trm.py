"""TRM [arXiv 2512.23075]: Trust Region Masking, a sequence leaves the loss when any of its tokens left the region.

    M_i = 1[max_t k2(rho_t) <= delta_max] * 1[mean_t k3(rho_t) <= delta_avg],    l_t = -M_i A_i rho_t

with the paper's 1 / N over every sequence (Algorithm 1). The math and the departures are in `tether.core.trm`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch

from ..core import surrogates as _sur
from ..core import trm as _trm
from ..core.masked import masked_fraction
from .base import ObjectiveConfig, check, objective
from .batch import Mean, TokenBatch, masked_fill


@dataclass
class TRMConfig(ObjectiveConfig):
    """TRM [arXiv 2512.23075]: mask a whole sequence when its largest (or mean) token divergence exceeds delta."""

    aggregation: str = "seq-mean-token-sum"
    """The paper's Algorithm 1: (1 / N) sum_i M_i A_i sum_t rho_t, with N every sequence of the batch (a masked one
    adds 0 and still counts)."""
    max_delta: Optional[float] = 0.05
    """delta of the max criterion, max_t k(rho_t) <= delta (the paper's TRM-Max: 0.05; 0.1 in its combined run);
    null: off."""
    avg_delta: Optional[float] = None
    """delta of the average criterion, (1 / |o_i|) sum_t k(rho_t) <= delta (the paper's TRM-Avg: 0.001; 0.002 in its
    combined run); null (default, Algorithm 1): off."""
    max_estimator: Literal["k2", "k3"] = "k2"
    """Detector of the max criterion: k2 = (log rho)^2 / 2, symmetric in rho and 1 / rho (the paper's; verl's
    seq_max_k2), or k3 = rho - 1 - log rho (verl's seq_max_k3)."""
    avg_estimator: Literal["k3", "k2"] = "k3"
    """Estimator of the average criterion: k3, unbiased for KL(pi_roll || pi_theta) (the paper's; verl's
    seq_mean_k3), or k2 (verl's seq_mean_k2)."""
    against: Literal["old", "sampler"] = "old"
    """What rho measures: old, pi_theta / pi_old at every update (the paper's rho = pi_theta / pi_roll when pi_old is
    the rollout policy: trainer.old_logprobs=sampler, verl's bypass mode); sampler, pi_old / pi_sampler, fixed per
    rollout batch (verl's decoupled mode; needs sampler_logprobs and trainer.old_logprobs=recompute)."""
    eps_low: Optional[float] = None
    """PPO clip of rho on the kept sequences, lower side (verl's bypass ppo_clip with rollout_rs): l = -M min(rho A,
    clip(rho, 1 - eps_low, 1 + eps_high) A); null (default, the paper's Algorithm 1): no clip."""
    eps_high: Optional[float] = None
    """Upper side of that clip; null: eps_low. Needs eps_low."""

    def __post_init__(self):
        super().__post_init__()
        for key in ("max_delta", "avg_delta"):
            value = getattr(self, key)
            check(value is None or value > 0, key, value, "a number > 0, or null to turn that criterion off")
        check(
            self.max_delta is not None or self.avg_delta is not None,
            "max_delta/avg_delta",
            (self.max_delta, self.avg_delta),
            "at least one threshold (the paper's TRM-Max: max_delta 0.05; TRM-Avg: avg_delta 0.001)",
        )
        check(self.eps_low is None or self.eps_low >= 0, "eps_low", self.eps_low, "a number >= 0, or null for no clip")
        check(
            self.eps_high is None or (self.eps_low is not None and self.eps_high >= 0),
            "eps_high",
            self.eps_high,
            "a number >= 0 together with eps_low, or null",
        )

    def needs(self) -> dict[str, str]:
        need = super().needs()
        if self.against == "sampler" and "sampler_logprobs" not in need:
            need["sampler_logprobs"] = "trm against='sampler' measures log(pi_old / pi_sampler); or use against='old'"
        return need

    def vanishes_when_old_is_sampler(self) -> dict[str, str]:
        out = super().vanishes_when_old_is_sampler()
        if self.against == "sampler":
            out["against"] = (
                "against: sampler measures log(pi_old / pi_sampler), which is 0 when pi_old is pi_sampler: no "
                "sequence is ever masked; set against: old (the paper's rho = pi_theta / pi_roll under this "
                "anchoring), or trainer.old_logprobs: recompute (verl's decoupled mode)"
            )
        return out


@objective("trm", TRMConfig)
def _trm_loss(cfg: TRMConfig, b: TokenBatch, lp, old):
    if cfg.against == "old":
        d = _sur.log_ratio(lp, old).detach()
    else:  # log(pi_old / pi_sampler); the padding and a missing (NaN) sampler log-prob count as 0
        d = torch.nan_to_num(old - masked_fill(b.sampler_logprobs, b.loss_mask).detach(), nan=0.0)
    seq_max, seq_avg = _trm.statistics(d, b.loss_mask, cfg.max_estimator, cfg.avg_estimator)
    keep = _trm.trm_keep(d, b.loss_mask, cfg.max_delta, cfg.avg_delta, cfg.max_estimator, cfg.avg_estimator)
    tokens = _trm.trm(lp, old, b.advantages, keep, cfg.eps_low, cfg.eps_high)
    return tokens, {
        "trm/masked_frac": masked_fraction(~keep[:, None] & b.loss_mask.bool(), b.loss_mask),
        "trm/seq_masked_frac": _sequence_mean(~keep, b.loss_mask),
        "trm/max_stat_mean": _sequence_mean(seq_max, b.loss_mask),
        "trm/avg_stat_mean": _sequence_mean(seq_avg, b.loss_mask),
    }


def _sequence_mean(x: torch.Tensor, mask: torch.Tensor) -> Mean:
    """The mean of a per-sequence value x (N,) over the sequences with a counted token, with their number as the
    count, so micro-batches merge exactly."""
    seqs = mask.bool().any(-1)  # (N,)
    n = seqs.sum().to(torch.float64)
    total = torch.where(seqs, x.to(torch.float64), torch.zeros_like(x, dtype=torch.float64)).sum()
    return Mean(total / n.clamp(min=1.0), n)
