"""tether's training loop: sample, score, advantage, update, log, checkpoint.

    run <- start_run(cfg)                                         tether.trainer.setup: new, or resumed
    for step in 1..total_steps:                                   tether.trainer.step.rl_step:
        prompts  <- the data stream (resumable position)
        rollout  <- engine.generate(prompts, group_size)          sampler log-probs, finish reasons
        rewards  <- verifier(completion, example)                 (dynamic sampling: refill flat groups)
        A        <- objective.advantages(rewards, groups)
        old, ref <- log-probs recomputed before any update        (ref only when the objective needs it)
        for epoch in ppo_epochs, mini-batch in mini_batches:      one optimiser step per mini-batch
            micro-batches accumulate with the mini-batch normaliser   (tether.trainer.update)
        reference refresh every K optimiser steps or on a KL threshold (docs/algorithms/rpg.md)
        log metrics (one host sync), evaluate held-out accuracy, checkpoint (weights, optimiser, `Counters`)

The setup lives in `tether.trainer.setup`, one step in `tether.trainer.step`; this module is the loop that
joins them.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Optional

from transformers.utils import logging as hf_logging

from .. import faults
from ..config.sections import Config, EnvConfig, RolloutConfig
from ..model.causal_lm import shared_prompt_reason
from ..records import checkpoint
from ..records.checkpoint import rng_state, set_rng_state
from ..records.plots import plot_run
from ..records.runlog import HELDOUT_FILE, accuracy, read_metrics
from ..records.sinks import JsonlSink, TensorBoardSink, WandbSink, make_progress, truncate_jsonl
from ..records.summary import write_samples, write_summary
from ..envs import EnvironmentBroken, EnvWarnings, env_label
from ..rollout import RolloutBatch
from ..rewards import FaultWarnings, RewardBroken, greedy_evaluation, reward_label
from ..schema import ConfigError, to_dict
from . import step_zero
from .setup import Run, start_run
from .step import rl_step
from .stopping import Interrupted, StopNow, StopSignals


def train(cfg: Config, resume_dir: Optional[str] = None, log=print) -> Path:
    """Run (or resume) training; returns the run directory.

    SIGINT and SIGTERM stop it cleanly after the step under way (tether.trainer.stopping): a checkpoint
    of that step, the summary and the plots, then `Interrupted`.
    """
    hf_logging.disable_progress_bar()  # tether draws its own progress bar
    run, t = start_run(cfg, resume_dir, log), cfg.trainer
    at, parts, counters = run.progress, run.parts, run.progress.counters
    if resume_dir is not None and _already_finished(run, log):
        return run.records.run_dir
    sinks, samples_file, heldout_file = _open_logs(run, resume_dir)
    progress = make_progress(t.total_steps, at.start, t.progress, t.log_every_steps, log)
    tic, bad_steps, stop = time.perf_counter(), 0, StopSignals(log)
    env_warnings = EnvWarnings(env_label(run.cfg.env), log_file=run.records.run_dir / ERRORS_FILE)
    warnings = (FaultWarnings(reward_label(parts.source.reward_fn)), env_warnings)
    before_any_step = False
    try:
        with stop, _broken_reward(run):
            if at.start == 0 and not _log_step_zero(run, sinks, heldout_file, progress, stop, log):
                raise _StoppedBeforeAnyStep(stop.signum)
            for step in range(at.start + 1, t.total_steps + 1):
                if stop.signum is not None:
                    break
                with _droppable(run, stop, step, log) as dropped:
                    scored, metrics = rl_step(parts, counters, step)  # counts the step in `counters`
                if dropped:
                    break
                bad_steps = _checks(run, step, scored, metrics, bad_steps, warnings, log)
                if bad_steps >= t.max_nonfinite_steps:
                    _stop_nonfinite(run, bad_steps, metrics, sinks)
                if step % t.eval_every == 0 or step == t.total_steps:
                    _evaluate_after(run, step, metrics, heldout_file, progress, stop)
                _record(run, step, scored, metrics, sinks, samples_file, progress)
            if stop.signum is not None and at.saved_step != counters.step:
                run.save()  # the last finished step, so the resume loses nothing
    except _StoppedBeforeAnyStep:
        before_any_step = True  # the step-0 evaluation was abandoned: nothing to summarise
    finally:
        parts.source.sampler.close()  # the overlap's batch prefetched past a stop or an error: waited for, dropped
        progress.close()
        samples_file.close()
        heldout_file.close()
        for s in sinks:
            s.close()
    if before_any_step:
        raise Interrupted(stop.signum, 0, str(run.records.run_dir), before_any_step=True)
    _finish(run, time.perf_counter() - tic, stop.signum, log)
    if stop.signum is not None:
        raise Interrupted(stop.signum, counters.step, str(run.records.run_dir))
    return run.records.run_dir


def _already_finished(run: Run, log) -> bool:
    """A resumed run that has done its steps: nothing to do, and its summary and logs are left as they are."""
    t, run_dir = run.cfg.trainer, run.records.run_dir
    if run.progress.start < t.total_steps:
        return False
    run.parts.source.sampler.close()
    log(
        f"{run_dir} already finished its {t.total_steps} steps; to train it further, resume with a "
        f"larger trainer.total_steps (`tether train --resume {run_dir} trainer.total_steps=N`)"
    )
    return True


def _record(
    run: Run, step: int, scored: RolloutBatch, metrics: dict[str, float], sinks, samples_file, progress
) -> None:
    """A finished step's metrics to every sink, its samples, its progress line; then its checkpoint when one is due
    (every trainer.save_every steps, the last step, and every new best held-out accuracy: `--step best`)."""
    t, at = run.cfg.trainer, run.progress
    for s in sinks:
        s.log(step, metrics)
    write_samples(samples_file, step, scored, scored.examples, scored.rewards, t.log_samples)
    sample = (scored.completions[0], str(scored.examples[0].answer), float(scored.rewards[0]))
    progress.update(step, metrics, sample)
    faults.point("logged")
    acc = metrics.get("eval/accuracy")
    if step % t.save_every == 0 or step == t.total_steps or (acc is not None and acc > at.best_accuracy):
        run.save(acc)


def _checks(run: Run, step: int, scored: RolloutBatch, metrics: dict[str, float], bad_steps: int, warnings, log) -> int:
    """What a finished step may need to say: after the first, the shared-prompt fallback and the early warnings;
    the reward's and the environment's faults (`warnings`: their rate-limited warners); skipped non-finite updates; a
    streak of flat steps (`rollout/flat_streak`, added to
    `metrics`). Returns the count of steps in a row with skipped updates."""
    cfg, counters = run.cfg, run.progress.counters
    if step == run.progress.start + 1:
        _log_shared_prompts(run, log)
        for line in first_step_warnings(metrics, cfg.rollout, cfg.env):
            log(line)
    reward_warnings, env_warnings = warnings
    for line in reward_warnings.lines(step, scored.completions, scored.results):
        log(line)
    for line in env_warnings.lines(step, scored.episodes or []):
        log(line)
    env_warnings.write_tracebacks(step, scored.episodes or [])
    skipped = _skipped_updates(metrics, step, scored)
    if skipped:
        log(skipped)
    counters.flat_streak, warning = flat_streak(metrics, cfg.rollout, cfg.trainer.log_every_steps, counters.flat_streak)
    metrics["rollout/flat_streak"] = float(counters.flat_streak)
    if warning:
        log(warning)
    return bad_steps + 1 if skipped else 0


@contextlib.contextmanager
def _droppable(run: Run, stop: StopSignals, step: int, log):
    """Within, a first signal drops the step (`StopNow`, tether.trainer.stopping) until its first optimiser step:
    the prompts it took and the random state are put back, so a resume redoes it as if never begun.
    Yields a list that holds True when the step was dropped. Not with trainer.overlap (its sampler
    thread has already taken the next batch's prompts) nor trainer.staleness (its FIFO of policies
    has moved on): those finish the step."""
    dropped: list[bool] = []
    source, policy = run.parts.source, run.parts.policy
    if not source.sampler.droppable:
        yield dropped
        return
    position, rng = source.stream.position, rng_state()
    hook = policy.optimizer.register_step_pre_hook(lambda *_: stop.before_update())
    stop.droppable = True
    try:
        yield dropped
    except StopNow:
        source.stream.position = position
        set_rng_state(rng)
        policy.model.train()
        log(f"step {step} stopped before it changed the weights: dropped (a resume redoes it)")
        dropped.append(True)
    finally:
        stop.droppable = stop.pending = False
        hook.remove()


@contextlib.contextmanager
def _broken_reward(run: Run):
    """A reward that fails on every completion (`RewardBroken`), or an environment on every episode
    (`EnvironmentBroken`), before a new run's first step has finished is a ConfigError (the CLI's `error:`, exit 2),
    and the run directory it leaves
    is removed (`Run.discard`): nothing was learned, and a directory holding a config and a step-0
    line would pass for a run. Later, or on resume, it propagates as it is."""
    try:
        yield
    except (RewardBroken, EnvironmentBroken) as err:
        if run.progress.start != 0 or run.progress.counters.step != 0:
            raise
        removed = run.discard()
        raise ConfigError(f"{err} ({removed})") from None


def _open_logs(run: Run, resume_dir: Optional[str]):
    """The metric sinks, samples.jsonl and heldout.jsonl, open for appending; on resume, what was logged after the
    checkpoint is dropped first (everything, when there is none)."""
    run_dir, start = run.records.run_dir, run.progress.start
    resume_after = start if start else (-1 if resume_dir else None)
    sinks = [JsonlSink(run_dir / "metrics.jsonl", resume_after)]
    if run.cfg.trainer.tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tb"))
    if run.cfg.trainer.wandb:
        sinks.append(WandbSink(run.cfg.trainer.wandb_project, run_dir, to_dict(run.cfg)))
    for name in ("samples.jsonl", HELDOUT_FILE):
        if resume_after is not None and (run_dir / name).exists():
            truncate_jsonl(run_dir / name, resume_after)
    return sinks, (run_dir / "samples.jsonl").open("a"), (run_dir / HELDOUT_FILE).open("a")


def write_heldout(f, step: int, outcomes: dict[str, list]) -> None:
    """One held-out evaluation's per-problem outcomes as a line of heldout.jsonl (`runlog.heldout` reads it)."""
    f.write(json.dumps({"step": step, **outcomes}) + "\n")
    f.flush()


