"""ASPO [arXiv 2510.06062]: GRPO's clip mask, the ratio of positive-advantage tokens flipped to 1 / w, and a soft
dual clip that caps a token's weight at c without removing its gradient.

    d l_t / d lp_t = -A_t m_t min(w^_t, c),     w^ = 1 / w (A > 0), w (A < 0),     m_t GRPO's clip mask

The math and the departures from the paper are in `tether.core.aspo`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..core import aspo as _aspo
from ..core.masked import masked_fraction
from ..core.surrogates import per_token
from .base import ClipRange, check, check_at_least_zero, check_dual, objective
from .batch import Mean, TokenBatch


@dataclass
class ASPOConfig(ClipRange):
    """ASPO [arXiv 2510.06062]: flipped ratio for A > 0, GRPO's clip mask, soft dual clip at c (tether.core.aspo).
    eps_low / eps_high (0.2 / 0.2, the paper's eps) are the clip range of every token, or of the tokens at or below
    the entropy quantile when `high_entropy_eps_low` / `high_entropy_eps_high` are set."""

    dual_clip_c: Optional[float] = 3.0
    """Soft dual clip c > 1: a token whose weight (1 / w for A > 0, w for A < 0) exceeds c keeps its gradient at
    weight c. The paper gives no value; the released code uses 3.0 for both signs. null: no dual clip (the paper's
    ablation, whose gradient norm spikes)."""
    high_entropy_eps_low: Optional[float] = None
    """Lower clip range of the high-entropy tokens (above `high_entropy_quantile` of their sequence's entropies);
    the released code's 0.4. null (the paper's single range): eps_low for every token. Needs TokenBatch.entropy."""
    high_entropy_eps_high: Optional[float] = None
    """Upper clip range of the high-entropy tokens; the released code's 0.4. Set together with high_entropy_eps_low."""
    high_entropy_quantile: float = 0.8
    """The per-sequence entropy quantile above which a token is high-entropy (the released code's 0.8); read only
    when the high-entropy ranges are set."""

    def __post_init__(self):
        super().__post_init__()
        check_dual(self.dual_clip_c)
        pair = (self.high_entropy_eps_low, self.high_entropy_eps_high)
        check(
            (pair[0] is None) == (pair[1] is None),
            "high_entropy_eps_low/high",
            pair,
            "both null (one clip range, the paper's) or both numbers >= 0 (the released code's 0.4 / 0.4)",
        )
        if self.splits_by_entropy():
            check_at_least_zero(self, "high_entropy_eps_low", "high_entropy_eps_high")
        check(
            0 < self.high_entropy_quantile < 1,
            "high_entropy_quantile",
            self.high_entropy_quantile,
            "a number in (0, 1) (the released code's 0.8)",
        )

    def splits_by_entropy(self) -> bool:
        """Whether high-entropy tokens get their own clip range (the released code's rule, not the paper's)."""
        return self.high_entropy_eps_low is not None

    def needs(self) -> dict[str, str]:
        need = super().needs()
        if self.splits_by_entropy():
            need.setdefault(
                "entropy",
                "high_entropy_eps_low/high give the tokens above the per-sequence entropy quantile their own clip "
                "range; pass the per-token entropy or set both to null",
            )
        return need


def _share(cond: torch.Tensor, among: torch.Tensor) -> Mean:
    """The share of the tokens `among` where `cond` holds, with their count (merges exactly over micro-batches)."""
    n = among.sum().to(torch.float64)
    return Mean((cond & among).sum().to(torch.float64) / n.clamp(min=1.0), n)


def _mean(x: torch.Tensor, among: torch.Tensor) -> Mean:
    """The mean of `x` over the tokens `among`, with their count."""
    n = among.sum().to(torch.float64)
    return Mean(torch.where(among, x, torch.zeros_like(x)).sum().to(torch.float64) / n.clamp(min=1.0), n)


@objective("aspo", ASPOConfig)
def _aspo_loss(cfg: ASPOConfig, b: TokenBatch, lp, old):
    eps_low, eps_high = cfg.eps_low, cfg.eps_high
    extra = {}
    if cfg.splits_by_entropy():
        high = _aspo.high_entropy_tokens(b.entropy, b.loss_mask, cfg.high_entropy_quantile)  # (N, T)
        eps_low = torch.where(high, lp.new_tensor(cfg.high_entropy_eps_low), lp.new_tensor(cfg.eps_low))
        eps_high = torch.where(high, lp.new_tensor(cfg.high_entropy_eps_high), lp.new_tensor(cfg.eps_high))
        extra["aspo/high_entropy_frac"] = masked_fraction(high, b.loss_mask)
    out = _aspo.aspo(lp, old, b.advantages, eps_low, eps_high, cfg.dual_clip_c)
    counted = b.loss_mask.bool()
    adv = per_token(b.advantages, lp)
    pos, neg = counted & (adv > 0), counted & (adv < 0)
    extra.update(
        {
            "aspo/weight_pos_mean": _mean(out.weight, pos),
            "aspo/weight_neg_mean": _mean(out.weight, neg),
            "aspo/dual_frac_pos": _share(out.dual_pos, pos),
            "aspo/dual_frac_neg": _share(out.dual_neg, neg),
        }
    )
    return out.tokens, extra
