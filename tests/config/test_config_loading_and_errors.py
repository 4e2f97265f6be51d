"""One schema (issue 15): the objective is resolved once, on load, and recorded with every
parameter and the tether version; task, knobs, reward and engine are checked before anything is
written; every config error is `error: ...` with exit 2 and leaves nothing behind; a resume may
change only the budget, logging and checkpointing, and never rewrites config.yaml otherwise."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tether import __version__, objectives
from tether.schema import ConfigError
from tether.config.loading import load_config

from conftest import DIGIT_REWARD

RUNNER = Path(__file__).resolve().parents[1].joinpath("cli_runner.py")


def _tether(*args, cwd):
    return subprocess.run([sys.executable, str(RUNNER), *args], capture_output=True, text=True, cwd=cwd, timeout=300)


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.task=arithmatic", "data.task: unknown task 'arithmatic'. Did you mean 'arithmetic'?"),
        (
            "data.task_args.digts=3",
            "data.task_args.digts: task 'arithmetic' has no knob 'digts'. Did you mean 'digits'?",
        ),
        ("data.task_args.digits=two", "data.task_args.digits: expected an integer, got 'two'"),
        ("reward.name=exact_mach", "reward.name: unknown reward 'exact_mach'. Did you mean 'exact_match'?"),
        ("reward.weights={exact_mach: 1.0}", "reward.weights: unknown reward 'exact_mach'"),
        ("rollout.engine=sglang", "rollout.engine: unknown rollout engine 'sglang'. Valid: hf, vllm"),
        # engines do not plug in by import path (a KeyError traceback before): the same unknown-name error
        ("rollout.engine=mymod:Engine", "rollout.engine: unknown rollout engine 'mymod:Engine'. Valid: hf, vllm."),
        (
            "reward.weights={overlong: {cach: 16, max_tokens: 16}}",
            "reward.weights.overlong.cach: reward 'overlong' has no parameter 'cach'. Did you mean 'cache'?",
        ),
        ("objective=grpoo", "unknown objective or preset 'grpoo'. Did you mean 'grpo'"),
        ("trainer.totl_steps=3", "unknown key 'trainer.totl_steps'. Did you mean 'total_steps'"),
        ("trainer.micro_batch_tokens=-1", "trainer.micro_batch_tokens: got -1, expected 0 (micro-batches of"),
        ("trainer.pack_width=-8", "trainer.pack_width: got -8, expected tokens per packed row (0: the longest row)"),
        ("trainer.packing=maybe", "trainer.packing"),
    ],
)
def test_each_config_error_exits_2_with_its_message_and_writes_nothing(
    tmp_path, override, message, capsys, monkeypatch
):
    from tether.cli import main

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    assert main(["train", f"output_dir={out}", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err
    assert not out.exists() and not (tmp_path / "runs").exists()


def test_valid_names_are_listed_once():
    with pytest.raises(ConfigError) as err:
        objectives.build("grpoo")
    valid = str(err.value).split("Valid: ")[1].rstrip(".").split(", ")
    assert len(valid) == len(set(valid)) and {"cispo", "etr", "gspo"} <= set(valid)


def test_the_objective_is_resolved_once_and_recorded_with_every_parameter(tiny_dir, tmp_path):
    from tether.trainer.loop import train

    cfg = load_config(
        None,
        [
            f"model.name_or_path={tiny_dir}",
            f"output_dir={tmp_path / 'run'}",
            "warm_start.enabled=false",
            f"reward.name={DIGIT_REWARD}",
            "rollout.prompts_per_step=2",
            "rollout.group_size=2",
            "rollout.max_new_tokens=4",
            "trainer.total_steps=1",
            "data.eval_size=4",
            "trainer.progress=false",
            "trainer.plots=false",
            "objective=etr",
            "objective.alpha=0.25",
        ],
    )
    assert cfg.objective == objectives.resolve({"preset": "etr", "alpha": 0.25}, max_len=4)
    run = train(cfg, log=lambda *_: None)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["tether_version"] == __version__
    assert saved["objective"] == {"name": "etr", **{k: v for k, v in cfg.objective.items() if k != "name"}}
    assert "preset" not in saved["objective"] and saved["objective"]["max_len"] == 4
    # The recorded config loads back to the same run config.
    assert load_config(str(run / "config.yaml")).objective == cfg.objective


@pytest.mark.slow
def test_a_resume_that_changes_the_objective_is_refused_and_rewrites_nothing(tiny_dir, tmp_path):
    run = tmp_path / "run"
    base = [
        f"model.name_or_path={tiny_dir}",
        f"output_dir={run}",
        "warm_start.enabled=false",
        f"reward.name={DIGIT_REWARD}",
        "rollout.prompts_per_step=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=4",
        "trainer.total_steps=2",
        "data.eval_size=4",
        "trainer.plots=false",
        "objective=etr",
        "trainer.threads=1",
    ]
    assert _tether("train", *base, cwd=tmp_path).returncode == 0
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    proc = _tether("train", "--resume", str(run), "objective=dapo", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "a resumed run cannot change objective" in proc.stderr and "start a new run" in proc.stderr
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # nothing rewritten
    # The budget may change: the run goes on to step 3, and config.yaml records the new budget only.
    ok = _tether("train", "--resume", str(run), "trainer.total_steps=3", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr[-2000:]
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["trainer"]["total_steps"] == 3 and saved["objective"]["name"] == "etr"


@pytest.mark.slow
def test_resume_of_a_directory_without_a_run_exits_2(tmp_path):
    proc = _tether("train", "--resume", str(tmp_path / "nothing"), cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --resume") and "Traceback" not in proc.stderr


def test_a_missing_data_file_names_the_key_to_change(tmp_path, capsys, monkeypatch):
    from tether.cli import main

    monkeypatch.chdir(tmp_path)
    assert (
        main(
            [
                "train",
                "data.task=math",
                f"data.task_args.train={tmp_path / 'nope.jsonl'}",
                f"output_dir={tmp_path / 'run'}",
                "model.name_or_path=tiny",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "data.task_args.train" in err and "nope.jsonl" in err and "does not exist" in err
    assert not (tmp_path / "run").exists()  # nothing written


def test_building_a_config_imports_no_plugin_reads_no_file_and_checks_no_package(tmp_path):
    """A Config is a plain value: a plug-in that does not exist, a model directory that is not there and an
    engine whose package may be missing all build; `check_config`, which the loader runs, refuses the first."""
    import sys

    from tether.config.loading import check_config
    from tether.config.sections import Config, DataConfig, ModelConfig, RolloutConfig

    cfg = Config(
        data=DataConfig(task="no_such_module_for_tether:task"),
        model=ModelConfig(name_or_path=str(tmp_path / "missing")),
        rollout=RolloutConfig(engine="vllm"),
    )
    assert cfg.objective == "atr_grpo" and "no_such_module_for_tether" not in sys.modules
    with pytest.raises(ConfigError, match="data.task"):
        check_config(cfg)


def test_a_config_files_data_is_found_from_any_directory(tmp_path, monkeypatch):
    """A relative data file in a config file that is not there from the working directory is read from beside
    the config file (configs/math_gsm8k.yaml's data, run from anywhere); one that is there from the working
    directory, and the command line's, stay as typed."""
    from tether.config.loading import load_config

    (tmp_path / "cfg" / "data").mkdir(parents=True)
    (tmp_path / "cfg" / "data" / "train.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n')
    config = tmp_path / "cfg" / "job.yaml"
    config.write_text("data:\n  task: math\n  task_args: {train: data/train.jsonl, test: data/train.jsonl}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(str(config))
    assert cfg.data.task_args["train"] == str((tmp_path / "cfg" / "data" / "train.jsonl").resolve())
    (elsewhere / "data").mkdir()
    (elsewhere / "data" / "train.jsonl").write_text('{"problem": "2+2", "answer": "4"}\n')
    assert load_config(str(config)).data.task_args["train"] == "data/train.jsonl"  # there from here: as typed
    override = load_config(str(config), ["data.task_args.test=mine.jsonl"]).data.task_args["test"]
    assert override == "mine.jsonl"


@pytest.mark.parametrize(
    "override, meant",
    [("model.lora.rank=8", "r"), ("trainer.learning_rate=1e-4", "lr"), ("rollout.num_generations=8", "group_size")],
)
def test_another_frameworks_name_for_a_key_suggests_ours(override, meant):
    """Issue 49: `model.lora.rank` suggested nothing (difflib finds 'rank' far from 'r'); peft's, TRL's and
    verl's names of a key now suggest tether's."""
    with pytest.raises(ConfigError, match=f"Did you mean '{meant}'\\?"):
        load_config(None, [override])
