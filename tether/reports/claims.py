"""Claims about methods, tested on a comparison's runs as one family with its null control (tether.reports.family:
the t-test or a design's looks, Holm's correction, the exact sign-flip p beside).

A claims file (YAML) is a list of claims, or a mapping with that list under `claims:` and a `design:` fixed before
the first look (tether.reports.sequential; docs/compare.md):

    design:
      looks: [4, 6, 9]              # seeds at each look; the last is the most any claim gets
      spending: obrien_fleming      # or pocock
      test: t                       # or combination (later stages' sizes may change)
      family: holm                  # or primary_first (secondary claims once every primary one is decided)
      detect: 0.05                  # the difference the study is sized for (planning)
    claims:
      - claim: "ATR-GRPO's KL3 clip improves final accuracy over GRPO"
        metric: final_accuracy      # one of METRICS but CENSORED
        method: atr_grpo
        baseline: grpo
        direction: higher           # higher or lower is better for the claim
        regime: off_policy          # optional: only this regime (default: every regime)
        relative_to: s0             # optional: the change of the metric from this regime, per seed
        primary: true               # optional (family: primary_first)

With `relative_to: R`, each seed's value is metric(this regime) - metric(regime R) of the same
method and seed (tether compare gives seed k of every regime the same initial model and data
order), so the claim compares how much each method lost or gained from R: "holds accuracy better
as staleness grows" is final_accuracy relative_to the on-policy regime, method higher than
baseline. It is a paired difference of differences; regime R itself is not tested.

For each regime, with a_1..a_n the method's per-seed values and b_1..b_m the baseline's, the values are paired by
seed when both methods ran the same seeds (tether compare's design: seed k of every method has the same initial
model, data order and sampling stream); when one side ran more seeds, paired over the seeds both ran if they share
at least MIN_SEEDS, the others left out and counted ("6 seeds, paired; 2 run by one side only left out"); unpaired
(Welch's t, no design) otherwise. The seed is the unit of replication: a test that pools the held-out problems of
every seed as independent outcomes is refused (`unit`, tests/reports/test_heldout.py shows its false verdicts).
The tests, verdicts and fields are tether.reports.family's.

A claim whose method or baseline was not run in a regime (or whose regime is not reported) is
listed as skipped, with the reason (`skipped_claims`), never dropped without a word.

Per-seed metrics (one value per run, from its metrics.jsonl; `METRICS`):
final_accuracy and best_accuracy (held-out greedy), auc (the mean held-out accuracy over the
run, trapezoids over the evaluation steps divided by their span: it averages over the run's
evaluations, so it carries less evaluation noise than one final value), max_drop (the largest fall of
held-out accuracy between consecutive evaluations: stability), final_entropy (policy entropy,
mean of the last 10% of steps), entropy_retained (the mean policy entropy over the run divided by the
first step's: how much of it the run kept, measured on every run), entropy_half_step (the first step whose
entropy is below half the first step's; the run's last step + 1 when it never falls that far: censored, so kept
for the tables and refused in a claim, CENSORED), clipfrac (the mean over steps of clipfrac_low + clipfrac_high),
constrained_frac (the mean over steps of the fraction of tokens a trust region clipped or masked: clipfrac_low +
clipfrac_high + the masked fractions of M2PO, the rollout correction and the off-policy sequence mask, so that
methods that mask instead of clipping are counted too).

Why paired: the seed (its warm start, its data order) moves final accuracy by more than any
method does (seed spreads of 0.05-0.1 against method gaps of a few points), and it moves every
method the same way; pairing removes that shared part, the unpaired test keeps it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import yaml

from ..records.runlog import accuracy, series, tail_mean
from ..schema import ConfigError
from . import family, sequential, stats

DIRECTIONS = ("higher", "lower")
MIN_SEEDS = stats.MIN_SEEDS
NOT_ENOUGH = "not enough seeds"
NO_TEST = "no test"


# ---------------------------------------------------------------- per-run metrics


def _auc(rows: list[dict]) -> float:
    ev = accuracy(rows)
    if len(ev) < 2:
        return ev[0][1] if ev else float("nan")
    area = sum((s1 - s0) * (a0 + a1) / 2 for (s0, a0), (s1, a1) in zip(ev, ev[1:]))
    return area / (ev[-1][0] - ev[0][0])


def _max_drop(rows: list[dict]) -> float:
    ev = [a for _, a in accuracy(rows)]
    return max([0.0] + [a0 - a1 for a0, a1 in zip(ev, ev[1:])])


def _entropy_half_step(rows: list[dict]) -> float:
    ent = series(rows, "policy/entropy")
    if not ent:
        return float("nan")
    half = ent[0][1] / 2
    return float(next((s for s, v in ent if v < half), ent[-1][0] + 1))


def _entropy_retained(rows: list[dict]) -> float:
    ent = series(rows, "policy/entropy")
    if not ent or ent[0][1] <= 0:
        return float("nan")
    return statistics.fmean(v for _, v in ent) / ent[0][1]


CLIPPED = ("policy/clipfrac_low", "policy/clipfrac_high")
CONSTRAINED = (*CLIPPED, "m2po/masked_frac", "rollout_correction/masked_frac", "policy/off_policy_masked_frac")
"""The per-step fractions of tokens a trust region clipped or masked, summed by `constrained_frac`."""


def _mean_of_sum(rows: list[dict], keys: Sequence[str]) -> float:
    """The mean, over the steps that logged any of `keys`, of their sum (one not logged counts 0)."""
    vals = [sum(r.get(k) or 0.0 for k in keys) for r in rows if any(r.get(k) is not None for k in keys)]
    return statistics.fmean(vals) if vals else float("nan")


METRICS: dict[str, Callable[[list[dict]], float]] = {
    "final_accuracy": lambda rows: accuracy(rows)[-1][1] if accuracy(rows) else float("nan"),
    "best_accuracy": lambda rows: max((a for _, a in accuracy(rows)), default=float("nan")),
    "auc": _auc,
    "max_drop": _max_drop,
    "final_entropy": lambda rows: tail_mean(rows, "policy/entropy"),
    "entropy_half_step": _entropy_half_step,
    "entropy_retained": _entropy_retained,
    "clipfrac": lambda rows: _mean_of_sum(rows, CLIPPED),
    "constrained_frac": lambda rows: _mean_of_sum(rows, CONSTRAINED),
}
"""Per-run metrics (module docstring); a claim can name any but those in CENSORED."""
CENSORED = {
    "entropy_half_step": "it is censored: a run whose entropy never halves gets the last step + 1, a bound the "
    "t-test would treat as a measurement (too liberal with many such runs); test entropy_retained instead, the mean "
    "entropy over the run relative to the first step's, which every run measures"
}
"""Metrics kept per run for the tables but refused in a claim, with why."""


# ---------------------------------------------------------------- statistics


@dataclass(frozen=True)
class Comparison:
    difference: float
    ci95: Optional[tuple[float, float]]
    """None when there are too few seeds for a test (`verdict` says why)."""
    mde80: Optional[float]
    """The smallest true difference the test would detect at 5% with 80% power (tether.reports.stats)."""
    p: Optional[float]
    """The two-sided p-value, before any correction for the other claims."""
    verdict: str
    why: str = ""
    """Why there is no verdict ('' when there is one)."""
    test: str = ""
    """"paired t" or "Welch t"."""


def verdict_of(difference: float, p: float, direction: str, alpha: float = stats.ALPHA) -> str:
    """supported / contradicted when p < alpha, by the side of 0 the difference lies on; else inconclusive."""
    if p >= alpha or difference == 0:
        return "inconclusive"
    sign = 1 if direction == "higher" else -1
    return "supported" if sign * difference > 0 else "contradicted"


def compare_values(
    a: Sequence[float], b: Sequence[float], direction: str = "higher", paired: bool = False
) -> Comparison:
    """mean(a) - mean(b), its t-test and the (uncorrected) verdict for a claim that `a` is `direction` than `b`
    (module docstring). `paired`: a[k] and b[k] come from the same seed."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    a, b = [float(x) for x in a], [float(x) for x in b]
    if not a or not b:
        raise ValueError("each side needs at least one value")
    if paired and len(a) != len(b):
        raise ValueError(f"paired values need as many of each, got {len(a)} and {len(b)}")
    difference = statistics.fmean(a) - statistics.fmean(b)
    if min(len(a), len(b)) < MIN_SEEDS:
        have = f"{len(a)} paired seed{'s' * (len(a) != 1)}" if paired else f"{len(a)} and {len(b)} seeds"
        why = (
            f"{have}; a verdict needs {MIN_SEEDS}{' shared' if paired else ' per method'}: with fewer the t-test's "
            "power is negligible"
        )
        return Comparison(difference, None, None, None, NOT_ENOUGH, why)
    t = stats.paired_t([x - y for x, y in zip(a, b)]) if paired else stats.welch_t(a, b)
    if t.se == 0:
        return Comparison(difference, None, None, None, NO_TEST, "zero spread: every difference is equal")
    return Comparison(
        difference,
        t.ci95,
        t.mde80,
        t.p,
        verdict_of(difference, t.p, direction),
        test="paired t" if paired else "Welch t",
    )


