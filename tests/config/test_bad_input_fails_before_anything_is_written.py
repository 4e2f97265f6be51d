"""Bad data, contradictory settings and untrusted run directories: one clear error (or warning)
that names the problem and the fix, before any model is loaded, and no code from a file runs."""

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tether.records import checkpoint
from tether.schema import ConfigError
from tether.config.loading import load_config
from tether.objectives import build
from tether.tasks import DataError, MathTask, load_math_dataset
from tether.trainer.setup import config_warnings
from tether.trainer.loop import train


def _jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


GOOD = json.dumps({"problem": "1+1?", "answer": "2"})


@pytest.mark.parametrize(
    "lines, match",
    [
        ([GOOD, '{"problem": "2+2?", "answer": "4"', GOOD], r"bad\.jsonl:2: not valid JSON"),
        (
            [GOOD, GOOD, json.dumps({"question": "3+3?", "answer": "6"})],
            r"bad\.jsonl:3: row has no .*'problem'.*question",
        ),
        ([GOOD, json.dumps({"problem": "3+3?", "answer": ""})], r"bad\.jsonl:2: row has no \(or an empty\) 'answer'"),
        ([GOOD, json.dumps({"problem": "3+3?", "answer": None})], r"bad\.jsonl:2: .*'answer'"),
        (["", GOOD, "[1, 2]"], r"bad\.jsonl:3: expected a JSON object"),  # blank lines still count
        ([], r"bad\.jsonl: no rows"),
    ],
)
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
    import tether.model.loading
    import tether.trainer.setup
    import tether.trainer.warmstart

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    for module in (
        tether.model.loading,
        tether.trainer.setup,
        tether.trainer.warmstart,
    ):  # where it is defined and used
        monkeypatch.setattr(module, "load_model", refuse)
    for module in (tether.trainer.warmstart, tether.trainer.setup):
        monkeypatch.setattr(module, "initial_model", refuse)


def _math_cfg(tmp_path, train_file, *extra):
    return load_config(
        None,
        [
            "model.name_or_path=tiny",
            f"output_dir={tmp_path / 'run'}",
            "data.task=math",
            f"data.task_args.train={train_file}",
            "trainer.progress=false",
            *extra,
        ],
    )


def test_bad_data_fails_before_any_model_is_loaded(tmp_path, no_model_loading):
    bad = _jsonl(tmp_path / "bad.jsonl", [GOOD, json.dumps({"problem": "x"})])
    with pytest.raises(DataError, match=r"bad\.jsonl:2"):
        train(_math_cfg(tmp_path, bad), log=lambda *_: None)
    rows = [json.dumps({"problem": f"{i}+1?", "answer": str(i + 1)}) for i in range(40)]
    small = _jsonl(tmp_path / "small.jsonl", rows)
    with pytest.raises(DataError, match=r"data.eval_size=200: .*lower data.eval_size"):
        train(_math_cfg(tmp_path, small, "data.task_args.test_fraction=0.25"), log=lambda *_: None)


@pytest.mark.slow
def test_cli_reports_data_errors_without_a_traceback(tmp_path):
    bad = _jsonl(tmp_path / "bad.jsonl", [GOOD, GOOD, "{oops"])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tether.cli",
            "train",
            "model.name_or_path=tiny",
            "data.task=math",
            f"data.task_args.train={bad}",
            f"output_dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "bad.jsonl:3: not valid JSON" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "objective, updates, warns",
    [
        ("atr_grpo", ["trainer.mini_batches=1"], True),
        ("cispo", ["trainer.mini_batches=1"], True),
        ("rpg_fkl", ["trainer.mini_batches=1"], True),
        ("atr_grpo", ["trainer.mini_batches=2"], False),
        ("atr_grpo", ["trainer.mini_batches=1", "trainer.ppo_epochs=2"], False),
        ({"name": "reinforce"}, ["trainer.mini_batches=1"], False),
        ({"name": "rpg", "clip": "none"}, ["trainer.mini_batches=1"], False),
    ],
)
def test_a_clip_that_can_never_act_is_warned_about(objective, updates, warns):
    cfg = load_config(None, updates)
    warnings = config_warnings(cfg.trainer, build(objective))
    assert bool(warnings) == warns
    if warns:
        assert "clip is inactive" in warnings[0] and "trainer.mini_batches>=2" in warnings[0]


