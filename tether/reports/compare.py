"""`tether compare` and `tether report`: methods side by side on one budget, with plots.

Every objective x seed run gets the same config except the objective: same budget, same data
order (the data stream is seeded by `trainer.seed`), same initial model (the warm start is
cached by seed and does not depend on the objective). Runs live in
`OUT/<objective>/seed<N>/`; a finished run is skipped, an interrupted one resumed from its last
checkpoint (or restarted when it has none), so an interrupted compare picks up where it stopped.

With `jobs` > 1 the runs go to that many child processes at a time (`tether train`, each writing
`OUT/logs/<objective>-seed<N>.log`): several small runs share one GPU, or two 1-thread runs share
a 2-core CPU, better than one run at a time. A run that fails does not stop the others; compare
then raises, naming each failed run and its log, and a rerun resumes them. Runs of the same seed
started together may both build that seed's warm start (the cache's atomic rename keeps one).

`null_control=BASELINE` adds an A/A pair: BASELINE runs a second time, as `BASELINE_null`, from the same
initial model, data order and held-out set with an independent sampling stream (`trainer.sampling_seed` =
the seed + NULL_SAMPLING_OFFSET); the report tests it against BASELINE like a claim
(`claims.null_control`), so that the noise floor is measured on the same job as the claims.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from ..records.plots import (
    EVAL_MARKER,
    coinciding,
    pyplot,
    rolling_mean,
    save_panel,
    window_for,
    window_note,
    ylabel_of,
)
from ..records.runlog import ACCURACY, METRICS_FILE, accuracy, has_metrics, read_config, read_metrics, tail_mean, values
from ..config.loading import load_config
from ..config.sections import Config, config_differences, flatten, one_line
from ..schema import ConfigError, to_dict
from .claims import (
    MIN_SEEDS,
    claims_markdown,
    evaluate_claims,
    load_claims,
    mean_interval,
    null_control,
    null_markdown,
    per_seed,
    skipped_claims,
)

CURVES = [  # (file, title, metric, smoothed); the y-axis label is the run plots' (ylabel_of), the window theirs
    ("accuracy", "held-out accuracy", ACCURACY, False),
    ("reward", "reward", "reward/mean", True),
    ("entropy", "policy entropy", "policy/entropy", True),
    ("clipfrac_high", "clip fraction, high", "policy/clipfrac_high", True),
    ("clipfrac_low", "clip fraction, low", "policy/clipfrac_low", True),
    ("kl_old", "k3 KL(old || new) per update", "policy/kl_old", True),
    ("response_length", "response length", "rollout/len_mean", True),
]


NULL_SUFFIX = "_null"
"""The label of a null-control run: its baseline's, with this suffix."""
NULL_SAMPLING_OFFSET = 10_000
"""Seed k's null-control run samples with trainer.sampling_seed = k + this (an independent stream)."""


class RunsFailed(Exception):
    """Some of compare's child runs exited with an error (the message names each and its log)."""


def run_dir(out: Path, objective: str, seed: int) -> Path:
    return Path(out) / objective / f"seed{seed}"


def is_finished(run: Path) -> bool:
    if not (run / "config.yaml").exists() or not (run / "summary.md").exists():
        return False
    total = read_config(run)["trainer"]["total_steps"]
    rows = read_metrics(run)
    return bool(rows) and rows[-1]["step"] >= total


