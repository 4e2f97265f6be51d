"""The claims' and the null control's tables in report.md, from the result rows of `claims.judge`
(tether.reports.family defines every field)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from .sequential import Design

ALPHA_TEXT = "0.05"


def p_text(p: Optional[float]) -> str:
    if p is None:
        return "n/a"
    return f"{p:.3f}" if p >= 0.001 else "<0.001"


def _cells(r: dict[str, Any]) -> tuple[str, str, str]:
    if r["ci95"] is None:
        return "n/a", "n/a", "n/a"
    lo, hi = r["ci95"]
    mde = f"{r['mde80']:.4f}" if r.get("mde80") is not None else "n/a"
    if r.get("mde80_last") is not None:
        mde = f"{mde} now; {r['mde80_last']:.4f} at look {r['look'][1]}"
    return f"[{lo:+.4f}, {hi:+.4f}]", p_text(r["p"]), mde


def seeds_text(r: dict[str, Any]) -> str:
    n, m = r["seeds"]
    if r.get("paired"):
        k = r.get("left_out", 0)
        extra = f"; {k} run by one side only left out" if k else ""
        return f"{n} seed{'s' * (n != 1)}, paired{extra}"
    return f"{n} / {m} seeds, unpaired"


def _look(r: dict[str, Any]) -> str:
    if not r.get("look"):
        return "n/a"
    k, total = r["look"]
    return f"{k} of {total} ({r['seeds_at_look']} seeds)"


def _verdict(r: dict[str, Any]) -> str:
    text = f"**{r['verdict']}**"
    if r["ci95"] is None and r.get("why"):
        text += f" ({r['why']})"
    if r.get("robust") is False:
        text += (
            f" (by t only: the exact sign-flip test's p (Holm) is {p_text(r['p_exact_holm'])}; the verdict "
            f"rests on the "
            "normality of the differences)"
        )
    return text


def _columns(design: Optional[Design]) -> tuple[str, str]:
    seq = "| look | p (sequential) " if design else ""
    head = f"| difference | 95% CI (this look) | p (t) | p (exact) {seq}| p (Holm) | detectable (80% power) | verdict |"
    return head, "|---" * (head.count("|") - 1) + "|"


def _stat_cells(r: dict[str, Any], design: Optional[Design]) -> str:
    ci, p, mde = _cells(r)
    seq = f"{_look(r)} | {p_text(r.get('p_sequential'))} | " if design else ""
    return (
        f"{r['difference']:+.4f} | {ci} | {p} | {p_text(r.get('p_exact'))} | {seq}{p_text(r.get('p_holm'))} | {mde} | "
        f"{_verdict(r)} |"
    )


def claims_markdown(
    results: Sequence[dict[str, Any]], skipped: Sequence[dict[str, Any]] = (), design: Optional[Design] = None
) -> str:
    """The claims' table, then the skipped claims."""
    head, rule = _columns(design)
    lines = ["| claim | regime | metric | method vs baseline " + head, "|---|---|---|---" + rule]
    for r in results:
        metric = r["metric"] if not r.get("relative_to") else f"change of {r['metric']} from {r['relative_to']}"
        lines.append(
            f"| {r['claim']} | {r['regime']} | {metric} ({r['direction']} is the claim) | "
            f"{r['method']} vs {r['baseline']} ({seeds_text(r)}) | {_stat_cells(r, design)}"
        )
    if skipped:
        lines += ["", "Skipped claims (not tested):", ""]
        lines += [f"- {s['claim']} (regime {s['regime']}): {s['reason']}" for s in skipped]
    return "\n".join(lines)


def null_markdown(results: Sequence[dict[str, Any]], design: Optional[Design] = None) -> str:
    """The null control's table and the false verdicts it shows."""
    head, rule = _columns(design)
    lines = ["| regime | metric | control vs baseline " + head, "|---|---|---" + rule]
    for r in results:
        lines.append(
            f"| {r['regime']} | {r['metric']} | {r['method']} vs {r['baseline']} ({seeds_text(r)}) | "
            f"{_stat_cells(r, design)}"
        )
    tested = [r for r in results if r["p"] is not None]
    false = sum(r["verdict"] == "false verdict" for r in tested)
    family = results[0].get("family", len(tested)) if results else 0
    lines += [
        "",
        f"False verdicts in the null control: {false} of {len(tested)} tests (in one Holm family of {family} with "
        "the claims).",
    ]
    return "\n".join(lines)


def design_text(design: Design, recorded: Optional[dict] = None, changed: str = "") -> str:
    """A paragraph that states the design the verdicts are under, and any change since its first look."""
    looks = ", ".join(str(n) for n in design.looks)
    test = (
        "Student's paired t on every seed so far"
        if design.test == "t"
        else "the inverse-normal combination of each stage's paired t (later stages' sizes may change)"
    )
    family = (
        "one Holm family over every claim and null-control test"
        if design.family == "holm"
        else "primary claims (and the null control on their metrics) first as one Holm family, the secondary ones "
        "once every primary one is decided"
    )
    when = f", recorded {recorded['recorded']}" if recorded else ""
    text = (
        f"Design (fixed before the first look{when}): looks at "
        f"{looks} seeds, alpha {design.alpha} spent by {design.spending.replace('_', '-')} boundaries simulated for "
        f"each look's degrees of freedom, the statistic {test}, {family}. A claim is decided when it crosses its "
        "boundary at a look; until then it is *continuing*, and at the last look *inconclusive*. `p (t)` and "
        "`p (exact)` are this look's alone (the exact sign-flip test assumes nothing of the differences' shape); "
        "`p (sequential)` is the smallest level at which the design would have decided by this look, and "
        "`p (Holm)` that p corrected over the family."
    )
    if changed:
        text += f" **The design was changed after its first look: {changed}.**"
    return text