def test_the_trainer_logs_the_warning_first(tmp_path, no_model_loading):
    logs = []
    with pytest.raises(AssertionError, match="a model was loaded"):
        train(load_config(None, [f"output_dir={tmp_path / 'run'}", "trainer.mini_batches=1"]), log=logs.append)
    # Logged before any model is loaded (the run directory line comes first).
    assert [line for line in logs if line.startswith("warning: ")][0].startswith(
        "warning: objective 'divergence_clip' clips"
    )


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


# ---------------------------------------------------------------- through the CLI: error, exit 2, nothing written


def _train_cli(tmp_path, capsys, *overrides):
    """`tether train OVERRIDES` in this process, from tmp_path: (exit code, stdout, stderr), and
    whether anything was written (the run directory, or a warm start in the cache)."""
    from tether.cli import main

    code = main(
        [
            "train",
            *overrides,
            f"output_dir={tmp_path / 'runs' / 'run'}",
            f"warm_start.cache_dir={tmp_path / 'cache'}",
            "trainer.progress=false",
        ]
    )
    out = capsys.readouterr()
    written = (tmp_path / "runs").exists() or (tmp_path / "cache").exists()
    return code, out.out, out.err, written


def test_math_without_its_train_file_names_the_missing_knob(tmp_path, capsys, monkeypatch):
    # Was: TypeError: MathTask.__init__() missing 1 required positional argument: 'train' (traceback, exit 1).
    monkeypatch.chdir(tmp_path)
    code, out, err, written = _train_cli(tmp_path, capsys, "data.task=math")
    assert code == 2 and not written and out == ""
    assert (
        err.startswith("error: data.task_args.train: task 'math' needs it (JSONL or Parquet file")
        and "set data.task_args.train=VALUE" in err
    )


def test_a_knob_value_the_task_refuses_is_a_config_error(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err, written = _train_cli(tmp_path, capsys, "data.task_args.test_fraction=2")
    assert code == 2 and not written and out == ""
    assert err.startswith("error: data.task=arithmetic with data.task_args {'test_fraction': 2}: test_fraction must be")


@pytest.mark.slow
def test_math_without_its_train_file_from_a_fresh_process(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "tether.cli", "train", "data.task=math", f"output_dir={tmp_path / 'runs' / 'run'}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert (
        proc.returncode == 2
        and proc.stderr.startswith("error: data.task_args.train")
        and "Traceback" not in proc.stderr
    )
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("task", ["arithmetic", "math"])
@pytest.mark.parametrize(
    "model, message",
    [
        ("./modles/tiny", "model './modles/tiny' is neither an existing directory nor a Hugging Face hub id"),
        ("models/tyni", "model 'models/tyni' does not exist, but models/ is a local directory: a mistyped path?"),
        ("models", "model directory 'models' holds no config.json: it is not a saved model"),
        ("models/weights.bin", "model 'models/weights.bin' is a file; pass the model's directory"),
        ("nobody-xyz/no-such-model", "is not a local directory nor in the Hugging Face cache, and the hub is off"),
    ],
)
def test_a_mistyped_model_path_fails_before_anything_is_written(tmp_path, capsys, monkeypatch, task, model, message):
    # Was: with data.task=math a transformers OSError traceback; with the default task exit 2, but only
    # after the run directory and config.yaml were written and "warm start: ..." printed.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no test reaches the network; the hub id case is read offline
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "weights.bin").write_bytes(b"\0")
    data = _jsonl(
        tmp_path / "train.jsonl", [json.dumps({"problem": f"{i}+1?", "answer": str(i + 1)}) for i in range(40)]
    )
    args = ["data.task=math", f"data.task_args.train={data}"] if task == "math" else []
    code, out, err, written = _train_cli(tmp_path, capsys, f"model.name_or_path={model}", *args)
    assert code == 2 and not written and out == "", (err, out)  # no "run directory: ..." and no "warm start: ..."
    assert err.startswith("error: model.name_or_path: model ") and message in err, err


def test_a_directory_with_an_unknown_architecture_fails_before_anything_is_written(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "odd"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "no_such_architecture"}))
    code, out, err, written = _train_cli(tmp_path, capsys, f"model.name_or_path={model}")
    assert code == 2 and not written and out == ""
    assert (
        err.startswith(f"error: model.name_or_path: model '{model}' cannot be read: ") and "no_such_architecture" in err
    )


