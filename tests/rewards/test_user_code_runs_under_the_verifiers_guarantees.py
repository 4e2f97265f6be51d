"""The user's own code and settings cannot hang, poison or silently stall a run (issue 32): a
reward from the user's code runs in a worker under `reward.timeout_s`, a non-finite or
non-numeric score is 0 and counted, the first fault of each kind is a `warning:` line, and a
reward that fails on every completion of the first step is an `error:` (exit 2) that leaves no
run directory behind. Each numbered case of the issue is replayed through the CLI here."""

import json
import sys
import textwrap

import pytest

from tether.rewards import FaultWarnings, Isolated, RewardBroken, get_reward, isolate, score_batch, verifier_faults
from tether.schema import ConfigError
from tether.tasks import Example

USER_REWARDS = textwrap.dedent("""
    import os, time

    def slow_on_sevens(completion, example):
        if "7" in completion:
            time.sleep(600)  # far past any limit: only the kill ends it
        return 1.0

    def dies_on_nines(completion, example):
        if "9" in completion:
            os._exit(3)  # the worker process ends, as a segfault in a C extension would end it
        return 0.5

    def nan_when_not_empty(completion, example):
        return float("nan") if completion.strip() and completion != example.answer else 0.0

    def nan_always(completion, example):
        return float("nan")

    def raises_on_sixes(completion, example):
        if "6" in completion:
            raise ValueError("cannot parse " + completion[:8])
        return float(completion[:1].isdigit())

    def sleeps_on_odd_first_digit(completion, example):
        if completion[:1] in "13579":
            time.sleep(600)
        return float(completion[:1].isdigit())
    """)

EX = Example(id="e", prompt="p", answer="81")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """`user_rewards.py` in the current directory, found as the `tether` command finds a user's module."""
    (tmp_path / "user_rewards.py").write_text(USER_REWARDS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "user_rewards", raising=False)
    return tmp_path


def _isolated(name: str, timeout_s: float = 1.0) -> Isolated:
    reward = isolate(get_reward(f"user_rewards:{name}"), timeout_s, f"user_rewards:{name}")
    assert isinstance(reward, Isolated)
    return reward


# ---------------------------------------------------------------- the worker (items 1, 2, 5)


def test_a_hanging_call_is_killed_scored_zero_and_counted_and_the_rest_of_the_batch_scored(user_module):
    reward = _isolated("slow_on_sevens")
    try:
        results = score_batch(reward, ["1", "17", "2", "x7", "5"], [EX] * 5)
        assert [r.score for r in results] == [1.0, 0.0, 1.0, 0.0, 1.0]
        assert results[1].reason == "timeout: reward user_rewards:slow_on_sevens took longer than reward.timeout_s=1 s"
        assert verifier_faults(results) == {"reward/timeouts": 2.0, "reward/errors": 0.0}
        # One start for the call, one after each kill that left completions to score.
        assert (reward.starts, reward.restarts) == (3, 2)
    finally:
        reward.close()


def test_a_worker_that_dies_is_an_error_on_that_completion_only(user_module):
    reward = _isolated("dies_on_nines")
    try:
        results = score_batch(reward, ["1", "99", "2"], [EX] * 3)
        assert [r.score for r in results] == [0.5, 0.0, 0.5]
        assert results[1].reason == "reward error: the worker of reward user_rewards:dies_on_nines died"
        assert verifier_faults(results) == {"reward/timeouts": 0.0, "reward/errors": 1.0}
    finally:
        reward.close()


