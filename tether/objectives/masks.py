"""The token-mask family: a token whose update left a trust region leaves the loss (no clip).

    DPPO [arXiv 2602.04879]: keep t iff D(pi_theta, pi_old) at the sampled token <= delta on the side A pushes;
                             l_t = -keep_t SG(min(w_t, c)) A log pi_theta(y_t)
    M2PO [arXiv 2510.01161]: drop the tokens with the largest (log r)^2 until the kept tokens' mean is below tau;
                             J = (1 / sum_i |o_i|) sum_{i,t} M_t r_t A_t (every counted token in the normaliser, no
                             clip); AReaL's kept-token normaliser and PPO clip are options

The math is `tether.core.dppo` and `tether.core.m2po`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch

from ..core import divergences as _div
from ..core import dppo as _dppo
from ..core import m2po as _m2po
from ..core import surrogates as _sur
from ..core.masked import masked_fraction
from .base import ObjectiveConfig, check, check_measure, check_positive, objective
from .batch import TokenBatch, masked_fill


@dataclass
class DPPOConfig(ObjectiveConfig):
    """DPPO [arXiv 2602.04879]: mask the tokens whose update left a divergence trust region (tether.core.dppo)."""

    measure: Any = "binary_tv"
    """binary_tv or binary_kl (divergence of the sampled token's Bernoulli, the paper's; binary_kl_max: both KL
    directions, AReaL's KPop measure), or a ratio measure
    (ratio, log_ratio, kl2, kl3, kl3_reverse, chi2, hellinger, or a callable D(w)): then the mask keeps
    D(w) <= delta on the side the advantage pushes, ATR-GRPO's region."""
    delta_low: float = 0.15
    """Threshold for tokens with A <= 0 (verl's clip_ratio_low); the paper: 0.15 for binary_tv, 0.05 for binary_kl."""
    delta_high: float = 0.15
    """Threshold for tokens with A > 0 (verl's clip_ratio_high)."""
    truncation_c: Optional[float] = None
    """Cap c of the importance weight SG(min(w, c)) (truncated IS); null (default): no cap, as in the authors'
    runs (their verl script sets clip_ratio_c 10000). verl's dppo_tv/dppo_kl read actor.clip_ratio_c, which
    defaults to 3.0 (its code falls back to 20 only when the key is missing): set 3.0 to match verl's default."""

    def __post_init__(self):
        super().__post_init__()
        check_measure(self.measure, tuple(_dppo.BINARY_MEASURES.names()))
        check_positive(self, "delta_low", "delta_high")
        check(
            self.truncation_c is None or self.truncation_c > 0,
            "truncation_c",
            self.truncation_c,
            "a number > 0, or null for no truncation",
        )
        self.bounds: Optional[tuple[float, float]] = None
        if not (isinstance(self.measure, str) and self.measure in _dppo.BINARY_MEASURES):
            self.bounds = (
                _div.interval(self.measure, self.delta_low)[0],
                _div.interval(self.measure, self.delta_high)[1],
            )


@objective("dppo", DPPOConfig)
def _dppo_loss(cfg: DPPOConfig, b: TokenBatch, lp, old):
    if cfg.bounds is None:
        valid = _dppo.binary_valid(cfg.measure, lp, old, b.advantages, cfg.delta_low, cfg.delta_high)
    else:
        valid = _dppo.interval_valid(lp, old, b.advantages, *cfg.bounds)
    out, truncated = _dppo.dppo(lp, old, b.advantages, valid, cfg.truncation_c)
    return out, {"dppo/truncfrac": masked_fraction(truncated, b.loss_mask)}


@dataclass
class M2POConfig(ObjectiveConfig):
    """M2PO [arXiv 2510.01161]: drop the tokens with the largest (log r)^2 until the batch's mean is below tau."""

    tau: float = 0.04
    """tau_M2: the kept tokens' mean of (log r)^2 must be below it (the paper's 0.04 in every run; AReaL's
    m2_threshold)."""
    against: Literal["old", "sampler"] = "old"
    """Which log-ratio the second moment measures: old, log(pi_theta / pi_old) at every update (the paper, with pi_old
    the behaviour policy: trainer.old_logprobs=sampler); sampler, log(pi_old / pi_sampler), fixed per rollout batch
    (AReaL: behaviour against the recomputed proximal policy; needs sampler_logprobs and trainer.old_logprobs=recompute,
    since under sampler it is identically 0)."""
    normaliser: Literal["all_tokens", "kept_tokens"] = "all_tokens"
    """all_tokens (the paper's 1 / sum_i |o_i|): a dropped token stays in the token mean's count; kept_tokens (AReaL,
    which applies the mask to its loss_mask): the mean runs over the kept tokens of the batch the mask is computed on
    (each l_t times |B| / kept); needs aggregation token-mean."""
    eps_low: Optional[float] = None
    """AReaL's PPO clip of r = pi_theta / pi_old on the kept tokens, lower side (actor.eps_clip): l = -min(r A,
    clip(r, 1 - eps_low, 1 + eps_high) A); null (default, the paper): no clip, the mask is the trust region."""
    eps_high: Optional[float] = None
    """Upper side of that clip (AReaL's eps_clip_higher); null: eps_low. Needs eps_low."""

    def __post_init__(self):
        super().__post_init__()
        check_positive(self, "tau")
        check(
            self.normaliser != "kept_tokens" or self.aggregation == "token-mean",
            "normaliser",
            self.normaliser,
            f"all_tokens with aggregation {self.aggregation!r} (kept_tokens is AReaL's token mean over the kept "
            "tokens; set aggregation: token-mean)",
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
            need["sampler_logprobs"] = "m2po against='sampler' measures log(pi_old / pi_sampler); or use against='old'"
        return need

    def vanishes_when_old_is_sampler(self) -> dict[str, str]:
        out = super().vanishes_when_old_is_sampler()
        if self.against == "sampler":
            out["against"] = (
                "against: sampler measures log(pi_old / pi_sampler), which is 0 when pi_old is pi_sampler: nothing is "
                "ever masked and the run is an unconstrained importance-sampled policy gradient; set against: old (the "
                "paper's r = pi_theta / pi_behaviour under this anchoring), or trainer.old_logprobs: recompute "
                "(AReaL's)"
            )
        return out


@objective("m2po", M2POConfig)
def _m2po_loss(cfg: M2POConfig, b: TokenBatch, lp, old):
    if cfg.against == "old":
        d = _sur.log_ratio(lp, old).detach()
    else:  # log(pi_old / pi_sampler); the padding and a missing (NaN) sampler log-prob count as 0
        d = torch.nan_to_num(old - masked_fill(b.sampler_logprobs, b.loss_mask).detach(), nan=0.0)
    keep = _m2po.m2_keep(d, b.loss_mask, cfg.tau)
    tokens = _m2po.m2po(lp, old, b.advantages, keep, cfg.eps_low, cfg.eps_high)
    if cfg.normaliser == "kept_tokens":
        tokens = tokens._replace(loss=tokens.loss * _m2po.kept_scale(b.loss_mask, keep).to(tokens.loss.dtype))
    ones = torch.ones((), dtype=lp.dtype, device=lp.device)
    return tokens, {
        "m2po/m2": _m2po.second_moment(d, b.loss_mask),
        "m2po/m2_kept": _m2po.second_moment(d, keep),
        "m2po/masked_frac": masked_fraction(b.loss_mask.bool() & ~keep, b.loss_mask),
        "m2po/tau": ones * cfg.tau,
    }
