"""Policy divergence measures and their trust-region intervals [ATR, arXiv 2602.05494].

A measure D(w) of the importance ratio w = pi_theta / pi_old defines the per-token trust
region {w : D(w) <= delta}. Every measure here has D(1) = 0, decreases on (0, 1] and
increases on [1, inf), so the region is an interval [low, high], and clipping by the
measure is exactly PPO ratio clipping with those bounds ([ATR] Theorem 4.1): for A > 0 only
`high` binds, for A < 0 only `low` binds. Computing the interval once per delta is therefore
all the divergence clip needs; the surrogate itself is `surrogates.ppo_clip`.

    ratio        |w - 1|               [1 - delta, 1 + delta]   (delta is PPO's epsilon)
    log_ratio    |log w|               [e^-delta, e^delta]
    kl2          (log w)^2 / 2         [e^-sqrt(2 delta), e^sqrt(2 delta)]
    kl3          w - 1 - log w         [-W0(-e^(-1-delta)), -W_-1(-e^(-1-delta))]
    kl3_reverse  w log w - w + 1       bracketed roots on each side of 1
    chi2         (w - 1)^2 / 2         [1 - sqrt(2 delta), 1 + sqrt(2 delta)]
    hellinger    2 (sqrt(w) - 1)^2     [(1 - sqrt(delta/2))^2, (1 + sqrt(delta/2))^2]

All but `ratio` and `log_ratio` agree to second order at w = 1 (D ~ (w-1)^2 / 2), so one
delta means about the same region; what differs is the asymmetry (kl3 allows more room
above 1 than below).

Departures from the paper:
1. Lower bounds that would fall below 0 (chi2, hellinger, kl3_reverse with large delta) are
   reported as 0: the ratio is positive, so the region is then one-sided.
2. A user-supplied measure (any callable D of a float) is accepted; its interval is found by
   bisection and verified (D(low) = D(high) = delta) before it is used.

Binary measures (`BINARY_MEASURES`) are not functions of the ratio alone: each compares the two
Bernoulli distributions {sampled token, everything else} that two policies give the sampled token,
from their log-probs a = log p and b = log q [DPPO, arXiv 2602.04879, its "Binary" approximation]:

    binary_tv      |p - q|                                          TV(Ber(p), Ber(q))
    binary_kl      p log(p / q) + (1 - p) log((1 - p) / (1 - q))    KL(Ber(p) || Ber(q))
    binary_kl_max  max(KL(Ber(p) || Ber(q)), KL(Ber(q) || Ber(p)))  KPop (AReaL's rejection_sampling
                                                                    metric `binary_kl`): both directions

A ratio measure cannot express them: binary_tv = p |w - 1| with w = q / p, wide for a rare token and
narrow for a confident one. DPPO masks by binary_tv / binary_kl (tether.core.dppo); rollout correction
rejects a token whose binary measure between pi_old and pi_sampler exceeds delta (tether.core.correction),
which with binary_kl_max is AReaL's KPop: keep the token iff max of the two KLs <= phi (AReaL's `upper`).

Departures of the binary measures:
3. binary_kl adds 1e-8 inside the second log, as the DPPO authors' and verl's code do, so that p -> 1 gives a
   finite value. AReaL's `compute_binary_kl_divergence` instead clamps p and q to [1e-8, 1 - 1e-8]; for
   finite log-probs the two differ by less than 1e-6 (tests/core/test_divergence_intervals_and_clipping.py compares
   them), which can
   change a decision only for a value within that of the threshold. binary_kl_max is binary_kl both ways.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .registry import Registry

Measure = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class DivergenceMeasure:
    """D(w) on tensors, and optionally its interval in closed form (else found numerically)."""

    name: str
    value: Measure
    closed_form: Optional[Callable[[float], tuple[float, float]]] = None


MEASURES: Registry[DivergenceMeasure] = Registry("divergence measure")


def _measure(name: str, closed_form=None):
    def decorator(fn: Measure) -> Measure:
        MEASURES.register(name)(DivergenceMeasure(name, fn, closed_form))
        return fn

    return decorator


# ---------------------------------------------------------------- Lambert W (real branches)
def lambertw(x: float, branch: int = 0) -> float:
    """Real Lambert W: the w with w e^w = x, on branch 0 (w >= -1) or -1 (w <= -1).

    Branch 0 is defined for x >= -1/e, branch -1 for -1/e <= x < 0. Halley iteration from a
    series start near the branch point (where both branches meet at w = -1) or the
    asymptotic start elsewhere; converges to double precision in a handful of steps.
    """
    if branch not in (0, -1):
        raise ValueError(f"lambertw: branch must be 0 or -1, got {branch}")
    if x < -1.0 / math.e - 1e-15 or (branch == -1 and x >= 0.0):
        raise ValueError(f"lambertw: x = {x} is outside the real domain of branch {branch}")
    p2 = max(2.0 * (math.e * x + 1.0), 0.0)
    if p2 == 0.0:
        return -1.0
    p = math.sqrt(p2)
    if branch == 0:
        if x < -0.25:
            w = -1.0 + p - p * p / 3.0 + 11.0 / 72.0 * p**3
        elif x < 3.0:
            w = x / (1.0 + x) if x > -0.2 else x
        else:
            lx = math.log(x)
            w = lx - math.log(lx)
    else:
        if x < -0.25:
            w = -1.0 - p - p * p / 3.0 - 11.0 / 72.0 * p**3
        else:
            l1 = math.log(-x)
            l2 = math.log(-l1)
            w = l1 - l2 + l2 / l1
    for _ in range(100):
        ew = math.exp(w)
        f = w * ew - x
        if w == -1.0:
            break
        step = f / (ew * (w + 1.0) - (w + 2.0) * f / (2.0 * w + 2.0))
        w_new = w - step
        if w_new == w or abs(step) <= 4e-16 * (1.0 + abs(w_new)):
            return w_new
        w = w_new
    return w


# ---------------------------------------------------------------- closed-form intervals
def _ratio_interval(delta: float) -> tuple[float, float]:
    return max(1.0 - delta, 0.0), 1.0 + delta


def _log_ratio_interval(delta: float) -> tuple[float, float]:
    return math.exp(-delta), math.exp(delta)


def _kl2_interval(delta: float) -> tuple[float, float]:
    r = math.sqrt(2.0 * delta)
    return math.exp(-r), math.exp(r)


def _kl3_interval(delta: float) -> tuple[float, float]:
    # w - 1 - log w = delta  <=>  (-w) e^(-w) = -e^(-1-delta)  <=>  w = -W(-e^(-1-delta)).
    # Both real branches give the two roots: W0 the one below 1, W_-1 the one above.
    x = -math.exp(-1.0 - delta)
    return -lambertw(x, 0), -lambertw(x, -1)


def _chi2_interval(delta: float) -> tuple[float, float]:
    r = math.sqrt(2.0 * delta)
    return max(1.0 - r, 0.0), 1.0 + r


def _hellinger_interval(delta: float) -> tuple[float, float]:
    r = math.sqrt(delta / 2.0)
    return (1.0 - r) ** 2 if r < 1.0 else 0.0, (1.0 + r) ** 2


# ---------------------------------------------------------------- the measures
@_measure("ratio", _ratio_interval)
def ratio(w: torch.Tensor) -> torch.Tensor:
    return (w - 1.0).abs()


@_measure("log_ratio", _log_ratio_interval)
def log_ratio(w: torch.Tensor) -> torch.Tensor:
    return torch.log(w).abs()


@_measure("kl2", _kl2_interval)
def kl2(w: torch.Tensor) -> torch.Tensor:
    return torch.log(w) ** 2 / 2.0


@_measure("kl3", _kl3_interval)
def kl3(w: torch.Tensor) -> torch.Tensor:
    return w - 1.0 - torch.log(w)


@_measure("kl3_reverse")
def kl3_reverse(w: torch.Tensor) -> torch.Tensor:
    return torch.xlogy(w, w) - w + 1.0


@_measure("chi2", _chi2_interval)
def chi2(w: torch.Tensor) -> torch.Tensor:
    return (w - 1.0) ** 2 / 2.0


@_measure("hellinger", _hellinger_interval)
def hellinger(w: torch.Tensor) -> torch.Tensor:
    return 2.0 * (torch.sqrt(w) - 1.0) ** 2


# ---------------------------------------------------------------- binary measures of two log-probs
BinaryMeasure = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
BINARY_MEASURES: Registry[BinaryMeasure] = Registry("binary divergence measure")


@BINARY_MEASURES.register("binary_tv")
def binary_tv(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """TV(Ber(e^a), Ber(e^b)) = |e^a - e^b|, elementwise (N, T)."""
    return (torch.exp(b) - torch.exp(a)).abs()


@BINARY_MEASURES.register("binary_kl")
def binary_kl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """KL(Ber(p) || Ber(q)) with p = e^a, q = e^b, elementwise (N, T); 1e-8 guards log(1 - q) at q = 1
    (departure 3)."""
    p, q = torch.exp(a), torch.exp(b)
    return p * (a - b) + (1.0 - p) * torch.log((1.0 - p + 1e-8) / (1.0 - q + 1e-8))


@BINARY_MEASURES.register("binary_kl_max")
def binary_kl_max(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """KPop's symmetric binary KL, max(KL(Ber(p) || Ber(q)), KL(Ber(q) || Ber(p))), elementwise (N, T)."""
    return torch.maximum(binary_kl(a, b), binary_kl(b, a))