def evaluate(run: Run) -> tuple[dict[str, float], dict[str, list]]:
    """Held-out greedy accuracy of the policy as it is (`rewards.greedy_evaluation`: the task's 0/1 verifier), and
    the per-problem outcomes."""
    r, t, e, policy = run.cfg.rollout, run.cfg.trainer, run.evaluation, run.parts.policy
    policy.model.eval()
    with policy.precision():
        return greedy_evaluation(
            e.engine,
            e.examples,
            e.verifier,
            r.max_new_tokens,
            r.stop_strings,
            seed=t.seed,
            batch_size=t.eval_batch_size,
            lenient=e.lenient,
        )


class _StoppedBeforeAnyStep(Exception):
    """A signal abandoned the step-0 evaluation: the run stops with nothing but its config written."""


def _log_step_zero(run: Run, sinks, heldout_file, progress, stop: StopSignals, log) -> bool:
    """A new run's step 0: held-out accuracy before any update, with the warm start's metrics. A signal abandons
    the evaluation at once (False): no step has run, nothing is kept but the config."""
    progress.phase("the step-0 evaluation")
    try:
        kept = "no step has run, so nothing is lost (resume the run or start it again)"
        with stop.abandoning("the step-0 evaluation", kept):
            (evaluated, outcomes), cached = step_zero.shared(run.cfg, lambda: evaluate(run))
    except StopNow:
        return False
    finally:
        progress.phase(None)
    m = {**evaluated, **run.records.warm_start}
    write_heldout(heldout_file, 0, outcomes)
    for s in sinks:
        s.log(0, m)
    progress.update(0, m)
    shared = f" (shared: evaluated once for this initial model, {cached})" if cached else ""
    log(f"step 0: held-out accuracy {m['eval/accuracy']:.3f}{shared}")
    return True


