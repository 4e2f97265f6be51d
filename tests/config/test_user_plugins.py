"""A reward or a task of the user's own, named by import path (`module:name`, tether.plugins), from
the command line: it trains, the run records the path and resumes with the same code, and every
way the path can be wrong is an `error: ...` with exit 2 that names the problem, nothing written."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "plugins"


def _small(tiny_dir, out, steps=2):
    return [
        f"model.name_or_path={tiny_dir}",
        f"output_dir={out}",
        "warm_start.enabled=false",
        "rollout.prompts_per_step=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=4",
        "data.eval_size=4",
        "trainer.progress=false",
        "trainer.plots=false",
        "trainer.tensorboard=false",
        "trainer.threads=1",
        f"trainer.total_steps={steps}",
        "trainer.save_every=1",
    ]


def _tether(*args, cwd, pythonpath=None):
    """`tether ARGS` in a fresh process run from `cwd`. `-P` keeps the current directory off
    sys.path, as the installed `tether` command does, so finding a module there is tether's doing."""
    env = {**os.environ, "PYTHONPATH": pythonpath or ""}
    return subprocess.run(
        [sys.executable, "-P", "-m", "tether.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def _rows(run):
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_reward_function_in_the_users_file_trains_and_resumes(tiny_dir, tmp_path):
    # A reward that is 0.25 on every completion: reward/mean is exactly 0.25 only if it is the one used.
    (tmp_path / "quarter.py").write_text("def score(completion, example):\n    return 0.25\n")
    run = tmp_path / "run"
    first = _tether("train", "reward.name=quarter:score", *_small(tiny_dir, run), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    assert yaml.safe_load((run / "config.yaml").read_text())["reward"]["name"] == "quarter:score"
    assert [r["reward/mean"] for r in _rows(run) if "reward/mean" in r] == [0.25, 0.25]
    resumed = _tether("train", "--resume", str(run), "trainer.total_steps=3", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert [r["step"] for r in _rows(run)] == [0, 1, 2, 3] and _rows(run)[-1]["reward/mean"] == 0.25
    # From a directory where the module is not, the resume says which module it needs.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    lost = _tether("train", "--resume", str(run), "trainer.total_steps=4", cwd=elsewhere)
    assert lost.returncode == 2
    assert lost.stderr.startswith("error: reward.name='quarter:score': no module named 'quarter'")


@pytest.mark.slow
def test_the_documented_example_task_and_reward_run(tiny_dir, tmp_path):
    """docs/rewards.md's worked example: a JSONL task with its own verifier (examples/plugins/reverse_task.py),
    then a reward function (my_rewards.py) on the arithmetic task, each module on PYTHONPATH."""
    data = shutil.copy(EXAMPLES / "reverse.jsonl", tmp_path)
    run = tmp_path / "reverse"
    proc = _tether(
        "train",
        "data.task=reverse_task:ReverseTask",
        f"data.task_args.path={data}",
        *_small(tiny_dir, run),
        cwd=tmp_path,
        pythonpath=str(EXAMPLES),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert yaml.safe_load((run / "config.yaml").read_text())["data"]["task"] == "reverse_task:ReverseTask"
    assert _rows(run)[0]["eval/accuracy"] == 0.0  # an untrained model reverses no word
    run = tmp_path / "near"
    proc = _tether(
        "train",
        "reward.name=my_rewards:near_miss",
        *_small(tiny_dir, run, steps=1),
        cwd=tmp_path,
        pythonpath=str(EXAMPLES),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_example_verifiers_score_what_they_say(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from my_rewards import near_miss
    from reverse_task import ReverseTask

    from tether.tasks import Example

    gold = Example("a", "12+88=", "100")
    # 100 exact: 1; 95 and 110 within 10% of 100: 0.5; 89 is 11% off: 0; text: 0.
    assert [near_miss(c, gold) for c in ("100", " 95", "110", "89", "one hundred")] == [1.0, 0.5, 0.5, 0.0, 0.0]
    task = ReverseTask(str(EXAMPLES / "reverse.jsonl"))
    train, test = task.examples("train"), task.examples("test")
    assert len(train) + len(test) == 400 and not {e.prompt for e in train} & {e.prompt for e in test}
    ex = test[0]
    word = ex.prompt[len("reverse ") : -1]  # "reverse WORD="
    assert task.reward(word[::-1], ex) == 1.0 and task.reward(word, ex) == 0.0


# ---------------------------------------------------------------- wrong import paths: error, exit 2, nothing written


MODULES = {
    "u_one_arg": "def score(completion):\n    return 1.0\n",
    "u_not_callable": "score = 0.5\n",
    "u_syntax": "def score(completion, example)\n    return 1.0\n",
    "u_needs_dep": "import no_such_dependency_xyz\n\ndef score(completion, example):\n    return 1.0\n",
    "u_returns_text": "def score(completion, example):\n    return 'yes'\n",
    "u_params": textwrap.dedent("""
        class Near:
            def __init__(self, tolerance):
                self.tolerance = tolerance
            def __call__(self, completion, example):
                return 1.0
        """),
    "u_tasks": textwrap.dedent("""
        class NoExamples:
            reward = "exact_match"
            def __init__(self, path):
                self.path = path
        def make(size=3):
            return object()
        class TypoReward:
            reward = "exact_mach"
            def examples(self, split, n=None, *, seed=None, unique=True):
                return []
        class NoSolution:
            reward = "exact_match"
            def __init__(self):
                pass
            def examples(self, split, n=None, *, seed=None, unique=True):
                return []
        """),
}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["reward.name=nowhere_xyz:score"],
            "reward.name='nowhere_xyz:score': no module named 'nowhere_xyz' (searched the current directory",
        ),
        (["reward.name=u_one_arg:scor"], "module 'u_one_arg' ("),  # a typo: the names it does define follow
        (
            ["reward.name=u_one_arg:score"],
            "reward 'u_one_arg:score' cannot be called with 2 argument(s): too many "
            "positional arguments (its signature is score(completion)); expected a "
            "function (completion: str, example",
        ),
        (["reward.name=u_not_callable:score"], "reward.name='u_not_callable:score' is a float, not callable"),
        (["reward.name=u_syntax:score"], "reward.name='u_syntax:score': importing 'u_syntax' failed: SyntaxError"),
        (
            ["reward.name=u_needs_dep:score"],
            "importing 'u_needs_dep' failed: ModuleNotFoundError: No module named 'no_such_dependency_xyz'",
        ),
        (
            ["reward.name=u_returns_text:score"],
            "reward u_returns_text:score returned str 'yes'; expected a float or a "
            "RewardResult (called on an empty completion before training)",
        ),
        (["reward.name=bad path:score"], "an import path is MODULE:NAME"),
        (
            ["reward.weights={u_params:Near: 1.0}"],
            "reward.weights.u_params:Near: reward 'u_params:Near' needs parameter(s) ['tolerance']",
        ),
        (
            ["reward.weights.u_params:Near.tolerans=0.1"],
            "reward 'u_params:Near' has no parameter 'tolerans'. Did you mean 'tolerance'?",
        ),
        (["data.task=nowhere_xyz:Task"], "data.task='nowhere_xyz:Task': no module named 'nowhere_xyz'"),
        (["data.task=u_tasks:NoExamples"], "data.task_args.path: task 'u_tasks:NoExamples' needs it"),
        (
            ["data.task=u_tasks:NoExamples", "data.task_args.path=x", "data.task_args.size=2"],
            "data.task_args.size: task 'u_tasks:NoExamples' has no knob 'size'. Valid knobs: path.",
        ),
        (
            ["data.task=u_tasks:NoExamples", "data.task_args.path=x"],
            "data.task='u_tasks:NoExamples': the object it built (NoExamples) has no examples",
        ),
        (["data.task=u_tasks:make"], "the object it built (object) has no reward, examples"),
        (
            ["data.task=u_tasks:TypoReward", "warm_start.enabled=false"],
            "error: data.task=u_tasks:TypoReward: its reward 'exact_mach': unknown reward 'exact_mach'. Did you mean "
            "'exact_match'?",
        ),
        (
            ["data.task=u_tasks:NoSolution"],
            "has no solution (the warm start trains on it; or set warm_start.enabled=false)",
        ),
    ],
)
def test_a_wrong_import_path_is_an_error_before_anything_is_written(tmp_path, monkeypatch, capsys, overrides, message):
    from tether.cli import main

    for name, text in MODULES.items():
        (tmp_path / f"{name}.py").write_text(text)
    monkeypatch.chdir(tmp_path)  # found from the current directory, as the `tether` command finds it
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    for name in MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    code = main(
        ["train", *overrides, "model.name_or_path=tiny", f"output_dir={tmp_path / 'run'}", "trainer.progress=false"]
    )
    out = capsys.readouterr()
    assert code == 2 and out.err.startswith("error: ") and message in out.err, out.err
    assert not (tmp_path / "run").exists() and out.out == ""  # nothing written, nothing loaded


def test_an_import_path_keeps_its_dots_in_a_weights_override():
    from tether.config.loading import _set_dotted

    tree: dict = {}
    _set_dotted(tree, "reward.weights.pkg.mod:Near.tolerance", 0.1)
    _set_dotted(tree, "reward.weights.math", 1.0)
    assert tree == {"reward": {"weights": {"pkg.mod:Near": {"tolerance": 0.1}, "math": 1.0}}}


def test_a_user_reward_class_takes_its_parameters_from_the_weights(tmp_path, monkeypatch):
    from tether.config.loading import load_config
    from tether.rewards import Combined, UserReward, get_reward
    from tether.tasks import Example

    (tmp_path / "params_ok.py").write_text(MODULES["u_params"].replace("return 1.0", "return self.tolerance"))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(None, ["reward.weights.params_ok:Near.tolerance=0.3", "reward.weights.exact_match=1.0"])
    reward = get_reward(cfg.reward.weights)
    assert isinstance(reward, Combined) and isinstance(reward.parts[0][2], UserReward)
    result = reward("7", Example("a", "3+4=", "7"))
    # 1 x 0.3 (Near, the tolerance it was given) + 1 x 1.0 (exact match "7") = 1.3
    assert result.score == pytest.approx(1.3, abs=1e-12) and result.components["params_ok:Near"] == 0.3
