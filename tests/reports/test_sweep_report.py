"""A comparison swept over one setting (issue 26's staleness sweep): claims about the change of a
metric from a reference regime (`relative_to`), the clipped-or-masked fraction that counts masking
methods too, the interval of a mean, and the report's table and plots against the setting."""

import json

import pytest
import yaml

from tether.reports.claims import METRICS, evaluate_claims, load_claims, mean_interval, skipped_claims
from tether.reports.report import write_report
from tether.reports.sweep import setting_axis
from tether.config.sections import Config
from tether.schema import to_dict


def _values(final, seeds=(0, 1, 2, 3, 4)):
    return {"seeds": list(seeds), "final_accuracy": list(final)}


def test_a_claim_relative_to_a_regime_compares_each_seeds_change_from_it(tmp_path):
    # Seed effects shared by both methods: s0 gives A and B the same per-seed values; at s16 A loses
    # 0.20 on every seed and B loses 0.05 (+-0.01), so B's change minus A's change is +0.15 on each
    # seed (the seed effect cancels twice), while B vs A at s16 alone is also +0.15.
    seed_effect = [0.30, 0.45, 0.38, 0.52, 0.41]
    jitter = [0.01, -0.01, 0.0, 0.01, -0.01]
    regimes = {
        "s0": {"A": _values(seed_effect), "B": _values(seed_effect)},
        "s16": {
            "A": _values([v - 0.20 for v in seed_effect]),
            "B": _values([v - 0.05 + j for v, j in zip(seed_effect, jitter)]),
        },
    }
    path = tmp_path / "claims.yaml"
    path.write_text("- {claim: B holds up, metric: final_accuracy, method: B, baseline: A, relative_to: s0}\n")
    (r,) = evaluate_claims(load_claims(path), regimes)  # s0 itself is not tested
    assert r["regime"] == "s16" and r["relative_to"] == "s0" and r["paired"] and r["seeds"] == [5, 5]
    assert r["difference"] == pytest.approx(0.15) and r["verdict"] == "supported"
    # the per-seed differences are 0.15 + jitter = 0.16, 0.14, 0.15, 0.16, 0.14: s = 0.01, se = 0.01 / sqrt(5),
    # t_{0.975,4} = 2.776445: 0.15 +- 0.0124167
    assert r["ci95"] == pytest.approx([0.1375833, 0.1624167], abs=1e-6)
    # B lost more than A instead: contradicted.
    regimes["s16"]["B"] = _values([v - 0.30 + j for v, j in zip(seed_effect, jitter)])
    (r,) = evaluate_claims(load_claims(path), regimes)
    assert r["difference"] == pytest.approx(-0.10) and r["verdict"] == "contradicted"


def test_a_claim_relative_to_a_regime_that_is_missing_is_listed_as_skipped(tmp_path):
    path = tmp_path / "claims.yaml"
    path.write_text(
        "- {claim: B holds up, metric: final_accuracy, method: B, baseline: A, relative_to: s0}\n"
        "- {claim: C holds up, metric: final_accuracy, method: C, baseline: A, relative_to: s16}\n"
    )
    claims = load_claims(path)
    regimes = {
        "s16": {"A": _values([0.3] * 5), "B": _values([0.4] * 5)},
        "s64": {"A": _values([0.3] * 5), "B": _values([0.4] * 5), "C": _values([0.4] * 5)},
    }
    assert evaluate_claims(claims, regimes) == []
    reasons = {s["claim"]: s["reason"] for s in skipped_claims(claims, regimes)}
    assert "regime 's0' is not in this report" in reasons["B holds up"]
    assert "'C (in s16)'" in reasons["C holds up"]