def compare(
    config: Optional[str],
    objectives: list[str],
    seeds: int,
    overrides: list[str],
    out: str,
    threshold: Optional[float] = None,
    log=print,
    claims: Optional[str] = None,
    jobs: int = 1,
    null_control: Optional[str] = None,
) -> Path:
    """Run every objective x seed (skipping finished runs, resuming interrupted ones), then report.

    jobs > 1: that many runs at a time, each in a child `tether train` process (module header).
    null_control: one of `objectives`, run again with an independent sampling stream (module header)."""
    from ..records import checkpoint  # lazy: torch; `tether report` reads runs without it
    from ..trainer.loop import train  # lazy: torch; `tether report` reads runs without it

    out_dir = Path(out)
    if null_control is not None and null_control not in objectives:
        raise ConfigError(
            f"--null-control {null_control!r}: name one of the compared objectives ({', '.join(objectives)})"
        )
    # Validate every combination, and that runs already there used the same settings, before any work.
    plans = []
    for label, objective, extra in _arms(objectives, null_control):
        for seed in range(seeds):
            run = run_dir(out_dir, label, seed)
            run_overrides = [*overrides, f"objective={objective}", f"trainer.seed={seed}", f"output_dir={run}"]
            run_overrides += extra(seed)
            cfg = load_config(config, run_overrides)
            _check_same_settings(run, cfg, out_dir)
            plans.append((label, seed, run, cfg, run_overrides))
    if claims:
        load_claims(claims)  # a bad claims file fails now, not after the runs
    if jobs < 1:
        raise ValueError(f"jobs={jobs}: expected 1 or more runs at a time")
    out_dir.mkdir(parents=True, exist_ok=True)
    pending = []
    for i, (label, seed, run, cfg, run_overrides) in enumerate(plans, 1):
        tag = f"[{i}/{len(plans)}] {label} seed {seed}"
        if is_finished(run):
            log(f"{tag}: finished, skipped")
            continue
        resume = checkpoint.latest(run) is not None
        if not resume and run.exists():
            shutil.rmtree(run)  # started but never checkpointed: nothing to keep
        action = "resuming" if resume else "training"
        if jobs > 1:
            command = [
                sys.executable,
                "-m",
                "tether.cli",
                "train",
                *([config] if config else []),
                *run_overrides,
                *(["--resume", str(run)] if resume else []),
            ]
            pending.append((tag, action, command, out_dir / "logs" / f"{label}-seed{seed}.log"))
            continue
        log(f"{tag}: {action}")
        train(cfg, resume_dir=str(run) if resume else None, log=log)
    if pending:
        _run_children(pending, jobs, log)
    return write_report({out_dir.name: [p[2] for p in plans]}, out_dir, threshold, claims)


def _arms(objectives: list[str], null_control: Optional[str]) -> list[tuple[str, str, Callable[[int], list[str]]]]:
    """(label, objective, seed -> extra overrides) of each arm: the objectives, then the null control's."""
    arms: list[tuple[str, str, Callable[[int], list[str]]]] = [(o, o, lambda seed: []) for o in objectives]
    if null_control is not None:
        label = f"{null_control}{NULL_SUFFIX}"
        arms.append((label, null_control, lambda seed: [f"trainer.sampling_seed={seed + NULL_SAMPLING_OFFSET}"]))
    return arms


def _run_children(pending: list[tuple[str, str, list[str], Path]], jobs: int, log) -> None:
    """Run (tag, action, command, log file) children, `jobs` at a time; raise naming every one that failed.

    Ctrl-C (or any error here) passes SIGINT to the children still running, which drop their
    unfinished step as `tether train` does, and waits for them before re-raising."""
    running: list[tuple[str, subprocess.Popen, Path]] = []
    failed: list[str] = []
    queue = list(pending)
    try:
        while queue or running:
            while queue and len(running) < jobs:
                tag, action, command, log_file = queue.pop(0)
                log_file.parent.mkdir(parents=True, exist_ok=True)
                with log_file.open("w") as f:
                    running.append((tag, subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT), log_file))
                log(f"{tag}: {action} (log: {log_file})")
            time.sleep(0.5)
            for item in [r for r in running if r[1].poll() is not None]:
                running.remove(item)
                tag, child, log_file = item
                if child.returncode:
                    failed.append(f"{tag} (exit {child.returncode}, log: {log_file})")
                    log(f"{tag}: failed, exit {child.returncode}; see {log_file}")
                else:
                    log(f"{tag}: done")
    except BaseException:
        for _, child, _ in running:
            child.send_signal(signal.SIGINT)
        for _, child, _ in running:
            try:
                child.wait(timeout=120)
            except subprocess.TimeoutExpired:
                child.kill()
        raise
    if failed:
        raise RunsFailed(
            f"{len(failed)} run(s) failed: "
            + "; ".join(failed)
            + ". Fix the cause and rerun the same command: finished runs are skipped, the rest resume."
        )


