"""The claims machinery: per-run metrics by hand, the t-test verdicts on synthetic seeds with a known effect,
none, and the opposite, Holm's correction over a report's claims, the null control in their family, zero spread
as no test, and claims files checked on load. (Their false-verdict rate: test_claims_false_verdict_rate.py; the
sequential designs: test_sequential.py.)"""

import math
import random

import pytest

from tether.reports.claims import (
    METRICS,
    Claim,
    compare_values,
    evaluate_claims,
    judge,
    load_claims,
    per_seed,
    skipped_claims,
)
from tether.reports.tables import claims_markdown, null_markdown
from tether.schema import ConfigError


def _rows(acc, ent=None, clip=None):
    """metrics.jsonl rows: evaluations every 10 steps, entropy and clip fractions every step."""
    rows = []
    for step in range(0, 10 * (len(acc) - 1) + 1):
        r = {"step": step}
        if step % 10 == 0:
            r["eval/accuracy"] = acc[step // 10]
        if step > 0:
            r["policy/entropy"] = ent(step) if ent else 1.0
            r["policy/clipfrac_low"], r["policy/clipfrac_high"] = clip or (0.01, 0.02)
        rows.append(r)
    return rows


def test_per_run_metrics_by_hand():
    rows = _rows([0.2, 0.5, 0.3, 0.6], ent=lambda s: 1.0 - s / 40)
    m = {name: fn(rows) for name, fn in METRICS.items()}
    assert m["final_accuracy"] == 0.6 and m["best_accuracy"] == 0.6
    # trapezoids over steps 0..30: 10*(0.35 + 0.4 + 0.45) / 30 = 0.4
    assert m["auc"] == pytest.approx(0.4)
    assert m["max_drop"] == pytest.approx(0.2)  # 0.5 -> 0.3
    # entropy 1 - s/40 at steps 1..30: half of the first (0.975 / 2 = 0.4875) is first undercut at
    # s = 21 (1 - 21/40 = 0.475); the last 10% (3 steps: 28, 29, 30) average 1 - 29/40 = 0.275.
    assert m["entropy_half_step"] == 21 and m["final_entropy"] == pytest.approx(0.275)
    assert m["clipfrac"] == pytest.approx(0.03)
    # entropy_retained: mean entropy over steps 1..30 = 1 - 15.5/40 = 0.6125, over step 1's 0.975 = 0.628205
    assert m["entropy_retained"] == pytest.approx(0.6125 / 0.975)
    assert METRICS["entropy_half_step"](_rows([0.1, 0.2])) == 11  # never halves: last step + 1


def test_a_known_effect_is_supported_none_is_inconclusive_the_opposite_contradicted():
    rng = random.Random(0)
    base = [0.40 + rng.gauss(0, 0.02) for _ in range(5)]
    better = [0.50 + rng.gauss(0, 0.02) for _ in range(5)]
    same = [0.40 + rng.gauss(0, 0.02) for _ in range(5)]
    up = compare_values(better, base, "higher")
    assert up.verdict == "supported" and up.ci95[0] > 0 and up.difference == pytest.approx(0.1, abs=0.04)
    assert up.test == "Welch t" and up.p < 0.001
    assert compare_values(same, base, "higher").verdict == "inconclusive"
    assert compare_values(better, base, "lower").verdict == "contradicted"
    assert compare_values(base, better, "lower").verdict == "supported"
    # A constant paired difference has no spread to measure the noise by: no test, never p = 0.
    exact = compare_values([1.0] * 4, [0.0] * 4, paired=True)
    assert exact.p is None and exact.ci95 is None and exact.verdict == "no test" and "zero spread" in exact.why


def test_the_paired_test_by_hand():
    # d = (0.05, 0.02, 0.08, -0.01): mean 0.035, s = sqrt((0.015^2 + 0.015^2 + 0.045^2 + 0.045^2) / 3)
    # = sqrt(0.0045 / 3) = 0.0387298; se = s / 2 = 0.0193649; t = 1.80739 on 3 df: two-sided p = 0.16843
    # (Student's t table: P(T_3 > 1.807) = 0.0842); t_{0.975,3} = 3.18245 gives the interval
    # 0.035 +- 0.061628; t_{0.80,3} = 0.97847 gives mde80 = (3.18245 + 0.97847) * 0.0193649 = 0.080576.
    r = compare_values([0.55, 0.52, 0.58, 0.49], [0.50] * 4, paired=True)
    assert r.test == "paired t" and r.difference == pytest.approx(0.035)
    assert r.p == pytest.approx(0.168429, abs=1e-6) and r.verdict == "inconclusive"
    assert r.ci95 == pytest.approx((0.035 - 0.0616278, 0.035 + 0.0616278), abs=1e-7)
    assert r.mde80 == pytest.approx(0.0805758, abs=1e-7)


@pytest.mark.parametrize("n, paired", [(1, True), (1, False), (2, True), (3, True), (3, False)])
def test_fewer_than_4_seeds_give_no_verdict_and_say_why(n, paired):
    # A large, nearly constant effect: with 4 seeds or more it is supported, with fewer there is no verdict
    # (below 4 the t-test's power is negligible and rests on one or two degrees of freedom).
    a, b = [0.5 + 0.01 * k for k in range(n)], [0.1 + 0.01 * k * k for k in range(n)]
    r = compare_values(a, b, "higher", paired=paired)
    assert r.verdict == "not enough seeds" and r.ci95 is None and r.mde80 is None and r.p is None
    assert r.difference == pytest.approx(sum(a) / n - sum(b) / n)  # the difference is still reported
    assert ("paired seed" if paired else f"{n} and {n} seeds") in r.why and "needs 4" in r.why
    a4, b4 = [0.5 + 0.01 * k for k in range(4)], [0.1 + 0.01 * k * k for k in range(4)]
    four = compare_values(a4, b4, "higher", paired=paired)
    assert four.verdict == "supported" and four.ci95 is not None
    assert compare_values([0.5] * 5, [0.1], "higher").verdict == "not enough seeds"  # one side short


def test_holm_corrects_the_verdicts_of_claims_tested_together():
    # Three claims on 5 paired seeds. Alone, B's p is under 0.05 (supported); with Holm over the family of
    # three it is compared after C's much smaller p: p_holm(B) = max(3 p(C), 2 p(B)), over 0.05.
    seeds = [0, 1, 2, 3, 4]
    base = [0.30, 0.35, 0.40, 0.32, 0.38]
    regime = {
        "A": {"seeds": seeds, "final_accuracy": base},
        "B": {"seeds": seeds, "final_accuracy": [x + d for x, d in zip(base, [0.05, 0.01, 0.04, 0.0, 0.03])]},
        "C": {"seeds": seeds, "final_accuracy": [x + d for x, d in zip(base, [0.20, 0.21, 0.19, 0.20, 0.22])]},
        "D": {"seeds": seeds, "final_accuracy": [x + d for x, d in zip(base, [0.01, -0.02, 0.0, 0.02, -0.01])]},
    }
    claims = [Claim(claim=f"{m} beats A", metric="final_accuracy", method=m, baseline="A") for m in "BCD"]
    results = {r["method"]: r for r in evaluate_claims(claims, {"r": regime})}
    alone = compare_values(regime["B"]["final_accuracy"], base, paired=True)
    assert 0.025 < alone.p < 0.05 and alone.verdict == "supported"
    assert sorted("BCD", key=lambda m: results[m]["p"]) == ["C", "B", "D"]
    assert results["C"]["p_holm"] == pytest.approx(3 * results["C"]["p"])
    assert results["B"]["p_holm"] == pytest.approx(max(3 * results["C"]["p"], 2 * results["B"]["p"]))
    assert results["D"]["p_holm"] == pytest.approx(min(1.0, max(results["B"]["p_holm"], results["D"]["p"])))
    assert [results[m]["verdict"] for m in "BCD"] == ["inconclusive", "supported", "inconclusive"]
    assert all(r["family"] == 3 for r in results.values())
    assert "| p (t) | p (exact) | p (Holm) | detectable (80% power) |" in claims_markdown(list(results.values()))
    # the detectable difference is at the level the family holds each claim to: 0.05 / 3, not 0.05
    assert all(r["alpha_tested"] == pytest.approx(0.05 / 3) for r in results.values())
    assert results["B"]["mde80"] > compare_values(regime["B"]["final_accuracy"], base, paired=True).mde80


def test_the_null_control_is_tested_on_the_claims_metrics_in_their_family():
    seeds = [0, 1, 2, 3, 4, 5]
    base = {
        "seeds": seeds,
        "final_accuracy": [0.5, 0.6, 0.55, 0.52, 0.58, 0.61],
        "auc": [0.4] * 6,
        "max_drop": [0.0] * 6,
    }
    same = {
        "seeds": seeds,
        "final_accuracy": [0.52, 0.57, 0.56, 0.5, 0.6, 0.6],
        "auc": [0.41, 0.4, 0.39, 0.4, 0.42, 0.38],
        "max_drop": [0.0] * 6,
    }
    claims = [Claim(claim="c", metric=m, method="grpo_null", baseline="grpo") for m in ("max_drop", "auc")]
    regime = {"r": {"grpo": base, "grpo_null": same}}
    results, nulls = judge(claims, regime, controls=[("grpo", "grpo_null")])
    assert [r["metric"] for r in nulls] == ["max_drop", "auc"]  # the metrics the claims name
    assert [r["verdict"] for r in nulls] == ["no test", "inconclusive"]  # max_drop 0 everywhere: zero spread
    assert nulls[1]["family"] == 2 and nulls[1]["p_holm"] is not None  # one family: auc claim and auc control
    # the control's difference is signed by its seed's label coin (which run is called the control): differences
    # of 0.1 on the side each coin names are a false verdict, counted as such
    from tether.reports.family import label_sign

    shift = [label_sign(k) * (0.1 + 0.01 * k) for k in seeds]
    off = {**base, "final_accuracy": [x + d for x, d in zip(base["final_accuracy"], shift)]}
    _, (shifted, _) = judge([], {"r": {"grpo": base, "grpo_null": off}}, controls=[("grpo", "grpo_null")])
    assert shifted["metric"] == "final_accuracy" and shifted["verdict"] == "false verdict"
    text = null_markdown([shifted, nulls[1]])
    assert "False verdicts in the null control: 1 of 2 tests (in one Holm family of" in text


def test_null_control_labels_are_a_fair_coin_per_seed():
    from tether.reports.family import label_sign

    signs = [label_sign(s) for s in range(2000)]
    assert set(signs) == {-1, 1} and abs(sum(signs)) < 2000 * 0.06  # about half each (|z| < 2.7)
    assert [label_sign(s) for s in range(8)] == [label_sign(s) for s in range(8)]  # fixed, not drawn anew


def test_a_one_seed_report_says_not_enough_seeds_pairs_same_seeds_and_lists_skipped_claims():
    claims = [
        Claim(claim="m beats b", metric="final_accuracy", method="m", baseline="b"),
        Claim(claim="x beats b", metric="final_accuracy", method="x", baseline="b"),
        Claim(claim="m beats b off-policy", metric="final_accuracy", method="m", baseline="b", regime="off"),
    ]
    regime = {"m": {"seeds": [0], "final_accuracy": [0.6]}, "b": {"seeds": [0], "final_accuracy": [0.2]}}
    (r,) = evaluate_claims(claims, {"on": regime})
    # Both ran seed 0: paired (one seed is still a pair), and one seed gives no verdict.
    assert r["paired"] and r["seeds"] == [1, 1] and r["verdict"] == "not enough seeds" and r["ci95"] is None
    skipped = skipped_claims(claims, {"on": regime})
    assert skipped == [
        {"claim": "x beats b", "regime": "on", "reason": "'x' not run here (methods run: m, b)"},
        {
            "claim": "m beats b off-policy",
            "regime": "off",
            "reason": "regime 'off' is not in this report (regimes: on)",
        },
    ]
    text = claims_markdown([r], skipped)
    assert (
        "m vs b (1 seed, paired)" in text
        and "+0.4000 | n/a | n/a | n/a | n/a | n/a | **not enough seeds** (1 paired seed; a verdict needs 4" in text
    )
    assert "unpaired" not in text
    assert "Skipped claims (not tested):" in text and "- x beats b (regime on): 'x' not run here" in text
    # A seed whose run never evaluated (NaN) is left out of the pairs rather than poisoning the mean.
    nan = float("nan")
    regime5 = {
        "m": {"seeds": [0, 1, 2, 3, 4], "final_accuracy": [0.6, 0.6, nan, 0.6, 0.6]},
        "b": {"seeds": [0, 1, 2, 3, 4], "final_accuracy": [0.2, 0.2, 0.2, 0.2, 0.2]},
    }
    (r5,) = evaluate_claims(claims[:1], {"on": regime5})
    assert r5["seeds"] == [4, 4] and r5["paired"] and r5["difference"] == pytest.approx(0.4)
    assert r5["verdict"] == "no test" and r5["p"] is None  # every difference 0.4: zero spread, no test


def test_claims_are_evaluated_per_regime_on_synthetic_runs(tmp_path):
    path = tmp_path / "claims.yaml"
    path.write_text(
        "- {claim: B beats A, metric: final_accuracy, method: B, baseline: A, direction: higher}\n"
        "- {claim: C keeps entropy, metric: final_entropy, method: C, baseline: A, regime: r2}\n"
    )
    claims = load_claims(path)
    rng = random.Random(1)
    runs = lambda acc: [_rows([0.2, acc + rng.gauss(0, 0.01)]) for _ in range(5)]  # noqa: E731
    same = runs(0.3)  # r2: B and C are A's seeds exactly, no effect at all
    regimes = {
        "r1": per_seed({"A": runs(0.3), "B": runs(0.5)}),
        "r2": per_seed({"A": same, "B": list(reversed(same)), "C": same}),
    }
    results = evaluate_claims(claims, regimes)
    verdicts = {(r["claim"], r["regime"]): r["verdict"] for r in results}
    assert verdicts == {
        ("B beats A", "r1"): "supported",
        ("B beats A", "r2"): "inconclusive",
        ("C keeps entropy", "r2"): "no test",  # C is A's seeds exactly: every difference 0
    }


def test_seeds_shared_by_both_methods_are_paired_and_pairing_removes_the_seed_effect():
    # tether compare's design: seed k has the same warm start and data for every method. Here the
    # seed moves accuracy by 0.1-0.5 and the method adds 0.02 on every seed.
    seed_effect = [0.1, 0.5, 0.2, 0.4, 0.3]
    base = {"seeds": [0, 1, 2, 3, 4], "final_accuracy": seed_effect}
    order = [3, 0, 4, 1, 2]  # the method's runs listed in another order: aligned by seed, not position
    noise = [0.001, -0.002, 0.002, 0.0, -0.001]  # small against the seed effect, so that there is a spread
    method = {"seeds": order, "final_accuracy": [seed_effect[k] + 0.02 + noise[k] for k in order]}
    claim = Claim(claim="m beats b", metric="final_accuracy", method="m", baseline="b")
    (paired,) = evaluate_claims([claim], {"r": {"m": method, "b": base}})
    assert paired["paired"] and paired["verdict"] == "supported"
    assert paired["difference"] == pytest.approx(0.02) and paired["ci95"] == pytest.approx([0.02, 0.02], abs=0.004)
    unpaired = compare_values(method["final_accuracy"], base["final_accuracy"], "higher")
    assert unpaired.verdict == "inconclusive" and unpaired.difference == pytest.approx(0.02)
    # different seed sets cannot be paired: the unpaired interval is used and said so
    other = {"seeds": [5, 6, 7, 8, 9], "final_accuracy": method["final_accuracy"]}
    (r,) = evaluate_claims([claim], {"r": {"m": other, "b": base}})
    assert not r["paired"] and r["verdict"] == "inconclusive" and "unpaired" in claims_markdown([r])
    assert "5 seeds, paired" in claims_markdown([paired])


def test_a_method_given_extra_seeds_is_paired_over_the_seeds_both_ran_and_the_rest_are_counted():
    # a comparison extended for one pair of methods: the method ran seeds 0-7, the baseline 0-5
    seed_effect = [0.1, 0.5, 0.2, 0.4, 0.3, 0.6, 0.9, 0.0]
    base = {"seeds": list(range(6)), "final_accuracy": seed_effect[:6]}
    noise = [0.001, -0.002, 0.002, 0.0, -0.001, 0.0, 0.0]
    method = {"seeds": list(range(8)), "final_accuracy": [v + 0.02 + e for v, e in zip(seed_effect, noise)] + [-5.0]}
    claim = Claim(claim="m beats b", metric="final_accuracy", method="m", baseline="b")
    (r,) = evaluate_claims([claim], {"r": {"m": method, "b": base}})
    # seeds 6 and 7 (one of them wildly off) are left out: the difference is the method's 0.02
    assert r["paired"] and r["seeds"] == [6, 6] and r["left_out"] == 2 and r["verdict"] == "supported"
    assert r["difference"] == pytest.approx(0.02)
    assert "6 seeds, paired; 2 run by one side only left out" in claims_markdown([r])
    # too few shared seeds for a paired test (3 < MIN_SEEDS): unpaired over every value, said so
    few = {"seeds": [0, 1, 2, 10, 11, 12], "final_accuracy": [0.3, 0.4, 0.5, 0.3, 0.4, 0.5]}
    (u,) = evaluate_claims([claim], {"r": {"m": few, "b": base}})
    assert not u["paired"] and u["seeds"] == [6, 6] and u["left_out"] == 0 and "unpaired" in claims_markdown([u])


@pytest.mark.parametrize(
    "text, match",
    [
        ("- {claim: x, metric: final_acc, method: a, baseline: b}", "metric 'final_acc' is not one of"),
        ("- {claim: x, metric: auc, method: a, baseline: b, direction: up}", "direction 'up'"),
        ("- {claim: x, metric: auc, method: a}", "missing keys \\['baseline'\\]"),
        ("claim: x", "expected a YAML list"),
        ("- {claim: x, metric: entropy_half_step, method: a, baseline: b}", "cannot be tested: it is censored"),
        ("- {claim: x, metric: auc, method: a, baseline: b, unit: problem}", "unit 'problem' is refused"),
        ("{design: {looks: [4, 6]}}", "mapping with `claims:`"),
        ("{design: {looks: [2, 6]}, claims: []}", "looks must increase from at least 4"),
        ("{design: {looks: [4, 8], spending: obf}, claims: []}", "spending 'obf' is not one of"),
        ("{design: {looks: 9}, claims: []}", "looks must be a list"),
        ("{design: {looks: [4, 9], stop: 3}, claims: []}", "unknown keys \\['stop'\\]"),
    ],
)
def test_a_bad_claims_file_names_the_problem(tmp_path, text, match):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_claims(path)


def test_seeds_for_is_the_fewest_seeds_whose_detectable_difference_is_small_enough():
    from tether.reports.stats import paired_t, seeds_for

    def mde(sd, n):  # the paired test's detectable difference on n differences whose sample spread is exactly sd
        z = [k - (n - 1) / 2 for k in range(n)]
        scale = sd / math.sqrt(sum(x * x for x in z) / (n - 1))
        return paired_t([scale * x for x in z]).mde80

    assert seeds_for(0.0, 0.05) == 2
    for sd in (0.02, 0.04, 0.063):
        n = seeds_for(sd, 0.05)
        assert mde(sd, n) <= 0.05 + 1e-12
        assert n == 2 or mde(sd, n - 1) > 0.05  # not at fewer
    assert seeds_for(0.04, 0.05) == 8 and seeds_for(0.063, 0.05) == 15  # the binding study's spreads
    assert seeds_for(1.0, 0.05, most=10) == 11
    # planned at the level the claim is tested at (Holm's first step over six claims): more seeds (issue 48: 9 -> 14)
    assert seeds_for(0.045, 0.05) == 9 and seeds_for(0.045, 0.05, alpha=0.05 / 6) == 14
    with pytest.raises(ValueError, match="positive"):
        seeds_for(0.04, 0.0)
