"""Every divergence measure's trust-region interval equals the roots of D(w) = delta found independently by
mpmath at 50 significant digits (`mpmath.findroot` on each side of w = 1, and `mpmath.lambertw` for kl3's closed
form [ATR, arXiv 2602.05494]). No ATR reference code is published; mpmath (a dependency of torch, through sympy)
is the independent check, to rel 1e-12 (tether computes in float64).
"""

import math

import pytest

mpmath = pytest.importorskip("mpmath")

from tether.divergences import interval, lambertw  # noqa: E402

mpmath.mp.dps = 50

# D(w) written again from the measures' definitions (tether/core/divergences.py's table), in mpmath.
DEFINITIONS = {
    "ratio": lambda w: abs(w - 1),
    "log_ratio": lambda w: abs(mpmath.log(w)),
    "kl2": lambda w: mpmath.log(w) ** 2 / 2,
    "kl3": lambda w: w - 1 - mpmath.log(w),
    "kl3_reverse": lambda w: w * mpmath.log(w) - w + 1,
    "chi2": lambda w: (w - 1) ** 2 / 2,
    "hellinger": lambda w: 2 * (mpmath.sqrt(w) - 1) ** 2,
}


def _root(measure, delta, lo, hi):
    f = DEFINITIONS[measure]
    return float(mpmath.findroot(lambda w: f(w) - delta, (mpmath.mpf(lo), mpmath.mpf(hi)), solver="anderson"))


@pytest.mark.parametrize("delta", [0.0231, 0.005, 0.1])
@pytest.mark.parametrize("measure", sorted(DEFINITIONS))
def test_interval_is_the_pair_of_roots_of_d_equals_delta(measure, delta):
    low, high = interval(measure, delta)
    assert high == pytest.approx(_root(measure, delta, 1 + 1e-9, 3.0), rel=1e-12)
    assert low == pytest.approx(_root(measure, delta, 1e-3, 1 - 1e-9), rel=1e-12)


def test_kl3_closed_form_equals_mpmaths_lambert_w_on_both_branches():
    for delta in (0.0231, 0.005, 0.1, 1.0):
        x = -math.exp(-1 - delta)
        for branch in (0, -1):
            assert lambertw(x, branch) == pytest.approx(float(mpmath.lambertw(x, branch).real), rel=1e-12)
        low, high = interval("kl3", delta)
        assert (low, high) == pytest.approx(
            (-float(mpmath.lambertw(x, 0).real), -float(mpmath.lambertw(x, -1).real)), rel=1e-12
        )
