"""TROLL [Becker, Freymuth, Thilges, Otto, Neumann, arXiv 2510.03817]: the ratio clip replaced by a differentiable
projection of each token's distribution onto a KL trust region around pi_old.

At every counted position t, on a sparse support S_t (below), with pi~ = pi_theta renormalised over S_t:

    pi* = argmin_pi KL(pi || pi~)   s.t.   KL(pi || pi_old) <= eps                       (the projection)
    log pi*(a) = a* log pi~(a) + (1 - a*) log pi_old(a) - log Z,   a* = 1 / (1 + eta*)   (its Lagrangian solution)
    l_t = -(pi*(y_t) / pi_old(y_t)) A_t + alpha KL(pi~ || SG(pi*))                        (the loss per token)

eta* = 0 (pi* = pi~) inside the region, else the root of KL(pi* || pi_old) = eps; the gradient flows through eta*
by the implicit function theorem (tether.core.troll, which holds the math and its departures). The paper's
settings: eps = 0.05, alpha = 1, supports of each policy's top K = 64 tokens or 1 - delta of the mass,
delta = 1e-5 (the `troll` preset).

The support S_t is the union of pi_old's set (kept by the trainer's old log-prob pass), pi_theta's own set (taken
without gradient in the update's forward) and the sampled token: `TokenBatch.support_*`, fed by tether's trainer,
the TRL adapter and the verl plugin alike (tether.model.support; docs/algorithms/troll.md, "What the trainer feeds").

Choices and departures (beyond tether.core.troll's):
1. Aggregation is the config's (`token-mean` in the preset, verl's default, which the authors' code forks); both
   terms are per token and aggregated alike, where the project page writes the regression term outside the token
   sum: the paper does not tie TROLL to an aggregation (it swaps the clip inside GRPO, Dr.GRPO, GSPO, REINFORCE++).
2. tether's other axes act outside the per-token loss and compose as for every objective: the KL penalty, the
   entropy bonus, rollout correction (each token's loss times SG(c), the regression term included), the
   off-policy mask and top_entropy_frac (a dropped token loses both terms).
3. pi_old must be recomputed (trainer.old_logprobs=recompute): the sampler returns only the sampled token's
   log-prob, so trainer.old_logprobs=sampler is refused (tether.config.loading), as are TRL's adapter and verl's
   plugin, which carry only the sampled tokens' log-probs (tether.integrations).
4. With one update per rollout batch (no staleness) the old pass is skipped, pi_old is pi_theta detached, nothing
   is projected, and TROLL is the policy gradient of the support's conditional pi(y | S_t), as every trust region
   is on-policy.
5. Positions outside the loss mask (padding, an environment's tokens) get a one-entry support and 0 scores before
   the projection, so whatever the trainer leaves there gives neither a NaN nor a gradient.
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
    "tether's trainer feeds it with trainer.old_logprobs=recompute, the TRL adapter and the verl plugin with their own "
    "old pass (tether.model.support); TokenBatch's four "
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
        check(
            not self.uses_teacher_topk(),
            "distill",
            self.distill,
            "a distill signal that reads the teacher's sampled-token log-probs alone (reverse_kl or kl_loss), or "
            "null: TROLL's update forward computes pi_theta on its own sparse support, not on the teacher's top-k",
        )

    def sparse_support(self) -> Optional[SupportSize]:
        return SupportSize(self.top_k, 1.0 - self.delta)

    def needs(self) -> dict[str, str]:
        need = super().needs()
        for field in ("support_logprobs", "old_support_logprobs", "support_mask", "support_token_index"):
            need[field] = f"TROLL projects each position's distribution on its sparse support; {_FEED}"
        return need


@objective("troll", TROLLConfig)
def _troll_loss(cfg: TROLLConfig, b: TokenBatch, lp, old):
    m = b.loss_mask.bool()
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