def _check_same_settings(run: Path, cfg, out_dir: Path) -> None:
    """A run already in `out_dir` must have the settings this compare would give it (budget included):
    a comparison never mixes runs of different settings."""

    saved = run / "config.yaml"
    if not saved.exists():
        return
    diff = config_differences(cfg, load_config(str(saved)), ignore=("output_dir",))
    if diff:
        shown = "; ".join(f"{k}: {old!r} there, {new!r} now" for k, old, new in diff[:5])
        raise ConfigError(
            f"{out_dir} holds runs made with other settings ({run.relative_to(out_dir)}: {shown}); "
            f"re-run with the same settings to resume them, or pass another --out DIR"
        )


# ---------------------------------------------------------------- report


def _label(run: Path) -> str:
    """The objective a run used, by the name the user chose: the compare directory name, else its
    config's label (`atr_grpo`, not the `divergence_clip` it builds; tether.objectives.label_of)."""
    if run.name.startswith("seed"):
        return run.parent.name
    from ..objectives import label_of  # lazy: torch; `tether report` reads runs without it

    return label_of(read_config(run)["objective"])


def discover(paths: list[str]) -> list[Path]:
    """Run directories under the given paths (a run dir, or a compare dir holding runs)."""
    runs = []
    for p in map(Path, paths):
        if has_metrics(p):
            runs.append(p)
        else:
            runs.extend(sorted(q.parent for q in p.glob(f"**/{METRICS_FILE}")))
    if not runs:
        raise FileNotFoundError(f"no run directories (with metrics.jsonl) under {', '.join(paths)}")
    return runs


def _mean_of(rows: list[dict], key: str) -> float:
    vals = values(rows, key)
    return statistics.fmean(vals) if vals else float("nan")


def run_summary(run: Path, threshold: float) -> dict:
    rows = read_metrics(run)
    evals = accuracy(rows)
    reached = [s for s, a in evals if a >= threshold]
    return {
        "initial": evals[0][1] if evals else float("nan"),
        "final": evals[-1][1] if evals else float("nan"),
        "best": max(a for _, a in evals) if evals else float("nan"),
        "steps_to_threshold": reached[0] if reached else None,
        "final_entropy": tail_mean(rows, "policy/entropy"),
        "clip_low": _mean_of(rows, "policy/clipfrac_low"),
        "clip_high": _mean_of(rows, "policy/clipfrac_high"),
        "wall_s": sum(r.get("time/step_s") or 0.0 for r in rows),
    }


def _ms(values: list[float], digits: int = 3) -> str:
    """mean ± std over seeds; a single seed has no spread to show."""
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return "n/a"
    if len(vals) == 1:
        return f"{vals[0]:.{digits}f}"
    return f"{statistics.fmean(vals):.{digits}f} ± {statistics.stdev(vals):.{digits}f}"


