"""`tether compare` and `tether report`: methods side by side on one budget, with plots.

Every objective x seed run gets the same config except the objective: same budget, same data
order (the data stream is seeded by `trainer.seed`), same initial model (the warm start is
cached by seed and does not depend on the objective). Runs live in
`OUT/<objective>/seed<N>/`; a finished run is skipped, an interrupted one resumed from its last
checkpoint (or restarted when it has none), so an interrupted compare picks up where it stopped.
"""

from __future__ import annotations

import math
import shutil
import statistics
from pathlib import Path
from typing import Optional

import yaml

from .plots import save_panel
from .sinks import read_jsonl

CURVES = [  # (file, title, metric, smoothing window in steps)
    ("accuracy", "held-out accuracy", "eval/accuracy", 1),
    ("reward", "reward (rolling mean)", "reward/mean", 20),
    ("entropy", "policy entropy (rolling mean)", "policy/entropy", 20),
    ("clipfrac_high", "clip fraction, high (rolling mean)", "policy/clipfrac_high", 20),
    ("clipfrac_low", "clip fraction, low (rolling mean)", "policy/clipfrac_low", 20),
    ("kl_old", "k3 KL(old || new) per update (rolling mean)", "policy/kl_old", 20),
    ("response_length", "response length (rolling mean)", "rollout/len_mean", 20),
]


def run_dir(out: Path, objective: str, seed: int) -> Path:
    return Path(out) / objective / f"seed{seed}"


def is_finished(run: Path) -> bool:
    cfg = run / "config.yaml"
    if not cfg.exists() or not (run / "summary.md").exists():
        return False
    total = yaml.safe_load(cfg.read_text())["trainer"]["total_steps"]
    rows = read_jsonl(run / "metrics.jsonl")
    return bool(rows) and rows[-1]["step"] >= total


def compare(config: Optional[str], objectives: list[str], seeds: int, overrides: list[str], out: str,
            threshold: Optional[float] = None, log=print) -> Path:
    """Run every objective x seed (skipping finished runs, resuming interrupted ones), then report."""
    from . import checkpoint
    from .config import load_config
    from .train import train

    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Validate every combination before any expensive work starts.
    plans = []
    for objective in objectives:
        for seed in range(seeds):
            run = run_dir(out_dir, objective, seed)
            cfg = load_config(config, [*overrides, f"objective={objective}", f"trainer.seed={seed}", f"output_dir={run}"])
            plans.append((objective, seed, run, cfg))
    for i, (objective, seed, run, cfg) in enumerate(plans, 1):
        tag = f"[{i}/{len(plans)}] {objective} seed {seed}"
        if is_finished(run):
            log(f"{tag}: finished, skipped")
            continue
        if checkpoint.latest(run) is not None:
            log(f"{tag}: resuming")
            train(cfg, resume_dir=str(run), log=log)
        else:
            if run.exists():
                shutil.rmtree(run)  # started but never checkpointed: nothing to keep
            log(f"{tag}: training")
            train(cfg, log=log)
    return write_report([p[2] for p in plans], out_dir, threshold)


# ---------------------------------------------------------------- report


def _label(run: Path) -> str:
    """The objective a run used: the compare directory name, else its config's objective."""
    if run.name.startswith("seed"):
        return run.parent.name
    obj = yaml.safe_load((run / "config.yaml").read_text())["objective"]
    if isinstance(obj, dict):
        return str(obj.get("preset") or obj.get("name"))
    return str(obj)


def discover(paths: list[str]) -> list[Path]:
    """Run directories under the given paths (a run dir, or a compare dir holding runs)."""
    runs = []
    for p in map(Path, paths):
        if (p / "metrics.jsonl").exists():
            runs.append(p)
        else:
            runs.extend(sorted(q.parent for q in p.glob("**/metrics.jsonl")))
    if not runs:
        raise FileNotFoundError(f"no run directories (with metrics.jsonl) under {', '.join(paths)}")
    return runs


def _evals(rows: list[dict]) -> list[tuple[int, float]]:
    return [(r["step"], r["eval/accuracy"]) for r in rows if r.get("eval/accuracy") is not None]


