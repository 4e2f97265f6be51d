"""Group-sequential tests of claims: looks fixed in advance, alpha spent across them, boundaries for small samples.

A comparison is looked at after n_1 < n_2 < ... < n_K seeds (the design's `looks`; n_K = `max_seeds`). At look
k a claim's statistic S_k is computed from its first n_k paired differences d_1..d_{n_k} (seed order), and the
claim is decided when |S_k| reaches the boundary c_k; the study stops once every claim is decided or n_K is
reached. The boundaries spend the level alpha across the looks by a spending function (Lan & DeMets 1983) of the
information fraction f_k (n_k / n_K):

    obrien_fleming   a(f) = 2 - 2 Phi(z_{1-alpha/2} / sqrt(f))     spends almost nothing early (the default)
    pocock           a(f) = alpha ln(1 + (e - 1) f)                   spends evenly

    c_k is the value with  P_0(|S_1| < c_1, ..., |S_{k-1}| < c_{k-1}, |S_k| >= c_k) = a(f_k) - a(f_{k-1})

so that, with no true difference, the chance of deciding at any look is a(1) = alpha.

Two statistics (the design's `test`):

    t            S_k = mean(d_1..n_k) / (s_k / sqrt(n_k)), Student's paired t on every seed so far.
    combination  the inverse-normal combination test (Bauer & Koehne 1994; Lehmacher & Wassmer 1999): stage j
                 (the seeds between looks j-1 and j) gives its own paired t_j on its m_j seeds, made standard
                 normal through its own distribution, z_j = Phi^-1(F_{t, m_j - 1}(t_j)), and
                 S_k = sum_{j<=k} w_j z_j / sqrt(sum_{j<=k} w_j^2), with w_j = sqrt(planned m_j) fixed in advance.

Why the boundaries are simulated: textbook boundaries assume S_k is normal with known variance. With 4-9 seeds
the t statistics have 3-8 degrees of freedom and heavy tails, and normal boundaries err well above alpha. The
joint null distribution of (S_1..S_K) does not depend on the unknown spread (t is scale-free; z_j is exactly
standard normal), so it is simulated once per set of looks: SIMULATIONS draws of n_K standard normal
differences, seeded (SIM_SEED), so the boundaries are the same on every machine. The first look's boundary is
exact (the t or normal quantile); each later one is the quantile among the draws that have not yet crossed. The
Monte Carlo error of a boundary is about 1% at the smallest increments a study spends (1e-4 of 400,000 draws).

Why a combination test: the t design's looks are fixed. An extension decided from what a look showed (the spread
asked for more seeds, or a p-value just missed) changes the design after its first look, and its rate with it:
the look-and-extend procedure of the binding study (4, 6, then 9 seeds on a spread) published a false verdict in
6.9-10.8% of null studies. The combination test keeps alpha whatever the later stages' sizes: each stage's z_j is
standard normal given everything before it, so the sizes of stages after look 1 may be chosen from any data seen
(only the weights w_j stay as planned). It costs power: at 4, 6 and 9 seeds and a true difference of one standard
deviation, 66% against the t design's 72% (`tests/reports/test_sequential.py` measures both).

Holm across claims (`decide`): each claim's repeated p-value at look k is the smallest level at which its own
design would have crossed a boundary at some look up to k (Jennison & Turnbull 2000, ch. 9); Holm's step-down
on these is the sequentially rejective procedure of Maurer & Bretz (2013) for Holm's graph, which keeps the
family-wise rate at alpha over every look and claim. With `family: primary_first`, the primary claims are one
Holm family at alpha and the secondary claims one more, tested only once every primary claim is decided (serial
gatekeeping, a closed test).

Departures from the textbook design:
  1. The information fraction is n_k / n_K for the t test, planned sum w_j^2 share for the combination test; a
     look with more seeds than planned (n_k > n_K) has nothing left to spend (a(f > 1) = alpha), so the t design
     cannot gain by extension: that is what the combination test is for.
  2. No futility boundary: a claim that is not decided goes on to n_K and ends "inconclusive".
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Callable, Optional, Sequence

import numpy as np

from . import stats

SIMULATIONS = 400_000
SIM_SEED = 48
"""The boundaries' Monte Carlo: draws and seed (module docstring)."""
_N = NormalDist()


def _obrien_fleming(alpha: float, f: float) -> float:
    if f <= 0:
        return 0.0
    return min(alpha, 2.0 - 2.0 * _N.cdf(_N.inv_cdf(1.0 - alpha / 2.0) / math.sqrt(min(f, 1.0))))


