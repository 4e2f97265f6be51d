"""`tether report`: a comparison's runs read back, as report.md, plots and summary.json, and its claims tested.

The runs are those `tether compare` (tether.trainer.compare) writes, `OUT/<label>/seed<N>/`, or any run
directories; a label ending in NULL_SUFFIX is the null control of the method it names (tether.reports.claims).
`rewrite_from_summary` re-tests a comparison whose runs are gone, from the per-seed values in its summary.json.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Optional

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
from ..records.runlog import (
    ACCURACY,
    METRICS_FILE,
    accuracy,
    has_metrics,
    read_config,
    read_metrics,
    tail_mean,
    unfinished,
    values,
)
from ..config.sections import Config, flatten, one_line
from ..schema import to_dict
from . import stats
from .claims import judge, load_claims, load_design, per_seed, skipped_claims
from .sequential import Design
from .tables import claims_markdown, design_text, null_markdown
from .forest import plot_claims
from .heldout import markdown as heldout_markdown
from .heldout import noise_rows
from .sweep import axis_section, setting_axis

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


def _label(run: Path) -> str:
    """The objective a run used, by the name the user chose: the compare directory name, else its
    config's label (`atr_grpo`, not the `divergence_clip` it builds; tether.objectives.label_of)."""
    if run.name.startswith("seed"):
        return run.parent.name
    from ..objectives import label_of  # lazy: torch; `tether report` reads runs without it

    return label_of(read_config(run)["objective"])


def discover(paths: list[str], left_out: Optional[list[str]] = None) -> list[Path]:
    """Run directories under the given paths (a run dir, or a compare dir holding runs). A run found under a
    compare dir that has not reached its last step (in progress, or interrupted: `runlog.unfinished`) is
    left out, and named in `left_out` when given; a run dir named directly is always taken as it stands."""
    runs = []
    for p in map(Path, paths):
        if has_metrics(p):
            runs.append(p)
            continue
        for run in sorted(q.parent for q in p.glob(f"**/{METRICS_FILE}")):
            short = unfinished(run)
            if short is None:
                runs.append(run)
            elif left_out is not None:
                left_out.append(f"{run} (step {short[0]} of {short[1]})")
    if not runs:
        raise FileNotFoundError(
            f"no finished run directories (with metrics.jsonl) under {', '.join(paths)}"
            + (
                f"; not finished: {', '.join(left_out)} (name a run directory to report it as it stands)"
                if left_out
                else ""
            )
        )
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


def mean_std(values: list[float], digits: int = 3) -> str:
    """mean ± std over seeds; a single seed has no spread to show."""
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return "n/a"
    if len(vals) == 1:
        return f"{vals[0]:.{digits}f}"
    return f"{statistics.fmean(vals):.{digits}f} ± {statistics.stdev(vals):.{digits}f}"


def write_report(
    regimes: dict[str, list[Path]],
    out_dir: Path,
    threshold: Optional[float] = None,
    claims: Optional[str] = None,
    left_out: tuple[str, ...] = (),
) -> Path:
    """report.md (per regime: its settings, a table of mean ± std over seeds, overlay plots; then the
    claims with their intervals and verdicts) and summary.json (per-seed values, `tether.reports.claims`).
    `left_out`: the runs `discover` left out as not finished, named under the title."""

    claim_list = load_claims(claims) if claims else None  # checked before anything is written
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = {name: _by_method(runs) for name, runs in regimes.items()}
    lines = ["# Method comparison", ""]
    if left_out:
        lines += [f"Not finished, so left out: {', '.join(left_out)}.", ""]
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
    runs = {name: {m: {_seed_of(r): r for r in rs} for m, rs in methods.items()} for name, methods in groups.items()}
    lines += derived_sections(summary, out_dir, claims, claim_list, runs=runs)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=_json_safe) + "\n")
    report = out_dir / "report.md"
    report.write_text("\n".join(lines) + "\n")
    return report


DERIVED = ("## Against", "## Claims", "## Null control", "## Held-out noise")
"""The headings of the sections computed from summary.json's per-seed values alone, in the order written."""


def derived_sections(
    summary: dict,
    out_dir: Path,
    claims: Optional[str],
    claim_list,
    axis: bool = True,
    figure: str = "claims",
    runs: Optional[dict] = None,
) -> list[str]:
    """The sweep's axis section (unless `axis` is False), the claims, the null control, from `summary`'s per-seed
    values, and the held-out noise of each accuracy test from the runs' per-problem outcomes (`runs`: {regime:
    {method: {seed: run dir}}}; without them, as summary.json recorded it); the results are added to `summary`
    ("axis", "claims", "skipped_claims", "null_control", "heldout_noise")."""
    lines: list[str] = []
    axis = setting_axis({name: r["config"] for name, r in summary["regimes"].items()}) if axis else None
    if axis is not None:
        summary["axis"] = {"setting": axis[0], "values": axis[1]}
        lines += axis_section(axis, summary["regimes"], out_dir)
    per_regime = {n: dict(r["methods"]) for n, r in summary["regimes"].items()}
    design, changed = _design(claims, out_dir, summary) if claim_list is not None else (None, "")
    pairs = _null_pairs(per_regime)
    results, controls = judge(claim_list or [], per_regime, design, pairs)
    if claim_list is not None:
        skipped = skipped_claims(claim_list, per_regime)
        summary["claims"], summary["skipped_claims"] = results, skipped
        lines += _claims_section(summary, claims, design, changed, results, skipped, len(controls))
    drawn = plot_claims(summary.get("claims", []), controls, out_dir / "plots" / f"{figure}.png")
    if drawn is not None:
        lines += [f"![{figure}]({drawn.relative_to(out_dir)})", ""]
    if controls:
        summary["null_control"] = controls
        lines += _null_section(controls, design)
    if runs is not None:
        summary["heldout_noise"] = noise_rows([*summary.get("claims", []), *controls], runs)
    if summary.get("heldout_noise"):
        lines += _heldout_section(summary["heldout_noise"], design)
    return lines