def mean_interval(values: Sequence[float]) -> Optional[tuple[float, float]]:
    """The 95% Student-t interval of the mean of `values` (NaN left out); None with fewer than MIN_SEEDS."""
    vals = [float(v) for v in values if not math.isnan(v)]
    if len(vals) < MIN_SEEDS:
        return None
    se = statistics.stdev(vals) / math.sqrt(len(vals))
    half = stats.t_quantile(1 - stats.ALPHA / 2, len(vals) - 1) * se
    mean = statistics.fmean(vals)
    return mean - half, mean + half


# ---------------------------------------------------------------- claims


@dataclass(frozen=True)
class Claim:
    claim: str
    metric: str
    method: str
    baseline: str
    direction: str = "higher"
    regime: Optional[str] = None
    relative_to: Optional[str] = None
    """A regime: the claim is about each seed's change of the metric from it (module docstring)."""
    unit: str = "seed"
    """The unit of replication: the seed, the only one accepted (`UNIT_REFUSED`)."""
    primary: bool = True
    """Under a design's `family: primary_first`, secondary claims (False) are tested once every primary one is
    decided; otherwise every claim is in one Holm family."""


UNIT_REFUSED = (
    "a test that pools the held-out problems of every seed treats each seed x problem outcome as independent, but "
    "the problems a run solves move together with its seed (its initial model, data and samples): with no true "
    "difference such a test calls one in far more than 5% of comparisons (tests/reports/test_heldout.py). The seed "
    "is the unit: use unit: seed (the default), and a larger held-out set to lower each seed's noise"
)

