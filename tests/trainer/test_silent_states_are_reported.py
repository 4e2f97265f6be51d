"""A run is never silent about a state that wastes it (issue 24, items 14-16): a warm start that
stopped below its target, steps in which no group had reward variance, and long stretches
without a progress line (training and `tether eval`, both redirected to a file, flushed)."""

import json
import subprocess
import sys
import time

import pytest

from tether.config.loading import load_config
from tether.evaluation.progress import progress as eval_progress
from tether.rewards import REWARDS, RewardResult
from tether.records.sinks import Heartbeat, PlainProgress
from tether.trainer.loop import FLAT_WARN_AFTER, flat_streak, train

ALWAYS_ZERO = "test_always_zero"
if ALWAYS_ZERO not in REWARDS:
    REWARDS.register(ALWAYS_ZERO)(lambda completion, example: RewardResult(0.0, {}))


class _File:
    """A stream that is not a terminal (output redirected to a file)."""

    def isatty(self):
        return False


# ---------------------------------------------------------------- flat steps (item 14)


def test_flat_streak_counts_steps_without_variance_and_warns_at_three_then_every_log_every():
    cfg = load_config(None, ["trainer.log_every=2"])  # dynamic sampling off: flat = every group flat
    flat, live = {"adv/zero_var_frac": 1.0, "reward/mean": 0.0}, {"adv/zero_var_frac": 0.5, "reward/mean": 0.4}
    streak, warned = 0, []
    for step, m in enumerate([flat, flat, flat, flat, flat, live, flat], start=1):
        streak, line = flat_streak(m, cfg.rollout, cfg.trainer.log_every, streak)
        warned += [(step, streak)] if line else []
    # streaks 1 2 3 4 5 | 0 | 1: a warning at 3 (FLAT_WARN_AFTER) and at 3 + log_every = 5, none after the reset
    assert FLAT_WARN_AFTER == 3 and streak == 1
    assert warned == [(3, 3), (5, 5)]


def test_flat_streak_with_dynamic_sampling_reads_the_kept_fraction():
    cfg = load_config(None, ["rollout.dynamic_sampling=true"])
    # zero_var_frac = 1 on the first round, but a refill round found a live group: not flat
    assert (
        flat_streak(
            {"adv/zero_var_frac": 1.0, "rollout/dynamic_kept_frac": 0.25, "reward/mean": 0.0},
            cfg.rollout,
            cfg.trainer.log_every,
            2,
        )[0]
        == 0
    )
    streak, line = flat_streak(
        {"adv/zero_var_frac": 1.0, "rollout/dynamic_kept_frac": 0.0, "reward/mean": 0.0},
        cfg.rollout,
        cfg.trainer.log_every,
        2,
    )
    assert streak == 3 and "dynamic sampling kept 0 of 16 groups after 3 refill rounds" in line


@pytest.mark.slow
def test_a_run_warns_of_a_warm_start_below_target_and_of_flat_steps(tiny_dir, tmp_path):
    """The warm start stops at its 2-step budget far below target 1.0; the reward is 0 for every
    sample, so dynamic sampling keeps no group at any step: both are said, and logged as metrics."""
    lines = []
    cfg = load_config(
        None,
        [
            f"model.name_or_path={tiny_dir}",
            f"output_dir={tmp_path / 'run'}",
            f"reward.name={ALWAYS_ZERO}",
            "warm_start.enabled=true",
            "warm_start.max_steps=2",
            "warm_start.eval_every=1",
            "warm_start.batch_size=4",
            "warm_start.target_accuracy=1.0",
            f"warm_start.cache_dir={tmp_path / 'cache'}",
            "rollout.dynamic_sampling=true",
            "rollout.dynamic_sampling_max_rounds=1",
            "rollout.prompts_per_step=2",
            "rollout.group_size=2",
            "rollout.max_new_tokens=4",
            "data.eval_size=4",
            "trainer.total_steps=3",
            "trainer.progress=false",
            "trainer.plots=false",
            "trainer.tensorboard=false",
            "trainer.threads=1",
        ],
    )
    run = train(cfg, log=lines.append)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["warm_start/below_target"] == 1.0 and rows[0]["warm_start/steps"] == 2.0
    assert rows[0]["warm_start/accuracy"] < 1.0
    assert [r["rollout/flat_streak"] for r in rows[1:]] == [1.0, 2.0, 3.0]
    assert [r["rollout/dynamic_kept_frac"] for r in rows[1:]] == [0.0, 0.0, 0.0]
    warnings = [x for x in lines if x.startswith("warning:")]
    assert any("warm_start.max_steps=2" in w and "below warm_start.target_accuracy=1.0" in w for w in warnings)
    assert any("3 steps in a row with no reward variance" in w for w in warnings)
    # The cached warm start warns again: its model is as weak the second time.
    lines.clear()
    cfg.output_dir = str(tmp_path / "run2")
    cfg.trainer.total_steps = 1
    train(cfg, log=lines.append)
    assert any("cached model" in x for x in lines) and any("below warm_start.target_accuracy" in x for x in lines)