def test_non_finite_and_raising_scores_are_zero_and_counted_never_the_loss(user_module):
    reward = _isolated("nan_when_not_empty")
    try:
        results = score_batch(reward, ["", "12", "81"], [EX] * 3)
        assert [r.score for r in results] == [0.0, 0.0, 0.0]
        assert results[1].reason == "reward error: returned a non-finite score (nan)"
        assert results[1].faults == ("error", "nonfinite") and verifier_faults(results)["reward/errors"] == 1.0
    finally:
        reward.close()
    reward = _isolated("raises_on_sixes")
    try:
        results = score_batch(reward, ["1", "6x", "a"], [EX] * 3)
        assert [r.score for r in results] == [1.0, 0.0, 0.0]
        assert results[1].reason == "reward error: ValueError: cannot parse 6x"
        # Every completion of a batch failing is a bug in the reward, named.
        with pytest.raises(RewardBroken, match="the reward user_rewards:raises_on_sixes failed on every completion"):
            score_batch(reward, ["6", "66"], [EX] * 2)
    finally:
        reward.close()


def test_a_reward_that_does_not_pickle_is_refused_with_the_fix():
    from tether.rewards import user_reward

    with pytest.raises(
        ConfigError,
        match=r"reward mine cannot run in a worker .* top level of a module .* "
        r"reward.isolate=false",
    ):
        isolate(user_reward(lambda completion, example: 1.0, "mine"), 5.0, "mine")


def test_the_first_fault_of_each_kind_is_one_warning_line_naming_reward_reason_and_completion():
    from tether.rewards import RewardResult

    warn = FaultWarnings("user_rewards:r")
    timeout = RewardResult(
        0.0, {}, "timeout: reward user_rewards:r took longer than reward.timeout_s=5 s", ("timeout",)
    )
    nan = RewardResult(0.0, {}, "reward error: returned a non-finite score (nan)", ("error", "nonfinite"))
    raised = RewardResult(0.0, {}, "reward error: KeyError: 'x'", ("error",))
    ok = RewardResult(1.0)
    lines = warn.lines(1, ["fine", "slow one", "nan one", "again slow"], [ok, timeout, nan, timeout])
    assert lines == [
        "warning: step 1: reward user_rewards:r timed out on a completion, scored 0 (timeout: reward user_rewards:r "
        "took longer than reward.timeout_s=5 s); the completion: 'slow one'. Further ones are counted in "
        "reward/timeouts (metrics.jsonl) without a warning",
        "warning: step 1: reward user_rewards:r returned a non-finite score on a completion, scored 0 (reward error: "
        "returned a non-finite score (nan)); the completion: 'nan one'. Further ones are counted in reward/errors "
        "(metrics.jsonl) without a warning",
    ]
    assert warn.lines(2, ["x", "y"], [timeout, nan]) == []  # rate-limited: once per kind per run
    assert warn.lines(3, ["z"], [raised])[0].startswith("warning: step 3: reward user_rewards:r failed on a completion")


# ---------------------------------------------------------------- through the CLI (items 1, 2, 5)


def _train(tiny_dir, tmp_path, capsys, *overrides):
    from tether.cli import main

    code = main(
        [
            "train",
            f"model.name_or_path={tiny_dir}",
            f"output_dir={tmp_path / 'runs' / 'run'}",
            "warm_start.enabled=false",
            "rollout.prompts_per_step=4",
            "rollout.group_size=4",
            "rollout.max_new_tokens=6",
            "data.eval_size=4",
            "trainer.progress=false",
            "trainer.plots=false",
            "trainer.tensorboard=false",
            "trainer.threads=1",
            "trainer.total_steps=2",
            *overrides,
        ]
    )
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_nan_reward_on_the_load_time_probe_is_an_error_before_anything_is_written(user_module, tiny_dir, capsys):
    # Was (item 1): 3 steps with a NaN loss, a traceback, exit 1, a run directory and a checkpoint.
    code, out, err = _train(tiny_dir, user_module, capsys, "reward.name=user_rewards:nan_always")
    assert code == 2 and out == "" and not (user_module / "runs").exists()
    assert err == (
        "error: reward user_rewards:nan_always returned a non-finite score (nan) (called on an empty "
        "completion before training): a reward returns a finite number or a RewardResult with one; "
        "fix the reward\n"
    )