def test_a_lora_adapter_directory_names_the_export_that_makes_it_a_model(tmp_path, capsys, monkeypatch):
    # A LoRA run's checkpoint model/ holds an adapter, not a model: it failed with transformers' "Unrecognized
    # model ... Should have a `model_type` key", which names no fix (found giving one as an OPD teacher).
    monkeypatch.chdir(tmp_path)
    adapter = tmp_path / "step_000020" / "model"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 16}))
    code, out, err, written = _train_cli(tmp_path, capsys, f"model.name_or_path={adapter}")
    assert code == 2 and not written and out == ""
    assert err.startswith(f"error: model.name_or_path: '{adapter}' holds a LoRA adapter"), err
    assert "tether export RUN_DIR --step N OUT" in err


@pytest.mark.parametrize(
    "device, message",
    [
        ("cuda", "error: trainer.device=cuda but no CUDA device is available; use trainer.device=cpu (or auto)"),
        ("cuda:1", "error: trainer.device=cuda:1 but no CUDA device is available"),
        ("gpu", "error: trainer.device='gpu' is not a device; expected auto, cpu, cuda or cuda:N"),
    ],
)
def test_a_device_the_machine_lacks_fails_before_anything_is_written(tmp_path, capsys, monkeypatch, device, message):
    # Was: RuntimeError traceback, exit 1.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU machine, even on a GPU one
    code, out, err, written = _train_cli(tmp_path, capsys, f"trainer.device={device}")
    assert code == 2 and not written and out == "" and err.startswith(message), err


def test_a_gpu_index_past_the_last_one_is_named(monkeypatch):
    from tether.model.devices import device_problem

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert device_problem("cuda:2") == "trainer.device=cuda:2 but this machine has 2 CUDA device(s), cuda:0 to cuda:1"
    assert device_problem("cuda:1") == "" and device_problem("cpu") == ""


@pytest.mark.parametrize(
    "text, where",
    [
        # Line 4 opens a flow sequence that line 5 breaks: the error is at 5:5, the sequence opened at 4:17.
        (
            "trainer:\n  total_steps: 5\nrollout:\n  stop_strings: [a, b\ndata:\n  task: math\n",
            "bad.yaml:5:5: not valid YAML: expected ',' or ']', but got ':' (while parsing a flow sequence, "
            "opened at line 4, column 17)",
        ),
        (
            "trainer:\n  total_steps: 5\n    lr: 0.1\n",
            "bad.yaml:3:7: not valid YAML: mapping values are not allowed here",
        ),
        (
            "trainer: {lr: 'abc}\n",
            "bad.yaml:2:1: not valid YAML: found unexpected end of stream (while scanning a "
            "quoted scalar, opened at line 1, column 15)",
        ),
    ],
)
def test_a_yaml_syntax_error_names_file_line_and_column(tmp_path, capsys, monkeypatch, text, where):
    # Was: "not valid tether YAML (while parsing a flow sequence)", no line.
    from tether.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.yaml").write_text(text)
    code = main(["train", "bad.yaml", f"output_dir={tmp_path / 'runs' / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: {where}"), err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "overrides, key, fix",
    [
        # m2po against the sampler measures log(pi_old / pi_sampler): identically 0 when pi_old is pi_sampler
        (("objective=m2po", "objective.against=sampler"), "objective.against", "set against: old"),
        # rollout correction weighs by pi_old / pi_sampler: every weight 1 under the same anchoring
        (
            ("objective.rollout_correction.mode=mask",),
            "objective.rollout_correction",
            "set trainer.old_logprobs: recompute, or drop rollout_correction",
        ),
        (
            (
                "objective=m2po",
                "objective.rollout_correction.measure=kl3",
                "objective.rollout_correction.mode=mask",
                "objective.rollout_correction.delta=0.01",
            ),
            "objective.rollout_correction",
            "trainer.old_logprobs: recompute",
        ),
    ],
)
def test_a_constraint_that_vanishes_under_bypass_anchoring_is_refused(
    tmp_path, capsys, monkeypatch, overrides, key, fix
):
    # Was: m2po against=sampler under trainer.old_logprobs=sampler trained with masked_frac 0.0 at drifts of 2 nats,
    # an unconstrained importance-sampled policy gradient, without a word.
    monkeypatch.chdir(tmp_path)
    code, out, err, written = _train_cli(tmp_path, capsys, "trainer.old_logprobs=sampler", *overrides)
    assert code == 2 and not written and out == "", (err, out)
    assert err.startswith(f"error: {key} with trainer.old_logprobs=sampler (pi_old = pi_sampler): ") and fix in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    # The same objective under the decoupled anchoring loads.
    load_config(None, ["model.name_or_path=tiny", *overrides])
