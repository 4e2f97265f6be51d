"""PNG plots of a run's metrics.jsonl (matplotlib, headless).

Every per-step metric is drawn twice in one colour: its raw value at each rollout step as faint
dots, and a trailing rolling mean over it as a line (`rolling_mean`). THE smoothing rule, here and
in `tether report`'s comparison plots (docs/training.md, docs/compare.md): the window is a tenth
of the run's logged points, at least 1 and at most 20 (`window_for`), and the legend says it
("line: mean of the last W steps"), so a short run is not flattened (a fixed window of 20 would turn one
spike at step 3 of a 40-step run into a curve decaying until step 22). A trailing mean lags a trend by (window - 1) /
2 steps; it never uses a future
step, so the line at step s is what a reader watching the run saw at step s. Held-out accuracy
is measured every `trainer.eval_every` steps on the same examples, and is drawn unsmoothed, a
marker on every evaluation (a line alone would hide that three points are three points). A line
drawn exactly over another (equal values: a clip fraction that never fires on either side) hides
it, so the hidden one's legend entry says so (`coinciding`). Every panel's x-axis spans the run's
logged steps in whole steps; a panel with a value at one step only (a run stopped before its
second evaluation) says so in its legend.
"""

from __future__ import annotations

import statistics
import textwrap
from pathlib import Path
from typing import Optional

from . import runlog
from .runlog import ACCURACY, read_config, read_metrics


class Panel:
    """One PNG: the metrics drawn on the same axes, their y-axis label, whether to smooth them."""

    def __init__(
        self, fname: str, title: str, keys: list[str], ylabel: str, smooth: bool = True, fraction: bool = False
    ):
        self.fname, self.title, self.keys, self.ylabel = fname, title, keys, ylabel
        self.smooth = smooth
        self.fraction = fraction  # y starts at 0


PANELS = [
    Panel("reward", "reward", ["reward/mean"], "mean reward per completion"),
    Panel("accuracy", "held-out accuracy", [ACCURACY], "fraction of test prompts correct", smooth=False, fraction=True),
    Panel("entropy", "policy entropy", ["policy/entropy"], "nats per token"),
    Panel(
        "clip_fractions",
        "clip fractions",
        ["policy/clipfrac_low", "policy/clipfrac_high", "policy/clipfrac_dual"],
        "fraction of tokens",
        fraction=True,
    ),
    Panel("kl", "KL estimates (k3)", ["policy/kl_old", "kl/ref", "rpg/kl_anchor"], "nats per token"),
    Panel("response_length", "response length", ["rollout/len_mean"], "tokens (mean per completion)"),
]


def ylabel_of(key: str) -> str:
    """The y-axis label of a metric: its panel's (the comparison plots use the same)."""
    return next(p.ylabel for p in PANELS if key in p.keys)


MAX_WINDOW = 20  # the longest smoothing window, of run and comparison plots alike


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """`key`'s logged steps and values, as two lists (runlog.series, unzipped)."""
    pts = runlog.series(rows, key)
    return [p[0] for p in pts], [p[1] for p in pts]


def rolling_mean(rows: list[dict], key: str, window: int) -> dict[int, float]:
    """{step: mean of `key` over this logged point and the window - 1 before it} (fewer at the start).

    Steps where `key` is missing or null are skipped, not counted as zeros.
    """
    pts = runlog.series(rows, key)
    out = {}
    for i, (step, _) in enumerate(pts):
        w = pts[max(0, i - window + 1) : i + 1]
        out[step] = statistics.fmean(v for _, v in w)
    return out


