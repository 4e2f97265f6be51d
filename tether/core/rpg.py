"""Regularized Policy Gradient (RPG) [Zhang, Liu, Yuan, Gu, Yao, arXiv 2505.17508, ICLR 2026].

Objective J(theta) = E_{pi_theta}[R] - beta Div(pi_theta, pi_a), samples from pi_old. With
w = pi_theta / pi_old, q = pi_a / pi_old (no gradient; q = 1 when the anchor is pi_old) and
rho = w / q, every gradient is E_old[(w A + C_KL) grad lp]:

    kl      Div                           C_KL                     differentiable KL term (x beta)
    fkl     KL(pi_a || pi_theta)          beta q                   -q log rho  (= -q lp + const)
    ufkl    UKL(pi_a || pi_theta)         -beta (w - q)            q k3(rho)
    rkl     KL(pi_theta || pi_a)          -beta w (log rho + 1)    w log rho
    urkl    UKL(pi_theta || pi_a)         -beta w log rho          w k3(1/rho) = q - w + w log rho

Forms ([RPG] Prop. 4.1, same expected gradient):
    differentiable   l = -w A + beta * term                       ([RPG] Table 1 when q = 1)
    reinforce        l = -SG(w A + C_KL) lp                       ([RPG] Table 2 when q = 1)
Stabilised forms:
    RPG-Style Clip   l = -mask (A SG(w) + SG(C_KL(w_bar))) lp     ([RPG] section 3.3, Algorithm 2)
                     w_bar = clip(w, 1 - eps_low, 1 + eps_high), A' = A + C_KL(w_bar) / w,
                     mask = [A' >= 0 and w < 1 + eps_high] or [A' < 0 and 1 - eps_low < w < c]
    clipped diff.    l = PPO dual-clip loss on A + beta * term, the term clamped to [-10, 10]
                     for ufkl, rkl, urkl and not clamped for fkl    ([RPG] Algorithm 1, as released)

Departures from the paper:
1. A general anchor pi_a (the reference model, refreshed every K steps: [RPG] section 5,
   docs/algorithms/rpg.md "Iterative reference update") besides pi_old; the formulas above
   reduce to the paper's tables at q = 1.
2. RPG-Style Clip evaluates C_KL at the clipped weight w_bar both in the loss and in A'
   (Algorithm 2 uses the unclipped C_KL inside A'; the two differ only outside the trust
   region and only through beta-sized terms). `branch_on="advantage"` branches on the sign
   of A instead of A', as the authors' released code does.
3. The loss of the paper's Algorithm 2 uses l = -log pi and branches on psi = A' l; since
   l > 0 that is the sign of A', which is what is implemented. A' = 0 takes the positive
   branch (docs/algorithms/rpg.md, "RPG-Style Clip": the branch is A' >= 0). With
   `branch_on="advantage"` the branch is A > 0, as in the released code
   (`torch.where(advantages > 0, ...)`): A = 0, every token of a zero-variance group, takes
   the negative branch (mask 1 - eps_low < w < c).
4. The fkl term is written -q log rho (the released code's `-(lp - ref_lp)`), not -q lp: the
   same gradient, but a value near 0, and it is never clamped, as in the released code. The
   clamp of the clipped differentiable form applies to ufkl, rkl and urkl only, whose terms
   depend on the ratios alone; written as -q lp, a clamp at -10 zeroed the KL gradient of
   every token with log pi < -10.
5. Rewards: the paper scores +1 / -1 (its `math_dapo.py`), tether's verifiers 0 / 1, which
   halves A = R - mean; the presets use beta = 5e-5 so that beta / A keeps the paper's ratio
   (docs/algorithms/rpg.md shows the arithmetic).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from .kl import k3_of_log
from .registry import Registry
from .surrogates import TokenLoss, clip_ratio_loss, log_ratio, per_token

RPG_VARIANTS: Registry = Registry("RPG KL variant")
KL_TERM_CLAMP = 10.0


def _c_kl_fkl(beta, w, log_w, log_q):
    return beta * torch.exp(log_q).expand_as(w)


def _c_kl_ufkl(beta, w, log_w, log_q):
    return -beta * (w - torch.exp(log_q))


def _c_kl_rkl(beta, w, log_w, log_q):
    return -beta * w * (log_w - log_q + 1.0)


def _c_kl_urkl(beta, w, log_w, log_q):
    return -beta * w * (log_w - log_q)


def _term_fkl(lp, w, log_w, log_q):
    return -torch.exp(log_q) * (log_w - log_q)  # -q log rho: gradient -q grad lp, value near 0


def _term_ufkl(lp, w, log_w, log_q):
    return torch.exp(log_q) * k3_of_log(log_w - log_q)


def _term_rkl(lp, w, log_w, log_q):
    return w * (log_w - log_q)


def _term_urkl(lp, w, log_w, log_q):
    return w * k3_of_log(log_q - log_w)


class RPGVariant(NamedTuple):
    c_kl: Callable  # (beta, w, log_w, log_q) -> C_KL
    term: Callable  # (lp, w, log_w, log_q) -> the differentiable KL term (without beta)
    clamped: bool  # whether the clipped differentiable form clamps the term to [-10, 10] (as released)


for _name, _variant in (
    ("fkl", RPGVariant(_c_kl_fkl, _term_fkl, clamped=False)),
    ("ufkl", RPGVariant(_c_kl_ufkl, _term_ufkl, clamped=True)),
    ("rkl", RPGVariant(_c_kl_rkl, _term_rkl, clamped=True)),
    ("urkl", RPGVariant(_c_kl_urkl, _term_urkl, clamped=True)),
):
    RPG_VARIANTS.register(_name)(_variant)


def anchor_log_q(old_logprobs: torch.Tensor, anchor_logprobs: Optional[torch.Tensor]) -> torch.Tensor:
    """log q = lp_a - lp_old (no gradient); 0 when the anchor is pi_old itself."""
    if anchor_logprobs is None:
        return torch.zeros_like(old_logprobs)
    return (anchor_logprobs - old_logprobs).detach()


def c_kl(kl: str, beta: float, log_w: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """The per-token KL weight C_KL at log-ratio log_w (detached inputs give a detached result)."""
    return RPG_VARIANTS.get(kl).c_kl(beta, torch.exp(log_w), log_w, log_q)


def kl_term(kl: str, logprobs: torch.Tensor, old_logprobs: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """The differentiable KL term (without beta), whose E_old-gradient is -C_KL / beta grad lp."""
    log_w = log_ratio(logprobs, old_logprobs)
    return RPG_VARIANTS.get(kl).term(logprobs, torch.exp(log_w), log_w, log_q)


def _flags(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like, dtype=torch.bool)


def rpg_differentiable(kl, logprobs, old_logprobs, advantages, beta, log_q) -> TokenLoss:
    """l = -w A + beta * term."""
    w = torch.exp(log_ratio(logprobs, old_logprobs))
    adv = per_token(advantages, logprobs)
    loss = -w * adv + beta * kl_term(kl, logprobs, old_logprobs, log_q)
    f = _flags(logprobs)
    return TokenLoss(loss, f, f, f)


def rpg_reinforce(kl, logprobs, old_logprobs, advantages, beta, log_q) -> TokenLoss:
    """l = -SG(w A + C_KL) lp."""
    log_w = log_ratio(logprobs, old_logprobs).detach()
    adv = per_token(advantages, logprobs)
    weight = torch.exp(log_w) * adv + c_kl(kl, beta, log_w, log_q)
    f = _flags(logprobs)
    return TokenLoss(-weight.detach() * logprobs, f, f, f)


def rpg_style_clip(
    kl: str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    beta: float,
    log_q: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip_c: Optional[float] = 10.0,
    branch_on: str = "regularized_advantage",
) -> TokenLoss:
    """RPG-Style Clip ([RPG] Algorithm 2): REINFORCE form with a dual-clip gradient mask."""
    log_w = log_ratio(logprobs, old_logprobs).detach()
    w = torch.exp(log_w)
    adv = per_token(advantages, logprobs)
    low, high = 1.0 - eps_low, 1.0 + eps_high
    c = float("inf") if dual_clip_c is None else dual_clip_c
    w_bar = w.clamp(min=low, max=high)
    ckl = c_kl(kl, beta, torch.log(w_bar), log_q)  # (N, T), detached
    if branch_on == "regularized_advantage":
        branch = adv + ckl / w
    elif branch_on == "advantage":
        branch = adv
    else:
        raise ValueError(f"branch_on must be 'regularized_advantage' or 'advantage', got {branch_on!r}")
    pos = branch >= 0 if branch_on == "regularized_advantage" else branch > 0  # released code: A > 0
    keep = torch.where(pos, w < high, (w > low) & (w < c))
    loss = -keep.to(logprobs.dtype) * (adv * w + ckl) * logprobs
    return TokenLoss(loss, ~pos & (w <= low), pos & (w >= high), ~pos & (w >= c))


def rpg_clipped_differentiable(
    kl, logprobs, old_logprobs, advantages, beta, log_q, eps_low=0.2, eps_high=0.28, dual_clip_c=10.0
) -> TokenLoss:
    """[RPG] Algorithm 1 as released: PPO dual-clip on A plus beta * term (clamped to [-10, 10]
    except for fkl, departure 4)."""
    ratio = torch.exp(log_ratio(logprobs, old_logprobs))
    adv = per_token(advantages, logprobs)
    ppo = clip_ratio_loss(ratio, adv, 1.0 - eps_low, 1.0 + eps_high, dual_clip_c)
    term = kl_term(kl, logprobs, old_logprobs, log_q)
    if RPG_VARIANTS.get(kl).clamped:
        term = term.clamp(-KL_TERM_CLAMP, KL_TERM_CLAMP)
    return ppo._replace(loss=ppo.loss + beta * term)
