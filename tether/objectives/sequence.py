"""The sequence-ratio family: one ratio per sequence, from its token ratios.

    GSPO  [arXiv 2507.18071]: s_i = exp(mean_t log w_t), clipped per sequence to [1 - eps_low, 1 + eps_high]
    LUSPO [arXiv 2602.05261]: GSPO's clipped s_i with each sequence's loss scaled by its length |y_i|
    GMPO  [arXiv 2507.20673]: prod_t clip(w_t)^(1/|y_i|), each token ratio clipped in log space first
    VESPO [arXiv 2602.10693]: -SG(phi(w_i)) A log pi, w_i = prod_t w_t (times the rollout-correction weights),
                              phi(w) = w^k e^(lambda (1 - w)), (k, lambda) by the sign of A

The math is `tether.core.surrogates.gspo`, `tether.core.gmpo` and `tether.core.vespo`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core import gmpo as _gmpo
from ..core import surrogates as _sur
from ..core import vespo as _vespo
from ..core.masked import seq_mean
from .base import ClipRange, ObjectiveConfig, check, check_positive, objective
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
    return _sur.gspo(lp, old, b.advantages, b.loss_mask, cfg.eps_low, cfg.eps_high), {}


@dataclass
class LUSPOConfig(GSPOConfig):
    """LUSPO [arXiv 2602.05261]: GSPO with each sequence's loss scaled by its length |y_i|, so that the update no
    longer favours short sequences: loss = mean_i |y_i| l_i, the GSPO token terms summed over each sequence."""

    aggregation: str = "seq-mean-token-sum"
    """The length scaling itself: a sum over each sequence's tokens, each carrying GSPO's sequence term, is |y_i| l_i
    (TRL's luspo). token-mean and seq-mean-token-sum-norm also weigh a sequence by its length (with another
    constant normaliser); seq-mean-token-mean divides it out again (that is GSPO) and is refused."""

    def __post_init__(self):
        super().__post_init__()
        check(
            self.aggregation != "seq-mean-token-mean",
            "aggregation",
            self.aggregation,
            "seq-mean-token-sum (LUSPO's |y_i| scaling; token-mean or seq-mean-token-sum-norm also keep it): "
            "seq-mean-token-mean divides each sequence by its length again, which is plain GSPO (use gspo)",
        )


@objective("luspo", LUSPOConfig)
def _luspo(cfg: LUSPOConfig, b: TokenBatch, lp, old):
    # The same per-token terms as GSPO; the |y_i| factor is the length-summing aggregation.
    return _sur.gspo(lp, old, b.advantages, b.loss_mask, cfg.eps_low, cfg.eps_high), {}


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
    out, seq_ratio = _gmpo.gmpo(lp, old, b.advantages, b.loss_mask, cfg.eps_low, cfg.eps_high)
    return out, {"gmpo/seq_ratio_mean": _mean_over_sequences(seq_ratio, b.loss_mask)}


@dataclass
class VESPOConfig(ObjectiveConfig):
    """VESPO [arXiv 2602.10693]: REINFORCE weighted by the gamma kernel phi(w) = w^k e^(lambda (1 - w)) of the
    sequence ratio w = prod_t pi_theta / pi_old (times the rollout-correction weights), no clip."""

    k_pos: float = 2.0
    """k for A >= 0: phi ~ w^k below w = 1, how hard a sequence the policy now finds unlikely is down-weighted
    (TRL's vespo_k_pos; the authors' recipe code)."""
    lambda_pos: float = 3.0
    """lambda for A >= 0: phi ~ e^(-lambda w) above w = 1, how hard an over-likely sequence is down-weighted."""
    k_neg: float = 3.0
    """k for A < 0."""
    lambda_neg: float = 2.0
    """lambda for A < 0."""

    def __post_init__(self):
        super().__post_init__()
        check_positive(self, "k_pos", "lambda_pos", "k_neg", "lambda_neg")
        rc = self.rollout_correction
        if rc is not None:
            check(
                rc.level == "token",
                "rollout_correction.level",
                rc.level,
                "'token' with vespo: VESPO folds each token's weight pi_old / pi_sampler into its sequence ratio "
                "(a product over the tokens already); TRL's vespo likewise takes only token_truncate/token_mask",
            )

    def folds_rollout_correction(self) -> bool:
        return True


@objective("vespo", VESPOConfig)
def _vespo_loss(cfg: VESPOConfig, b: TokenBatch, lp, old):
    out, phi, log_w = _vespo.vespo(
        lp, old, b.advantages, b.loss_mask, cfg.k_pos, cfg.lambda_pos, cfg.k_neg, cfg.lambda_neg, b.rollout_weights
    )
    phi_seq = seq_mean(phi, b.loss_mask)  # (N,): phi's value per sequence (one value with sequence-level advantages)
    return out, {
        "vespo/phi_mean": _mean_over_sequences(phi_seq, b.loss_mask),
        "vespo/log_w_mean": _mean_over_sequences(log_w, b.loss_mask),
    }


def _mean_over_sequences(x: torch.Tensor, mask: torch.Tensor) -> Mean:
    """The mean of a per-sequence value x (N,) over the sequences with a counted token, with their count."""
    has_tokens = (mask.sum(-1) > 0).to(x.dtype)  # (N,)
    n_seq = has_tokens.sum()
    return Mean((x * has_tokens).sum() / n_seq.clamp(min=1.0), n_seq)