# ---------------------------------------------------------------- numeric intervals
_W_MIN = 1e-12  # smallest ratio probed on the low side; below it the bound is reported as 0
_W_MAX = 1e12  # largest ratio probed on the high side; beyond it the bound is inf


def _as_float_fn(measure: Callable) -> Callable[[float], float]:
    def f(w: float) -> float:
        return float(measure(torch.tensor(w, dtype=torch.float64)))

    return f


def _bisect(f: Callable[[float], float], lo: float, hi: float, delta: float) -> float:
    """Root of f(w) = delta on [lo, hi], given f - delta changes sign there."""
    flo = f(lo) - delta
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        fmid = f(mid) - delta
        if (fmid > 0) == (flo > 0):
            lo, flo = mid, fmid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def numeric_interval(measure: Callable, delta: float) -> tuple[float, float]:
    """[low, high] = {w : D(w) <= delta} for a measure with D(1) = 0, by bisection."""
    f = _as_float_fn(measure)
    if abs(f(1.0)) > 1e-12:
        raise ValueError(f"a divergence measure must satisfy D(1) = 0; got D(1) = {f(1.0)}")
    grid_low = [10.0**-k for k in range(12, 0, -1)] + [0.25, 0.5, 0.75, 0.9, 0.99, 1.0]
    grid_high = [1.0, 1.01, 1.1, 1.5, 2.0] + [10.0**k for k in range(1, 13)]
    for grid, side in ((grid_low, "(0, 1]"), (grid_high, "[1, inf)")):
        vals = [f(w) for w in grid]
        decreasing = grid is grid_low
        ok = all((a >= b) if decreasing else (a <= b) for a, b in zip(vals, vals[1:]))
        if not ok or any(math.isnan(v) for v in vals):
            trend = "decrease" if decreasing else "increase"
            raise ValueError(
                f"a divergence measure must {trend} on {side} so that D(w) <= delta is an "
                f"interval; values on a grid there were {[round(v, 6) for v in vals]}"
            )
    low = 0.0 if f(_W_MIN) <= delta else _bisect(f, _W_MIN, 1.0, delta)
    high = math.inf if f(_W_MAX) <= delta else _bisect(f, 1.0, _W_MAX, delta)
    return low, high