def _claims_section(summary, claims, design, changed, results, skipped, controls: int) -> list[str]:
    family = results[0]["family"] if results else controls
    lines = ["## Claims", ""]
    if design is not None:
        lines += [design_text(design, summary.get("design"), changed), ""]
    return lines + [
        f"From `{claims}`: difference of the means over seeds (method minus baseline), tested on the per-seed "
        "differences (paired: seed k of every method starts from the same model, data order and sampling "
        f"stream; Welch's t when the seeds do not pair). The {family} tests here, claims and null control, are "
        "one family: `p (Holm)` is corrected by Holm's method over them, so that the chance of any false verdict "
        "in this report is at most 5%. The verdict: *supported* when the family decides a claim and its "
        "difference lies on the claimed side, *contradicted* when on the other, else *inconclusive*. "
        "`detectable` is the smallest true difference the test would find with 80% power given the spread "
        f"seen, at the level the claim is held to. *not enough seeds*: fewer than {stats.MIN_SEEDS} seeds per "
        "method (paired: shared); *no test*: every difference equal (docs/compare.md).",
        "",
        claims_markdown(results, skipped, design),
        "",
    ]


def _null_section(controls: list[dict], design) -> list[str]:
    return [
        "## Null control",
        "",
        "The baseline run a second time from the same initial model, data order, held-out set and sampling "
        "stream, with only its mini-batch order changed (`tether compare --null-control`), tested against the "
        "baseline as the claims are, in their family; which run is called the control is decided per seed by "
        "a fair coin. With no true difference, any verdict but *inconclusive* (or *continuing*) is a false one. "
        "The spread it shows is the noise floor of the claims above.",
        "",
        null_markdown(controls, design),
        "",
    ]


def _heldout_section(rows: list[dict], design) -> list[str]:
    return [
        "## Held-out noise",
        "",
        "How much of each accuracy test's spread is the choice of held-out problems, from the runs' per-problem "
        "outcomes (heldout.jsonl): the seed x problem part of the paired differences (tether/reports/heldout.py "
        "derives it), its share of their variance, and the spread (and the seeds a single look at the tested "
        "level needs) with a held-out set 2 and 4 times as large.",
        "",
        heldout_markdown(rows, design.detect if design is not None else None),
        "",
    ]


DESIGN_FILE = "design.json"
"""Where a comparison records its design at its first look (`_design`)."""


def _design(claims: Optional[str], out_dir: Path, summary: dict) -> tuple[Optional[Design], str]:
    """The claims file's design, recorded in OUT/design.json the first time a look is reached, and the change since
    (""); a combination test keeps its recorded stage weights whatever the looks become (its later stages may
    change size without costing its rate)."""
    design = load_design(claims) if claims else None
    if design is None:
        return None, ""
    path = out_dir / DESIGN_FILE
    record = {k: getattr(design, k) for k in ("looks", "alpha", "spending", "test", "family", "detect", "weights")}
    record = json.loads(json.dumps(record))
    claims_text = Path(claims).read_text()
    if path.exists():
        old = json.loads(path.read_text())
        summary["design"] = old
        diffs = [
            f"{k} {old['design'][k]} -> {record[k]}" for k in record if k != "weights" and old["design"][k] != record[k]
        ]
        if old["claims"] != claims_text:
            diffs.append("the claims file's text changed")
        if design.test == "combination" and old["design"]["weights"] != record["weights"]:
            design = Design(**{**record, "looks": tuple(record["looks"]), "weights": tuple(old["design"]["weights"])})
            diffs = [d for d in diffs if not d.startswith("looks")]
        return design, "; ".join(diffs)
    reached = any(
        len(m.get("seeds", [])) >= design.looks[0] for r in summary["regimes"].values() for m in r["methods"].values()
    )
    if reached:
        import datetime  # lazy: only when a design is first recorded

        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        entry = {"recorded": stamp, "design": record, "claims": claims_text}
        path.write_text(json.dumps(entry, indent=1) + "\n")
        summary["design"] = entry
    return design, ""


