"""Claims about methods, tested on a comparison's runs: difference of means over seeds, a t-test
(tether.reports.stats: its p-value, 95% interval and detectable difference), Holm's correction over the
claims tested together, and a verdict.

A claim (YAML, `claims/*.yaml`) says that `method` beats `baseline` on `metric` in `direction`:

    - claim: "ATR-GRPO's KL3 clip improves final accuracy over GRPO"
      metric: final_accuracy        # one of METRICS
      method: atr_grpo
      baseline: grpo
      direction: higher             # higher or lower is better for the claim
      regime: off_policy            # optional: only this regime (default: every regime)
      relative_to: s0               # optional: the change of the metric from this regime, per seed

With `relative_to: R`, each seed's value is metric(this regime) - metric(regime R) of the same
method and seed (tether compare gives seed k of every regime the same initial model and data
order), so the claim compares how much each method lost or gained from R: "holds accuracy better
as staleness grows" is final_accuracy relative_to the on-policy regime, method higher than
baseline. It is a paired difference of differences; regime R itself is not tested.

For each regime, with a_1..a_n the method's per-seed values and b_1..b_m the baseline's:

    difference = mean(a) - mean(b)
    test       = paired, when both methods ran the same seeds (tether compare's design: seed k of every
                 method has the same initial model and data order): Student's t on d_k = a_k - b_k;
                 when one side ran more seeds (a method given extra seeds), paired over the seeds both
                 ran if they share at least MIN_SEEDS, the others left out and counted ("6 seeds,
                 paired; 2 run by one side only left out"); unpaired otherwise: Welch's t over every
                 value (tether.reports.stats, which argues the choice)
    p          = its two-sided p-value; ci95 its 95% interval; mde80 the smallest true difference it
                 would detect at 5% with 80% power, given the observed spread
    p_holm     = p adjusted by Holm's method over every claim-and-regime tested in the same report
                 (the family), so that the chance of any false verdict in the report is at most 5%
    verdict    = supported if p_holm < 0.05 and the difference lies on the claimed side of 0,
                 contradicted if p_holm < 0.05 on the other side, inconclusive otherwise;
                 "not enough seeds" (and no test) when a side has fewer than MIN_SEEDS = 4 values
                 (paired: fewer than 4 shared seeds): below 4 the t-test's power is negligible and it
                 rests on the normality of one or two degrees of freedom (tether.reports.stats)

A claim whose method or baseline was not run in a regime (or whose regime is not reported) is
listed as skipped, with the reason (`skipped_claims`), never dropped without a word.

Per-seed metrics (one value per run, from its metrics.jsonl; `METRICS`):
final_accuracy and best_accuracy (held-out greedy), auc (the mean held-out accuracy over the
run, trapezoids over the evaluation steps divided by their span: it averages over the run's
evaluations, so it carries less evaluation noise than one final value), max_drop (the largest fall of
held-out accuracy between consecutive evaluations: stability), final_entropy (policy entropy,
mean of the last 10% of steps), entropy_half_step (the first step whose entropy is below half
the first step's: collapse; the run's last step + 1 when it never falls that far), clipfrac (the
mean over steps of clipfrac_low + clipfrac_high), constrained_frac (the mean over steps of the
fraction of tokens a trust region clipped or masked: clipfrac_low + clipfrac_high + the masked
fractions of M2PO, the rollout correction and the off-policy sequence mask, so that methods that
mask instead of clipping are counted too).

Why paired: the seed (its warm start, its data order) moves final accuracy by more than any
method does (seed spreads of 0.05-0.1 against method gaps of a few points), and it moves every
method the same way; pairing removes that shared part, the unpaired test keeps it.

A null control (`tether compare --null-control`) is the baseline run again from the same initial models
and data with an independent sampling stream: `null_control` tests it against the baseline like a claim,
outside the Holm family, where any verdict but "inconclusive" is a false one.
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
from . import stats

DIRECTIONS = ("higher", "lower")
MIN_SEEDS = 4
"""The fewest values per side (paired: shared seeds) a verdict needs (module docstring)."""
NOT_ENOUGH = "not enough seeds"


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
    "clipfrac": lambda rows: _mean_of_sum(rows, CLIPPED),
    "constrained_frac": lambda rows: _mean_of_sum(rows, CONSTRAINED),
}
"""Per-run metrics a claim can name (module docstring)."""


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


def load_claims(path: str | Path) -> list[Claim]:
    """Claims from a YAML list; each entry is checked (metric and direction names) with the fix named."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as err:
        raise ConfigError(f"claims file {path}: {err.strerror}") from None
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
        if c.metric not in METRICS:
            raise ConfigError(f"{where}: metric {c.metric!r} is not one of {', '.join(METRICS)}")
        if c.direction not in DIRECTIONS:
            raise ConfigError(f"{where}: direction {c.direction!r} is not one of {', '.join(DIRECTIONS)}")
        claims.append(c)
    return claims


