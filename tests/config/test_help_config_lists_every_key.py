"""Every task knob and reward parameter is documented under its field and listed by
`tether train --help-config`, and the example knobs in `DataConfig.task_args`'s docstring are
real (issue 15: it once advertised `{path: data.jsonl}` for math, which is not a knob)."""

import dataclasses
import re

import pytest

from tether.config.sections import DataConfig
from tether.config.help import describe_reward_params, describe_task_knobs
from tether.rewards import REWARDS
from tether.schema import field_docs
from tether.tasks import TASKS

TASK_FIELDS = [(name, f.name) for name in TASKS.names() for f in dataclasses.fields(TASKS.get(name)) if f.init]
REWARD_FIELDS = [
    (name, f.name)
    for name in REWARDS.names()
    if isinstance(REWARDS.get(name), type)
    for f in dataclasses.fields(REWARDS.get(name))
    if f.init
]


@pytest.fixture(scope="module")
def help_lines():
    import contextlib
    import io

    from tether.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["train", "--help-config"]) == 0
    return out.getvalue().splitlines()


def test_the_registries_have_the_knobs_this_file_checks():
    # Guards against a vacuous pass: tether's own tasks and parametrised rewards are here.
    assert {"arithmetic", "countdown", "math"} <= {t for t, _ in TASK_FIELDS}
    assert {("math", "train"), ("arithmetic", "digits"), ("countdown", "min_used")} <= set(TASK_FIELDS)
    assert {
        ("format", "pattern"),
        ("overlong", "max_tokens"),
        ("overlong", "cache"),
        ("math", "timeout_s"),
        ("math", "strict"),
    } <= set(REWARD_FIELDS)


@pytest.mark.parametrize("task, knob", TASK_FIELDS)
def test_every_task_knob_has_a_docstring_and_a_help_line(task, knob, help_lines):
    assert field_docs(TASKS.get(task)).get(knob), f"task {task!r}: no docstring under field {knob!r}"
    line = next((l for l in help_lines if l.startswith(f"data.task_args.{knob} ") and f"(task {task})" in l), None)
    assert line is not None, f"--help-config has no line for data.task_args.{knob} (task {task})"
    assert field_docs(TASKS.get(task))[knob] in line


@pytest.mark.parametrize("reward, param", REWARD_FIELDS)
def test_every_reward_parameter_has_a_docstring_and_a_help_line(reward, param, help_lines):
    assert field_docs(REWARDS.get(reward)).get(param), f"reward {reward!r}: no docstring under field {param!r}"
    key = f"reward.weights.{reward}.{param}"
    line = next((l for l in help_lines if l.startswith(key + " ") and f"(reward {reward})" in l), None)
    assert line is not None, f"--help-config has no line for {key}"
    assert field_docs(REWARDS.get(reward))[param] in line


def test_no_attributes_block_is_left_in_the_knob_classes():
    # The field docstrings replace the class docstrings' "Attributes:" blocks: one place per knob.
    classes = [TASKS.get(n) for n in TASKS.names()] + [REWARDS.get(n) for n in REWARDS.names()]
    for cls in classes:
        if isinstance(cls, type):
            assert "Attributes:" not in (cls.__doc__ or ""), cls.__name__


def test_help_rows_are_exactly_the_registered_fields():
    assert [(scope.split()[1], key.rsplit(".", 1)[1]) for key, scope, _, _ in describe_task_knobs()] == TASK_FIELDS
    assert [(scope.split()[1], key.rsplit(".", 1)[1]) for key, scope, _, _ in describe_reward_params()] == REWARD_FIELDS


def test_shared_reward_options_default_to_their_reward_config_keys():
    # The trainer passes reward.timeout_s / reward.strict to every part that takes them
    # (rewards.task_reward), so the math reward's own dataclass defaults never apply from a config.
    rows = {key: default for key, _, default, _ in describe_reward_params()}
    assert rows["reward.weights.math.timeout_s"] == "reward.timeout_s"
    assert rows["reward.weights.math.strict"] == "reward.strict"
    assert rows["reward.weights.overlong.max_tokens"] == "(required)"
    assert rows["reward.weights.format.pattern"] == "None"


def test_reward_parameters_are_set_the_way_the_help_says(tmp_path):
    # reward.weights.NAME.PARAM=V and reward.weights.NAME.weight=W build that part with them.
    from tether.config.loading import load_config
    from tether.rewards import task_reward
    from tether.tasks import get_task

    cfg = load_config(
        None,
        [
            "reward.weights.exact_match=1.0",
            "reward.weights.overlong.weight=0.5",
            "reward.weights.overlong.max_tokens=64",
            "reward.weights.overlong.cache=16",
        ],
    )
    r = cfg.reward
    combined = task_reward(get_task("arithmetic"), r.name, r.weights, r.timeout_s, r.strict)
    (_, w_exact, _), (_, w_overlong, overlong) = combined.parts
    assert (w_exact, w_overlong) == (1.0, 0.5)
    assert (overlong.max_tokens, overlong.cache) == (64, 16)


def test_task_args_docstring_examples_are_real_knobs():
    doc = field_docs(DataConfig)["task_args"]
    examples = re.findall(r"\{([^{}]*)\} for (\w+)", doc)
    assert {task for _, task in examples} >= {"arithmetic", "math"}, doc
    for body, task in examples:
        knobs = [item.split(":", 1)[0].strip() for item in body.split(",")]
        valid = {f.name for f in dataclasses.fields(TASKS.get(task)) if f.init}
        assert set(knobs) <= valid, f"{task}: {sorted(set(knobs) - valid)} in the task_args docstring are not knobs"
        assert "tokenizer" not in knobs  # set by the trainer, not the config