@pytest.mark.slow
@pytest.mark.parametrize("skip", [True, False])
def test_flat_steps_take_no_optimiser_step_and_the_warning_says_what_changed(tiny_dir, tmp_path, skip):
    """Issue 49, defect 2: with every group flat (reward 0 everywhere) GRPO's k3 KL term still moved the weights
    (Adam scales its near-zero gradient into full-size steps: kl/ref 7e-14 -> 6e-3 in 5 steps) while the warning
    said nothing trained. With trainer.skip_flat_steps (the default) the weights do not change; without it the
    warning says what moved them."""
    import torch

    from tether.records import checkpoint

    lines = []
    cfg = load_config(
        None,
        [
            f"model.name_or_path={tiny_dir}",
            f"output_dir={tmp_path / 'run'}",
            f"reward.name={ALWAYS_ZERO}",
            "warm_start.enabled=false",
            "objective=grpo",
            "objective.entropy_coef=0.01",  # a gradient that a flat step still has (GRPO's k3 KL's is exactly 0 here)
            f"trainer.skip_flat_steps={str(skip).lower()}",
            "rollout.prompts_per_step=2",
            "rollout.group_size=2",
            "rollout.max_new_tokens=4",
            "data.eval_size=4",
            "trainer.total_steps=4",
            "trainer.save_every=1",
            "trainer.progress=false",
            "trainer.plots=false",
            "trainer.tensorboard=false",
            "trainer.threads=1",
        ],
    )
    run = train(cfg, log=lines.append)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["optim/flat_skipped"] for r in rows[1:]] == [float(skip)] * 4
    from safetensors.torch import load_file

    weights = [
        load_file(str(next((ckpt / "model").glob("*.safetensors")))) for ckpt in checkpoint.list_checkpoints(run)
    ]
    unchanged = all(torch.equal(weights[0][k], w[k]) for w in weights[1:] for k in weights[0])
    assert unchanged == skip
    warning = next(x for x in lines if "3 steps in a row with no reward variance" in x)
    if skip:
        assert "no optimiser step was taken (trainer.skip_flat_steps)" in warning
    else:
        assert "the weights moved only by the KL penalty and the entropy bonus" in warning


# ---------------------------------------------------------------- heartbeats (item 16)


def _wait_for(condition, limit_s: float = 60.0) -> None:
    """Until `condition()` holds, or `limit_s` (a loaded machine runs the heartbeat's thread late, so no
    test asserts how soon it spoke, only that it did and what it said; issue 32, item 7)."""
    deadline = time.monotonic() + limit_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_heartbeat_speaks_after_a_quiet_spell_and_not_while_lines_come():
    lines = []
    beat = Heartbeat(lines.append, lambda quiet: quiet, every_s=1.0)
    try:
        for _ in range(15):  # a line every 0.1 s: never quiet for 1 s
            time.sleep(0.1)
            beat.beat()
        assert lines == []
        _wait_for(lambda: len(lines) >= 2)  # quiet: at least two heartbeats, each after 1 s without a line
        assert len(lines) >= 2 and all(quiet >= 1.0 for quiet in lines)
    finally:
        beat.close()