def interval(measure: str | Callable, delta: float) -> tuple[float, float]:
    """The trust-region interval (low, high) of {w : D(w) <= delta}, as floats.

    `measure` is a registered name (see `MEASURES.names()`) or a callable D(w) taking a
    float64 scalar tensor. Closed forms are used where they exist; every result is checked
    to satisfy D(low) = D(high) = delta (unless a bound is 0 or inf).
    """
    if not (isinstance(delta, (int, float)) and delta > 0 and math.isfinite(delta)):
        raise ValueError(f"delta must be a positive finite number, got {delta!r}")
    delta = float(delta)
    if isinstance(measure, str):
        spec = MEASURES.get(measure)
        fn: Callable = spec.value
        low, high = spec.closed_form(delta) if spec.closed_form else numeric_interval(fn, delta)
    elif callable(measure):
        fn = measure
        low, high = numeric_interval(fn, delta)
    else:
        raise TypeError(f"measure must be a name ({', '.join(MEASURES.names())}) or a callable, got {measure!r}")
    _verify(fn, delta, low, high)
    return float(low), float(high)


def _verify(fn: Callable, delta: float, low: float, high: float) -> None:
    f = _as_float_fn(fn)
    for bound in (low, high):
        if bound in (0.0, math.inf):
            continue
        if not math.isclose(f(bound), delta, rel_tol=1e-8, abs_tol=1e-12):
            raise ArithmeticError(f"interval check failed: D({bound}) = {f(bound)} != delta = {delta}")
    if not (low <= 1.0 <= high):
        raise ArithmeticError(f"interval [{low}, {high}] does not contain w = 1")


def value(measure: str | Callable, w: torch.Tensor) -> torch.Tensor:
    """D(w) elementwise for a registered name or a callable."""
    fn = MEASURES.get(measure).value if isinstance(measure, str) else measure
    return fn(w)
