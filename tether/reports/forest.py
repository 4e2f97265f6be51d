"""The claims of a report as one picture: each claim's difference with its 95% interval, coloured by verdict, one
panel per metric (their scales differ), beside the null control's pairs on the same metric, whose intervals
show the noise floor a claim's difference has to clear."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from ..records.plots import pyplot

COLOURS = {"supported": "tab:green", "contradicted": "tab:red", "inconclusive": "tab:gray", "continuing": "black"}
"""By the verdict's first word: "inconclusive (the study stopped ...)" is grey, "continuing (look 2 of 3)" black;
anything else (not enough seeds, no test) has no interval to draw."""


def colour_of(verdict: str) -> str:
    return COLOURS.get(verdict.split(" ", 1)[0], "black")


def _rows(claims: Sequence[dict[str, Any]], controls: Sequence[dict[str, Any]], metric: str) -> list[tuple]:
    """(label, difference, (lo, hi), colour) of every tested claim and control on `metric`, claims first."""
    rows = []
    for r in claims:
        if r["metric"] == metric and r.get("ci95"):
            rel = f", change from {r['relative_to']}" if r.get("relative_to") else ""
            label = f"{r['method']} vs {r['baseline']} [{r['regime']}{rel}] ({r['direction']} claimed)"
            rows.append((label, r["difference"], tuple(r["ci95"]), colour_of(r["verdict"])))
    for r in controls:
        if r["metric"] == metric and r.get("ci95"):
            colour = "tab:orange" if r["verdict"] == "false verdict" else "tab:blue"
            rows.append(
                (
                    f"null control: {r['method']} vs {r['baseline']} [{r['regime']}]",
                    r["difference"],
                    tuple(r["ci95"]),
                    colour,
                )
            )
    return rows


def plot_claims(claims: Sequence[dict[str, Any]], controls: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """Write the forest plot of `claims` (and `controls`) to `path`; None when nothing was tested."""
    metrics = list(dict.fromkeys(r["metric"] for r in [*claims, *controls] if r.get("ci95")))
    if not metrics:
        return None
    panels = [(m, _rows(claims, controls, m)) for m in metrics]
    plt = pyplot()
    heights = [max(1, len(rows)) for _, rows in panels]
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(8.5, 0.9 + 0.32 * sum(heights) + 0.5 * len(panels)),
        dpi=110,
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    for ax, (metric, rows) in zip(axes[:, 0], panels):
        for y, (label, diff, (lo, hi), colour) in enumerate(reversed(rows)):
            ax.errorbar(diff, y, xerr=[[diff - lo], [hi - diff]], fmt="o", color=colour, ms=4, capsize=3, lw=1.2)
        ax.axvline(0, color="black", lw=0.8)
        ax.set_yticks(range(len(rows)), [label for label, *_ in reversed(rows)], fontsize=7)
        ax.set_ylim(-0.7, len(rows) - 0.3)
        ax.set_title(f"{metric}: difference, method minus baseline, with its 95% interval", fontsize=8, loc="left")
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(
        "claims (green supported, red contradicted, grey inconclusive, black continuing, after Holm); "
        "null control (blue; orange: a false verdict)",
        fontsize=8,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
