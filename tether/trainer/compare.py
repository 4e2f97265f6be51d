"""`tether compare`: methods side by side on one budget; the report is `tether.reports.report`'s.

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
Runs that start from the same model evaluate it once at step 0 (`trainer.step0_cache` = OUT/step0).

`null_control=BASELINE` adds an A/A pair: BASELINE runs a second time, as `BASELINE_null`, from the same
initial model, data order, held-out set and sampling stream, with only its mini-batch order changed
(`trainer.minibatch_seed` = the seed + NULL_MINIBATCH_OFFSET): coupled as the methods of one seed are, so that
its spread is the noise floor of the claims' differences (an independent sampling stream, the earlier null
control, spread 1.5-3 times as wide as the methods did). The report tests it in the claims' family
(tether.reports.family), each seed's label drawn by a coin.

A claims file with a `design:` (tether.reports.sequential) runs the comparison in waves: every arm's seeds up to
the first look, a report, then the seeds up to the next look for the arms that a claim still open needs (its
method and baseline, and the null control's pair while any claim is open), until every claim is decided or the
last look is reached. The report of each look is written as it is reached; the design is recorded at the first.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from ..config.loading import load_config
from ..config.sections import PRESENTATION_KEYS, Config, config_differences
from ..records import checkpoint
from ..records.runlog import finished as is_finished
from ..reports.claims import load_claims, load_design
from ..reports.report import NULL_SUFFIX, write_report
from ..schema import ConfigError, RunsFailed
from .loop import train

STEP0_DIR = "step0"
"""Where a comparison's runs share their step-0 evaluation (`trainer.step0_cache`, tether.trainer.step_zero)."""
NULL_MINIBATCH_OFFSET = 10_000
"""Seed k's null-control run orders its mini-batches with trainer.minibatch_seed = k + this."""


def run_dir(out: Path, objective: str, seed: int) -> Path:
    return Path(out) / objective / f"seed{seed}"


def compare(
    config: Optional[str],
    objectives: list[str],
    seeds: Optional[int],
    overrides: list[str],
    out: str,
    threshold: Optional[float] = None,
    log=print,
    claims: Optional[str] = None,
    jobs: int = 1,
    null_control: Optional[str] = None,
) -> Path:
    """Run every objective x seed (skipping finished runs, resuming interrupted ones), then report.

    With a claims file that holds a `design:`, the seeds run in waves up to each look; after each look the
    report tests the claims, and the next wave runs only the arms an open claim (and the null control) needs;
    once every claim is decided, no further seed runs (module header).
    jobs > 1: that many runs at a time, each in a child `tether train` process (module header).
    null_control: one of `objectives`, run again with another mini-batch order (module header)."""
    if null_control is not None and null_control not in objectives:
        raise ConfigError(
            f"--null-control {null_control!r}: name one of the compared objectives ({', '.join(objectives)})"
        )
    design = load_design(claims) if claims else None
    if claims:
        load_claims(claims)  # a bad claims file fails now, not after the runs
    looks = _looks(design, seeds)
    out_dir = Path(out)
    arms = _arms(objectives, null_control)
    plans = _plans(config, arms, looks[-1], overrides, out_dir)
    if null_control is not None:
        _check_null_control(plans[0].cfg)
    if jobs < 1:
        raise ValueError(f"jobs={jobs}: expected 1 or more runs at a time")
    out_dir.mkdir(parents=True, exist_ok=True)
    needed, report, done = {label for label, _, _ in arms}, None, 0
    for k, n in enumerate(looks):
        wave = [p for p in plans if p.label in needed and p.seed < n]
        _run(wave, config, jobs, log, done)
        done = n
        ran = [p.run for p in plans if p.seed < n and (p.label in needed or is_finished(p.run))]
        report = write_report({out_dir.name: ran}, out_dir, threshold, claims)
        if design is None:
            break
        needed = _still_needed(out_dir, arms, null_control)
        if not needed:
            log(f"look {k + 1} of {len(looks)} ({n} seeds): every claim is decided; no further seed runs")
            break
        if k + 1 < len(looks):
            log(f"look {k + 1} of {len(looks)} ({n} seeds): continuing with {', '.join(sorted(needed))}")
    return report