def _pocock(alpha: float, f: float) -> float:
    return alpha * math.log(1.0 + (math.e - 1.0) * min(max(f, 0.0), 1.0))


SPENDING: dict[str, Callable[[float, float], float]] = {"obrien_fleming": _obrien_fleming, "pocock": _pocock}
"""Alpha-spending functions a(alpha, information fraction) (module docstring)."""
TESTS = ("t", "combination")
FAMILIES = ("holm", "primary_first")


@dataclass(frozen=True)
class Design:
    """A comparison's design, fixed before its first look (module docstring; docs/compare.md)."""

    looks: tuple[int, ...]
    """Seeds at each look, increasing; the last is the most seeds any claim gets."""
    alpha: float = stats.ALPHA
    """The family-wise level over every claim and look."""
    spending: str = "obrien_fleming"
    test: str = "t"
    family: str = "holm"
    detect: Optional[float] = None
    """The difference the study is sized to detect at 80% power (planning: `tether compare --plan`)."""
    weights: tuple[float, ...] = field(default=())
    """The combination test's stage weights, sqrt(planned stage sizes); () for the t test. Fixed when the design is
    first recorded, so that later stage sizes may change."""

    def __post_init__(self):
        looks = tuple(int(n) for n in self.looks)
        object.__setattr__(self, "looks", looks)
        if not looks or any(b <= a for a, b in zip(looks, looks[1:])) or looks[0] < stats.MIN_SEEDS:
            raise ValueError(f"looks must increase from at least {stats.MIN_SEEDS} seeds, got {list(looks)}")
        if self.spending not in SPENDING:
            raise ValueError(f"spending {self.spending!r} is not one of {', '.join(SPENDING)}")
        if self.test not in TESTS:
            raise ValueError(f"test {self.test!r} is not one of {', '.join(TESTS)}")
        if self.family not in FAMILIES:
            raise ValueError(f"family {self.family!r} is not one of {', '.join(FAMILIES)}")
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"alpha must lie in (0, 1), got {self.alpha}")
        if self.test == "combination":
            if any(b - a < 2 for a, b in zip((0, *looks), looks)):
                raise ValueError(f"a combination test needs at least 2 new seeds at each look, got looks {list(looks)}")
            if not self.weights:
                stages = [b - a for a, b in zip((0, *looks), looks)]
                object.__setattr__(self, "weights", tuple(math.sqrt(m) for m in stages))

    @property
    def max_seeds(self) -> int:
        return self.looks[-1]

    def fraction(self, k: int, n: int) -> float:
        """The information fraction at look k (0-based) taken at n seeds."""
        if self.test == "t":
            return n / self.max_seeds
        w2 = [w * w for w in self.weights]
        return sum(w2[: k + 1]) / sum(w2) if k < len(w2) else 1.0 + k

    def looks_taken(self, n: int) -> tuple[int, ...]:
        """The looks a claim with n paired seeds has reached."""
        return tuple(m for m in self.looks if m <= n)


# ---------------------------------------------------------------- the statistics at each look


def statistics_at(design: Design, d: Sequence[float], ns: Sequence[int]) -> list[Optional[float]]:
    """S_k at each look (module docstring) from the paired differences d in seed order; None where it is undefined
    (zero spread: every difference in the look equal)."""
    out: list[Optional[float]] = []
    if design.test == "t":
        for n in ns:
            t = stats.paired_t(d[:n])
            out.append(None if t.se == 0 else t.difference / t.se)
        return out
    if len(ns) > len(design.weights):
        raise ValueError(f"a combination test has {len(design.weights)} planned stages, not {len(ns)}")
    zs, bounds = [], (0, *ns)
    for k in range(len(ns)):
        t = stats.paired_t(d[bounds[k] : bounds[k + 1]])
        if t.se == 0:
            return out + [None] * (len(ns) - k)
        zs.append(_N.inv_cdf(min(max(stats.t_cdf(t.difference / t.se, t.df), 1e-300), 1.0 - 1e-16)))
        w = design.weights[: k + 1]
        out.append(sum(wj * zj for wj, zj in zip(w, zs)) / math.sqrt(sum(wj * wj for wj in w)))
    return out