def window_for(n_points: int) -> int:
    """The smoothing window of every plot: a tenth of the logged points, clamped to [1, MAX_WINDOW]."""
    return max(1, min(MAX_WINDOW, n_points // 10))


def window_note(window: int) -> str:
    """What a smoothed plot's legend says of its line (the same words in run and comparison plots)."""
    return f"line: mean of the last {window} steps"


EVAL_MARKER = {"marker": "o", "ms": 3}
"""How evaluation points are drawn: each one marked."""


def coinciding(curves: dict[str, tuple[list, list]]) -> dict[str, str]:
    """{label: label with a note} for each curve that a later-drawn one covers exactly (the same steps
    and values): "A (hidden under B: the same values)". Curves are drawn in the dict's order."""
    labels = {k: k for k in curves}
    names = list(curves)
    for i, a in enumerate(names):
        over = [
            b
            for b in names[i + 1 :]
            if list(curves[b][0]) == list(curves[a][0]) and list(curves[b][1]) == list(curves[a][1])
        ]
        if over:
            labels[a] = f"{a} (hidden under {over[-1]}: the same values)"
    return labels


def pyplot():
    """matplotlib.pyplot on the headless Agg backend (no display is needed or opened)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_panel(
    fig,
    ax,
    title: str,
    path: Path,
    legend: bool,
    xlabel: str = "rollout step",
    ylabel: Optional[str] = None,
    legend_title: Optional[str] = None,
) -> Path:
    """Label a metric-vs-step panel, write it as PNG and close the figure. A title's second line
    (the objective's parameters) is set smaller, under the first."""
    import matplotlib.pyplot as plt

    head, _, sub = title.partition("\n")
    if sub:
        fig.suptitle(head, fontsize=9)
        ax.set_title(sub, fontsize=6.5)
    else:
        ax.set_title(head, fontsize=9)
    ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=7, title=legend_title, title_fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def objective_label(run_dir: Path, width: int = 90) -> str:
    """The run's objective for a plot title, from RUN_DIR/config.yaml (resolved, so every parameter
    is there): the name the user chose with the objective it builds (`atr_grpo (divergence_clip)`),
    then its parameters on the lines below, wrapped at `width` characters (never cut); '' without a config.yaml."""
    from ..objectives import display  # lazy: torch (objectives); plots read a run without it

    if not (Path(run_dir) / "config.yaml").is_file():
        return ""
    obj = read_config(run_dir).get("objective")
    if not isinstance(obj, dict):
        return str(obj or "")
    head, params = display(obj, skip=("max_len",))
    return "\n".join([head, *textwrap.wrap(params, width, break_long_words=False, break_on_hyphens=False)])


def _drawn(rows: list[dict], panel: Panel) -> list[tuple[str, list[int], list[float]]]:
    """The panel's metrics that have data; a metric that is 0 throughout (a dual clip that is off)
    is left out when another one in the panel has something to show."""
    drawn = [(k, *series(rows, k)) for k in panel.keys]
    drawn = [d for d in drawn if d[1]]
    live = [d for d in drawn if any(v != 0 for v in d[2])]
    return (live or drawn[:1]) if drawn else []


def plot_run(run_dir: Path) -> list[Path]:
    """Write RUN_DIR/plots/<panel>.png for every panel with data; returns the files."""
    plt = pyplot()
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    objective = objective_label(run_dir)
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    steps = [r["step"] for r in rows]
    for panel in PANELS:
        drawn = _drawn(rows, panel)
        if not drawn:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
        note = _x_axis(ax, steps, sorted({x for _, xs, _ in drawn for x in xs}))
        window = window_for(max(len(xs) for _, xs, _ in drawn)) if panel.smooth else 1
        lines = {key: (xs, ys) for key, xs, ys in drawn}
        if window > 1:
            smoothed = {key: rolling_mean(rows, key, window) for key in lines}
            lines = {key: (list(sm), list(sm.values())) for key, sm in smoothed.items()}
        labels = coinciding(lines)
        for key, xs, ys in drawn:
            if window > 1:
                dots = ax.plot(xs, ys, ls="none", marker="o", ms=2.5, alpha=0.3)[0]
                ax.plot(*lines[key], color=dots.get_color(), lw=1.6, label=labels[key])
            elif panel.smooth:  # too few points to smooth: each one marked
                ax.plot(xs, ys, lw=1.4, label=labels[key], marker="o", ms=3 if len(xs) < 30 else 1.5)
            else:  # evaluations: each one marked
                ax.plot(xs, ys, lw=1.4, label=labels[key], **EVAL_MARKER)
        if panel.fraction:  # from 0, with a sliver below it so a line at 0 stays visible
            ax.set_ylim(bottom=-0.03 * ax.get_ylim()[1])
        title = f"{panel.title}: {objective}" if objective else panel.title
        if window > 1:
            note = f"{window_note(window)}; dots: each step"
        zeros = [k for k in panel.keys if k not in lines and series(rows, k)[0]]
        if zeros:  # left out by `_drawn` as 0 throughout: say so, or a reader takes them for unlogged
            note = "\n".join(filter(None, [note, f"0 throughout, not drawn: {', '.join(zeros)}"]))
        written.append(
            save_panel(
                fig, ax, title, out_dir / f"{panel.fname}.png", legend=True, ylabel=panel.ylabel, legend_title=note
            )
        )
    return written


def _x_axis(ax, steps: list[int], points: list[int]) -> Optional[str]:
    """Every panel spans the run's logged steps, in whole steps (a single point is not centred on
    an axis from -0.04 to 0.04); returns a note when the panel has a value at one step only."""
    from matplotlib.ticker import MaxNLocator

    lo, hi = min(steps), max(steps)
    pad = 0.03 * (hi - lo) if hi > lo else 1.0
    ax.set_xlim(lo - pad, hi + pad)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))  # 0, 5, ..., 20: the last step a tick
    if len(points) != 1:
        return None
    return f"one value only, at step {points[0]}" + (f"; the run ended at step {hi}" if hi > points[0] else "")
