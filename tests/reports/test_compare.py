"""tether compare / report: identical budgets per objective x seed, a well-formed report, resume."""

import json
import shutil

import pytest

from tether.reports.report import discover, write_report
from tether.trainer.compare import compare
from tether.records.sinks import read_jsonl
from conftest import tiny_run


def _overrides(tiny):
    steps = ["rollout.max_new_tokens=5", "trainer.total_steps=3", "trainer.eval_every=2", "trainer.save_every=1"]
    return tiny_run(tiny, *steps, "trainer.progress=false", "trainer.tensorboard=false", "trainer.plots=false")


@pytest.mark.slow
def test_compare_two_objectives_two_seeds_and_resume(tiny_dir, tmp_path):
    tiny = tiny_dir
    out = tmp_path / "cmp"
    logs = []
    report = compare(None, ["grpo", "atr_grpo"], 2, _overrides(tiny), str(out), threshold=0.5, log=logs.append)
    text = report.read_text()
    assert "| grpo | 2 |" in text and "| atr_grpo | 2 |" in text
    assert "±" in text
    for name in ("accuracy", "reward", "entropy", "clipfrac_high", "kl_old", "response_length"):
        assert (out / "plots" / f"{name}.png").stat().st_size > 1000
        assert f"plots/{name}.png" in text
    # Same data order and initial model across objectives: step-0 evaluations are identical.
    from tether.records.sinks import read_jsonl

    e0 = [read_jsonl(out / o / "seed0" / "metrics.jsonl")[0] for o in ("grpo", "atr_grpo")]
    assert e0[0] == e0[1]

    # Interrupt one run after its step-2 checkpoint: drop the rest; a rerun resumes only it.
    run = out / "atr_grpo" / "seed1"
    shutil.rmtree(run / "checkpoints" / "step_000003")
    (run / "summary.md").unlink()
    logs.clear()
    compare(None, ["grpo", "atr_grpo"], 2, _overrides(tiny), str(out), threshold=0.5, log=logs.append)
    status = [line for line in logs if line.startswith("[")]
    assert sum("skipped" in s for s in status) == 3 and sum("resuming" in s for s in status) == 1
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [0, 1, 2, 3]

    # tether report rebuilds from the run directories alone.
    rebuilt = write_report({"cmp": discover([str(out)])}, tmp_path / "again", threshold=0.5)
    assert "| grpo | 2 |" in rebuilt.read_text()

    # The report says the budget and every setting that differs from the defaults.
    assert "Budget: 3 rollout steps of 4 prompts x 4 samples, 1 x 2 optimiser steps each" in text
    assert "`rollout.max_new_tokens=5`" in text and "`trainer.total_steps=3`" in text

    # summary.json: per-seed lists per regime and method, and the claims with intervals and verdicts.
    claims = tmp_path / "claims.yaml"
    claims.write_text("- {claim: ATR beats GRPO, metric: final_accuracy, method: atr_grpo, baseline: grpo}\n")
    write_report({"cmp": discover([str(out)])}, tmp_path / "again", threshold=0.5, claims=str(claims))
    summary = json.loads((tmp_path / "again" / "summary.json").read_text())
    methods = summary["regimes"]["cmp"]["methods"]
    assert methods["grpo"]["seeds"] == [0, 1] and len(methods["atr_grpo"]["final_accuracy"]) == 2
    assert {"clipfrac", "final_entropy", "auc", "max_drop", "entropy_half_step"} <= set(methods["grpo"])
    assert summary["regimes"]["cmp"]["config"]["trainer"]["total_steps"] == 3
    (c,) = summary["claims"]
    # Two seeds, the same for both methods: paired, and too few for a verdict (tether.reports.claims.MIN_SEEDS).
    assert c["regime"] == "cmp" and c["paired"] and c["seeds"] == [2, 2]
    assert c["verdict"] == "not enough seeds" and c["ci95"] is None and "2 paired seeds" in c["why"]
    assert "## Claims" in (tmp_path / "again" / "report.md").read_text()