@functools.lru_cache(maxsize=32)
def _null(test: str, ns: tuple[int, ...], weights: tuple[float, ...]) -> np.ndarray:
    """(SIMULATIONS, K) |S_k| under no difference (module docstring), seeded."""
    rng = np.random.default_rng(SIM_SEED)
    d = rng.standard_normal((SIMULATIONS, ns[-1]))
    out = np.empty((SIMULATIONS, len(ns)))
    if test == "t":
        s1, s2 = np.cumsum(d, axis=1), np.cumsum(d * d, axis=1)
        for k, n in enumerate(ns):
            mean = s1[:, n - 1] / n
            var = np.maximum(s2[:, n - 1] - n * mean * mean, 0.0) / (n - 1)
            out[:, k] = np.abs(mean / np.sqrt(var / n))
        return out
    z_sum, w2 = np.zeros(SIMULATIONS), 0.0
    for k in range(len(ns)):
        # a stage's t, made standard normal through its own distribution, is exactly N(0, 1): draw it so
        z_sum += weights[k] * rng.standard_normal(SIMULATIONS)
        w2 += weights[k] ** 2
        out[:, k] = np.abs(z_sum / math.sqrt(w2))
    return out


@functools.lru_cache(maxsize=4096)
def boundaries(design: Design, ns: tuple[int, ...], alpha: float) -> tuple[float, ...]:
    """The boundaries c_1..c_K for |S_k| at looks taken at ns seeds, spending `alpha` (module docstring)."""
    spend = SPENDING[design.spending]
    spent = [spend(alpha, design.fraction(k, n)) for k, n in enumerate(ns)]
    increments = [b - a for a, b in zip([0.0, *spent], spent)]
    if design.test == "t":
        first = stats.t_quantile(1.0 - increments[0] / 2.0, ns[0] - 1) if increments[0] > 0 else math.inf
    else:
        first = _N.inv_cdf(1.0 - increments[0] / 2.0) if increments[0] > 0 else math.inf
    out = [first]
    if len(ns) == 1:
        return tuple(out)
    sims = _null(design.test, ns, design.weights)
    alive = sims[:, 0] < first
    for k in range(1, len(ns)):
        want = int(increments[k] * SIMULATIONS)  # draws that should cross here first (rounded down: conservative)
        vals = sims[alive, k]
        if want < 1:
            c = math.inf
        elif want >= len(vals):
            c = 0.0
        else:
            i = len(vals) - want  # the want-th largest: `want` draws reach it
            c = float(np.partition(vals, i)[i])
        out.append(c)
        alive &= sims[:, k] < c
    return tuple(out)


def crossed(design: Design, s: Sequence[Optional[float]], ns: tuple[int, ...], alpha: float) -> Optional[int]:
    """The first look (0-based) at which |S_k| reaches its boundary at level `alpha`, or None."""
    c = boundaries(design, ns, alpha)
    return next((k for k, v in enumerate(s) if v is not None and abs(v) >= c[k]), None)


def repeated_p(design: Design, s: Sequence[Optional[float]], ns: tuple[int, ...]) -> float:
    """The smallest level at which the design would have decided by the last look of ns (module docstring), to
    about 1e-4 relative: bisection on log(alpha)."""
    if all(v is None for v in s):
        return 1.0
    if crossed(design, s, ns, 1.0 - 1e-9) is None:
        return 1.0
    lo, hi = math.log(1e-12), math.log(1.0 - 1e-9)
    if crossed(design, s, ns, math.exp(lo)) is not None:
        return math.exp(lo)
    while hi - lo > 1e-4:
        mid = (lo + hi) / 2.0
        lo, hi = (lo, mid) if crossed(design, s, ns, math.exp(mid)) is not None else (mid, hi)
    return math.exp(hi)


# ---------------------------------------------------------------- the family


@dataclass(frozen=True)
class Hypothesis:
    """One claim's (or null-control test's) statistics at its looks: what `decide` needs."""

    s: tuple[Optional[float], ...]
    ns: tuple[int, ...]
    primary: bool = True


def _groups(design: Design, family: Sequence[Hypothesis]) -> list[list[int]]:
    """The indices of each Holm family, in testing order: one, or the primary then the secondary hypotheses."""
    if design.family == "primary_first":
        return [[i for i, h in enumerate(family) if h.primary], [i for i, h in enumerate(family) if not h.primary]]
    return [list(range(len(family)))]