DESIGN_KEYS = ("looks", "alpha", "spending", "test", "family", "detect")


def _read(path: str | Path) -> Any:
    try:
        return yaml.safe_load(Path(path).read_text())
    except OSError as err:
        raise ConfigError(f"claims file {path}: {err.strerror}") from None


def load_design(path: str | Path) -> Optional[sequential.Design]:
    """The `design:` of a claims file (tether.reports.sequential), checked with the fix named; None when the file is
    a plain list of claims (one look at the seeds there are)."""
    raw = _read(path)
    if not isinstance(raw, dict) or raw.get("design") is None:
        return None
    entry = raw["design"]
    where = f"claims file {path}, design"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected a mapping with {', '.join(DESIGN_KEYS)}")
    unknown = set(entry) - set(DESIGN_KEYS)
    if unknown or "looks" not in entry:
        raise ConfigError(
            f"{where}: unknown keys {sorted(unknown)}{', missing key looks' if 'looks' not in entry else ''} "
            f"(keys: {', '.join(DESIGN_KEYS)})"
        )
    if not isinstance(entry["looks"], list):
        raise ConfigError(f"{where}: looks must be a list of seed counts, for example [4, 6, 9]")
    try:
        return sequential.Design(**{**entry, "looks": tuple(entry["looks"])})
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{where}: {err}") from None


