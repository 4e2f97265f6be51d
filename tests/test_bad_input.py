"""Bad data, contradictory settings and untrusted run directories: one clear error (or warning)
that names the problem and the fix, before any model is loaded, and no code from a file runs."""

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tether import checkpoint
from tether.config import ConfigError, load_config
from tether.objectives import build
from tether.tasks import DataError, MathTask, load_math_dataset
from tether.train import config_warnings, train


def _jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


GOOD = json.dumps({"problem": "1+1?", "answer": "2"})


@pytest.mark.parametrize("lines, match", [
    ([GOOD, '{"problem": "2+2?", "answer": "4"', GOOD], r"bad\.jsonl:2: not valid JSON"),
    ([GOOD, GOOD, json.dumps({"question": "3+3?", "answer": "6"})], r"bad\.jsonl:3: row has no .*'problem'.*question"),
    ([GOOD, json.dumps({"problem": "3+3?", "answer": ""})], r"bad\.jsonl:2: row has no \(or an empty\) 'answer'"),
    ([GOOD, json.dumps({"problem": "3+3?", "answer": None})], r"bad\.jsonl:2: .*'answer'"),
    (["", GOOD, "[1, 2]"], r"bad\.jsonl:3: expected a JSON object"),  # blank lines still count
    ([], r"bad\.jsonl: no rows"),
])
def test_bad_rows_are_reported_with_file_and_line(tmp_path, lines, match):
    with pytest.raises(DataError, match=match):
        load_math_dataset(_jsonl(tmp_path / "bad.jsonl", lines))


def test_non_utf8_file_and_empty_splits(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"problem": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(DataError, match="not UTF-8"):
        load_math_dataset(path)
    one = _jsonl(tmp_path / "one.jsonl", [GOOD])
    with pytest.raises(DataError, match="split is empty"):
        MathTask(train=str(one), test_fraction=0.5)  # one problem cannot fill both splits
    with pytest.raises(DataError, match="train split is empty.*also in the test file"):
        MathTask(train=str(one), test=str(one))


@pytest.fixture
def no_model_loading(monkeypatch):
    """Fail loudly if the trainer gets as far as loading a model."""
    import tether.models
    import tether.warmstart

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(tether.models, "load_model", refuse)
    monkeypatch.setattr(tether.warmstart, "initial_model", refuse)


def _math_cfg(tmp_path, train_file, *extra):
    return load_config(None, [
        "model.name_or_path=tiny", f"output_dir={tmp_path / 'run'}", "data.task=math",
        f"data.task_args.train={train_file}", "trainer.progress=false", *extra,
    ])


def test_bad_data_fails_before_any_model_is_loaded(tmp_path, no_model_loading):
    bad = _jsonl(tmp_path / "bad.jsonl", [GOOD, json.dumps({"problem": "x"})])
    with pytest.raises(DataError, match=r"bad\.jsonl:2"):
        train(_math_cfg(tmp_path, bad), log=lambda *_: None)
    rows = [json.dumps({"problem": f"{i}+1?", "answer": str(i + 1)}) for i in range(40)]
    small = _jsonl(tmp_path / "small.jsonl", rows)
    with pytest.raises(DataError, match=r"data.eval_size=200: .*lower data.eval_size"):
        train(_math_cfg(tmp_path, small, "data.task_args.test_fraction=0.25"), log=lambda *_: None)


def test_cli_reports_data_errors_without_a_traceback(tmp_path):
    bad = _jsonl(tmp_path / "bad.jsonl", [GOOD, GOOD, "{oops"])
    proc = subprocess.run([sys.executable, "-m", "tether.cli", "train", "model.name_or_path=tiny",
                           "data.task=math", f"data.task_args.train={bad}", f"output_dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "bad.jsonl:3: not valid JSON" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("objective, updates, warns", [
    ("atr_grpo", ["trainer.mini_batches=1"], True),
    ("cispo", ["trainer.mini_batches=1"], True),
    ("rpg_fkl", ["trainer.mini_batches=1"], True),
    ("atr_grpo", ["trainer.mini_batches=2"], False),
    ("atr_grpo", ["trainer.mini_batches=1", "trainer.ppo_epochs=2"], False),
    ({"name": "reinforce"}, ["trainer.mini_batches=1"], False),
    ({"name": "rpg", "clip": "none"}, ["trainer.mini_batches=1"], False),
])
def test_a_clip_that_can_never_act_is_warned_about(objective, updates, warns):
    cfg = load_config(None, updates)
    warnings = config_warnings(cfg, build(objective))
    assert bool(warnings) == warns
    if warns:
        assert "clip is inactive" in warnings[0] and "trainer.mini_batches>=2" in warnings[0]


def test_the_trainer_logs_the_warning_first(tmp_path, no_model_loading):
    logs = []
    with pytest.raises(AssertionError, match="a model was loaded"):
        train(load_config(None, [f"output_dir={tmp_path / 'run'}", "trainer.mini_batches=1"]), log=logs.append)
    # Logged before any model is loaded (the run directory line comes first).
    assert [line for line in logs if line.startswith("warning: ")][0].startswith("warning: objective 'divergence_clip' clips")


def test_contradictory_settings_are_errors(tmp_path):
    with pytest.raises(ConfigError, match="group_size"):
        load_config(None, ["rollout.group_size=1"])


class _Payload:
    """Unpickling this would create a file: the proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_an_untrusted_run_directory_cannot_run_code(tmp_path):
    ckpt = tmp_path / "run" / "checkpoints" / "step_000001"
    ckpt.mkdir(parents=True)
    marker = tmp_path / "pwned"
    with (ckpt / "state.pt").open("wb") as f:
        pickle.dump({"step": 1, "evil": _Payload(marker)}, f)
    with pytest.raises(pickle.UnpicklingError):
        checkpoint.load_state(ckpt)
    torch.save({"step": 1, "evil": _Payload(marker)}, ckpt / "state.pt")
    with pytest.raises(pickle.UnpicklingError):
        checkpoint.load_state(ckpt)
    assert not marker.exists()
    # A config.yaml with a Python tag is refused by the YAML loader, not executed.
    (tmp_path / "run" / "config.yaml").write_text(f"trainer: !!python/object/apply:pathlib.Path.touch ['{marker}']\n")
    with pytest.raises(ConfigError):
        load_config(str(tmp_path / "run" / "config.yaml"))
    assert not marker.exists()
