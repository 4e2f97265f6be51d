"""TROLL [arXiv 2510.03817]: each token's distribution projected onto a KL trust region around pi_old.

    pi* = argmin_pi KL(pi || pi_theta) s.t. KL(pi || pi_old) <= eps,    l_t = -(pi*(y_t) / pi_old(y_t)) A_t
                                                                               + alpha KL(pi_theta || SG(pi*))

on a sparse support per position: the union of pi_old's and pi_theta's most probable tokens (top_k, 1 - delta of
the mass) and the sampled token, which the trainer feeds as `TokenBatch.support_*` (tether.trainer.support). The
math and the departures from the paper are in `tether.core.troll`; docs/algorithms/troll.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..core import troll as _troll
from ..core.masked import masked_fraction, masked_mean
from .base import ObjectiveConfig, SupportSize, check, check_positive, objective
from .batch import TokenBatch

_FEED = (
    "tether's trainer feeds it with trainer.old_logprobs=recompute (tether.trainer.support); TokenBatch's four "
    "support_* fields carry pi_theta's and pi_old's log-probs at each position's top tokens"
)


@dataclass
class TROLLConfig(ObjectiveConfig):
    """TROLL [arXiv 2510.03817]: the ratio clip replaced by a differentiable projection of each position's
    distribution onto {pi : KL(pi || pi_old) <= eps}, over a sparse support of the most probable tokens."""

    eps: float = 0.05
    """The KL bound per token, KL(pi* || pi_old) <= eps (the paper's 0.05 in every experiment)."""
    alpha: float = 1.0
    """Weight of the regression term alpha KL(pi_theta || SG(pi*)), which pulls pi_theta towards its projection so
    the next update starts inside the region (the paper's 1)."""
    top_k: int = 64
    """K: at most this many of each policy's most probable tokens per position join the support (the paper's 64).
    pi_old's set is stored for the whole batch: about 9 K bytes per token (int32 id, float32 log-prob, bool)."""
    delta: float = 1e-5
    """Mass left out of a policy's set: its tokens are taken most probable first while the mass before them is
    below 1 - delta (the paper's 1e-5; 5 to 10 tokens usually cover it)."""

    def __post_init__(self):
        super().__post_init__()
        check_positive(self, "eps")
        check(self.alpha >= 0, "alpha", self.alpha, "a number >= 0 (the paper's 1; 0: no regression term)")
        check(isinstance(self.top_k, int) and self.top_k >= 1, "top_k", self.top_k, "an integer >= 1 (the paper's 64)")
        check(0 <= self.delta < 1, "delta", self.delta, "a mass in [0, 1) (the paper's 1e-5)")

    def sparse_support(self) -> Optional[SupportSize]:
        return SupportSize(self.top_k, 1.0 - self.delta)

    def needs(self) -> dict[str, str]:
        need = super().needs()
        for field in ("support_logprobs", "old_support_logprobs", "support_mask", "support_token_index"):
            need[field] = f"TROLL projects each position's distribution on its sparse support; {_FEED}"
        return need


@objective("troll", TROLLConfig)
def _troll_loss(cfg: TROLLConfig, b: TokenBatch, lp, old):
    m = b.mask.bool()
    new, old_s, support = _counted_support(b, m)
    tokens, stats = _troll.troll(new, old_s, support, b.support_token_index, b.advantages, cfg.eps, cfg.alpha)
    loss = torch.where(m, tokens.loss, torch.zeros_like(tokens.loss))  # 0 and no gradient outside the loss mask
    a_star = 1.0 / (1.0 + stats.eta)
    metrics = {
        "troll/projected_frac": masked_fraction(stats.projected, m),
        "troll/a_star_mean": masked_mean(a_star, m),
        "troll/kl_before": masked_mean(stats.kl_before, m),
        "troll/kl_after": masked_mean(stats.kl_after, m),
        "troll/support_size": masked_mean(support.sum(-1).to(a_star.dtype), m),
    }
    return tokens._replace(loss=loss), metrics


def _counted_support(b: TokenBatch, m: torch.Tensor):
    """The support's scores and mask with every position outside the loss mask replaced by a one-entry support
    (its sampled token) and 0 scores: padding and an environment's tokens may hold anything, and must give neither
    a NaN nor a gradient. Returns (pi_theta's scores, pi_old's, detached, mask), each (N, T, S)."""
    keep = m[..., None]
    zero = torch.zeros_like(b.support_logprobs)
    new = torch.where(keep, b.support_logprobs, zero)
    old = torch.where(keep, b.old_support_logprobs.detach().to(zero.dtype), zero)
    own = torch.arange(zero.shape[-1], device=zero.device) == b.support_token_index[..., None]
    return new, old, torch.where(keep, b.support_mask.bool(), own)