def _mean_of(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(vals) if vals else float("nan")


def _tail_mean(rows: list[dict], key: str, frac: float = 0.1) -> float:
    vals = [r[key] for r in rows if r.get(key) is not None]
    if not vals:
        return float("nan")
    k = max(1, int(len(vals) * frac))
    return statistics.fmean(vals[-k:])


def run_summary(run: Path, threshold: float) -> dict:
    rows = read_jsonl(run / "metrics.jsonl")
    evals = _evals(rows)
    reached = [s for s, a in evals if a >= threshold]
    return {
        "initial": evals[0][1] if evals else float("nan"),
        "final": evals[-1][1] if evals else float("nan"),
        "best": max(a for _, a in evals) if evals else float("nan"),
        "steps_to_threshold": reached[0] if reached else None,
        "final_entropy": _tail_mean(rows, "policy/entropy"),
        "clip_low": _mean_of(rows, "policy/clipfrac_low"),
        "clip_high": _mean_of(rows, "policy/clipfrac_high"),
        "wall_s": sum(r.get("time/step_s") or 0.0 for r in rows),
    }


def _ms(values: list[float], digits: int = 3) -> str:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return "n/a"
    sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return f"{statistics.fmean(vals):.{digits}f} ± {sd:.{digits}f}"


def write_report(runs: list[Path], out_dir: Path, threshold: Optional[float] = None) -> Path:
    """report.md (a table, mean ± std over seeds) and plots/*.png overlaying the methods."""
    out_dir = Path(out_dir)
    groups: dict[str, list[Path]] = {}
    for run in runs:
        if (run / "metrics.jsonl").exists():
            groups.setdefault(_label(run), []).append(run)
    if threshold is None:  # default: 0.1 above the mean starting accuracy
        starts = [run_summary(r, 1.0)["initial"] for rs in groups.values() for r in rs]
        starts = [s for s in starts if not math.isnan(s)]
        threshold = round((statistics.fmean(starts) if starts else 0.0) + 0.1, 3)
    lines = [
        "# Method comparison", "",
        f"{sum(len(v) for v in groups.values())} runs: {', '.join(f'{k} ({len(v)} seeds)' for k, v in groups.items())}. "
        f"Held-out greedy accuracy; mean ± std over seeds. Threshold for 'steps to reach': {threshold}.", "",
        "| objective | seeds | initial acc | final acc | best acc | steps to reach | final entropy | clip low | clip high | train time (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, rs in groups.items():
        s = [run_summary(r, threshold) for r in rs]
        reached = [x["steps_to_threshold"] for x in s if x["steps_to_threshold"] is not None]
        steps = f"{statistics.fmean(reached):.0f} ({len(reached)}/{len(s)} seeds)" if reached else f"never (0/{len(s)})"
        lines.append(
            f"| {label} | {len(rs)} | {_ms([x['initial'] for x in s])} | {_ms([x['final'] for x in s])} | "
            f"{_ms([x['best'] for x in s])} | {steps} | {_ms([x['final_entropy'] for x in s])} | "
            f"{_ms([x['clip_low'] for x in s], 4)} | {_ms([x['clip_high'] for x in s], 4)} | "
            f"{_ms([x['wall_s'] for x in s], 0)} |"
        )
    plots = plot_comparison(groups, out_dir / "plots")
    lines += ["", "## Curves (mean line, band = min..max over seeds)", ""]
    lines += [f"![{p.stem}](plots/{p.name})" for p in plots]
    lines += ["", "## Runs", ""] + [f"- {label}: " + ", ".join(str(r) for r in rs) for label, rs in groups.items()]
    report = out_dir / "report.md"
    report.write_text("\n".join(lines) + "\n")
    return report


def _curve(rows: list[dict], key: str, window: int) -> dict[int, float]:
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    out = {}
    for i, (step, _) in enumerate(pts):
        w = pts[max(0, i - window + 1): i + 1]
        out[step] = statistics.fmean(v for _, v in w)
    return out


def plot_comparison(groups: dict[str, list[Path]], plot_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    data = {label: [read_jsonl(r / "metrics.jsonl") for r in rs] for label, rs in groups.items()}
    written = []
    for fname, title, key, window in CURVES:
        fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
        drawn = False
        for label, runs in data.items():
            curves = [_curve(rows, key, window) for rows in runs]
            steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
            if not steps:
                continue
            mean = [statistics.fmean(c[s] for c in curves) for s in steps]
            lo = [min(c[s] for c in curves) for s in steps]
            hi = [max(c[s] for c in curves) for s in steps]
            line, = ax.plot(steps, mean, label=label, lw=1.4)
            ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.18, lw=0)
            drawn = True
        if not drawn:
            plt.close(fig)
            continue
        written.append(save_panel(fig, ax, title, plot_dir / f"{fname}.png", legend=True))
    return written
