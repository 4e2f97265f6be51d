"""TROLL: each token's distribution projected onto a KL trust region around pi_old, in place of the ratio clip
[TROLL, Becker, Freymuth, Thilges, Otto, Neumann, arXiv 2510.03817].

At every response position, with pi~ the current (unprojected) policy and pi_old the old one over a support S:

    pi* = argmin_pi KL(pi || pi~)   subject to   KL(pi || pi_old) <= eps
    log pi*(a) = a* log pi~(a) + (1 - a*) log pi_old(a) - log Z(a*),     a* = 1 / (1 + eta*),  a in S
    l_t = -(pi*(y_t) / pi_old(y_t)) A_t + alpha KL(pi~ || SG(pi*))

pi* is the geometric interpolation of the two distributions that the Lagrangian of the projection gives; a* = 1
(pi* = pi~) when pi~ is inside the region, else the root of h(a) = KL(pi_a || pi_old) - eps, which increases
from -eps at a = 0 (pi_0 = pi_old) with h'(a) = a Var_{pi_a}(u), u = log pi~ - log pi_old, so a bisection on
[0, 1] brackets it. (The paper's dual variable is eta* = (1 - a*) / a*.) The gradient flows through a* by the
implicit function theorem, d a* = -(d_{pi~} h) / h'(a*): the projection is differentiable, and a projected
token keeps the part of its gradient that moves pi* along the region's boundary instead of losing it to a clip
(on a two-token support the boundary is a single point, and only the regression term's gradient remains). The
regression term pulls pi~ towards its projection so that the next update starts inside the region; its value
and gradient are 0 where nothing is projected. On-policy (pi~ = pi_old) the gradient is the plain policy
gradient -A grad log pi~(y_t).

A real vocabulary is too large to project at every position, so the paper sparsifies both distributions to their
most probable tokens, at most K = 64 per policy or until 1 - delta (delta = 1e-5) of the mass is covered. This
module is pure math on the distributions at given supports (`project`, `troll`) and builds those supports
(`top_mass`, `mass_cut`, `SparseSet`, `union_support`, `sparse_support`, `old_on_support`). The objective `troll`
(tether.objectives.troll) runs it on the supports tether's trainer feeds: pi_old's `SparseSet` kept by the old
log-prob pass, pi~'s own set from the update's forward, and pi~'s log-probs on their union with gradient
(tether.model.support; docs/algorithms/troll.md, "What the trainer feeds").

Departures from the paper (whose code, github.com/niklasfreymuth/troll with github.com/pbecker93/discrete_trpl,
was not available to compare against; the math is the paper's and its project page's):
1. The support of a position is the union of pi_old's and pi~'s sparse sets and the sampled token, and both
   distributions are renormalised over it: the projection acts on the two conditionals given the support. The
   authors' sparse layer, as third-party notes on it describe it, instead gives tokens outside a policy's set a
   default log-probability and renormalises. `old_on_support`
   fills a token of the union that pi_old's stored set lacks with pi_old's leftover mass spread evenly over the
   vocabulary outside its set; the sampled token, whose pi_old log-prob the trainer knows exactly (old_logprobs),
   gets that value instead.
2. a* is found by bisection on a in [0, 1] (an exact bracket) instead of on the dual variable eta; 64 halvings
   reach float64 resolution. The paper's bracketing of the one-dimensional dual has the same root.
3. log(pi* / pi_old) at the sampled token is clamped to [-20, 20] before exp (tether.core.surrogates,
   departure 1); inside the trust region it is far smaller.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .surrogates import LOG_RATIO_CLAMP, TokenLoss, per_token


class Projection(NamedTuple):
    """The projection of each position's distribution; log-probs are 0 (placeholders) outside the support."""

    logp: torch.Tensor  # (..., K) log pi* over the support, with gradient through pi~ and a*
    alpha: torch.Tensor  # (...) a* = 1 / (1 + eta*), detached; 1 where nothing is projected
    kl_before: torch.Tensor  # (...) KL(pi~ || pi_old), detached
    kl_after: torch.Tensor  # (...) KL(pi* || pi_old), detached; eps where projected
    projected: torch.Tensor  # (...) bool: KL(pi~ || pi_old) > eps


class Support(NamedTuple):
    """A sparse support per position: vocabulary ids, which entries count, and where the sampled token is."""

    index: torch.Tensor  # (..., S) long vocabulary ids; padding entries hold a valid id and mask False
    mask: torch.Tensor  # (..., S) bool
    token_index: torch.Tensor  # (...) long: the sampled token's entry in `index`


class SparseSet(NamedTuple):
    """A policy's most probable tokens at each position, most probable first (`top_mass`'s set, with its values)."""

    ids: torch.Tensor  # (..., K) vocabulary ids (int32 when stored)
    logp: torch.Tensor  # (..., K) their log-probs under the full softmax, descending
    keep: torch.Tensor  # (..., K) bool: inside the set (the mass cut, and a position that counts)