def per_seed(runs: dict[str, list[list[dict]]]) -> dict[str, dict[str, list[float]]]:
    """{method: {metric: [one value per seed]}} from {method: [metrics rows of each seed]}."""
    return {
        method: {name: [fn(rows) for rows in seeds] for name, fn in METRICS.items()} for method, seeds in runs.items()
    }


def evaluate_claims(claims: Sequence[Claim], regimes: dict[str, dict[str, dict[str, list[float]]]]) -> list[dict]:
    """Each claim in each regime it names (every regime by default) that holds both methods, with Holm's
    correction over all of them (the family); the others are `skipped_claims`."""
    out = []
    for c in claims:
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
            a, b, paired = aligned(mine, theirs, c.metric)
            if not a or not b:
                r = Comparison(float("nan"), None, None, None, NOT_ENOUGH, f"no run has a value of {c.metric}")
            else:
                r = compare_values(a, b, c.direction, paired=paired)
            out.append(
                {
                    "claim": c.claim,
                    "regime": name,
                    "relative_to": c.relative_to,
                    "metric": c.metric,
                    "method": c.method,
                    "baseline": c.baseline,
                    "direction": c.direction,
                    **_fields(r),
                    "seeds": [len(a), len(b)],
                    "paired": paired,
                    "left_out": _left_out(mine, theirs, paired),
                }
            )
    return with_holm(out)


def _fields(r: Comparison) -> dict:
    return {
        "difference": r.difference,
        "ci95": list(r.ci95) if r.ci95 else None,
        "mde80": r.mde80,
        "p": r.p,
        "test": r.test,
        "verdict": r.verdict,
        "why": r.why,
    }


def with_holm(results: list[dict]) -> list[dict]:
    """The results with `p_holm` (Holm over those that were tested: the family) and the verdict it gives."""
    tested = [r for r in results if r["p"] is not None]
    for r, adjusted in zip(tested, stats.holm([r["p"] for r in tested])):
        r["p_holm"], r["family"] = adjusted, len(tested)
        r["verdict"] = verdict_of(r["difference"], adjusted, r["direction"])
    for r in results:
        r.setdefault("p_holm", None)
        r.setdefault("family", len(tested))
    return results


NULL_METRICS = ("final_accuracy", "auc")
"""Metrics a null control is always tested on, besides those the claims name."""


def null_control(
    regimes: dict[str, dict[str, dict[str, list[float]]]], baseline: str, control: str, metrics: Sequence[str] = ()
) -> list[dict]:
    """The A/A pair (`control`: `baseline` rerun with an independent sampling stream) tested as a claim on each
    metric of NULL_METRICS and `metrics`, in every regime that holds both, at 5% each and outside any family:
    a verdict other than "inconclusive" is a false one, and their share is the control's false-verdict rate."""
    out = []
    for name, methods in regimes.items():
        if baseline not in methods or control not in methods:
            continue
        for metric in dict.fromkeys([*NULL_METRICS, *metrics]):
            a, b, paired = aligned(methods[control], methods[baseline], metric)
            r = (
                compare_values(a, b, "higher", paired=paired)
                if a and b
                else Comparison(float("nan"), None, None, None, NOT_ENOUGH, f"no run has a value of {metric}")
            )
            fields = _fields(r)
            if r.p is not None:  # two-sided: either side is a false verdict
                fields["verdict"] = "false verdict" if r.p < stats.ALPHA else "inconclusive"
            out.append(
                {
                    "regime": name,
                    "metric": metric,
                    "method": control,
                    "baseline": baseline,
                    "seeds": [len(a), len(b)],
                    "paired": paired,
                    "left_out": _left_out(methods[control], methods[baseline], paired),
                    **fields,
                }
            )
    return out