def _looks(design, seeds: Optional[int]) -> tuple[int, ...]:
    """The seed counts at which compare reports: the design's looks, or `seeds` once (3 when not given)."""
    if design is None:
        return (3 if seeds is None else seeds,)
    if seeds is not None and seeds != design.max_seeds:
        raise ConfigError(
            f"--seeds {seeds}, but the claims file's design looks at {list(design.looks)} seeds: drop --seeds (the "
            "design sets them), or change the design before its first look"
        )
    return design.looks


def _run(plans: list["_Plan"], config: Optional[str], jobs: int, log, first_seed: int) -> None:
    """Train each plan's run that has not finished: resumed from its last checkpoint, else started afresh."""
    pending = []
    for i, plan in enumerate(plans, 1):
        tag = f"[{i}/{len(plans)}] {plan.label} seed {plan.seed}"
        if is_finished(plan.run):
            if plan.seed >= first_seed:
                log(f"{tag}: finished, skipped")
            continue
        resume = checkpoint.latest(plan.run) is not None
        if not resume and plan.run.exists():
            shutil.rmtree(plan.run)  # started but never checkpointed: nothing to keep
        action = "resuming" if resume else "training"
        if jobs == 1:
            log(f"{tag}: {action}")
            train(plan.cfg, resume_dir=str(plan.run) if resume else None, log=log)
            continue
        # A resumed run reads its own config.yaml (`tether train --resume` takes overrides only; the file's values
        # are in it); a new one is built from the file and the overrides, as `load_config` built `plan.cfg`.
        train_cli = [sys.executable, "-m", "tether.cli", "train"]
        if resume:
            command = [*train_cli, *plan.overrides, "--resume", str(plan.run)]
        else:
            command = [*train_cli, *([config] if config else []), *plan.overrides]
        pending.append((tag, action, command, plan.run.parent.parent / "logs" / f"{plan.label}-seed{plan.seed}.log"))
    if pending:
        _run_children(pending, jobs, log)


def _still_needed(out_dir: Path, arms, null_control: Optional[str]) -> set[str]:
    """The arms the next wave runs: the methods and baselines of every claim still continuing in the report just
    written (summary.json), and the null control's pair while any claim is."""
    summary = json.loads((out_dir / "summary.json").read_text())
    open_ = [c for c in summary.get("claims", []) if str(c.get("verdict", "")).startswith("continuing")]
    needed = {c[k] for c in open_ for k in ("method", "baseline")}
    if needed and null_control is not None:
        needed |= {null_control, f"{null_control}{NULL_SUFFIX}"}
    return needed & {label for label, _, _ in arms}


def _check_null_control(cfg: Config) -> None:
    """The null control changes the mini-batch order alone: with one mini-batch it would be the baseline again."""
    if cfg.trainer.mini_batches < 2:
        raise ConfigError(
            f"--null-control reruns the baseline with another mini-batch order, which changes nothing with "
            f"trainer.mini_batches={cfg.trainer.mini_batches} (every epoch is one optimiser step on the whole "
            "batch): the A/A pair would be two copies of one run. Set trainer.mini_batches=2 or more"
        )


@dataclass(frozen=True)
class _Plan:
    """One run of a comparison: its label and seed, directory, overrides and the config they give."""

    label: str
    seed: int
    run: Path
    overrides: list[str]
    cfg: Config