@pytest.mark.slow
def test_a_reward_failing_on_every_completion_of_step_one_is_an_error_and_leaves_no_run(user_module, tiny_dir, capsys):
    # NaN on every non-empty completion passes the probe (the empty completion and the answer score 0).
    code, out, err = _train(tiny_dir, user_module, capsys, "reward.name=user_rewards:nan_when_not_empty")
    assert code == 2 and "Traceback" not in err, err
    assert err.startswith(
        "error: the reward user_rewards:nan_when_not_empty failed on every completion of the "
        "batch (reward error: returned a non-finite score (nan); one completion: "
    )
    assert err.rstrip().endswith(
        f"(removed the run directory {user_module / 'runs' / 'run'} and {user_module / 'runs'}, which it had made)"
    )
    assert not (user_module / "runs").exists()


@pytest.mark.slow
def test_slow_and_raising_rewards_warn_once_are_counted_and_the_run_continues(user_module, tiny_dir, capsys):
    # Was (items 2 and 5): step 1 stalled for minutes with nothing naming the reward; errors only in metrics.jsonl.
    code, out, err = _train(
        tiny_dir,
        user_module,
        capsys,
        "reward.timeout_s=0.5",
        "reward.weights.user_rewards:sleeps_on_odd_first_digit=1.0",
        "reward.weights.user_rewards:raises_on_sixes=1.0",
    )
    assert code == 0, err
    rows = [json.loads(line) for line in (user_module / "runs" / "run" / "metrics.jsonl").read_text().splitlines()]
    timeouts = sum(r.get("reward/timeouts", 0) for r in rows)
    errors = sum(r.get("reward/errors", 0) for r in rows)
    warnings = [line for line in out.splitlines() if line.startswith("warning: ")]
    assert [r["step"] for r in rows] == [0, 1, 2]
    # The tiny untrained model's completions start with odd digits and hold sixes: both faults happen.
    assert timeouts > 0 and errors > 0, rows
    assert (
        sum("timed out on a completion" in w and "user_rewards:sleeps_on_odd_first_digit" in w for w in warnings) == 1
    )
    assert sum(" failed on a completion" in w and "ValueError: cannot parse" in w for w in warnings) == 1


# ---------------------------------------------------------------- the first Ctrl-C (item 3)