def load_claims(path: str | Path) -> list[Claim]:
    """Claims from a YAML list, or from the `claims:` of a mapping that also holds a `design:` (`load_design`); each
    entry is checked (metric and direction names) with the fix named."""
    raw = _read(path)
    if isinstance(raw, dict):
        unknown = set(raw) - {"design", "claims"}
        if unknown or not isinstance(raw.get("claims"), list):
            raise ConfigError(
                f"claims file {path}: expected a YAML list of claims, or a mapping with `claims:` (that list) and "
                f"`design:`{f' (unknown keys {sorted(unknown)})' if unknown else ''}"
            )
        load_design(path)
        raw = raw["claims"]
    if not isinstance(raw, list):
        raise ConfigError(f"claims file {path}: expected a YAML list of claims")
    claims = []
    for i, entry in enumerate(raw):
        where = f"claims file {path}, entry {i + 1}"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: expected a mapping with claim, metric, method, baseline, direction")
        unknown = set(entry) - set(Claim.__dataclass_fields__)
        missing = {"claim", "metric", "method", "baseline"} - set(entry)
        if unknown or missing:
            raise ConfigError(f"{where}: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}")
        c = Claim(**entry)
        if c.unit != "seed":
            raise ConfigError(f"{where}: unit {c.unit!r} is refused: {UNIT_REFUSED}")
        if c.metric in CENSORED:
            raise ConfigError(f"{where}: metric {c.metric!r} cannot be tested: {CENSORED[c.metric]}")
        if c.metric not in METRICS:
            testable = [m for m in METRICS if m not in CENSORED]
            raise ConfigError(f"{where}: metric {c.metric!r} is not one of {', '.join(testable)}")
        if c.direction not in DIRECTIONS:
            raise ConfigError(f"{where}: direction {c.direction!r} is not one of {', '.join(DIRECTIONS)}")
        claims.append(c)
    return claims


def per_seed(runs: dict[str, list[list[dict]]]) -> dict[str, dict[str, list[float]]]:
    """{method: {metric: [one value per seed]}} from {method: [metrics rows of each seed]}."""
    return {
        method: {name: [fn(rows) for rows in seeds] for name, fn in METRICS.items()} for method, seeds in runs.items()
    }


def evaluate_claims(
    claims: Sequence[Claim],
    regimes: dict[str, dict[str, dict[str, list[float]]]],
    design: Optional[sequential.Design] = None,
    controls: Sequence[tuple[str, str]] = (),
) -> list[dict]:
    """Each claim in each regime it names (every regime by default) that holds both methods, tested as one family
    with the null control's tests (`judge`); the claims' results, in order."""
    return judge(claims, regimes, design, controls)[0]


def judge(
    claims: Sequence[Claim],
    regimes: dict[str, dict[str, dict[str, list[float]]]],
    design: Optional[sequential.Design] = None,
    controls: Sequence[tuple[str, str]] = (),
    p_values: bool = True,
) -> tuple[list[dict], list[dict]]:
    """The claims' results and the null control's, tested as one family (tether.reports.family): at one look, or
    at the looks of `design`. `controls`: (baseline, control) labels of each null-control pair; it is tested on the
    metrics the claims name (NULL_METRICS without claims), a test primary when a primary claim names its metric.
    Claims that cannot be tested anywhere are `skipped_claims`. `p_values` False: the verdicts alone
    (`family.judge`)."""
    pairs = [p for c in claims for p in _claim_pairs(c, regimes)]
    named = [c.metric for c in claims if c.relative_to is None] or list(NULL_METRICS)
    primary = {c.metric for c in claims if c.primary} or set(named)
    for baseline, control in controls:
        for name, methods in regimes.items():
            if baseline not in methods or control not in methods:
                continue
            for metric in dict.fromkeys(named):
                a, b, seeds, paired = aligned_by_seed(methods[control], methods[baseline], metric)
                fields = {"regime": name, "metric": metric, "method": control, "baseline": baseline}
                left = _left_out(methods[control], methods[baseline], paired)
                pairs.append(family.Pair(fields, a, b, seeds, paired, left, True, metric in primary))
    family.judge(pairs, design, p_values=p_values)
    rows = []
    for p in pairs:
        r = {**p.fields, **p.result, "seeds": [len(p.a), len(p.b)], "paired": p.paired, "left_out": p.left_out}
        if p.null and r["verdict"] in ("supported", "contradicted"):
            r["verdict"] = "false verdict"
        rows.append(r)
    return [r for r, p in zip(rows, pairs) if not p.null], [r for r, p in zip(rows, pairs) if p.null]


def _claim_pairs(c: Claim, regimes: dict[str, dict[str, dict[str, list[float]]]]) -> list[family.Pair]:
    """The claim's pair in each regime it applies to that holds both methods (and its `relative_to` regime)."""
    out = []
    for name, methods in regimes.items():
        if (c.regime is not None and c.regime != name) or c.method not in methods or c.baseline not in methods:
            continue
        if c.relative_to is not None:
            if name == c.relative_to or c.relative_to not in regimes:
                continue
            base = regimes[c.relative_to]
            if c.method not in base or c.baseline not in base:
                continue
            mine = _change(methods[c.method], base[c.method], c.metric)
            theirs = _change(methods[c.baseline], base[c.baseline], c.metric)
        else:
            mine, theirs = methods[c.method], methods[c.baseline]
        a, b, seeds, paired = aligned_by_seed(mine, theirs, c.metric)
        fields = {
            "claim": c.claim,
            "regime": name,
            "relative_to": c.relative_to,
            "metric": c.metric,
            "method": c.method,
            "baseline": c.baseline,
            "direction": c.direction,
            "primary": c.primary,
        }
        left = _left_out(mine, theirs, paired)
        out.append(family.Pair(fields, a, b, seeds, paired, left, False, c.primary, c.direction))
    return out