class TrollStats(NamedTuple):
    """Per-token statistics of `troll`, detached (..., i.e. (N, T))."""

    eta: torch.Tensor  # eta* = (1 - a*) / a*: 0 where nothing is projected
    kl_before: torch.Tensor  # KL(pi~ || pi_old)
    kl_after: torch.Tensor  # KL(pi* || pi_old)
    projected: torch.Tensor  # bool


def log_normalize(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Log-softmax over the entries of the last dimension where `mask` holds, 0 elsewhere (..., K). A row with
    no entry in `mask` gives 0s (it must not reach a loss; `troll` ignores it)."""
    x = torch.where(mask, scores, torch.full_like(scores, float("-inf")))
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # an empty row: no -inf - -inf
    return torch.where(mask, scores - lse, torch.zeros_like(scores))


def kl_on_support(logp: torch.Tensor, logq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(p || q) = sum_a p(a) (log p(a) - log q(a)) over the support (..., K) -> (...)."""
    terms = torch.exp(logp) * (logp - logq)
    return torch.where(mask, terms, torch.zeros_like(terms)).sum(-1)


def _interpolate(new: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """log pi_a = normalise(a log pi~ + (1 - a) log pi_old); alpha (..., 1)."""
    return log_normalize(alpha * new + (1.0 - alpha) * old, mask)


def _bisect(new: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, bound: float, steps: int) -> torch.Tensor:
    """The root a* in [0, 1] of KL(pi_a || pi_old) = bound, per position (..., 1); h increases in a."""
    lo = torch.zeros_like(new[..., :1])
    hi = torch.ones_like(lo)
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        above = kl_on_support(_interpolate(new, old, mask, mid), old, mask)[..., None] > bound
        lo, hi = torch.where(above, lo, mid), torch.where(above, mid, hi)
    return 0.5 * (lo + hi)


def project(
    logp_new: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor, bound: float = 0.05, steps: int = 64
) -> Projection:
    """Project pi~ onto {pi : KL(pi || pi_old) <= bound}, per position, differentiably in pi~.

    logp_new (..., K) log pi~ with gradient, logp_old (..., K): normalised log-probs over the support `mask`
    (..., K) bool (`log_normalize`); values outside the support are ignored. Returns a `Projection`."""
    old = logp_old.detach()
    kl_before = kl_on_support(logp_new.detach(), old, mask)
    projected = kl_before > bound
    with torch.no_grad():
        alpha0 = torch.where(projected[..., None], _bisect(logp_new.detach(), old, mask, bound, steps), 1.0)
    # Implicit function theorem: with a held at a*, h(a*, pi~) = KL(pi_a* || pi_old) - bound is 0 in value, and
    # a = a* - (h - SG(h)) / h'(a*) has the value a* and the gradient d a* = -(d_{pi~} h) / h'(a*).
    logp_a = _interpolate(logp_new, old, mask, alpha0)
    h = kl_on_support(logp_a, old, mask)
    with torch.no_grad():
        p_a = torch.where(mask, torch.exp(logp_a), torch.zeros_like(logp_a))
        u = torch.where(mask, logp_new - old, torch.zeros_like(old))
        mean = (p_a * u).sum(-1, keepdim=True)
        var = (p_a * (u - mean) ** 2).sum(-1)
        slope = alpha0[..., 0] * var  # h'(a*) = a* Var_{pi_a*}(u) > 0 where projected
        slope = torch.where(projected, slope.clamp(min=torch.finfo(slope.dtype).tiny), torch.ones_like(slope))
    step = torch.where(projected, (h - h.detach()) / slope, torch.zeros_like(h))
    alpha = alpha0 - step[..., None]
    logp = _interpolate(logp_new, old, mask, alpha)
    kl_after = kl_on_support(logp.detach(), old, mask)
    return Projection(logp, alpha0[..., 0], kl_before, kl_after, projected)


def troll(
    scores_new: torch.Tensor,
    scores_old: torch.Tensor,
    support_mask: torch.Tensor,
    token_index: torch.Tensor,
    advantages: torch.Tensor,
    bound: float = 0.05,
    alpha: float = 1.0,
    steps: int = 64,
) -> tuple[TokenLoss, TrollStats]:
    """TROLL's per-token loss (N, T), no clip flags, and its statistics.

    scores_new (N, T, K): pi~'s logits or log-probs at each position's support, with gradient (any per-position
    shift: they are renormalised over the support); scores_old (N, T, K): pi_old's, the same way; support_mask
    (N, T, K) bool; token_index (N, T) long: the sampled token's entry, which must be in the support;
    advantages (N,) or (N, T). The caller zeroes or masks the padding positions, as for every tether loss."""
    new = log_normalize(scores_new, support_mask)
    old = log_normalize(scores_old.detach(), support_mask)
    proj = project(new, old, support_mask, bound, steps)
    at = token_index[..., None]
    log_r = (proj.logp.gather(-1, at) - old.gather(-1, at))[..., 0].clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    adv = per_token(advantages, log_r)
    regression = kl_on_support(new, proj.logp.detach(), support_mask)
    loss = -torch.exp(log_r) * adv + alpha * regression
    none = torch.zeros_like(adv, dtype=torch.bool)
    eta = (1.0 - proj.alpha) / proj.alpha
    return TokenLoss(loss, none, none, none), TrollStats(eta, proj.kl_before, proj.kl_after, proj.projected)


# ---------------------------------------------------------------- sparse supports


def mass_cut(values: torch.Tensor, mass: float) -> torch.Tensor:
    """Which of the log-probs `values` (..., k), sorted descending, are kept: those whose mass before them is below
    `mass` (the first always is) (..., k) bool."""
    p = torch.exp(values.detach())
    before = torch.cumsum(p, dim=-1) - p
    return before < mass


def top_mass(logp: torch.Tensor, top_k: int, mass: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The most probable tokens of each row of logp (..., V), most probable first, while the mass before a token
    is below `mass`, at most `top_k`: (ids (..., k), keep (..., k) bool), k = min(top_k, V)."""
    values, ids = logp.detach().topk(min(top_k, logp.shape[-1]), dim=-1)
    return ids, mass_cut(values, mass)


def union_support(ids: torch.Tensor, keep: torch.Tensor, tokens: torch.Tensor, vocab: int) -> Support:
    """The support made of the candidate ids (..., M) where `keep` holds, deduplicated, and the sampled tokens
    (...). Width M + 1 (no host sync to trim it), ids ascending, unused entries last with mask False."""
    cand = torch.cat([ids, tokens[..., None]], dim=-1)
    valid = torch.cat([keep, torch.ones_like(tokens[..., None], dtype=torch.bool)], dim=-1)
    cand = torch.where(valid, cand, torch.full_like(cand, vocab)).sort(dim=-1).values  # unused -> vocab, last
    dup = torch.zeros_like(cand, dtype=torch.bool)
    dup[..., 1:] = cand[..., 1:] == cand[..., :-1]
    cand = torch.where(dup, torch.full_like(cand, vocab), cand).sort(dim=-1).values
    mask = cand < vocab
    index = torch.where(mask, cand, torch.zeros_like(cand))
    token_index = ((index == tokens[..., None]) & mask).to(torch.int8).argmax(dim=-1)
    return Support(index, mask, token_index)


def sparse_support(
    logp_old: torch.Tensor, logp_new: torch.Tensor, tokens: torch.Tensor, top_k: int = 64, mass: float = 1.0 - 1e-5
) -> Support:
    """The union of pi_old's and pi~'s `top_mass` sets and the sampled token, per position: logp_old, logp_new
    (..., V) full log-probs (only their values are read); tokens (...) the sampled ids. Width 2 min(top_k, V) + 1.
    A trainer that keeps only pi_old's set calls `union_support` with that set and pi~'s."""
    ids_old, keep_old = top_mass(logp_old, top_k, mass)
    ids_new, keep_new = top_mass(logp_new, top_k, mass)
    ids, keep = torch.cat([ids_old, ids_new], dim=-1), torch.cat([keep_old, keep_new], dim=-1)
    return union_support(ids, keep, tokens, logp_old.shape[-1])


def old_on_support(
    support: Support,
    known_ids: torch.Tensor,
    known_logp: torch.Tensor,
    known_mask: torch.Tensor,
    vocab: int,
    token_logp: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """pi_old's log-probs at a support (..., S) from a stored sparse set (known_ids, known_logp, known_mask
    (..., K), the `top_mass` set kept when pi_old's log-probs were computed). A support token outside the set
    gets pi_old's leftover mass 1 - sum(known) spread evenly over the vocab - |set| tokens outside it; the sampled
    token gets `token_logp` (...), pi_old's exact log-prob of it, where given (departure 1)."""
    p_known = torch.where(known_mask, torch.exp(known_logp), torch.zeros_like(known_logp))
    tiny = torch.finfo(known_logp.dtype).tiny
    left = (1.0 - p_known.sum(-1, keepdim=True)).clamp(min=tiny)
    outside = (vocab - known_mask.sum(-1, keepdim=True)).clamp(min=1).to(known_logp.dtype)
    fill = torch.log(left / outside)  # (..., 1)
    key, order = torch.where(known_mask, known_ids, torch.full_like(known_ids, vocab)).sort(dim=-1)
    index = support.index.to(key.dtype)
    at = torch.searchsorted(key.contiguous(), index.contiguous()).clamp(max=key.shape[-1] - 1)  # (..., S)
    found = key.gather(-1, at) == index
    value = known_logp.gather(-1, order).gather(-1, at)
    out = torch.where(found, value, fill.expand_as(value))
    if token_logp is None:
        return out
    entry = torch.arange(out.shape[-1], device=out.device) == support.token_index[..., None]  # (..., S)
    return torch.where(entry & ~found, token_logp[..., None].to(out.dtype), out)
