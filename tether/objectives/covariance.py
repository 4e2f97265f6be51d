"""The covariance family [arXiv 2505.22617]: act on the few tokens whose (A - mean A)(lp - mean lp)
is largest, the ones that drive the entropy down.

    Clip-Cov: PPO clip, plus no gradient for k random tokens with cov_lb < cov < cov_ub
    KL-Cov:   no clip; l_t = -w_t A + kl_coef |log w_t| on the top-k tokens by covariance

The math is `tether.core.covariance`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core import covariance as _cov
from ..core import surrogates as _sur
from ..core.masked import masked_fraction, masked_mean
from .base import ClipRange, ObjectiveConfig, check, objective
from .batch import Extra, TokenBatch


def _check_select_frac(cfg) -> None:
    check(0 < cfg.select_frac <= 1, "select_frac", cfg.select_frac, "a share in (0, 1]")


def _cov_metrics(out: _cov.CovLoss, m: torch.Tensor) -> Extra:
    return {
        "cov/selected_frac": masked_fraction(out.selected, m),
        "cov/candidate_frac": masked_fraction(out.candidates, m),
    }


@dataclass
class ClipCovConfig(ClipRange):
    """Clip-Cov [arXiv 2505.22617]: PPO clip, plus no gradient for a random few high-covariance tokens."""

    select_frac: float = 2e-4
    """Share r of the batch's tokens to detach: k = max(floor(r N_tok), 1) (the paper's 2e-4)."""
    cov_lb: float = 1.0
    """Candidates have cov_lb < (A - mean A)(lp - mean lp) < cov_ub (the paper's 1)."""
    cov_ub: float = 5.0
    """Upper covariance bound of the candidates (the paper's 5)."""

    def __post_init__(self):
        super().__post_init__()
        _check_select_frac(self)
        check(self.cov_ub > self.cov_lb, "cov_ub", self.cov_ub, f"a number > cov_lb ({self.cov_lb})")


@objective("clip_cov", ClipCovConfig)
def _clip_cov_loss(cfg: ClipCovConfig, b: TokenBatch, lp, old):
    out = _cov.clip_cov(
        lp, old, b.advantages, b.loss_mask, cfg.eps_low, cfg.eps_high, cfg.select_frac, cfg.cov_lb, cfg.cov_ub
    )
    return out.tokens, _cov_metrics(out, b.loss_mask)


@dataclass
class KLCovConfig(ObjectiveConfig):
    """KL-Cov [arXiv 2505.22617]: no clip; a |log w| penalty on the top-covariance tokens."""

    select_frac: float = 2e-3
    """Share r of the batch's tokens penalised: the top k = max(floor(r N_tok), 1) by covariance
    (the paper: 2e-3 for 7B models, 2e-4 for 32B)."""
    kl_coef: float = 1.0
    """Coefficient of |log w| on the selected tokens (the paper's beta = 1; verl's ppo_kl_coef, 0.1 there by
    default)."""

    def __post_init__(self):
        super().__post_init__()
        _check_select_frac(self)
        check(self.kl_coef >= 0, "kl_coef", self.kl_coef, "a number >= 0")


@objective("kl_cov", KLCovConfig)
def _kl_cov_loss(cfg: KLCovConfig, b: TokenBatch, lp, old):
    out = _cov.kl_cov(lp, old, b.advantages, b.loss_mask, cfg.select_frac, cfg.kl_coef)
    extra = _cov_metrics(out, b.loss_mask)
    extra["cov/kl_abs_mean"] = masked_mean(_sur.log_ratio(lp, old).detach().abs(), b.loss_mask)
    return out.tokens, extra
