"""How much of a comparison's spread is the choice of held-out problems, from each run's per-problem outcomes.

Every held-out evaluation records, per problem, whether the greedy completion was correct (heldout.jsonl,
tether.records.runlog.heldout). An accuracy metric of a run is a mean over the P problems of a per-problem
contribution x_p: for final_accuracy, correct at the last evaluation; for auc, the evaluations' trapezoid weights
(those of claims.METRICS's auc) applied to each problem's correct-or-not at each evaluation. For a claim's pair of
methods on seed k, delta_kp = x_p(method, k) - x_p(baseline, k) and the seed's difference is d_k = mean_p delta_kp.
Decompose delta as seed + problem + residual (a two-way layout, K seeds x P problems, one value per cell):

    sigma_e^2 = sum_kp (delta_kp - mean_k. - mean_.p + mean_..)^2 / ((K - 1)(P - 1))
    noise     = sigma_e^2 / P           the variance d_k owes to which problems the held-out set holds (the
                                        seed x problem interaction: a problem one run solves and the other not)
    share     = noise / var_k(d_k)      of the spread the paired test sees
    var(P')   = var_k(d_k) - noise + noise * P / P'   the spread with P' problems (the seed's own part kept)

The problem main effect (mean_.p: a problem the method solves more often than the baseline on every seed) does
not enter var_k(d_k) with a fixed held-out set; it is what the difference is about. A larger held-out set buys
seeds at the rate the share says: at share s and P' = 4P, the variance falls by 3s/4, and the seeds a claim
needs with it (stats.seeds_for, at the claim's tested level) are reported beside today's.

Runs recorded before tether kept per-problem outcomes (no heldout.jsonl) are left out and said so.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, Optional, Sequence

from ..records.runlog import accuracy, heldout, read_metrics
from . import stats
from .family import label_sign

METRICS = ("final_accuracy", "auc")
"""The metrics that are means over held-out problems (the others are not decomposed)."""
FACTORS = (2, 4)
"""The larger held-out sets (times today's) the report prices."""


def contributions(run: Path, metric: str) -> Optional[tuple[list[str], list[float]]]:
    """(problem ids, x_p) of a run for `metric` (module docstring); None without per-problem outcomes for every
    evaluation the metric reads."""
    outcomes = heldout(run)
    evals = accuracy(read_metrics(run))
    if not evals or any(step not in outcomes for step, _ in evals):
        return None
    ids = outcomes[evals[-1][0]]["id"]
    if any(outcomes[step]["id"] != ids for step, _ in evals):
        return None
    if metric == "final_accuracy" or len(evals) < 2:
        return ids, [float(c) for c in outcomes[evals[-1][0]]["correct"]]
    span = evals[-1][0] - evals[0][0]
    weights = [0.0] * len(evals)  # trapezoids: each interval's half width to each end
    for i, ((s0, _), (s1, _)) in enumerate(zip(evals, evals[1:])):
        weights[i] += (s1 - s0) / 2 / span
        weights[i + 1] += (s1 - s0) / 2 / span
    cols = [outcomes[step]["correct"] for step, _ in evals]
    return ids, [sum(w * col[p] for w, col in zip(weights, cols)) for p in range(len(ids))]


def decompose(deltas: Sequence[Sequence[float]]) -> dict[str, float]:
    """{"total": var_k(d_k), "noise": sigma_e^2 / P, "share", "problems": P, "seeds": K} of a K x P table of
    per-problem differences (module docstring); K >= 2 and P >= 2."""
    k, p = len(deltas), len(deltas[0])
    if k < 2 or p < 2:
        raise ValueError(f"a decomposition needs 2 seeds and 2 problems or more, got {k} x {p}")
    row = [statistics.fmean(r) for r in deltas]
    col = [statistics.fmean(r[j] for r in deltas) for j in range(p)]
    grand = statistics.fmean(row)
    ss = sum((deltas[i][j] - row[i] - col[j] + grand) ** 2 for i in range(k) for j in range(p))
    noise = ss / ((k - 1) * (p - 1)) / p
    total = statistics.variance(row)
    return {
        "total": total,
        "noise": noise,
        "share": noise / total if total > 0 else math.nan,
        "problems": p,
        "seeds": k,
    }


def pair_noise(method_runs: dict[int, Path], baseline_runs: dict[int, Path], metric: str, sign=lambda s: 1):
    """The decomposition of a pair's differences on the seeds both ran, or (None, why)."""
    table = []
    for seed in sorted(set(method_runs) & set(baseline_runs)):
        a, b = contributions(method_runs[seed], metric), contributions(baseline_runs[seed], metric)
        if a is None or b is None:
            return None, "a run has no per-problem outcomes (heldout.jsonl: runs made before tether kept them)"
        if a[0] != b[0]:
            return None, f"seed {seed}: the two runs scored different held-out problems"
        table.append([sign(seed) * (x - y) for x, y in zip(a[1], b[1])])
    if len(table) < 2:
        return None, "fewer than 2 paired seeds"
    return decompose(table), ""


def noise_rows(results: Sequence[dict[str, Any]], runs: dict[str, dict[str, dict[int, Path]]]) -> list[dict]:
    """One row per claim or null-control result on an accuracy metric (`METRICS`) whose runs kept per-problem
    outcomes: its decomposition and what FACTORS times the problems would give. `runs`: {regime: {method:
    {seed: run dir}}}."""
    out = []
    for r in results:
        if r["metric"] not in METRICS or r.get("relative_to") or not r.get("paired") or r["regime"] not in runs:
            continue
        methods = runs[r["regime"]]
        if r["method"] not in methods or r["baseline"] not in methods:
            continue
        null = "claim" not in r
        sign = label_sign if null else (lambda s: 1)  # the null control's differences are signed as its test signs
        found, why = pair_noise(methods[r["method"]], methods[r["baseline"]], r["metric"], sign)
        row = {k: r.get(k) for k in ("claim", "regime", "metric", "method", "baseline", "alpha_tested")}
        row["null_control"] = null
        if found is None:
            out.append({**row, "why": why})
            continue
        row.update(found)
        level = r.get("alpha_tested") or stats.ALPHA
        row["larger"] = [
            {"factor": f, "sd": math.sqrt(max(found["total"] - found["noise"], 0.0) + found["noise"] / f)}
            for f in FACTORS
        ]
        row["sd"] = math.sqrt(found["total"])
        row["level"] = level
        out.append(row)
    return out


def seeds_at(row: dict, detect: float) -> dict[str, int]:
    """Seeds a single look needs to detect `detect` at the row's level, today and with FACTORS times the problems."""
    level = row["level"]
    out = {"today": stats.seeds_for(row["sd"], detect, most=500, alpha=level)}
    for entry in row["larger"]:
        out[f"{entry['factor']}x"] = stats.seeds_for(entry["sd"], detect, most=500, alpha=level)
    return out


def markdown(rows: Sequence[dict], detect: Optional[float]) -> str:
    """The section's table."""
    larger = " | ".join(f"sd with {f}x problems" for f in FACTORS)
    seeds = f" | seeds to detect {detect} (today, {', '.join(f'{f}x' for f in FACTORS)})" if detect else ""
    lines = [
        f"| test | metric | seeds x problems | sd of differences | noise sd (problems) | share | {larger}{seeds} |",
        "|---" * (6 + len(FACTORS) + bool(detect)) + "|",
    ]
    for r in rows:
        name = r.get("claim") or f"null control ({r['method']} vs {r['baseline']})"
        if "why" in r:
            lines.append(f"| {name} | {r['metric']} | {r['why']} |" + " |" * (4 + len(FACTORS) + bool(detect)))
            continue
        cells = " | ".join(f"{entry['sd']:.4f}" for entry in r["larger"])
        extra = ""
        if detect:
            n = seeds_at(r, detect)
            extra = " | " + ", ".join(str(v) for v in n.values())
        lines.append(
            f"| {name} | {r['metric']} | {r['seeds']} x {r['problems']} | {r['sd']:.4f} | "
            f"{math.sqrt(r['noise']):.4f} | "
            f"{100 * r['share']:.0f}% | {cells}{extra} |"
        )
    return "\n".join(lines)