@pytest.mark.slow
def test_a_rerun_with_other_settings_is_refused_and_overrides_go_anywhere(tiny_dir, tmp_path, capsys):
    from tether.cli import main

    out = tmp_path / "cmp"
    args = ["compare", "--objectives", "grpo", "--seeds", "1", "--out", str(out)]
    assert main([*args, *_overrides(tiny_dir)]) == 0  # key=value after the options
    text = (out / "report.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| grpo | 1 |"))
    assert "±" not in row  # a single seed shows no spread
    capsys.readouterr()
    assert main([*args, *_overrides(tiny_dir), "trainer.total_steps=4"]) == 2  # another budget
    err = capsys.readouterr().err
    assert "holds runs made with other settings" in err and "trainer.total_steps: 3 there, 4 now" in err
    assert "--out DIR" in err
    # what a run shows (its progress lines, plots) is not a setting of the comparison: the rerun resumes
    assert main([*args, *_overrides(tiny_dir), "trainer.log_every=1", "trainer.plots=true"]) == 0


def test_a_bad_claims_file_fails_before_any_run_or_report_is_written(tiny_dir, tmp_path, capsys):
    from tether.cli import main

    bad = tmp_path / "claims.yaml"
    bad.write_text("- {claim: x, metric: final_acc, method: grpo, baseline: dapo}\n")
    out = tmp_path / "cmp"
    args = ["compare", "--objectives", "grpo", "--seeds", "1", "--out", str(out), "--claims", str(bad)]
    assert main([*args, *_overrides(tiny_dir)]) == 2
    assert "metric 'final_acc' is not one of" in capsys.readouterr().err
    assert not out.exists()  # no run was trained only to fail at the report
    runs = tmp_path / "runs"
    (runs / "grpo" / "seed0").mkdir(parents=True)
    (runs / "grpo" / "seed0" / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.5}\n')
    assert main(["report", str(runs), "--claims", str(bad), "--out", str(tmp_path / "rep")]) == 2
    assert not (tmp_path / "rep").exists()


@pytest.mark.slow
def test_jobs_run_children_side_by_side_and_a_failed_child_is_named_with_its_log(tiny_dir, tmp_path, monkeypatch):
    from tether.schema import RunsFailed

    overrides = [o for o in _overrides(tiny_dir) if not o.startswith("reward.name=")] + ["trainer.total_steps=2"]
    out = tmp_path / "cmp"
    logs = []
    report = compare(None, ["grpo", "dapo"], 1, overrides, str(out), threshold=0.5, log=logs.append, jobs=2)
    assert "| grpo | 1 |" in report.read_text() and "| dapo | 1 |" in report.read_text()
    for objective in ("grpo", "dapo"):
        assert [r["step"] for r in read_jsonl(out / objective / "seed0" / "metrics.jsonl")] == [0, 1, 2]
        assert "run directory:" in (out / "logs" / f"{objective}-seed0.log").read_text()
    assert sum(line.endswith(": done") for line in logs) == 2

    # A child that fails (a reward that raises on every completion: exit 2) is named with its log; the
    # other runs are untouched, and nothing is reported as done for it.
    (tmp_path / "broken_reward.py").write_text("def score(completion, example):\n    raise ValueError('broken')\n")
    monkeypatch.chdir(tmp_path)  # `module:name` is found in the current directory, by the children too
    with pytest.raises(
        RunsFailed, match=r"1 run\(s\) failed or stopped: \[1/1\] grpo seed 0 \(exit 2, log: .*grpo-seed0\.log\)"
    ):
        compare(None, ["grpo"], 1, [*overrides, "reward.name=broken_reward:score"], str(tmp_path / "bad"), jobs=2)
    assert "broken" in (tmp_path / "bad" / "logs" / "grpo-seed0.log").read_text()


