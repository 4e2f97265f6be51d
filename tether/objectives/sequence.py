"""The sequence-ratio family: one ratio per sequence, the geometric mean of its token ratios.

    GSPO [arXiv 2507.18071]: s_i = exp(mean_t log w_t), clipped per sequence to [1 - eps_low, 1 + eps_high]
    GMPO [arXiv 2507.20673]: prod_t clip(w_t)^(1/|y_i|), each token ratio clipped in log space first

The math is `tether.core.surrogates.gspo` and `tether.core.gmpo`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core import gmpo as _gmpo
from ..core import surrogates as _sur
from .base import ClipRange, objective
from .batch import Mean, TokenBatch


@dataclass
class GSPOConfig(ClipRange):
    """GSPO: sequence-level ratio (geometric mean of token ratios), clipped per sequence."""

    aggregation: str = "seq-mean-token-mean"
    """GSPO's default; with it the gradient equals that of GSPO's sequence-level objective."""
    eps_low: float = 3e-4
    """Lower clip of the sequence ratio."""
    eps_high: float = 4e-4
    """Upper clip of the sequence ratio."""


@objective("gspo", GSPOConfig)
def _gspo(cfg: GSPOConfig, b: TokenBatch, lp, old):
    return _sur.gspo(lp, old, b.advantages, b.mask, cfg.eps_low, cfg.eps_high), {}


@dataclass
class GMPOConfig(ClipRange):
    """GMPO [arXiv 2507.20673]: geometric mean of the token ratios, each clipped in log space first."""

    aggregation: str = "seq-mean-token-mean"
    """With it the loss is the paper's mean over sequences of -A_i * (geometric-mean ratio)."""
    eps_low: float = 0.4
    """Log-space lower clip: log w >= -eps_low for A < 0 (ratio e^-0.4 = 0.670, the paper's)."""
    eps_high: float = 0.4
    """Log-space upper clip: log w <= eps_high for A > 0 (ratio e^0.4 = 1.492, the paper's)."""


@objective("gmpo", GMPOConfig)
def _gmpo_loss(cfg: GMPOConfig, b: TokenBatch, lp, old):
    out, seq_ratio = _gmpo.gmpo(lp, old, b.advantages, b.mask, cfg.eps_low, cfg.eps_high)
    has_tokens = (b.mask.sum(-1) > 0).to(lp.dtype)  # (N,)
    n_seq = has_tokens.sum()
    mean_ratio = (seq_ratio * has_tokens).sum() / n_seq.clamp(min=1.0)
    return out, {"gmpo/seq_ratio_mean": Mean(mean_ratio, n_seq)}