def decide(design: Design, family: Sequence[Hypothesis]) -> list[Optional[int]]:
    """For each hypothesis, the look (0-based) at which the family decides it, or None: Holm's step-down over the
    repeated p-values, done with the boundaries at each Holm level alpha / (hypotheses still open) (module
    docstring), then the secondary family once every primary one is decided (`family: primary_first`)."""
    out: list[Optional[int]] = [None] * len(family)
    for group in _groups(design, family):
        open_ = {i for i in group if family[i].ns}
        while open_:
            level = design.alpha / len(open_)
            found = {i: crossed(design, family[i].s, family[i].ns, level) for i in open_}
            found = {i: look for i, look in found.items() if look is not None}
            if not found:
                break
            for i, look in found.items():
                out[i] = look
            open_ -= set(found)
        if any(out[i] is None for i in group):
            break  # a primary hypothesis is still open: the secondary family is not tested
    return out


def holm_p(design: Design, family: Sequence[Hypothesis]) -> list[Optional[float]]:
    """Each hypothesis's Holm-adjusted repeated p-value within its family; a secondary hypothesis gets None while a
    primary one is still open (`family: primary_first`: it is not tested yet)."""
    reps = [repeated_p(design, h.s, h.ns) if h.ns else None for h in family]
    out: list[Optional[float]] = [None] * len(family)
    for group in _groups(design, family):
        tested = [i for i in group if reps[i] is not None]
        for i, p in zip(tested, stats.holm([reps[i] for i in tested])):
            out[i] = min(1.0, p)
        if any(out[i] is None or out[i] >= design.alpha for i in group):
            break
    return out


# ---------------------------------------------------------------- planning


def power(design: Design, alpha: float, effect: float, draws: int = 20_000, seed: int = 7) -> tuple[float, float]:
    """(power, expected seeds) of `design` at level `alpha` when the paired differences have mean `effect` standard
    deviations: the share of simulated studies that decide on the effect's side, and the mean seeds they run (a
    study decided at look k stops there)."""
    ns = design.looks
    rng = np.random.default_rng(seed)
    d = rng.standard_normal((draws, ns[-1])) + effect
    signed = np.empty((draws, len(ns)))
    if design.test == "t":
        s1, s2 = np.cumsum(d, axis=1), np.cumsum(d * d, axis=1)
        for k, n in enumerate(ns):
            mean = s1[:, n - 1] / n
            signed[:, k] = mean / np.sqrt(np.maximum(s2[:, n - 1] - n * mean * mean, 1e-300) / (n - 1) / n)
    else:
        cdf = np.vectorize(stats.t_cdf)
        z_sum, w2, start = np.zeros(draws), 0.0, 0
        for k, n in enumerate(ns):
            x = d[:, start:n]
            m = n - start
            t = x.mean(1) / (x.std(1, ddof=1) / math.sqrt(m))
            z = np.array([_N.inv_cdf(min(max(p, 1e-300), 1 - 1e-16)) for p in cdf(t, m - 1)])
            z_sum += design.weights[k] * z
            w2 += design.weights[k] ** 2
            signed[:, k] = z_sum / math.sqrt(w2)
            start = n
    c = np.array(boundaries(design, ns, alpha))
    hit = np.abs(signed) >= c
    first = np.where(hit.any(1), hit.argmax(1), -1)
    decided_side = np.sign(signed[np.arange(draws), np.maximum(first, 0)])
    wins = (first >= 0) & (decided_side == np.sign(effect) if effect else first >= 0)
    seeds = np.where(first >= 0, np.array(ns)[np.maximum(first, 0)], ns[-1])
    return float(wins.mean()), float(seeds.mean())


def scaled(design: Design, most: int) -> Design:
    """The design with its looks at the same fractions of `most` seeds (each at least MIN_SEEDS, increasing)."""
    looks: list[int] = []
    for n in design.looks:
        k = max(
            stats.MIN_SEEDS,
            round(n * most / design.max_seeds),
            looks[-1] + (2 if design.test == "combination" else 1) if looks else 0,
        )
        looks.append(k)
    return Design(tuple(looks), design.alpha, design.spending, design.test, design.family, design.detect)


def seeds_needed(design: Design, alpha: float, effect: float, most: int = 60) -> Optional[tuple[Design, float, float]]:
    """The smallest scaling of `design` (`scaled`) that decides an effect of `effect` standard deviations with 80%
    power at level `alpha`: (that design, its power, its expected seeds); None when even `most` seeds do not."""
    for n in range(max(stats.MIN_SEEDS, design.looks[0]), most + 1):
        candidate = scaled(design, n)
        if candidate.max_seeds != n:
            continue
        p, expected = power(candidate, alpha, effect)
        if p >= stats.POWER:
            return candidate, p, expected
    return None