def test_plain_progress_speaks_during_a_slow_step_and_at_the_next_step_after_a_quiet_minute():
    lines = []
    progress = PlainProgress(total=100, start=0, every=1000, log=lines.append, heartbeat_s=0.3)
    try:
        progress.update(1, {"reward/mean": 0.5})  # off the step cadence (every 1000), not yet quiet: no line
        assert lines == []
        _wait_for(lambda: lines)  # step 2 takes "long": the heartbeat names it while it runs
        assert lines and lines[0].startswith("step 2/100 under way for 0m00s")
        progress._quiet_since -= 1.0  # a quiet spell of the log: the next step's line is due
        progress.update(2, {"reward/mean": 0.5})
        assert lines[-1].startswith("step 2/100  reward 0.500")
    finally:
        progress.close()


def test_a_heartbeat_never_speaks_while_steps_finish_without_lines():
    """Steps that finish within the heartbeat's period keep it quiet even when none of them prints a line
    (it said "no step finished in the last 1m00s" after three had finished, unprinted)."""
    lines = []
    progress = PlainProgress(total=1000, start=0, every=1000, log=lines.append, heartbeat_s=0.4)
    try:
        for step in range(1, 9):  # a step every 0.1 s, none on the cadence
            time.sleep(0.1)
            progress.update(step, {"reward/mean": 0.5})
        assert not any("under way" in line for line in lines), lines
    finally:
        progress.close()


def test_a_step_line_says_what_a_practitioner_reads_and_a_sample_comes_with_it():
    from tether.records.sinks import step_line

    m = {
        "reward/mean": 0.531,
        "adv/zero_var_frac": 0.25,
        "policy/clipfrac_low": 0.008,
        "policy/clipfrac_high": 0.002,
        "rollout/len_mean": 31.4,
        "rollout/truncation_rate": 0.125,
        "policy/entropy": 0.52,
        "kl/ref": 0.0011,
        "time/sample_s": 9.1,
        "time/old_logprobs_s": 2.0,
        "time/ref_logprobs_s": 1.0,
        "time/update_s": 10.2,
    }
    assert step_line(5, 20, m, 22.4) == (
        "step 5/20  reward 0.531  flat 0.25  clip 0.8%/0.2%  len 31 (trunc 12.5%)  ent 0.520  kl 0.0011  "
        "22.4 s/step (sample 9.1, logp 3.0, update 10.2)"
    )
    lines = []
    progress = PlainProgress(total=20, start=0, every=1, log=lines.append)
    try:
        progress.update(1, {**m, "time/step_s": 22.4}, ("2 + 3 =\n 5", "5", 1.0))
        progress.update(2, {**m, "time/step_s": 22.4}, ("7", "6", 0.0))  # no sample: not due
        progress.update(3, {**m, "time/step_s": 22.4, "eval/accuracy": 0.5}, ("2", "2", 1.0))
    finally:
        progress.close()
    assert lines[0].startswith("step 1/20  reward 0.531") and lines[1] == "  sample (reward 1.00, answer 5): 2 + 3 = 5"
    assert lines[2].startswith("step 2/20") and lines[3].startswith("step 3/20") and "acc 0.500 @3" in lines[3]
    assert lines[4] == "  sample (reward 1.00, answer 2): 2"


# ---------------------------------------------------------------- tether eval to a file (item 15)


def test_eval_progress_to_a_file_is_plain_lines_from_the_start():
    lines = []
    with eval_progress(True, 40, 0, stream=_File(), log=lines.append, every_s=60) as advance:
        assert lines == ["eval: 40 problems"]  # at once, before the first batch
        for _ in range(5):
            advance(8)
    # a line every tenth (4 problems): each batch of 8 crosses a boundary, the last is 40/40
    assert len(lines) == 6 and lines[1].startswith("eval 8/40 problems") and lines[-1].startswith("eval 40/40")