def rewrite_from_summary(summary_path: str | Path, claims: Optional[str] = None, out: Optional[str] = None) -> Path:
    """Re-test a comparison from its summary.json alone (its runs may be gone): the sweep section, the claims
    (`claims`, a YAML, or none) and the null control are computed again with this version's statistics and
    replace those sections of the report.md beside it, whose regime sections are kept; summary.json is
    rewritten with the new results. Returns report.md.

    `out` (a markdown file): write only the claims and the null control there, with a line saying how it was
    made, and leave report.md and summary.json alone (a second claims file, such as controls, on the same runs)."""
    claim_list = load_claims(claims) if claims else None  # checked before anything is written
    summary_path = Path(summary_path)
    out_dir = summary_path.parent
    summary = _read_summary(summary_path)
    if out is not None:
        figure = Path(out).stem  # its own picture beside report.md's
        sections = derived_sections(
            {"regimes": summary["regimes"]}, out_dir, claims, claim_list, axis=False, figure=figure
        )
        made = f"Made with `tether report {summary_path} --claims {claims} --out {out}` (docs/compare.md)."
        Path(out).write_text("\n".join([f"# Claims tested on {summary_path}", "", made, "", *sections]).rstrip() + "\n")
        return Path(out)
    for key in ("axis", "claims", "skipped_claims", "null_control"):
        summary.pop(key, None)
    summary["claims"] = []
    report = out_dir / "report.md"
    kept = report.read_text().split("\n") if report.exists() else ["# Method comparison", ""]
    cut = next((i for i, line in enumerate(kept) if line.startswith(DERIVED)), len(kept))
    lines = kept[:cut] + derived_sections(summary, out_dir, claims, claim_list)
    summary_path.write_text(json.dumps(summary, indent=1, default=_json_safe) + "\n")
    report.write_text("\n".join(lines).rstrip("\n") + "\n")
    return report


def pilot_values(path: str | Path) -> dict[str, dict[str, dict[str, list]]]:
    """{regime: {method: {"seeds": [...], metric: [one value per seed]}}} of a comparison: a summary.json (its
    per-seed values), or a compare directory's finished runs (one regime, named by the directory)."""
    path = Path(path)
    if path.name == "summary.json":
        return {name: r["methods"] for name, r in _read_summary(path)["regimes"].items()}
    methods = _by_method(discover([str(path)]))
    values = per_seed({m: [read_metrics(r) for r in rs] for m, rs in methods.items()})
    return {path.name: {m: {"seeds": [_seed_of(r) for r in rs], **values[m]} for m, rs in methods.items()}}


def _read_summary(path: Path) -> dict:
    """A summary.json, its per-seed nulls (a run that never evaluated) read back as NaN, as when written."""
    summary = json.loads(path.read_text())
    for regime in summary["regimes"].values():
        for method in regime["methods"].values():
            for name, vals in method.items():
                if name != "seeds":
                    method[name] = [math.nan if v is None else v for v in vals]
    return summary


def _null_pairs(regimes: dict[str, dict]) -> list[tuple[str, str]]:
    """(baseline, control) of every `X_null` arm whose baseline X ran in some regime."""
    labels = dict.fromkeys(m for methods in regimes.values() for m in methods)
    return [
        (label[: -len(NULL_SUFFIX)], label)
        for label in labels
        if label.endswith(NULL_SUFFIX) and label[: -len(NULL_SUFFIX)] in labels
    ]


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
    counts = ", ".join(f"{k} ({len(v)} seeds)" for k, v in methods.items())
    lines = ([f"## Regime {name}", ""] if name else []) + [
        f"{sum(len(v) for v in methods.values())} runs: {counts}. "
        f"Budget: {cfg['trainer']['total_steps']} rollout steps of {cfg['rollout']['prompts_per_step']} prompts x "
        f"{cfg['rollout']['group_size']} samples, {cfg['trainer']['ppo_epochs']} x {cfg['trainer']['mini_batches']} "
        f"optimiser steps each. Settings that differ from tether's defaults: "
        f"{', '.join(_non_default_settings(methods)) or 'none'}.",
        "",
        f"Held-out greedy accuracy; mean ± std over seeds. Threshold for 'steps to reach': {threshold}.",
        "",
        "| objective | seeds | initial acc | final acc | best acc | steps to reach | final entropy | clip low "
        "| clip high | train time (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, rs in methods.items():
        s = [run_summary(r, threshold) for r in rs]
        reached = [x["steps_to_threshold"] for x in s if x["steps_to_threshold"] is not None]
        steps = f"{statistics.fmean(reached):.0f} ({len(reached)}/{len(s)} seeds)" if reached else f"never (0/{len(s)})"
        lines.append(
            f"| {label} | {len(rs)} | {mean_std([x['initial'] for x in s])} | {mean_std([x['final'] for x in s])} | "
            f"{mean_std([x['best'] for x in s])} | {steps} | {mean_std([x['final_entropy'] for x in s])} | "
            f"{mean_std([x['clip_low'] for x in s], 4)} | {mean_std([x['clip_high'] for x in s], 4)} | "
            f"{mean_std([x['wall_s'] for x in s], 0)} |"
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