def _evaluate_after(run: Run, step: int, metrics: dict, heldout_file, progress, stop: StopSignals) -> None:
    """The held-out evaluation after `step` (its weights already updated), into `metrics` and heldout.jsonl. A signal
    abandons it at once: the step is logged and checkpointed without it."""
    progress.phase(f"the held-out evaluation after step {step}")
    kept = f"step {step} is logged and checkpointed without its evaluation"
    try:
        with stop.abandoning(f"the held-out evaluation after step {step}", kept):
            evaluated, outcomes = evaluate(run)
    except StopNow:
        return
    finally:
        progress.phase(None)
    metrics.update(evaluated)
    write_heldout(heldout_file, step, outcomes)


def _log_shared_prompts(run: Run, log) -> None:
    """After a run's first step, when trainer.share_prompts could not be honoured, why (the fused head's check
    of the model's cached forward runs in that step)."""
    t, model = run.cfg.trainer, run.parts.policy.model
    if t.share_prompts and t.fused_logprobs and not run.records.unfused and shared_prompt_reason(model):
        log(f"shared prompts off: {shared_prompt_reason(model)}; each row runs its prompt")


ERRORS_FILE = "errors.log"
"""Every environment fault of a run with its traceback, appended step by step (`EnvWarnings.write_tracebacks`)."""

