"""SAPO [arXiv 2511.20347]: a soft, temperature-controlled gate in place of the hard clip.

    l_t = -f_tau(w_t) A_t,   f_tau(w) = (4 / tau) sigmoid(tau (w - 1)),   tau = tau_pos if A_t > 0 else tau_neg

The math and the departures from the paper are in `tether.core.sapo`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core import sapo as _sapo
from ..core.masked import masked_mean
from .base import ObjectiveConfig, check_positive, objective
from .batch import TokenBatch


@dataclass
class SAPOConfig(ObjectiveConfig):
    """SAPO [arXiv 2511.20347]: soft sigmoid gate (4 / tau) sigmoid(tau (w - 1)) instead of a hard clip."""

    aggregation: str = "seq-mean-token-mean"
    """The paper's (and verl's sapo's) aggregation."""
    tau_pos: float = 1.0
    """Gate temperature for A > 0 (larger: the gradient decays faster as w leaves 1)."""
    tau_neg: float = 1.05
    """Gate temperature for A <= 0; the paper takes tau_neg > tau_pos."""

    def __post_init__(self):
        super().__post_init__()
        check_positive(self, "tau_pos", "tau_neg")


@objective("sapo", SAPOConfig)
def _sapo_loss(cfg: SAPOConfig, b: TokenBatch, lp, old):
    out, slope = _sapo.sapo(lp, old, b.advantages, cfg.tau_pos, cfg.tau_neg)
    return out, {"sapo/gate_slope_mean": masked_mean(slope, b.loss_mask)}
