"""A comparison's regimes against the one numeric setting they differ in (a sweep such as trainer.staleness = 0,
16, 64): per-seed metrics as a table and plots, each mean with its 95% Student-t interval."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..config.sections import flatten
from ..records.plots import pyplot, save_panel
from .claims import mean_interval

AXIS_METRICS = [  # (per-seed metric of tether.reports.claims.METRICS, y-axis label)
    ("final_accuracy", "final held-out accuracy"),
    ("auc", "mean held-out accuracy over the run"),
    ("constrained_frac", "fraction of tokens clipped or masked"),
]


def setting_axis(configs: dict[str, dict]) -> Optional[tuple[str, dict[str, float]]]:
    """(dotted key, {regime: value}) when the regimes' shared settings differ in exactly one numeric
    setting (a sweep such as trainer.staleness = 0, 16, 64); None otherwise (a single regime, or
    regimes that differ in several settings, which no single x-axis can show)."""

    if len(configs) < 2:
        return None
    flat = {name: flatten(cfg) for name, cfg in configs.items()}
    keys = set().union(*flat.values())
    differ = [k for k in sorted(keys) if len({repr(f.get(k)) for f in flat.values()}) > 1]
    if len(differ) != 1:
        return None
    values = {name: f.get(differ[0]) for name, f in flat.items()}
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values.values()):
        return None
    return differ[0], {name: float(v) for name, v in values.items()}


@dataclass(frozen=True)
class AxisPoint:
    """One method's per-seed values of one metric at one value of the setting, summarised."""

    x: float
    mean: float
    ci: Optional[tuple[float, float]]  # the 95% Student-t interval of the mean; None under 4 seeds
    n: int


def _axis_points(values: dict[str, float], regimes: dict) -> dict[str, dict[str, list[AxisPoint]]]:
    """{metric: {method: its points in the order of the setting}} for AXIS_METRICS, each mean and
    interval computed once for the table and the plots (regimes where a method has no value are left out)."""

    order = sorted(values, key=values.get)
    methods = list(dict.fromkeys(m for name in order for m in regimes[name]["methods"]))
    points: dict[str, dict[str, list[AxisPoint]]] = {}
    for metric, _ in AXIS_METRICS:
        per_method = points.setdefault(metric, {})
        for m in methods:
            per_method[m] = []
            for n in order:
                vals = [v for v in regimes[n]["methods"].get(m, {}).get(metric, []) if not math.isnan(v)]
                if vals:
                    per_method[m].append(AxisPoint(values[n], statistics.fmean(vals), mean_interval(vals), len(vals)))
    return points


def axis_section(axis: tuple[str, dict[str, float]], regimes: dict, out_dir: Path) -> list[str]:
    """A table and plots of each method's per-seed metrics against the one setting the regimes vary:
    mean over seeds and its 95% Student-t interval (tether.reports.claims.mean_interval)."""
    key, values = axis
    xs = sorted(set(values.values()))
    points = _axis_points(values, regimes)
    lines = [
        f"## Against `{key}`",
        "",
        f"Each method's runs at {key} = {', '.join(f'{x:g}' for x in xs)}: mean over seeds, and "
        "in brackets the 95% Student-t interval of that mean (shown from 4 seeds up).",
        "",
    ]
    for metric, label in AXIS_METRICS:
        lines += [
            f"{label} (`{metric}`):",
            "",
            f"| method | {' | '.join(f'{key}={x:g}' for x in xs)} |",
            "|---|" + "---|" * len(xs),
        ]
        for m, pts in points[metric].items():
            at = {p.x: p for p in pts}
            cells = [
                "n/a"
                if x not in at
                else f"{at[x].mean:.3f}"
                + (f" [{at[x].ci[0]:.3f}, {at[x].ci[1]:.3f}]" if at[x].ci else f" ({at[x].n} seeds)")
                for x in xs
            ]
            lines.append(f"| {m} | {' | '.join(cells)} |")
        lines.append("")
    plots = plot_against(key, xs, points, out_dir / "plots" / f"against_{key.split('.')[-1]}")
    return lines + [f"![{p.stem}]({p.relative_to(out_dir)})" for p in plots] + [""]


def plot_against(
    key: str, xs: list[float], points: dict[str, dict[str, list[AxisPoint]]], plot_dir: Path
) -> list[Path]:
    """One PNG per AXIS_METRICS entry: x = the setting, one line per method through its means over
    seeds, error bars = the 95% Student-t interval of each mean (none under 4 seeds)."""
    plt = pyplot()
    plot_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for metric, label in AXIS_METRICS:
        fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
        methods = points[metric]
        for i, (m, pts) in enumerate(methods.items()):
            if pts:  # a small sideways offset per method keeps the error bars apart
                shift = (i - (len(methods) - 1) / 2) * 0.012 * (max(xs) - min(xs) or 1)
                yerr = [
                    [p.mean - p.ci[0] if p.ci else 0.0 for p in pts],
                    [p.ci[1] - p.mean if p.ci else 0.0 for p in pts],
                ]
                ax.errorbar(
                    [p.x + shift for p in pts],
                    [p.mean for p in pts],
                    yerr=yerr,
                    label=m,
                    marker="o",
                    ms=3,
                    lw=1.2,
                    capsize=2,
                )
        ax.set_xticks(xs)
        written.append(
            save_panel(
                fig, ax, f"{label} against {key}", plot_dir / f"{metric}.png", legend=True, xlabel=key, ylabel=label
            )
        )
    return written