def null_markdown(results: Sequence[dict[str, Any]]) -> str:
    """The null control's table and the false-verdict rate it shows."""
    lines = [
        "| regime | metric | control vs baseline | difference | 95% CI | p | detectable (80% power) | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ci, p, mde = _cells(r)
        lines.append(
            f"| {r['regime']} | {r['metric']} | {r['method']} vs {r['baseline']} ({_seeds_text(r)}) | "
            f"{r['difference']:+.4f} | {ci} | {p} | {mde} | **{r['verdict']}** |"
        )
    tested = [r for r in results if r["p"] is not None]
    false = sum(r["verdict"] == "false verdict" for r in tested)
    lines += ["", f"False verdicts in the null control: {false} of {len(tested)} tests at 5% each."]
    return "\n".join(lines)


def _cells(r: dict[str, Any]) -> tuple[str, str, str]:
    if r["ci95"] is None:
        return "n/a", "n/a", "n/a"
    lo, hi = r["ci95"]
    return f"[{lo:+.4f}, {hi:+.4f}]", _p_text(r["p"]), f"{r['mde80']:.4f}"


def _p_text(p: float) -> str:
    return f"{p:.3f}" if p >= 0.001 else "<0.001"


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
    """The two methods' values of `metric`, without the seeds where it is NaN (a run that never
    evaluated), in seed order and paired when both ran the same seeds, one seed included, or when they
    share at least MIN_SEEDS seeds (the seeds only one side ran are then left out: the module docstring);
    each method's "seeds" list gives the seed of each value. Unpaired, every value as given, otherwise."""
    a, b = method[metric], baseline[metric]
    sa, sb = method.get("seeds"), baseline.get("seeds")
    unique = sa is not None and sb is not None and len(set(sa)) == len(sa) and len(set(sb)) == len(sb)
    shared = set(sa) & set(sb) if unique else set()
    if not unique or (shared != set(sa) | set(sb) and len(shared) < MIN_SEEDS):
        return [x for x in a if not math.isnan(x)], [y for y in b if not math.isnan(y)], False
    by_b = dict(zip(sb, b))
    pairs = [(x, by_b[s]) for s, x in zip(sa, a) if s in shared and not (math.isnan(x) or math.isnan(by_b[s]))]
    return [x for x, _ in pairs], [y for _, y in pairs], True


def claims_markdown(results: Sequence[dict[str, Any]], skipped: Sequence[dict[str, Any]] = ()) -> str:
    lines = [
        "| claim | regime | metric | method vs baseline | difference | 95% CI | p | p (Holm) | detectable (80% power) | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ci, p, mde = _cells(r)
        verdict = f"**{r['verdict']}**" + (f" ({r['why']})" if r["ci95"] is None else "")
        holm_p = _p_text(r["p_holm"]) if r.get("p_holm") is not None else "n/a"
        metric = r["metric"] if not r.get("relative_to") else f"change of {r['metric']} from {r['relative_to']}"
        lines.append(
            f"| {r['claim']} | {r['regime']} | {metric} ({r['direction']} is the claim) | "
            f"{r['method']} vs {r['baseline']} ({_seeds_text(r)}) | "
            f"{r['difference']:+.4f} | {ci} | {p} | {holm_p} | {mde} | {verdict} |"
        )
    if skipped:
        lines += ["", "Skipped claims (not tested):", ""]
        lines += [f"- {s['claim']} (regime {s['regime']}): {s['reason']}" for s in skipped]
    return "\n".join(lines)


def _left_out(method: dict[str, list], baseline: dict[str, list], paired: bool) -> int:
    """How many seeds a paired test left out because only one side ran them (`aligned`)."""
    return len(set(method["seeds"]) ^ set(baseline["seeds"])) if paired else 0


def _seeds_text(r: dict[str, Any]) -> str:
    n, m = r["seeds"]
    if r.get("paired"):
        k = r.get("left_out", 0)
        extra = f"; {k} run by one side only left out" if k else ""
        return f"{n} seed{'s' * (n != 1)}, paired{extra}"
    return f"{n} / {m} seeds, unpaired"
