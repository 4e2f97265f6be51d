"""A report's tests as one family: the claims and the null control, at one look or at a design's looks.

Every hypothesis of a report (each claim in each regime it applies to, and the null control's pair on each metric
it is tested on) is a paired comparison of per-seed values, d_k = a_k - b_k for seed k. The family is tested
together, so that the chance of any false verdict among them is at most alpha:

    no design    one look at the seeds there are: Student's paired t (Welch's t when the seeds do not pair), Holm's
                 correction over the whole family (`stats`)
    a design     the claims file's `design:` (tether.reports.sequential): the looks taken so far, each claim's
                 statistic against its boundaries, Holm's step-down over the repeated p-values; a claim not yet
                 decided is "continuing (look k of K)" until the last look, where it is "inconclusive"

Beside each t-based p-value stands the exact sign-flip p-value of the same differences at the same look
(`stats.sign_flip_p`: no assumption of normality), Holm-corrected over the same family; a verdict that holds by t
and not by the exact test is flagged (`robust` False), since it rests on the normality of a few differences.

The null control (`X_null`: X run again from the same initial model, data order, held-out set and sampling
stream, its mini-batch order alone changed: tether.trainer.compare) joins the family like a claim. Each seed's
difference takes a sign from a fair coin drawn from the seed (`label_sign`): which run is called the control is
assigned at random per seed, so that the A/A differences are symmetric about 0 by construction. Any verdict in
its tests is a false one.

The detectable difference (`mde80`) is at the level each test is held to: alpha over the size of its Holm family
(the first, strictest step), at the boundary of the look reported for a design. A claim still continuing also
shows `mde80_last`: the difference the design can still detect at its last look, the spread seen so far scaled
to that look's seeds (se * sqrt(n / n_K)) at that look's boundary; the first looks of an O'Brien-Fleming design
spend so little alpha that their own detectable difference can exceed the metric's range. Zero spread (every difference
equal) is "no test", never p = 0.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from . import sequential, stats
from .sequential import Design, Hypothesis

NOT_ENOUGH = "not enough seeds"
NO_TEST = "no test"


def label_sign(seed: int) -> int:
    """+1 or -1, a fair coin drawn from the seed: the null control's label assignment (module docstring)."""
    return 1 if hashlib.sha256(f"tether-null-label-{seed}".encode()).digest()[0] % 2 else -1


@dataclass
class Pair:
    """One hypothesis: its descriptive fields (claim, regime, metric, ...) and its per-seed values."""

    fields: dict[str, Any]
    a: list[float]
    b: list[float]
    seeds: list[int]
    """The seed of each value when paired (seed order); [] when unpaired."""
    paired: bool
    left_out: int = 0
    null: bool = False
    primary: bool = True
    direction: str = "higher"
    result: dict[str, Any] = field(default_factory=dict)

    def differences(self) -> list[float]:
        d = [x - y for x, y in zip(self.a, self.b)]
        return [label_sign(s) * x for s, x in zip(self.seeds, d)] if self.null else d


def verdict_of(difference: float, decided: bool, direction: str) -> str:
    """supported / contradicted by the side of 0 the difference lies on, when decided; else inconclusive."""
    if not decided or difference == 0:
        return "inconclusive"
    return "supported" if (difference > 0) == (direction == "higher") else "contradicted"


def judge(
    pairs: Sequence[Pair], design: Optional[Design] = None, alpha: float = stats.ALPHA, p_values: bool = True
) -> None:
    """Test every pair as one family (module docstring); each pair's `result` is filled in. `p_values` False skips
    what only the tables show (a design's repeated p-values, a bisection each, and the exact test): the verdicts
    are the same (a simulation of many studies asks for them alone)."""
    if design is not None:
        _sequential(pairs, design, p_values)
    else:
        _fixed(pairs, alpha)
    if p_values:
        _exact(pairs, design.alpha if design else alpha)


def _untestable(p: Pair) -> Optional[tuple[str, str]]:
    """(verdict, why) when a pair cannot be tested at all, else None."""
    n, m = len(p.a), len(p.b)
    if not n or not m:
        return NOT_ENOUGH, "no run has a value of this metric"
    if min(n, m) < stats.MIN_SEEDS:
        have = f"{n} paired seed{'s' * (n != 1)}" if p.paired else f"{n} and {m} seeds"
        need = f"{stats.MIN_SEEDS}{' shared' if p.paired else ' per method'}"
        return NOT_ENOUGH, f"{have}; a verdict needs {need}: with fewer the t-test's power is negligible"
    if p.paired and _flat(p.differences()):
        d = p.differences()[0]
        return NO_TEST, f"every paired difference is {d:+.4g}: zero spread, nothing to measure the noise by"
    if not p.paired and _flat(p.a) and _flat(p.b):
        return NO_TEST, "each method's values are all equal: zero spread, nothing to measure the noise by"
    return None


def _flat(values: Sequence[float]) -> bool:
    """Whether every value is equal, to float rounding (a spread of 1e-12 of their size)."""
    return max(values) - min(values) <= 1e-12 * max(1.0, max(abs(v) for v in values))


def _base(p: Pair, t: Optional[stats.TTest], crit: Optional[float]) -> dict[str, Any]:
    """The fields every tested pair reports at the look shown: difference, interval, p, detectable."""
    if t is None:
        return {"difference": _mean_diff(p), "ci95": None, "mde80": None, "p": None, "test": ""}
    half = stats.t_quantile(1 - stats.ALPHA / 2, t.df) * t.se
    mde = None if crit is None or math.isinf(crit) else stats.detectable(crit, t.df, t.se)
    return {
        "difference": t.difference,
        "ci95": [t.difference - half, t.difference + half],
        "mde80": mde,
        "p": t.p,
        "test": "paired t" if p.paired else "Welch t",
    }