FLAT_WARN_AFTER = 3
"""Rollout steps in a row with no reward variance in any group before the trainer warns."""


def flat_streak(metrics: dict[str, float], r: RolloutConfig, log_every: int, streak: int) -> tuple[int, str]:
    """Count rollout steps in a row in which no group had reward variance (every advantage 0, so
    nothing trains): with dynamic sampling, no group was kept after every refill round; without,
    every group of the batch was flat. Returns the new count, logged as `rollout/flat_streak`, and a
    warning line at FLAT_WARN_AFTER steps in a row and every `log_every` (`trainer.log_every`) steps after,
    else ""."""
    dynamic = r.dynamic_sampling
    flat = metrics.get("rollout/dynamic_kept_frac") == 0.0 if dynamic else metrics["adv/zero_var_frac"] == 1.0
    streak = streak + 1 if flat else 0
    due = streak >= FLAT_WARN_AFTER and (streak - FLAT_WARN_AFTER) % max(1, log_every) == 0
    if not due:
        return streak, ""
    what = (
        f"dynamic sampling kept 0 of {r.prompts_per_step} groups after {r.dynamic_sampling_max_rounds} refill rounds"
        if dynamic
        else "every group was flat"
    )
    return streak, (
        f"warning: {streak} steps in a row with no reward variance ({what}): every sample of a "
        f"group got the same reward, so every advantage is 0 and {_flat_effect(metrics)}. The task is too "
        f"hard or too easy for this policy (reward/mean {metrics['reward/mean']:.3f}): check the "
        f"warm start and the reward, or raise rollout.group_size or rollout.temperature"
    )


def _flat_effect(metrics: dict[str, float]) -> str:
    """What a step with every advantage 0 did to the weights, as the step's metrics say."""
    if metrics.get("optim/flat_skipped"):
        return "no optimiser step was taken (trainer.skip_flat_steps)"
    if "distill/reverse_kl" in metrics:  # a distilling step is never skipped: the teacher's signal is not flat
        return "the weights moved by the teacher's signal alone (objective.distill)"
    return (
        "the weights moved only by the KL penalty and the entropy bonus, whose near-zero gradients Adam scales into "
        "full-size steps (trainer.skip_flat_steps=true skips such steps)"
    )


TRUNCATED_WARN = 0.75
"""The share of a first step's samples cut off by rollout.max_new_tokens from which the trainer warns (most of
them: a few cut off at first is usual, and RL shortens them)."""


