"""PNG plots of a run's metrics.jsonl (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

from .sinks import read_jsonl

# (file name, title, metric names drawn on the same axes)
PANELS = [
    ("reward", "reward", ["reward/mean"]),
    ("accuracy", "held-out accuracy", ["eval/accuracy"]),
    ("entropy", "policy entropy", ["policy/entropy"]),
    ("clip_fractions", "clip fractions", ["policy/clipfrac_low", "policy/clipfrac_high", "policy/clipfrac_dual"]),
    ("kl", "KL", ["policy/kl_old", "kl/ref", "rpg/kl_anchor"]),
    ("response_length", "response length (tokens)", ["rollout/len_mean"]),
]


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def save_panel(fig, ax, title: str, path: Path, legend: bool) -> Path:
    """Label a metric-vs-step panel, write it as PNG and close the figure."""
    import matplotlib.pyplot as plt

    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_run(run_dir: Path) -> list[Path]:
    """Write RUN_DIR/plots/<panel>.png for every panel with data; returns the files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    for fname, title, keys in PANELS:
        drawn = [(k, *series(rows, k)) for k in keys]
        drawn = [d for d in drawn if d[1]]
        if not drawn:
            continue
        fig, ax = plt.subplots(figsize=(5, 3.2), dpi=110)
        for key, xs, ys in drawn:
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, ms=3, label=key)
        written.append(save_panel(fig, ax, title, out_dir / f"{fname}.png", legend=len(drawn) > 1))
    return written
