"""`tether compare --plan PILOT --claims C`: the seeds and looks a design needs, from a pilot's spreads.

For each claim (and each null-control test, which joins the claims' family), from the pilot's paired per-seed
differences d (tether.reports.claims.aligned_by_seed):

    sd          the standard deviation of d over the pilot's seeds
    level       the level the claim is tested at: alpha / m, m the size of its Holm family (every claim and
                null-control test; under `family: primary_first`, the primary or the secondary ones), the
                strictest step of Holm's procedure, which a claim must be planned for
    fixed       the fewest seeds a single look needs to detect `detect` with 80% power at that level
                (stats.seeds_for)
    design      the design's looks scaled to the fewest seeds that reach 80% power at that level
                (sequential.seeds_needed, simulated), and the seeds it runs on average at that effect

A claim that cannot be tested is said so: a metric equal on at least half of the pilot's runs (max_drop is 0
on most runs of a short regime), or a pilot without a spread (fewer than 2 paired seeds, or zero spread).
Planning from a pilot's sd is itself noisy (at 4 seeds the sd's 80% interval spans 0.6-1.6 times its value):
the table says how many seeds the spread came from.
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Optional

from . import sequential, stats
from .claims import CENSORED, METRICS, aligned_by_seed, load_claims, load_design
from .report import NULL_SUFFIX, pilot_values
from .sequential import Design


def plan_study(pilot: str, claims_path: str, detect: Optional[float] = None) -> str:
    """The planning table (module docstring) as markdown."""
    claims = load_claims(claims_path)
    design = load_design(claims_path) or Design((stats.MIN_SEEDS,))
    detect = detect if detect is not None else design.detect
    if detect is None:
        raise ValueError("give the difference to detect: --detect D, or `detect:` in the claims file's design")
    regimes = pilot_values(pilot)
    rows = []
    for name, methods in regimes.items():
        for c in claims:
            if (c.regime is None or c.regime == name) and c.method in methods and c.baseline in methods:
                rows.append((c.claim, name, c.metric, c.primary, methods[c.method], methods[c.baseline]))
        nulls = [m for m in methods if m.endswith(NULL_SUFFIX) and m[: -len(NULL_SUFFIX)] in methods]
        named = list(dict.fromkeys(c.metric for c in claims if c.relative_to is None))
        primary = {c.metric for c in claims if c.primary}
        for control in nulls:
            base = control[: -len(NULL_SUFFIX)]
            for metric in named:
                label = f"null control ({control} vs {base})"
                rows.append((label, name, metric, metric in primary, methods[control], methods[base]))
    if not rows:
        return f"No claim of {claims_path} has both its methods in {pilot}: nothing to plan."
    sizes = Counter(primary for *_, primary, _, _ in rows)
    lines = [
        f"# Plan from {pilot} for {claims_path}",
        "",
        f"Difference to detect: {detect}; design: looks at {list(design.looks)} ({design.test}, "
        f"{design.spending}, family {design.family}); 80% power at each claim's tested level.",
        "",
        "| claim | regime | metric | pilot | sd of differences | tested at | one look needs | the design needs "
        "| mean seeds run at that effect |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for claim, regime, metric, primary, a_vals, b_vals in rows:
        m = sizes[primary] if design.family == "primary_first" else len(rows)
        lines.append(_row(claim, regime, metric, a_vals, b_vals, design, design.alpha / m, detect))
    lines += [
        "",
        "The design's looks are scaled to keep their fractions of the last look. Set `looks` in the claims "
        "file's design to the largest a claim you must settle needs, before the first look (docs/compare.md).",
    ]
    return "\n".join(lines)


def _row(claim, regime, metric, a_vals, b_vals, design: Design, level: float, detect: float) -> str:
    head = f"| {claim} | {regime} | {metric} |"
    if metric in CENSORED:
        return f"{head} | | | | cannot be tested: {CENSORED[metric]} | |"
    if metric not in METRICS:
        return f"{head} | | | | cannot be tested: {metric} is not a per-run metric | |"
    if metric not in a_vals or metric not in b_vals:
        return f"{head} | | | | cannot be planned: the pilot has no values of {metric} (made before it existed) | |"
    a, b, seeds, paired = aligned_by_seed(a_vals, b_vals, metric)
    values = [*a_vals.get(metric, []), *b_vals.get(metric, [])]
    common, count = Counter(values).most_common(1)[0] if values else (None, 0)
    pilot = f"{len(seeds)} paired seeds" if paired else "unpaired"
    if values and count * 2 >= len(values):
        why = f"cannot be tested: {metric} is {common:g} on {count} of {len(values)} runs"
        return f"{head} {pilot} | | | | {why} | |"
    if not paired or len(seeds) < 2:
        return f"{head} {pilot} | | | | cannot be planned: the pilot needs 2 paired seeds or more | |"
    sd = statistics.stdev([x - y for x, y in zip(a, b)])
    if sd == 0:
        return f"{head} {pilot} | 0 | | | cannot be planned: zero spread in the pilot | |"
    fixed = stats.seeds_for(sd, detect, most=200, alpha=level)
    found = sequential.seeds_needed(design, level, detect / sd)
    seq = f"looks {list(found[0].looks)}" if found else "more than 60 seeds"
    mean = f"{found[2]:.1f}" if found else "n/a"
    fixed_text = str(fixed) if fixed <= 200 else "more than 200"
    return f"{head} {pilot} | {sd:.4f} | {level:.4f} | {fixed_text} | {seq} | {mean} |"


__all__ = ["plan_study"]