def _mean_diff(p: Pair) -> float:
    return statistics.fmean(p.a) - statistics.fmean(p.b) if p.a and p.b else float("nan")


def _ttest(p: Pair, n: Optional[int] = None) -> stats.TTest:
    if p.paired:
        d = p.differences()
        return stats.paired_t(d[:n] if n else d)
    return stats.welch_t(p.a, p.b)


def _fixed(pairs: Sequence[Pair], alpha: float) -> None:
    """One look, Holm over every testable pair."""
    tested = []
    for p in pairs:
        bad = _untestable(p)
        if bad:
            p.result = {**_base(p, None, None), "verdict": bad[0], "why": bad[1], "p_holm": None}
        else:
            tested.append(p)
    for p in tested:
        t = _ttest(p)
        crit = stats.t_quantile(1 - alpha / (2 * len(tested)), t.df)
        p.result = {**_base(p, t, crit), "why": "", "alpha_tested": alpha / len(tested)}
    for p, adjusted in zip(tested, stats.holm([p.result["p"] for p in tested])):
        p.result["p_holm"] = adjusted
        p.result["verdict"] = verdict_of(p.result["difference"], adjusted < alpha, p.direction)
    for p in pairs:
        p.result["family"] = len(tested)


def _sequential(pairs: Sequence[Pair], design: Design, p_values: bool = True) -> None:
    """The design's looks (tether.reports.sequential); paired pairs only."""
    hyps, tested = [], []
    for p in pairs:
        bad = _untestable(p) or (
            None if p.paired else (NOT_ENOUGH, "a sequential design pairs seeds; these methods share too few")
        )
        ns = design.looks_taken(len(p.a)) if not bad else ()
        if not bad and not ns:
            bad = NOT_ENOUGH, f"{len(p.a)} paired seeds; the first look is at {design.looks[0]}"
        if bad:
            p.result = {**_base(p, None, None), "verdict": bad[0], "why": bad[1], "p_holm": None}
            continue
        s = tuple(sequential.statistics_at(design, p.differences(), ns))
        hyps.append(Hypothesis(s, ns, p.primary))
        tested.append(p)
    looks = sequential.decide(design, hyps)
    adjusted = sequential.holm_p(design, hyps) if p_values else [None] * len(hyps)
    sizes = {g: sum(1 for h in hyps if h.primary == g) for g in (True, False)}
    claims_done = all(look is not None for p, look in zip(tested, looks) if not p.null)
    gated = design.family == "primary_first" and any(look is None for h, look in zip(hyps, looks) if h.primary)
    for p, h, look, p_holm in zip(tested, hyps, looks, adjusted):
        m = sizes[h.primary] if design.family == "primary_first" else len(hyps)
        shown = h.ns[look] if look is not None else h.ns[-1]  # a decided claim is reported at its deciding look
        t = _ttest(p, shown)
        k = h.ns.index(shown)
        crit = sequential.boundaries(design, h.ns[: k + 1], design.alpha / m)[k]
        p.result = {
            **_base(p, t, crit),
            "test": f"sequential {'paired t' if design.test == 't' else 'combination test'}",
            "p_sequential": sequential.repeated_p(design, h.s, h.ns) if p_values else None,
            "p_holm": p_holm,
            "alpha_tested": design.alpha / m,
            "look": [k + 1, len(design.looks)],
            "seeds_at_look": shown,
            "why": "",
            "verdict": _sequential_verdict(p, look, t, h, design, claims_done, gated and not h.primary),
            "mde80_last": _mde_last(design, t, shown, design.alpha / m) if look is None else None,
        }
    for p in pairs:
        p.result["family"] = len(hyps)
        p.result.setdefault("look", None)


def _mde_last(design: Design, t: stats.TTest, n: int, alpha: float) -> Optional[float]:
    """A continuing claim's detectable difference at the design's last look: the spread seen so far, scaled to the
    last look's seeds, at that look's boundary (t test only; None once the last look is reached)."""
    last = design.max_seeds
    if design.test != "t" or n >= last or not t.se > 0:
        return None
    crit = sequential.boundaries(design, design.looks, alpha)[-1]
    if math.isinf(crit):
        return None
    return stats.detectable(crit, last - 1, t.se * math.sqrt(n / last))


def _sequential_verdict(p: Pair, look, t, h: Hypothesis, design: Design, claims_done: bool, gated: bool) -> str:
    if look is not None:
        return verdict_of(t.difference, True, p.direction)
    k, total = len(h.ns), len(design.looks)
    if h.ns[-1] >= design.max_seeds:
        return "inconclusive"
    if claims_done:
        return f"inconclusive (the study stopped at look {k} of {total}: every claim was decided)"
    if gated:
        return f"continuing (look {k} of {total}; tested once every primary claim is decided)"
    return f"continuing (look {k} of {total})"


def _exact(pairs: Sequence[Pair], alpha: float) -> None:
    """The exact sign-flip p beside t, at the same look, Holm-corrected over the same pairs; the robustness flag."""
    tested = [p for p in pairs if p.result.get("p") is not None and p.paired]
    for p in tested:
        n = p.result.get("seeds_at_look") or len(p.a)
        p.result["p_exact"] = stats.sign_flip_p(p.differences()[:n])
    for p, adjusted in zip(tested, stats.holm([p.result["p_exact"] for p in tested])):
        p.result["p_exact_holm"] = adjusted
        decided = p.result["verdict"] in ("supported", "contradicted")
        p.result["robust"] = adjusted < alpha if decided else None
    for p in pairs:
        p.result.setdefault("p_exact", None)
        p.result.setdefault("p_exact_holm", None)
        p.result.setdefault("robust", None)