NULL_METRICS = ("final_accuracy", "auc")
"""Metrics a null control is tested on when no claim names one."""


def _change(values: dict[str, list], base: dict[str, list], metric: str) -> dict[str, list]:
    """{metric: [value - base value of the same seed], seeds: [...]} over the seeds both regimes ran."""
    by_seed = dict(zip(base["seeds"], base[metric]))
    pairs = [(s, v - by_seed[s]) for s, v in zip(values["seeds"], values[metric]) if s in by_seed]
    return {"seeds": [s for s, _ in pairs], metric: [d for _, d in pairs]}


def skipped_claims(claims: Sequence[Claim], regimes: dict[str, dict[str, Any]]) -> list[dict]:
    """{claim, regime, reason} for each claim that `evaluate_claims` could not test: its regime (or the
    regime it is relative to) is not reported, or its method or baseline was not run in a regime it
    applies to."""
    out = []
    for c in claims:
        absent = [r for r in (c.regime, c.relative_to) if r is not None and r not in regimes]
        if absent:
            out.append(
                {
                    "claim": c.claim,
                    "regime": c.regime or "every",
                    "reason": f"regime {absent[0]!r} is not in this report (regimes: {', '.join(regimes)})",
                }
            )
            continue
        for name, methods in regimes.items():
            if name == c.relative_to:
                continue
            missing = [m for m in (c.method, c.baseline) if m not in methods]
            if c.relative_to is not None:
                missing += [
                    f"{m} (in {c.relative_to})"
                    for m in (c.method, c.baseline)
                    if m not in regimes[c.relative_to] and m in methods
                ]
            if (c.regime is None or c.regime == name) and missing:
                out.append(
                    {
                        "claim": c.claim,
                        "regime": name,
                        "reason": f"{' and '.join(repr(m) for m in missing)} not run here "
                        f"(methods run: {', '.join(methods)})",
                    }
                )
    return out


def aligned(method: dict[str, list], baseline: dict[str, list], metric: str) -> tuple[list, list, bool]:
    """The two methods' values of `metric` (`aligned_by_seed` without the seeds)."""
    a, b, _, paired = aligned_by_seed(method, baseline, metric)
    return a, b, paired


def aligned_by_seed(
    method: dict[str, list], baseline: dict[str, list], metric: str
) -> tuple[list[float], list[float], list[int], bool]:
    """The two methods' values of `metric`, without the seeds where it is NaN (a run that never evaluated) or
    missing (a summary written before the metric existed), paired in seed order when both ran the same seeds, one
    seed included, or when they share at least MIN_SEEDS seeds (the seeds only one side ran are then left out: the
    module docstring); with the seed of each pair. Unpaired, every value as given and no seeds, otherwise."""
    if metric not in method or metric not in baseline:
        return [], [], [], False
    a, b = method[metric], baseline[metric]
    sa, sb = method.get("seeds"), baseline.get("seeds")
    unique = sa is not None and sb is not None and len(set(sa)) == len(sa) and len(set(sb)) == len(sb)
    shared = set(sa) & set(sb) if unique else set()
    if not unique or (shared != set(sa) | set(sb) and len(shared) < MIN_SEEDS):
        return [x for x in a if not math.isnan(x)], [y for y in b if not math.isnan(y)], [], False
    by_a, by_b = dict(zip(sa, a)), dict(zip(sb, b))
    seeds = [s for s in sorted(shared) if not (math.isnan(by_a[s]) or math.isnan(by_b[s]))]
    return [by_a[s] for s in seeds], [by_b[s] for s in seeds], seeds, True


def _left_out(method: dict[str, list], baseline: dict[str, list], paired: bool) -> int:
    """How many seeds a paired test left out because only one side ran them (`aligned`)."""
    return len(set(method["seeds"]) ^ set(baseline["seeds"])) if paired else 0