def write_report(
    regimes: dict[str, list[Path]], out_dir: Path, threshold: Optional[float] = None, claims: Optional[str] = None
) -> Path:
    """report.md (per regime: its settings, a table of mean ± std over seeds, overlay plots; then the
    claims with their intervals and verdicts) and summary.json (per-seed values, `tether.reports.claims`)."""

    claim_list = load_claims(claims) if claims else None  # checked before anything is written
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = {name: _by_method(runs) for name, runs in regimes.items()}
    lines = ["# Method comparison", ""]
    summary: dict = {"regimes": {}, "claims": []}
    for name, methods in groups.items():
        plot_dir = out_dir / "plots" if len(groups) == 1 else out_dir / "plots" / name
        lines += _regime_section(name if len(groups) > 1 else None, methods, plot_dir, out_dir, threshold)
        rows = {m: [read_metrics(r) for r in rs] for m, rs in methods.items()}
        values = per_seed(rows)
        summary["regimes"][name] = {
            "config": _regime_config(methods),
            "methods": {m: {"seeds": [_seed_of(r) for r in rs], **values[m]} for m, rs in methods.items()},
        }
    axis = setting_axis({name: r["config"] for name, r in summary["regimes"].items()})
    if axis is not None:
        summary["axis"] = {"setting": axis[0], "values": axis[1]}
        lines += _axis_section(axis, summary["regimes"], out_dir)
    per_regime = {n: dict(r["methods"]) for n, r in summary["regimes"].items()}
    if claim_list is not None:
        results, skipped = evaluate_claims(claim_list, per_regime), skipped_claims(claim_list, per_regime)
        summary["claims"], summary["skipped_claims"] = results, skipped
        family = results[0]["family"] if results else 0
        lines += [
            "## Claims",
            "",
            f"From `{claims}`: difference of the means over seeds (method minus baseline) and a t-test: Student's "
            "paired t on the per-seed differences when both methods ran the same seeds (seed k of every method "
            "starts from the same model and data order), Welch's t otherwise. `p` is its two-sided p-value, "
            f"`p (Holm)` that p-value corrected by Holm's method over the {family} claims tested here, so that "
            "the chance of any false verdict in this table is at most 5%. The verdict: *supported* when "
            "p (Holm) < 0.05 and the difference lies on the claimed side, *contradicted* when on the other, "
            "else *inconclusive*. `detectable` is the smallest true difference the test would find with 80% "
            f"power given the spread seen. *not enough seeds*: fewer than {MIN_SEEDS} seeds per method "
            "(paired: shared) (docs/compare.md).",
            "",
            claims_markdown(results, skipped),
            "",
        ]
    controls = _null_controls(per_regime, claim_list)
    if controls:
        summary["null_control"] = controls
        lines += [
            "## Null control",
            "",
            "The baseline run a second time from the same initial model, data order and held-out set, with an "
            "independent sampling stream (`tether compare --null-control`), tested against the baseline as a "
            "claim would be, at 5% each: with no true difference, any verdict but *inconclusive* is a false one. "
            "The spread it shows is the noise floor of the claims above.",
            "",
            null_markdown(controls),
            "",
        ]
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=_json_safe) + "\n")
    report = out_dir / "report.md"
    report.write_text("\n".join(lines) + "\n")
    return report


def _null_controls(regimes: dict[str, dict], claim_list) -> list[dict]:
    """The null-control tests of every `X_null` arm whose baseline X ran in the same regime."""
    metrics = [c.metric for c in claim_list or [] if c.relative_to is None]
    out = []
    labels = dict.fromkeys(m for methods in regimes.values() for m in methods)
    for label in labels:
        if label.endswith(NULL_SUFFIX) and label[: -len(NULL_SUFFIX)] in labels:
            out += null_control(regimes, label[: -len(NULL_SUFFIX)], label, metrics)
    return out


def _json_safe(x):
    return None if isinstance(x, float) and math.isnan(x) else str(x)


def _by_method(runs: list[Path]) -> dict[str, list[Path]]:
    groups: dict[str, list[Path]] = {}
    for run in runs:
        if has_metrics(run):
            groups.setdefault(_label(run), []).append(run)
    return groups


def _seed_of(run: Path) -> int:
    return read_config(run)["trainer"]["seed"]


def _regime_config(methods: dict[str, list[Path]]) -> dict:
    """The settings every run of a regime shares: the first run's config without objective, seed and paths."""
    first = next(iter(methods.values()))[0]
    cfg = read_config(first)
    cfg.pop("objective", None), cfg.pop("output_dir", None), cfg.pop("tether_version", None)
    cfg.get("trainer", {}).pop("seed", None)
    return cfg


def _non_default_settings(methods: dict[str, list[Path]]) -> list[str]:
    """`key: value` for every shared setting that differs from tether's defaults (the budget included)."""

    defaults = flatten({k: v for k, v in to_dict(Config()).items() if k != "objective"})
    shared = flatten(_regime_config(methods))
    return [f"`{k}={one_line(v)}`" for k, v in shared.items() if defaults.get(k) != v]