def _plans(config: Optional[str], arms, seeds: int, overrides: list[str], out_dir: Path) -> list[_Plan]:
    """Every seed x arm's plan, seed by seed (an interrupted comparison's finished runs are whole seeds, which
    its report can already pair), each config loaded and checked against a run already there (the same
    settings) before any work."""
    plans = []
    for seed in range(seeds):  # seed by seed: the runs finished so far always hold whole seeds of every arm
        for label, objective, extra in arms:
            run = run_dir(out_dir, label, seed)
            shared_step0 = f"trainer.step0_cache={out_dir / STEP0_DIR}"  # the user's own setting, given later, wins
            run_overrides = [shared_step0, *overrides, f"objective={objective}", f"trainer.seed={seed}"]
            run_overrides += [f"output_dir={run}", *extra(seed)]
            cfg = load_config(config, run_overrides)
            _check_same_settings(run, cfg, out_dir)
            plans.append(_Plan(label, seed, run, run_overrides, cfg))
    return plans


def _arms(objectives: list[str], null_control: Optional[str]) -> list[tuple[str, str, Callable[[int], list[str]]]]:
    """(label, objective, seed -> extra overrides) of each arm: the objectives, then the null control's."""
    arms: list[tuple[str, str, Callable[[int], list[str]]]] = [(o, o, lambda seed: []) for o in objectives]
    if null_control is not None:
        label = f"{null_control}{NULL_SUFFIX}"
        arms.append((label, null_control, lambda seed: [f"trainer.minibatch_seed={seed + NULL_MINIBATCH_OFFSET}"]))
    return arms


STOPPED = {130, 143, -signal.SIGINT, -signal.SIGTERM}
"""Exit codes of a child `tether train` stopped by a signal (a scheduler's SIGTERM, a Ctrl-C sent to it)."""


def _run_children(pending: list[tuple[str, str, list[str], Path]], jobs: int, log) -> None:
    """Run (tag, action, command, log file) children, `jobs` at a time; raise naming every one that failed.

    Ctrl-C or SIGTERM (or any error here) passes SIGTERM to the children still running, which stop as
    `tether train` does (drop a step not yet updated, else finish and checkpoint it), and waits for them before
    re-raising. A child stopped by a
    signal (a scheduler stopping its processes) stops the comparison too: no further run is started, the
    others finish their step, and a rerun resumes them all."""
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
                if child.returncode in STOPPED:
                    log(f"{tag}: stopped by a signal; starting no further run (rerun the command to resume)")
                    failed.append(f"{tag} (stopped by a signal, log: {log_file})")
                    queue.clear()
                    for _, other, _ in running:
                        other.send_signal(signal.SIGTERM)  # they finish their step and checkpoint it
                elif child.returncode:
                    failed.append(f"{tag} (exit {child.returncode}, log: {log_file})")
                    log(f"{tag}: failed, exit {child.returncode}; see {log_file}")
                else:
                    log(f"{tag}: done")
    except BaseException:
        for _, child, _ in running:  # SIGTERM, not SIGINT: a background job's children may ignore SIGINT
            child.send_signal(signal.SIGTERM)
        for _, child, _ in running:
            try:
                child.wait(timeout=120)
            except subprocess.TimeoutExpired:
                child.kill()
        raise
    if failed:
        raise RunsFailed(
            f"{len(failed)} run(s) failed or stopped: "
            + "; ".join(failed)
            + ". Fix the cause (if any) and rerun the same command: finished runs are skipped, the rest resume."
        )


def _check_same_settings(run: Path, cfg, out_dir: Path) -> None:
    """A run already in `out_dir` must have the settings this compare would give it (budget included):
    a comparison never mixes runs of different settings."""

    saved = run / "config.yaml"
    if not saved.exists():
        return
    diff = config_differences(cfg, load_config(str(saved)), ignore=("output_dir", *PRESENTATION_KEYS))
    if diff:
        shown = "; ".join(f"{k}: {old!r} there, {new!r} now" for k, old, new in diff[:5])
        raise ConfigError(
            f"{out_dir} holds runs made with other settings ({run.relative_to(out_dir)}: {shown}); "
            f"re-run with the same settings to resume them, or pass another --out DIR"
        )
