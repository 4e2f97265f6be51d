"""The distillation config (`teacher` section, `objective.distill`, the `opd` preset) is validated on load, each
error naming the key, what is wrong and the fix, before anything is written; `tether list` shows the preset and the
signals; the CLI reports a refusal as `error: ...` with exit 2. (The tokenizer check, which loads the teacher's
tokenizer, is tests/trainer/test_distillation.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import tiny_run
from tether import objectives
from tether.config.loading import load_config
from tether.schema import ConfigError

RUNNER = Path(__file__).resolve().parents[1].joinpath("cli_runner.py")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["objective=opd"], r"objective.distill \(signal 'reverse_kl'\).*teacher.name_or_path is empty; set it"),
        (["teacher.name_or_path=TEACHER"], r"the objective does not distill; set objective.distill.*objective=opd"),
        (["objective=opd", "teacher.name_or_path=tiny"], "teacher.name_or_path=tiny: the built-in tiny model is the"),
        (["objective=opd", "teacher.name_or_path=./no/such/dir"], r"teacher.name_or_path: model './no/such/dir' is"),
        (["objective=opd", "teacher.nme=TEACHER"], r"unknown key 'teacher.nme'. Valid keys: dtype, name_or_path"),
        (["objective=opd", "teacher.name_or_path=TEACHER", "teacher.dtype=fp8"], "teacher.dtype"),
        (["objective=opd", "teacher.name_or_path=TEACHER", "objective.distill.sigal=kl_loss"], "Did you mean 'signal'"),
        (["objective=opd", "teacher.name_or_path=TEACHER", "objective.distill.coef=0"], "expected coef > 0"),
    ],
)
def test_a_bad_distillation_config_is_refused_naming_the_fix(tiny_dir, overrides, message):
    overrides = [o.replace("TEACHER", str(tiny_dir)) for o in overrides]
    with pytest.raises(ConfigError, match=message):
        load_config(None, tiny_run(tiny_dir, *overrides))


def test_the_opd_preset_resolves_and_an_override_changes_only_its_key(tiny_dir):
    cfg = load_config(None, tiny_run(tiny_dir, "objective=opd", f"teacher.name_or_path={tiny_dir}"))
    assert cfg.teacher.enabled and cfg.objective["name"] == "reinforce"
    assert cfg.objective["distill"]["signal"] == "reverse_kl" and cfg.objective["distill"]["task_coef"] == 0.0
    mixed = load_config(
        None, tiny_run(tiny_dir, "objective=opd", "objective.distill.task_coef=1", f"teacher.name_or_path={tiny_dir}")
    )
    assert mixed.objective["distill"]["task_coef"] == 1.0 and mixed.objective["distill"]["estimator"] == "k1"
    assert objectives.build(mixed.objective).uses_teacher()
    # another signal on the preset: its estimator follows the signal's default (the preset sets none)
    for signal, estimator in (("kl_loss", "k3"), ("forward_kl_topk", None)):
        other = load_config(
            None,
            tiny_run(
                tiny_dir, "objective=opd", f"objective.distill.signal={signal}", f"teacher.name_or_path={tiny_dir}"
            ),
        )
        assert other.objective["distill"]["signal"] == signal and other.objective["distill"]["estimator"] == estimator
    # the recorded objective rebuilds the same one: a run never depends on what the preset says later
    recorded, preset = objectives.build(cfg.objective).config, objectives.build("opd").config
    assert recorded.distill == preset.distill and recorded.importance_weight == preset.importance_weight


def test_tether_list_shows_the_opd_preset_and_the_distillation_signals(capsys):
    from tether.cli import main

    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert any(line.split()[:2] == ["opd", "reinforce:"] and "distill=" in line for line in out.splitlines())
    for name in ("reverse_kl", "kl_loss", "forward_kl_topk"):
        assert any(line.split()[:1] == [name] for line in out.splitlines()), name


def test_the_cli_reports_a_teacher_without_distillation_as_an_error(tiny_dir, tmp_path):
    args = ["train", *tiny_run(tiny_dir, f"teacher.name_or_path={tiny_dir}", out=tmp_path / "run")]
    done = subprocess.run(
        [sys.executable, str(RUNNER), *args], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert done.returncode == 2 and done.stderr.startswith("error: teacher.name_or_path="), done.stderr
    assert not (tmp_path / "run").exists()
