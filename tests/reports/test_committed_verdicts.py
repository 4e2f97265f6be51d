"""Every committed comparison's verdicts (benchmarks/results/*/summary.json) come from the claims' statistics, and
each agrees with an independent paired t-test: recomputed here from the committed per-seed values with mpmath's
incomplete beta function (not tether.reports.stats), with Holm's correction over the report's claims done by hand.
A result whose summary.json was written by other statistics, or edited, fails here."""

from __future__ import annotations

import json
import math
from pathlib import Path

import mpmath
import pytest

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
STUDIES = sorted(  # every committed summary.json with a tested claim (a partial study's may have none yet)
    str(p.parent.relative_to(RESULTS))
    for p in RESULTS.glob("**/summary.json")
    if any(c.get("p") is not None for c in json.loads(p.read_text()).get("claims", []))
)


def two_sided_p(d: list[float]) -> float:
    n = len(d)
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    if sd == 0:
        return 1.0 if mean == 0 else 0.0
    t = abs(mean) / (sd / math.sqrt(n))
    df = n - 1
    return float(mpmath.betainc(df / 2, 0.5, 0, df / (df + t * t), regularized=True))  # = 2 P(T > |t|)


def per_seed(methods: dict, method: str, metric: str) -> dict[int, float]:
    return dict(zip(methods[method]["seeds"], methods[method][metric]))


def paired_differences(summary: dict, claim: dict) -> list[float]:
    regime = summary["regimes"][claim["regime"]]["methods"]
    a, b = per_seed(regime, claim["method"], claim["metric"]), per_seed(regime, claim["baseline"], claim["metric"])
    if claim.get("relative_to"):
        base = summary["regimes"][claim["relative_to"]]["methods"]
        a0, b0 = per_seed(base, claim["method"], claim["metric"]), per_seed(base, claim["baseline"], claim["metric"])
        a = {s: v - a0[s] for s, v in a.items() if s in a0}
        b = {s: v - b0[s] for s, v in b.items() if s in b0}
    return [a[s] - b[s] for s in sorted(set(a) & set(b))]


def test_the_committed_studies_are_found():
    assert {"compare_cpu", "staleness_cpu", "real_model_compare_cpu"} <= set(STUDIES)


@pytest.mark.parametrize("study", STUDIES)
def test_committed_verdicts_agree_with_an_independent_paired_t_test_and_holm(study):
    summary = json.loads((RESULTS / study / "summary.json").read_text())
    claims = [c for c in summary["claims"] if c["p"] is not None]
    designed = "design" in summary  # a group-sequential study: Holm runs over the looks' sequential p-values
    test = "sequential paired t" if designed else "paired t"
    assert claims and all(c["paired"] and c["test"] == test for c in claims)
    ps = []
    for c in claims:
        d = paired_differences(summary, c)
        assert len(d) == c["seeds"][0] >= 4
        assert c["difference"] == pytest.approx(sum(d) / len(d), abs=1e-12)
        p = two_sided_p(d)
        assert c["p"] == pytest.approx(p, abs=1e-9), (c["claim"], c["regime"])  # this look's t, recomputed
        ps.append(c["p_sequential"] if designed else p)
    family = claims
    if designed:  # the null control's tests are in the family too
        family = claims + summary["null_control"]
        ps += [n["p_sequential"] for n in summary["null_control"]]
    # Holm by hand: the i-th smallest of m p-values times (m - i), kept non-decreasing, capped at 1.
    order, running = sorted(range(len(ps)), key=ps.__getitem__), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        c = family[i]
        assert c["p_holm"] == pytest.approx(running, abs=1e-9) and c["family"] == len(ps)
        # undecided: inconclusive at the last look (or without a design), continuing at an interim one
        look, looks = c.get("look") or (1, 1)
        undecided = "inconclusive" if look == looks else f"continuing (look {look} of {looks})"
        if "claim" not in c:  # a null-control test: no claimed side
            assert c["verdict"] == undecided if running >= 0.05 else c["verdict"] not in ("inconclusive", undecided)
            continue
        sign = 1 if c["direction"] == "higher" else -1
        want = undecided if running >= 0.05 else ("supported" if sign * c["difference"] > 0 else "contradicted")
        assert c["verdict"] == want, (c["claim"], c["regime"])