def _regime_section(
    name: Optional[str], methods: dict[str, list[Path]], plot_dir: Path, out_dir: Path, threshold: Optional[float]
) -> list[str]:
    if threshold is None:  # default: 0.1 above the mean starting accuracy
        starts = [run_summary(r, 1.0)["initial"] for rs in methods.values() for r in rs]
        starts = [s for s in starts if not math.isnan(s)]
        threshold = round((statistics.fmean(starts) if starts else 0.0) + 0.1, 3)
    cfg = _regime_config(methods)
    lines = ([f"## Regime {name}", ""] if name else []) + [
        f"{sum(len(v) for v in methods.values())} runs: {', '.join(f'{k} ({len(v)} seeds)' for k, v in methods.items())}. "
        f"Budget: {cfg['trainer']['total_steps']} rollout steps of {cfg['rollout']['prompts_per_step']} prompts x "
        f"{cfg['rollout']['group_size']} samples, {cfg['trainer']['ppo_epochs']} x {cfg['trainer']['mini_batches']} "
        f"optimiser steps each. Settings that differ from tether's defaults: "
        f"{', '.join(_non_default_settings(methods)) or 'none'}.",
        "",
        f"Held-out greedy accuracy; mean ± std over seeds. Threshold for 'steps to reach': {threshold}.",
        "",
        "| objective | seeds | initial acc | final acc | best acc | steps to reach | final entropy | clip low | clip high | train time (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, rs in methods.items():
        s = [run_summary(r, threshold) for r in rs]
        reached = [x["steps_to_threshold"] for x in s if x["steps_to_threshold"] is not None]
        steps = f"{statistics.fmean(reached):.0f} ({len(reached)}/{len(s)} seeds)" if reached else f"never (0/{len(s)})"
        lines.append(
            f"| {label} | {len(rs)} | {_ms([x['initial'] for x in s])} | {_ms([x['final'] for x in s])} | "
            f"{_ms([x['best'] for x in s])} | {steps} | {_ms([x['final_entropy'] for x in s])} | "
            f"{_ms([x['clip_low'] for x in s], 4)} | {_ms([x['clip_high'] for x in s], 4)} | "
            f"{_ms([x['wall_s'] for x in s], 0)} |"
        )
    plots = plot_comparison(methods, plot_dir)
    lines += ["", "Curves (mean line, band = min..max over seeds):", ""]
    lines += [f"![{p.stem}]({p.relative_to(out_dir)})" for p in plots]
    lines += ["", "Runs:", ""] + [f"- {label}: " + ", ".join(str(r) for r in rs) for label, rs in methods.items()]
    return lines + [""]


def plot_comparison(groups: dict[str, list[Path]], plot_dir: Path) -> list[Path]:
    plt = pyplot()
    plot_dir.mkdir(parents=True, exist_ok=True)
    data = {label: [read_metrics(r) for r in rs] for label, rs in groups.items()}
    written = []
    for fname, title, key, smooth in CURVES:
        n_points = max(
            (sum(r.get(key) is not None for r in rows) for runs in data.values() for rows in runs), default=0
        )
        window = window_for(n_points) if smooth else 1  # the run plots' rule (tether.records.plots)
        means = {}
        for label, runs in data.items():
            curves = [rolling_mean(rows, key, window) for rows in runs]
            steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
            if steps:
                means[label] = (steps, curves)
        if not means:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
        lines = {
            label: (steps, [statistics.fmean(c[s] for c in curves) for s in steps])
            for label, (steps, curves) in means.items()
        }
        labels = coinciding(lines)
        for label, (steps, curves) in means.items():
            marks = EVAL_MARKER if not smooth else {}
            (line,) = ax.plot(*lines[label], label=labels[label], lw=1.4, **marks)
            lo = [min(c[s] for c in curves) for s in steps]
            hi = [max(c[s] for c in curves) for s in steps]
            ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.18, lw=0)
        note = (
            f"{window_note(window)}, mean over seeds; band: min..max"
            if window > 1
            else "mean over seeds (markers: evaluations); band: min..max"
            if not smooth
            else "each step, mean over seeds; band: min..max"
        )
        written.append(
            save_panel(fig, ax, title, plot_dir / f"{fname}.png", legend=True, ylabel=ylabel_of(key), legend_title=note)
        )
    return written


# ---------------------------------------------------------------- against a setting


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


def _axis_section(axis: tuple[str, dict[str, float]], regimes: dict, out_dir: Path) -> list[str]:
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