@pytest.mark.slow
def test_the_null_control_reruns_the_baseline_with_another_mini_batch_order(tiny_dir, tmp_path):
    """The null control shares the methods' sampling stream and initial model and changes only the order of its
    mini-batches (trainer.minibatch_seed), so its pair is coupled as the methods of one seed are (issue 48)."""
    out = tmp_path / "cmp"
    overrides = [*_overrides(tiny_dir), "trainer.total_steps=2", "trainer.save_every=2", "trainer.mini_batches=2"]
    report = compare(None, ["grpo"], 1, overrides, str(out), threshold=0.5, log=lambda *_: None, null_control="grpo")
    base, null = (read_jsonl(out / label / "seed0" / "metrics.jsonl") for label in ("grpo", "grpo_null"))
    from tether.records.runlog import read_config

    control, baseline = (read_config(out / label / "seed0")["trainer"] for label in ("grpo_null", "grpo"))
    assert control["minibatch_seed"] == 10_000 and baseline["minibatch_seed"] is None
    assert control["sampling_seed"] is None  # the methods' sampling stream, not another one
    # The same initial model and held-out set (step 0 equal) and the same first batch of samples (the weights
    # differ only after step 1's mini-batches ran in another order).
    assert base[0]["eval/accuracy"] == null[0]["eval/accuracy"]
    samples = [read_jsonl(out / label / "seed0" / "samples.jsonl")[0] for label in ("grpo", "grpo_null")]
    assert samples[0]["step"] == samples[1]["step"] == 1 and samples[0] == samples[1]
    text = report.read_text()
    assert "## Null control" in text and "| grpo_null | 1 |" in text
    assert "grpo_null vs grpo (1 seed, paired)" in text and "False verdicts in the null control: 0 of 0 tests" in text
    with pytest.raises(Exception, match="--null-control 'dapo': name one of the compared objectives"):
        compare(None, ["grpo"], 1, overrides, str(tmp_path / "x"), null_control="dapo")


def test_a_child_stopped_by_a_signal_stops_the_comparison(tmp_path, monkeypatch):
    """A scheduler that stops a comparison's processes (SIGTERM to each) must not see it start the next runs: a
    child that exits as stopped (143) empties the queue, the other running children are asked to stop (SIGTERM:
    they finish their step and checkpoint it), and the comparison raises, saying a rerun resumes."""
    import subprocess
    import sys

    from tether.schema import RunsFailed
    from tether.trainer import compare as runner

    script = tmp_path / "child.py"
    script.write_text(
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))\n"
        "if sys.argv[1] == 'stop':\n    sys.exit(143)\n"
        "time.sleep(60)\n"
    )
    pending = [
        (f"[{i}/4] run {i}", "training", [sys.executable, str(script), kind], tmp_path / f"{i}.log")
        for i, kind in enumerate(["stop", "long", "long", "long"], 1)
    ]
    started = []
    real_popen = subprocess.Popen
    monkeypatch.setattr(runner.subprocess, "Popen", lambda cmd, **kw: started.append(cmd) or real_popen(cmd, **kw))
    logs = []
    with pytest.raises(RunsFailed, match="stopped by a signal"):
        runner._run_children(pending, jobs=2, log=logs.append)
    assert len(started) == 2  # the two first runs; none after the stop
    assert any("starting no further run" in line for line in logs)


@pytest.mark.slow
def test_jobs_resume_an_interrupted_run_of_a_config_file(tiny_dir, tmp_path):
    """With --jobs a resumed child was `tether train CONFIG ... --resume RUN`, which `--resume` refuses (it takes
    overrides only): every interrupted run of a comparison built from a config file failed with exit 2."""
    config = tmp_path / "cmp.yaml"
    config.write_text("trainer:\n  total_steps: 3\n  save_every: 1\n")
    overrides = [o for o in _overrides(tiny_dir) if not o.startswith(("trainer.total_steps", "trainer.save_every"))]
    overrides = [o for o in overrides if not o.startswith("reward.name=")]
    out = tmp_path / "cmp"
    compare(str(config), ["grpo", "dapo"], 1, overrides, str(out), threshold=0.5, log=lambda *_: None, jobs=2)
    run = out / "dapo" / "seed0"
    shutil.rmtree(run / "checkpoints" / "step_000003")
    (run / "summary.md").unlink()
    logs = []
    compare(str(config), ["grpo", "dapo"], 1, overrides, str(out), threshold=0.5, log=logs.append, jobs=2)
    assert any("dapo seed 0: resuming" in line for line in logs) and any("dapo seed 0: done" in line for line in logs)
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [0, 1, 2, 3]
