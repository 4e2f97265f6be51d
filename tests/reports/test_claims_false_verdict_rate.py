"""The claims' verdicts are wrong no more often than they say: simulated A/A comparisons (two methods with no
true difference, paired by seed as `tether compare` pairs them) come out "supported" or "contradicted" in at
most 5% of trials at 4, 5 and 8 seeds, on Gaussian, heavy-tailed and 40-problem-accuracy values; a known effect
is found with the power the detectable difference promises; and, as the contrast that shows the simulation
can fail, the percentile bootstrap the claims used before calls far more than 5% of A/A pairs.

Deterministic: every trial draws from `random.Random` with a fixed seed. With 4,000 trials the binomial
standard error of a 5% rate is 0.34%, so the bound 5% + 0.9% (2.6 standard errors) fails a correct test by
chance once in 200 seeds of the simulation, and this one seed was not chosen for passing.
"""

from __future__ import annotations

import math
import random
import statistics

import pytest

from tether.reports import stats
from tether.reports.claims import compare_values

TRIALS = 4000


def gaussian(rng: random.Random, n: int) -> tuple[list[float], list[float]]:
    """Per-seed values of two methods with a shared seed effect (sd 0.08) and independent noise (sd 0.04)."""
    seed_effect = [rng.gauss(0.5, 0.08) for _ in range(n)]
    return [s + rng.gauss(0, 0.04) for s in seed_effect], [s + rng.gauss(0, 0.04) for s in seed_effect]


def heavy_tailed(rng: random.Random, n: int) -> tuple[list[float], list[float]]:
    """As `gaussian`, with Student-t noise of 3 degrees of freedom (infinite fourth moment)."""

    def t3() -> float:
        return rng.gauss(0, 1) / math.sqrt(sum(rng.gauss(0, 1) ** 2 for _ in range(3)) / 3)

    seed_effect = [rng.gauss(0.5, 0.08) for _ in range(n)]
    return [s + 0.03 * t3() for s in seed_effect], [s + 0.03 * t3() for s in seed_effect]


def accuracy_40(rng: random.Random, n: int) -> tuple[list[float], list[float]]:
    """Held-out accuracy on 40 problems: each seed's true accuracy (0.6 +- 0.1, shared by both methods), then
    each run's 40 problems right or wrong at that rate: discrete values, binomial noise of sd 0.077."""
    a, b = [], []
    for _ in range(n):
        p = min(0.95, max(0.05, rng.gauss(0.6, 0.1)))
        a.append(sum(rng.random() < p for _ in range(40)) / 40)
        b.append(sum(rng.random() < p for _ in range(40)) / 40)
    return a, b


def false_verdict_rate(draw, n: int, seed: int, trials: int = TRIALS) -> float:
    rng = random.Random(seed)
    false = 0
    for _ in range(trials):
        a, b = draw(rng, n)
        false += compare_values(a, b, "higher", paired=True).verdict in ("supported", "contradicted")
    return false / trials


@pytest.mark.parametrize("n", [4, 5, 8])
@pytest.mark.parametrize("draw", [gaussian, heavy_tailed, accuracy_40], ids=lambda f: f.__name__)
def test_aa_comparisons_get_a_verdict_in_at_most_5_percent_of_trials(draw, n):
    rate = false_verdict_rate(draw, n, seed=1000 * n + len(draw.__name__))
    assert rate <= 0.059, rate
    assert rate >= 0.025, rate  # and not so conservative that it would miss real effects (measured 3.9-5.5%)


@pytest.mark.parametrize("n", [4, 5, 8])
def test_a_known_effect_at_the_detectable_difference_is_found_with_80_percent_power(n):
    """Per-seed differences with sd 1 and a true mean of mde80 computed from that sd: found in about 80% of
    trials (the approximation in tether.reports.stats gives 0.78 at 4 seeds, 0.80 at 8)."""
    se = 1 / math.sqrt(n)
    effect = (stats.t_quantile(0.975, n - 1) + stats.t_quantile(0.80, n - 1)) * se
    rng = random.Random(7 + n)
    found = 0
    for _ in range(TRIALS):
        d = [rng.gauss(effect, 1.0) for _ in range(n)]
        found += compare_values(d, [0.0] * n, "higher", paired=True).verdict == "supported"
    assert 0.75 <= found / TRIALS <= 0.84, found / TRIALS


def test_a_large_effect_on_40_problem_accuracies_is_supported_at_8_seeds():
    """+0.15 accuracy on every seed's 40 problems: about 3 binomial standard errors of one run. At 8 seeds the
    paired test finds it in nearly every trial."""
    rng = random.Random(3)
    found = 0
    for _ in range(1000):
        a, b = [], []
        for _ in range(8):
            p = min(0.8, max(0.1, rng.gauss(0.5, 0.1)))
            a.append(sum(rng.random() < p + 0.15 for _ in range(40)) / 40)
            b.append(sum(rng.random() < p for _ in range(40)) / 40)
        found += compare_values(a, b, "higher", paired=True).verdict == "supported"
    assert found / 1000 >= 0.9, found / 1000


def percentile_bootstrap_verdict(a: list[float], b: list[float], rng: random.Random, n_boot: int = 1000) -> bool:
    """The claims' earlier verdict: a paired percentile-bootstrap 95% interval of the mean difference excludes 0."""
    d = [x - y for x, y in zip(a, b)]
    means = sorted(statistics.fmean(rng.choices(d, k=len(d))) for _ in range(n_boot))
    lo, hi = means[int(0.025 * n_boot)], means[int(0.975 * n_boot) - 1]
    return lo > 0 or hi < 0


@pytest.mark.parametrize("n", [4, 8])
def test_the_percentile_bootstrap_the_claims_used_before_calls_far_more_than_5_percent(n):
    rng = random.Random(11 + n)
    trials = 400
    rate = sum(percentile_bootstrap_verdict(*gaussian(rng, n), rng) for _ in range(trials)) / trials
    assert rate >= 0.09, rate  # measured 0.19 at 4 seeds, 0.11 at 8