@pytest.mark.slow
def test_tether_eval_redirected_writes_its_first_line_while_it_runs(tiny_dir, tmp_path):
    log = tmp_path / "eval.log"
    cmd = [
        sys.executable,
        "-m",
        "tether.cli",
        "eval",
        str(tiny_dir),
        "task:arithmetic",
        "--n",
        "4",
        "--limit",
        "48",
        "--out",
        str(tmp_path / "out"),
    ]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            seen_running = False
            while proc.poll() is None:
                if "eval: 48 problems" in log.read_text():
                    seen_running = proc.poll() is None
                    break
                time.sleep(0.05)
            proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    assert proc.returncode == 0, text
    assert seen_running, f"the first progress line was only written at exit:\n{text}"
    assert "eval 48/48 problems" in text


# ---------------------------------------------------------------- threads (item 16)


@pytest.mark.parametrize(
    "setting, cores, expected",
    [
        (0, 2, 1),
        (0, 1, 1),
        (0, 16, 8),
        (0, 64, 8),
        (0, 6, 3),  # auto: cores // 2, at least 1, at most 8
        (3, 64, 3),
        (-1, 64, 0),  # N as given; -1 keeps torch's default (0: nothing set)
    ],
)
def test_auto_threads_are_half_the_cores_between_one_and_eight(setting, cores, expected):
    from tether.model.devices import cpu_threads

    threads, why = cpu_threads(setting, cores)
    assert threads == expected
    assert bool(why) == (setting == 0)


def test_threads_below_minus_one_are_refused():
    from tether.schema import ConfigError

    with pytest.raises(ConfigError, match="trainer.threads"):
        load_config(None, ["trainer.threads=-2"])


@pytest.mark.slow
def test_a_resume_continues_the_flat_streak(tiny_dir, tmp_path):
    """Killed after 2 flat steps and resumed, the count goes on (3, 4), as in an uninterrupted run."""

    def cfg(steps):
        return load_config(
            None,
            [
                f"model.name_or_path={tiny_dir}",
                f"output_dir={tmp_path / 'run'}",
                f"reward.name={ALWAYS_ZERO}",
                "warm_start.enabled=false",
                "rollout.prompts_per_step=2",
                "rollout.group_size=2",
                "rollout.max_new_tokens=4",
                "data.eval_size=4",
                f"trainer.total_steps={steps}",
                "trainer.save_every=1",
                "trainer.progress=false",
                "trainer.plots=false",
                "trainer.tensorboard=false",
                "trainer.threads=1",
            ],
        )

    run = train(cfg(2), log=lambda *_: None)
    train(cfg(4), resume_dir=str(run), log=lambda *_: None)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("rollout/flat_streak") for r in rows] == [None, 1.0, 2.0, 3.0, 4.0]


def test_the_truncation_warning_names_the_key_that_cut_the_samples():
    """Issue 49, defect 8: in episodes the warning named rollout.max_new_tokens when env.max_turn_tokens cut."""
    from tether.trainer.loop import first_step_warnings

    m = {"rollout/truncation_rate": 0.9, "adv/zero_var_frac": 0.5}
    single = load_config(None, ["rollout.max_new_tokens=48"])
    (line,) = first_step_warnings(m, single.rollout, single.env)
    assert "ran out of rollout.max_new_tokens=48" in line and "raise rollout.max_new_tokens" in line
    episodes = load_config(None, ["env.name=retry", "env.max_turn_tokens=16", "rollout.max_new_tokens=48"])
    (line,) = first_step_warnings(m, episodes.rollout, episodes.env)
    assert "env.max_turn_tokens=16" in line and "env.max_episode_tokens=96" in line
    assert "rollout.max_new_tokens=48" not in line and "raise env.max_turn_tokens" in line
