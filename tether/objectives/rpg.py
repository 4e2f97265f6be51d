"""Regularized Policy Gradient [RPG, arXiv 2505.17508]: the reward minus beta times a KL to an anchor
(pi_old or the reference), in a differentiable or a REINFORCE form, optionally with RPG-Style Clip:

    J(theta) = E_{pi_theta}[R] - beta Div(pi_theta, pi_a),   every gradient E_old[(w A + C_KL) grad lp]

The math, its table of KL variants and the departures from the paper are in `tether.core.rpg`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from ..core import rpg as _rpg
from ..core import surrogates as _sur
from ..core.kl import k3_of_log
from ..core.masked import masked_mean
from .base import ClipRange, check, check_dual, objective
from .batch import TokenBatch, masked_fill


@dataclass
class RPGConfig(ClipRange):
    """Regularized Policy Gradient [RPG, arXiv 2505.17508]."""

    eps_high: float = 0.28
    """Upper clip."""
    kl: Literal["fkl", "ufkl", "rkl", "urkl"] = "urkl"
    """KL regulariser: fkl/ufkl (forward, normalised/unnormalised), rkl/urkl (reverse)."""
    form: Literal["differentiable", "reinforce"] = "reinforce"
    """differentiable: -w A + beta term (Table 1); reinforce: -SG(w A + C_KL) lp (Table 2)."""
    beta: float = 5e-5
    """KL coefficient, relative to the reward scale: 5e-5 for 0/1 rewards is the paper's 1e-4 for its +1/-1
    rewards (docs/algorithms/rpg.md, "Reward scale and beta"); in general 1e-4 * (R_max - R_min) / 2."""
    anchor: Literal["old", "ref"] = "old"
    """The policy the KL is taken to: old (pi_old, the paper's choice) or ref (needs ref_logprobs)."""
    clip: Literal["none", "rpg"] = "rpg"
    """rpg: RPG-Style Clip (reinforce form, Algorithm 2) or dual-clip + clamped KL (differentiable form)."""
    dual_clip_c: Optional[float] = 10.0
    """Dual-clip bound for negative advantages; null disables it."""
    branch_on: Literal["regularized_advantage", "advantage"] = "regularized_advantage"
    """RPG-Style Clip's positive branch: A' = A + C_KL / w >= 0 ([RPG] Algorithm 2; docs/algorithms/rpg.md,
    "RPG-Style Clip"), or A > 0 (the authors' code; A = 0 then takes the negative branch)."""
    advantage: str = "dr_grpo"
    """RPG uses A = R - group mean, no std division ([RPG] Algorithm 2, lines 6 and 12)."""

    def __post_init__(self):
        super().__post_init__()
        check(self.beta >= 0, "beta", self.beta, "a number >= 0")
        check_dual(self.dual_clip_c)

    def needs(self) -> dict[str, str]:
        need = super().needs()
        if self.anchor == "ref":
            why = "rpg anchor='ref' takes its KL to the reference policy"
            need["ref_logprobs"] = f"{need['ref_logprobs']}; {why}" if "ref_logprobs" in need else why
        return need

    def reference_kl_coef(self) -> float:
        return super().reference_kl_coef() or (self.beta if self.anchor == "ref" else 0.0)

    def has_trust_region(self) -> bool:
        return self.clip != "none"


@objective("rpg", RPGConfig)
def _rpg_loss(cfg: RPGConfig, b: TokenBatch, lp, old):
    log_q = _rpg.anchor_log_q(old, masked_fill(b.ref_logprobs, b.loss_mask) if cfg.anchor == "ref" else None)
    args = (cfg.kl, lp, old, b.advantages, cfg.beta, log_q)
    if cfg.form == "reinforce":
        out = (
            _rpg.rpg_style_clip(*args, cfg.eps_low, cfg.eps_high, cfg.dual_clip_c, cfg.branch_on)
            if cfg.clip == "rpg"
            else _rpg.rpg_reinforce(*args)
        )
    else:
        out = (
            _rpg.rpg_clipped_differentiable(*args, cfg.eps_low, cfg.eps_high, cfg.dual_clip_c)
            if cfg.clip == "rpg"
            else _rpg.rpg_differentiable(*args)
        )
    log_w = _sur.log_ratio(lp, old).detach()
    m = b.loss_mask
    extra = {
        "rpg/c_kl_mean": masked_mean(_rpg.c_kl(cfg.kl, cfg.beta, log_w, log_q), m),
        # k3 estimate of the divergence between the policy and its anchor (drives the reference refresh:
        # docs/algorithms/rpg.md, "Iterative reference update").
        "rpg/kl_anchor": masked_mean(k3_of_log(log_q - log_w), m),
    }
    return out, extra