def first_step_warnings(metrics: dict[str, float], r: RolloutConfig, env: Optional[EnvConfig] = None) -> list[str]:
    """`warning:` lines after a run's first step when it cannot learn as set up, naming the likely cause: no
    group had reward variance (every advantage 0: nothing trains), or most samples ran out of their token
    budget before they stopped (their answers are cut off, so they score 0). The budget is named by the key that
    set it: in episodes env.max_turn_tokens and env.max_episode_tokens, else rollout.max_new_tokens (issue 49:
    the warning named rollout.max_new_tokens where env.max_turn_tokens had cut the turns)."""
    lines = []
    truncated = metrics.get("rollout/truncation_rate", 0.0)
    if truncated >= TRUNCATED_WARN:
        if env is not None and env.enabled:
            budget = (
                f"their turn's budget (env.max_turn_tokens={env.turn_tokens(r)}"
                f"{'' if env.max_turn_tokens else ', from rollout.max_new_tokens'}) or the episode's "
                f"(env.max_episode_tokens={env.episode_tokens(r)})"
            )
            fix = "raise env.max_turn_tokens (or env.max_episode_tokens)"
        else:
            budget, fix = f"rollout.max_new_tokens={r.max_new_tokens}", "raise rollout.max_new_tokens"
        lines.append(
            f"warning: {100 * truncated:.0f}% of the first step's samples ran out of {budget} before they stopped, "
            f"so their answers are cut off and score 0: {fix}, or ask for a shorter answer (data.task_args.template)"
        )
    flat = (
        metrics.get("rollout/dynamic_kept_frac") == 0.0
        if r.dynamic_sampling
        else metrics.get("adv/zero_var_frac") == 1.0
    )
    if flat:
        lines.append(
            f"warning: in the first step no group's samples differed in reward (reward/mean "
            f"{metrics.get('reward/mean', float('nan')):.3f}), so every advantage is 0 and "
            f"{_flat_effect(metrics)}. The task "
            "is too hard (or too easy) for this model as prompted: check the prompt template and the reward on a "
            "few samples (samples.jsonl), or raise rollout.group_size or rollout.temperature"
        )
    return lines


def _skipped_updates(metrics: dict[str, float], step: int, scored: RolloutBatch) -> str:
    """A log line when this step skipped updates with a non-finite loss or gradient, else ""."""
    if metrics["optim/skipped_updates"] == 0:
        return ""
    return (
        f"step {step}: {int(metrics['optim/skipped_updates'])} update(s) skipped: "
        f"{int(metrics['optim/skipped_nonfinite_loss'])} with a non-finite loss, "
        f"{int(metrics['optim/skipped_nonfinite_grad'])} with a finite loss but a non-finite gradient "
        f"(loss/total={metrics.get('loss/total')}, reward/mean={scored.rewards.mean().item()})"
    )


def _stop_nonfinite(run: Run, bad_steps: int, metrics: dict[str, float], sinks) -> None:
    """trainer.max_nonfinite_steps bad steps in a row: log the step, checkpoint it, raise."""
    step = run.progress.counters.step
    for sink in sinks:
        sink.log(step, metrics)
    run.save()
    raise RuntimeError(
        f"stopping at step {step}: {bad_steps} steps in a row had a non-finite loss or gradient "
        f"(see metrics.jsonl 'optim/skipped_updates'; check rewards for NaN, lower trainer.lr). The "
        f"weights are those of the last good update; a checkpoint was written to "
        f"{run.records.run_dir / 'checkpoints'}."
    )


def _export_hint(run_dir: Path) -> str:
    """The export command that will work on this run: `--step best` when a checkpoint recorded its held-out
    accuracy, else `--step last` (issue 49: the closing line named `--step best` where it failed), else none."""
    saved = checkpoint.list_checkpoints(run_dir)  # manifests only: export checks the files' checksums itself
    if any(checkpoint.recorded_accuracy(c) is not None for c in saved):
        return f" (`tether export {run_dir} --step best OUT`)"
    if saved:
        return f" (`tether export {run_dir} --step last OUT`: no checkpoint recorded a held-out accuracy)"
    return ""


def _finish(run: Run, wall_s: float, signum: Optional[int], log) -> None:
    """summary.md (what the run was, then the metrics table) and the plots."""
    run_dir, at = run.records.run_dir, run.progress
    log(write_summary(run.cfg, run_dir, at.start, at.counters.step, wall_s, run.parts.policy.device, signum))
    if run.cfg.trainer.plots:
        plot_run(run_dir)
    evals = accuracy(read_metrics(run_dir, missing_ok=True))
    if evals:
        (first_step, first), (last_step, last) = evals[0], evals[-1]
        best_step, best = max(evals, key=lambda e: (e[1], -e[0]))
        plots = f"; plots in {run_dir / 'plots'}" if run.cfg.trainer.plots else ""
        log(
            f"held-out accuracy {first:.3f} (step {first_step}) -> {last:.3f} (step {last_step}), best {best:.3f} at "
            f"step {best_step}; checkpoints in {run_dir / 'checkpoints'}{_export_hint(run_dir)}{plots}"
        )
    log(f"run directory: {run_dir}")
