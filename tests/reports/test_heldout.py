"""Per-problem outcomes and what they measure (tether.reports.heldout): the held-out noise of a paired difference by
hand, a run's per-problem contributions to auc, and why a test that pools the problems of every seed is refused."""

from __future__ import annotations

import json
import math
import statistics

import numpy as np
import pytest

from tether.reports import stats
from tether.reports.heldout import contributions, decompose


def test_the_decomposition_by_hand():
    # 2 seeds x 3 problems of differences delta: row means 1/3 and 2/3, column means 0.5, 0.5, 0.5, grand mean 0.5
    deltas = [[1, 0, 0], [0, 1, 1]]
    # residuals delta - row - col + grand: row 0: (1 - 1/3, 0 - 1/3, 0 - 1/3) = (2/3, -1/3, -1/3); row 1 the negatives
    # sum of squares = 2 * (4/9 + 1/9 + 1/9) = 4/3; over (K - 1)(P - 1) = 2: sigma_e^2 = 2/3; noise = 2/3 / 3 = 2/9
    out = decompose(deltas)
    assert out["noise"] == pytest.approx(2 / 9)
    # var_k(d_k) of (1/3, 2/3) = 1/18
    assert out["total"] == pytest.approx(1 / 18) and out["share"] == pytest.approx(4.0)
    assert out["problems"] == 3 and out["seeds"] == 2
    with pytest.raises(ValueError, match="2 seeds and 2 problems"):
        decompose([[1, 0]])


def test_a_runs_contributions_to_auc_are_its_evaluations_trapezoid_weights(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": 0, "eval/accuracy": 0.5}, {"step": 2, "eval/accuracy": 0.5}, {"step": 6, "eval/accuracy": 1.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = [
        {"step": 0, "id": ["a", "b"], "correct": [1, 0]},
        {"step": 2, "id": ["a", "b"], "correct": [0, 1]},
        {"step": 6, "id": ["a", "b"], "correct": [1, 1]},
    ]
    (run / "heldout.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    ids, x = contributions(run, "auc")
    # span 6; weights: step 0 gets 2/2/6 = 1/6, step 2 gets (2 + 4)/2/6 = 1/2, step 6 gets 4/2/6 = 1/3
    assert ids == ["a", "b"] and x == pytest.approx([1 / 6 + 1 / 3, 1 / 2 + 1 / 3])
    # their mean is the run's auc: (0.5 + 0.5) / 2 * 2 / 6 + (0.5 + 1.0) / 2 * 4 / 6 = 1/6 + 1/2 = 2/3
    assert statistics.fmean(x) == pytest.approx(2 / 3)
    assert contributions(run, "final_accuracy")[1] == [1.0, 1.0]
    (run / "heldout.jsonl").write_text(json.dumps(lines[0]) + "\n")  # an evaluation without outcomes
    assert contributions(run, "auc") is None


def _null_runs(rng, seeds: int, problems: int = 200, seed_sd: float = 0.08, base: float = 0.6) -> np.ndarray:
    """(seeds, problems) 0/1 outcomes of one method: each seed's accuracy moves by a seed effect (its initial model,
    data and samples), each problem is solved with that seed's probability."""
    p = np.clip(base + rng.normal(0, seed_sd, seeds), 0.01, 0.99)
    return (rng.random((seeds, problems)) < p[:, None]).astype(float)


def test_a_test_pooling_the_problems_of_every_seed_calls_a_difference_where_there_is_none():
    """Why tether refuses a test that pools problems and ignores seeds (claims.UNIT_REFUSED): the problems a run
    solves move together with its seed, so seeds x problems outcomes are not independent. With no true difference and
    a seed spread of 0.08 (the tiny model's was 0.098 over its A/A runs), the pooled two-proportion z-test over 9
    seeds x 200 problems per method calls one in about half of the comparisons; Welch's t over the seeds' accuracies
    (tether's unpaired test) holds its 5%."""
    rng = np.random.default_rng(11)
    pooled = welch = 0
    trials = 2000
    for _ in range(trials):
        a, b = _null_runs(rng, 9), _null_runs(rng, 9)
        pa, pb = a.mean(), b.mean()
        pool = (pa + pb) / 2
        z = (pa - pb) / math.sqrt(2 * pool * (1 - pool) / a.size)
        pooled += abs(z) > 1.959964
        welch += stats.welch_t(list(a.mean(1)), list(b.mean(1))).p < 0.05
    assert pooled / trials > 0.3
    assert welch / trials <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / trials)