def test_constrained_frac_counts_clipped_and_masked_tokens():
    rows = [
        {"step": 1, "policy/clipfrac_low": 0.01, "policy/clipfrac_high": 0.02},
        {"step": 2, "policy/clipfrac_low": 0.0, "policy/clipfrac_high": 0.0, "m2po/masked_frac": 0.10},
        {"step": 3, "rollout_correction/masked_frac": 0.05, "policy/off_policy_masked_frac": 0.01},
        {"step": 4, "eval/accuracy": 0.5},
    ]  # an evaluation-only row is not a step of the update
    # (0.03 + 0.10 + 0.06) / 3 = 0.0633...
    assert METRICS["constrained_frac"](rows) == pytest.approx(0.19 / 3)
    assert METRICS["clipfrac"](rows[:2]) == pytest.approx(0.015)  # unchanged: clipping only


def test_mean_interval_is_students_and_none_under_4_values():
    assert mean_interval([0.1, 0.2, 0.3]) is None
    # mean 0.3, s = 0.158114, se = 0.0707107, t_{0.975,4} = 2.776445: 0.3 +- 0.196324
    assert mean_interval([0.1, 0.2, 0.3, 0.4, 0.5]) == pytest.approx((0.103676, 0.496324), abs=1e-6)
    assert mean_interval([0.2] * 4) == pytest.approx((0.2, 0.2))
    assert mean_interval([0.2, float("nan"), 0.2, 0.2, 0.2]) == pytest.approx((0.2, 0.2))


def test_setting_axis_is_the_one_numeric_setting_the_regimes_differ_in():
    base = {"trainer": {"staleness": 0, "lr": 5e-5}, "rollout": {"engine": "hf"}}
    stale = {"trainer": {"staleness": 16, "lr": 5e-5}, "rollout": {"engine": "hf"}}
    assert setting_axis({"s0": base, "s16": stale}) == ("trainer.staleness", {"s0": 0.0, "s16": 16.0})
    assert setting_axis({"s0": base}) is None  # one regime: nothing to put on an x-axis
    both = {"trainer": {"staleness": 16, "lr": 1e-4}, "rollout": {"engine": "hf"}}
    assert setting_axis({"s0": base, "x": both}) is None  # two settings differ
    vllm = {"trainer": {"staleness": 0, "lr": 5e-5}, "rollout": {"engine": "vllm"}}
    assert setting_axis({"s0": base, "v": vllm}) is None  # not numeric


def _fake_run(run, staleness, seed, acc):
    cfg = to_dict(Config())
    cfg["trainer"].update(staleness=staleness, seed=seed)
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = [
        {"step": 0, "eval/accuracy": 0.25},
        {"step": 1, "policy/clipfrac_low": 0.01 * (1 + staleness), "policy/clipfrac_high": 0.0, "policy/entropy": 1.0},
        {"step": 2, "eval/accuracy": acc, "policy/clipfrac_low": 0.0, "policy/clipfrac_high": 0.0},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_swept_report_has_a_table_and_plots_against_the_setting(tmp_path):
    regimes = {}
    for s in (0, 4):
        runs = []
        for method, acc in (("grpo", 0.40 - 0.02 * s), ("m2po", 0.40 - 0.005 * s)):
            for seed in range(4):
                run = tmp_path / f"s{s}" / method / f"seed{seed}"
                _fake_run(run, s, seed, acc + 0.01 * seed)
                runs.append(run)
        regimes[f"s{s}"] = runs
    report = write_report(regimes, tmp_path / "report").read_text()
    assert "## Against `trainer.staleness`" in report
    # grpo at s=4: 0.32 + 0.01 * seed over seeds 0..3, mean 0.335; its interval from 4 seeds
    assert "| grpo | 0.415 [" in report and "| 0.335 [" in report
    for name in ("final_accuracy", "auc", "constrained_frac"):
        png = tmp_path / "report" / "plots" / "against_staleness" / f"{name}.png"
        assert png.stat().st_size > 5000 and f"plots/against_staleness/{name}.png" in report
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["axis"] == {"setting": "trainer.staleness", "values": {"s0": 0.0, "s4": 4.0}}