@pytest.mark.slow
def test_the_first_ctrl_c_drops_a_step_that_has_not_updated_and_the_resume_matches(tiny_dir, tmp_path, monkeypatch):
    # Was: the first Ctrl-C waited for the step under way, and a step that could not finish ignored it.
    import os
    import signal
    import time

    import torch

    import tether.trainer.step
    from conftest import checkpoint_weights, metrics_rows, train_config, untimed
    from tether.trainer.stopping import Interrupted
    from tether.trainer.loop import train

    plain = train(
        train_config(tiny_dir, tmp_path / "plain", "trainer.total_steps=3", "trainer.plots=false"), log=lambda *_: None
    )
    real, calls = tether.trainer.step.collect, []

    def stalls_at_step_two(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)  # the user's Ctrl-C, while step 2 samples
            time.sleep(600)  # a step that would not finish: only the signal ends it
        return real(*args, **kwargs)

    monkeypatch.setattr(tether.trainer.step, "collect", stalls_at_step_two)
    lines, run = [], tmp_path / "run"
    with pytest.raises(Interrupted) as stopped:
        train(train_config(tiny_dir, run, "trainer.total_steps=3", "trainer.plots=false"), log=lines.append)
    assert stopped.value.step == 1 and stopped.value.exit_code == 130
    assert "step 2 stopped before it changed the weights: dropped (a resume redoes it)" in lines
    assert [r["step"] for r in metrics_rows(run)] == [0, 1]
    monkeypatch.setattr(tether.trainer.step, "collect", real)
    train(
        train_config(tiny_dir, run, "trainer.total_steps=3", "trainer.plots=false"),
        resume_dir=str(run),
        log=lambda *_: None,
    )
    for a, b in zip(metrics_rows(plain), metrics_rows(run)):  # the dropped step redone as if never begun
        assert untimed(a) == untimed(b), a["step"]
    wa, wb = checkpoint_weights(plain, 3), checkpoint_weights(run, 3)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_first_signal_swallowed_by_python_still_drops_the_step_before_it_updates(tiny_dir, tmp_path, monkeypatch):
    # Was: a SIGTERM handled inside a weakref callback (torch.dynamo runs them during a compiled
    # decode) raised StopNow there, Python printed "Exception ignored" and went on, and the stop fell
    # back to "after the step": step 2 was trained and kept.
    import gc
    import os
    import signal
    import sys
    import weakref

    import tether.trainer.step
    from conftest import metrics_rows, train_config
    from tether.trainer.stopping import Interrupted, StopNow
    from tether.trainer.loop import train

    real, calls, ignored = tether.trainer.step.collect, [], []

    class Cached:
        pass

    def signal_in_a_weakref_callback(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            entry = Cached()
            keep = weakref.ref(entry, lambda _: (os.kill(os.getpid(), signal.SIGTERM), sum(range(1000))))
            del entry  # the callback runs now, and the signal's handler inside it
            gc.collect()
            assert keep() is None
        return real(*args, **kwargs)

    monkeypatch.setattr(tether.trainer.step, "collect", signal_in_a_weakref_callback)
    monkeypatch.setattr(sys, "unraisablehook", lambda u: ignored.append(u.exc_type))
    lines, run = [], tmp_path / "run"
    with pytest.raises(Interrupted) as stopped:
        train(train_config(tiny_dir, run, "trainer.total_steps=3", "trainer.plots=false"), log=lines.append)
    assert ignored == [StopNow]  # the situation: Python swallowed the first raise
    assert stopped.value.step == 1 and stopped.value.exit_code == 143
    assert "step 2 stopped before it changed the weights: dropped (a resume redoes it)" in lines
    assert [r["step"] for r in metrics_rows(run)] == [0, 1]


# ---------------------------------------------------------------- settings a run cannot progress with (items 3, 4)


def _train_tiny(tmp_path, capsys, *overrides):
    """`tether train` on the tiny model from tmp_path: (exit code, stdout, stderr, anything written?)."""
    from tether.cli import main

    code = main(
        [
            "train",
            "model.name_or_path=tiny",
            f"output_dir={tmp_path / 'runs' / 'run'}",
            f"warm_start.cache_dir={tmp_path / 'cache'}",
            "trainer.progress=false",
            *overrides,
        ]
    )
    out = capsys.readouterr()
    return code, out.out, out.err, (tmp_path / "runs").exists() or (tmp_path / "cache").exists()


def test_max_new_tokens_past_the_models_context_is_an_error_before_anything_is_written(tmp_path, capsys, monkeypatch):
    # Was (item 3): accepted; step 1 never finished (8m43s), the run directory was written.
    monkeypatch.chdir(tmp_path)
    code, out, err, written = _train_tiny(tmp_path, capsys, "rollout.max_new_tokens=100000", "warm_start.enabled=false")
    assert code == 2 and out == "" and not written, err
    # The arithmetic task's longest prompt is 6 characters: 6 + 100000 positions of the tiny model's 256.
    assert err == (
        "error: rollout.max_new_tokens=100000 with prompts of up to 6 tokens needs 100006 positions, but "
        "the model 'tiny' has a context of 256 (max_position_embeddings): generation past it cannot work. "
        "Lower rollout.max_new_tokens to at most 250\n"
    )


def test_a_warm_start_whose_solutions_cannot_fit_its_budget_is_an_error_before_anything_is_written(
    tmp_path, capsys, monkeypatch
):
    # Was (item 4): the loss fell to 0.03 while accuracy stayed 0.000 for 3000 steps (100 minutes), then a warning.
    monkeypatch.chdir(tmp_path)
    rows = [json.dumps({"problem": f"What is {i} + {i}?", "answer": str(2 * i)}) for i in range(100, 400)]
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")
    code, out, err, written = _train_tiny(
        tmp_path, capsys, "data.task=math", "data.task_args.train=train.jsonl", "data.eval_size=20"
    )
    assert code == 2 and out == "" and not written, err
    # "The answer is \boxed{NNN}." is 26 characters, each one token of the character model; the budget is 16.
    assert err.startswith(
        "error: the warm start can never reach warm_start.target_accuracy=0.25: its greedy check "
        "generates rollout.max_new_tokens=16 tokens, but only 0 of the 20 reference solutions it "
        "checks fit in that (the longest is 26 tokens: 'The answer is \\\\boxed{"
    )
    assert err.endswith(
        "Raise rollout.max_new_tokens to at least 26 (all fit at 26), or set warm_start.enabled=false\n"
    )
    code, out, err, written = _train_tiny(
        tmp_path,
        capsys,
        "data.task=math",
        "data.task_args.train=train.jsonl",
        "data.eval_size=20",
        "rollout.max_new_tokens=100000",
    )
    assert code == 2 and "has a context of 256" in err and not written  # the larger budget is checked too


def test_the_warm_start_gives_up_when_the_loss_has_converged_and_accuracy_has_not_moved():
    from tether.trainer.sft import stalled

    def checks(losses, accuracies):
        return [{"step": 25 * (i + 1), "loss": l, "accuracy": a} for i, (l, a) in enumerate(zip(losses, accuracies))]

    # Loss 0.03 and accuracy 0 for 3 checks after one at 0.2: converged (below 0.05), no new best.
    why = stalled(checks([0.2, 0.03, 0.03, 0.03], [0.0, 0.0, 0.0, 0.0]), 3)
    assert why.startswith(
        "over the last 3 checks (75 steps) the loss went from 0.2000 to 0.0300 (converged) while "
        "greedy accuracy stayed at most 0.000 (best before: 0.000)"
    )
    # Flat: 1.00 -> 0.99 fell by 1% < 2%.
    assert stalled(checks([1.0, 0.995, 0.99, 0.99], [0.1, 0.1, 0.05, 0.1]), 3)
    assert not stalled(checks([1.0, 0.99, 0.98, 0.97], [0.0, 0.0, 0.0, 0.0]), 3)  # still falling: 3%
    assert not stalled(checks([0.2, 0.03, 0.03, 0.03], [0.0, 0.0, 0.01, 0.0]), 3)  # accuracy moved: a new best
    assert not stalled(checks([0.2, 0.03, 0.03], [0.0, 0.0, 0.0]), 3)  # too few checks yet
    assert not stalled(checks([0.2, 0.03, 0.03, 0.03], [0.0] * 4), 0)  # 0: never


@pytest.mark.slow
def test_a_warm_start_that_cannot_learn_gives_up_early_and_says_what_it_saw(tiny_dir):
    """The verifier rejects every reference solution, whatever the model learns: the loss converges while
    accuracy stays 0, and the warm start stops after give_up_checks checks, not at steps_max."""
    from tether.model.loading import load_model
    from tether.rewards import RewardResult
    from tether.trainer.sft import SFTSettings, sft
    from tether.tasks import get_task

    model, tokenizer = load_model(tiny_dir)
    lines = []
    result = sft(
        model,
        tokenizer,
        get_task("arithmetic", digits=1),
        SFTSettings(
            steps_max=3000, batch_size=16, lr=3e-3, eval_every=10, give_up_checks=3, max_new_tokens=4, n_eval=16
        ),
        reward=lambda completion, example: RewardResult(0.0),
        log=lines.append,
    )
    assert result["steps"] < 3000 and result["gave_up"] and not result["reached"], lines
    assert lines[-1] == f"sft step {result['steps']}: giving up: {result['gave_up']}"
