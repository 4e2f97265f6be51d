"""Divergence measures and trust-region intervals (SPEC section 1)."""

import math

import pytest
import torch

from tether import objectives
from tether.divergences import MEASURES, interval, lambertw, value


@pytest.mark.parametrize(
    "delta, low, high",
    # SPEC 1 check values for kl3.
    [(0.02, 0.8131, 1.2136), (0.0231, 0.8002, 1.2306), (0.0331, 0.7643, 1.2798)],
)
def test_kl3_check_values(delta, low, high):
    lo, hi = interval("kl3", delta)
    assert lo == pytest.approx(low, abs=1e-4)
    assert hi == pytest.approx(high, abs=1e-4)


def test_kl3_example_from_the_api():
    lo, hi = interval("kl3", 0.0231)
    assert (round(lo, 5), round(hi, 5)) == (0.80017, 1.23061)


@pytest.mark.parametrize("name", MEASURES.names())
@pytest.mark.parametrize("delta", [1e-4, 0.02, 0.0231, 0.1, 0.4])
def test_every_interval_hits_delta_on_both_sides(name, delta):
    lo, hi = interval(name, delta)
    assert 0 < lo < 1 < hi
    d = lambda w: float(value(name, torch.tensor(w, dtype=torch.float64)))  # noqa: E731
    assert d(lo) == pytest.approx(delta, rel=1e-9)
    assert d(hi) == pytest.approx(delta, rel=1e-9)
    # Inside the interval D < delta, just outside D > delta.
    assert d(lo * (1 + 1e-6)) < delta < d(lo * (1 - 1e-6))
    assert d(hi * (1 - 1e-6)) < delta < d(hi * (1 + 1e-6))


def test_closed_forms_of_the_simple_measures():
    d = 0.02
    assert interval("ratio", d) == pytest.approx((0.98, 1.02))
    assert interval("log_ratio", d) == pytest.approx((math.exp(-d), math.exp(d)))
    r = math.sqrt(2 * d)  # 0.2
    assert interval("kl2", d) == pytest.approx((math.exp(-r), math.exp(r)))
    assert interval("chi2", d) == pytest.approx((0.8, 1.2))
    assert interval("hellinger", d) == pytest.approx((0.81, 1.21))  # (1 -+ 0.1)^2


def test_large_delta_gives_a_one_sided_region():
    assert interval("chi2", 2.0)[0] == 0.0  # 1 - sqrt(4) < 0
    assert interval("kl3_reverse", 1.5)[0] == 0.0  # D(0+) = 1 < 1.5


@pytest.mark.parametrize("x", [-1 / math.e + 1e-12, -0.3, -0.1, -1e-5])
def test_lambert_w_both_real_branches(x):
    for branch, side in ((0, lambda w: w >= -1), (-1, lambda w: w <= -1)):
        w = lambertw(x, branch)
        assert side(w)
        assert w * math.exp(w) == pytest.approx(x, rel=1e-12, abs=1e-15)


def test_lambert_w_principal_branch_positive_argument():
    assert lambertw(math.e, 0) == pytest.approx(1.0, rel=1e-14)
    assert lambertw(0.0, 0) == 0.0
    with pytest.raises(ValueError):
        lambertw(0.5, -1)


def test_user_supplied_measure_by_root_finding():
    # Neyman chi-square: (w - 1)^2 / (2 w); roots of (w-1)^2 = 2 delta w.
    d = 0.02
    lo, hi = interval(lambda w: (w - 1) ** 2 / (2 * w), d)
    exact = [1 + d - math.sqrt(d * d + 2 * d), 1 + d + math.sqrt(d * d + 2 * d)]
    assert (lo, hi) == pytest.approx(exact, rel=1e-10)
    # A callable equal to a registered measure gives the registered interval.
    assert interval(lambda w: w - 1 - torch.log(w), d) == pytest.approx(interval("kl3", d), rel=1e-10)


def test_bad_user_measures_are_rejected_with_the_reason():
    with pytest.raises(ValueError, match="D\\(1\\) = 0"):
        interval(lambda w: w, 0.1)
    with pytest.raises(ValueError, match="decrease on"):
        interval(lambda w: (w - 1) ** 3 + 0 * w, 0.1)
    with pytest.raises(ValueError, match="positive"):
        interval("kl3", -0.1)
    with pytest.raises(KeyError, match="kl3"):
        interval("kl4", 0.1)


@pytest.mark.parametrize("measure", ["kl3", "kl2", "chi2", "hellinger", "kl3_reverse", "log_ratio"])
def test_divergence_clip_equals_ratio_clip_with_the_interval(measure):
    delta = 0.0331
    lo, hi = interval(measure, delta)
    N, T = 6, 7
    lp_old = -torch.rand(N, T, dtype=torch.float64) - 0.5
    lp0 = lp_old + 0.4 * torch.randn(N, T, dtype=torch.float64)  # ratios from ~0.3 to ~3
    adv = torch.randn(N, dtype=torch.float64)
    mask = (torch.rand(N, T) > 0.2).double()
    results = []
    for spec in (
        {"name": "divergence_clip", "measure": measure, "delta": delta, "dual_clip_c": 3.0},
        {"name": "ppo_clip", "eps_low": 1 - lo, "eps_high": hi - 1, "dual_clip_c": 3.0},
    ):
        lp = lp0.clone().requires_grad_()
        out = objectives.build(spec)(objectives.TokenBatch(lp, lp_old, adv, mask))
        out.loss.backward()
        results.append((out.loss.detach(), lp.grad, out.metrics["policy/clipfrac_high"]))
    (l1, g1, c1), (l2, g2, c2) = results
    assert torch.equal(l1, l2) and torch.equal(g1, g2) and torch.equal(c1, c2)
    assert c1 > 0  # the bounds acted
