"""The run as a user lives it (issue 17): output redirected to a file reads well, Ctrl-C and a
scheduler's SIGTERM stop cleanly with a checkpoint, a summary and a resume hint, the summary says
what the run was, and wandb without credentials fails before anything is written."""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import tiny_run

RUNNER = Path(__file__).resolve().parents[1].joinpath("cli_runner.py")


def _overrides(tiny_dir, out, steps, *extra):
    settings = ["trainer.micro_batch_size=8", "trainer.eval_every=5", "trainer.tensorboard=false"]
    return tiny_run(tiny_dir, *settings, f"trainer.total_steps={steps}", *extra, out=out)


def _start(args, log: Path):
    f = log.open("w")  # stdout and stderr to a file, as nohup or Slurm would
    return subprocess.Popen(
        [sys.executable, str(RUNNER), *args], stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
    ), f


def _rows(run):
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_output_to_a_file_has_the_run_directory_and_plain_progress_lines(tiny_dir, tmp_path):
    run, log = tmp_path / "run", tmp_path / "out.log"
    proc, f = _start(["train", *_overrides(tiny_dir, run, 6, "trainer.log_every=2", "trainer.plots=false")], log)
    assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    f.close()
    text = log.read_text()
    assert "\x1b[" not in text and "\r" not in text  # no terminal control sequences in a file
    assert text.count(f"run directory: {run}") == 2  # at the start and at the end
    steps = [int(m) for m in re.findall(r"^step (\d+)/6  reward [0-9.]+", text, re.M)]
    assert steps == [2, 4, 5, 6]  # every 2 steps, and at the evaluations (5, 6)
    assert re.search(r"^step 5/6 .*flat [0-9.]+  clip .* s/step .*acc [0-9.]+ @5  ETA", text, re.M)
    assert re.search(
        r"^  sample \(reward [0-9.]+, answer \S+\): ", text, re.M
    )  # a sampled completion at the evaluation


@pytest.mark.slow
@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_cleanly_then_the_run_resumes_and_finishes(tiny_dir, tmp_path, signum, code):
    run, log = tmp_path / "run", tmp_path / "out.log"
    args = _overrides(tiny_dir, run, 40, "trainer.save_every=1000", "trainer.progress=true")
    proc, f = _start(["train", *args], log)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if (run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(signum)
    assert proc.wait(timeout=120) == code, log.read_text()[-3000:]
    f.close()
    text = log.read_text()
    assert "Traceback" not in text
    last = _rows(run)[-1]["step"]
    assert 2 <= last < 40
    assert f"interrupted at step {last}; resume with: tether train --resume {run}" in text
    # The checkpoint of the last finished step (save_every would not have written one), summary and plots.
    assert (run / "checkpoints" / f"step_{last:06d}" / "manifest.json").exists()  # complete, written last
    summary = (run / "summary.md").read_text()
    assert f"steps: {last} of 40 (interrupted by signal {int(signum)}" in summary
    assert (run / "plots" / "reward.png").exists()
    done = subprocess.run(
        [sys.executable, str(RUNNER), "train", "--resume", str(run)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in _rows(run)] == list(range(41))
    assert "steps: 40 of 40 (finished)" in (run / "summary.md").read_text()


@pytest.mark.slow
def test_summary_says_what_the_run_was(tiny_dir, tmp_path):
    from tether.config.loading import load_config
    from tether.trainer.loop import train

    run = train(
        load_config(
            None,
            _overrides(tiny_dir, tmp_path / "run", 5, "objective=etr", "trainer.progress=false", "trainer.plots=false"),
        ),
        log=lambda *_: None,
    )
    text = (run / "summary.md").read_text()
    assert text.startswith(f"# Run {run.name}")
    assert "- objective: **etr** (" in text and "eta=0.5" in text and "aggregation=token-mean" in text
    assert f"- model: {tiny_dir}" in text and "task: arithmetic" in text
    assert "- steps: 5 of 5 (finished)" in text and "s on cpu" in text
    best = max((r["eval/accuracy"], -r["step"]) for r in _rows(run) if "eval/accuracy" in r)
    assert f"- best held-out accuracy: {best[0]:.3f} at step {-best[1]}" in text
    assert f"- reproduce: `tether train {run / 'config.yaml'} output_dir={run}-rerun`" in text
    assert "| eval/accuracy |" in text  # the metrics table follows


def test_wandb_without_credentials_fails_before_anything_is_written(tiny_dir, tmp_path, monkeypatch):
    import importlib.machinery
    import types

    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("HOME", str(tmp_path))
    from tether.cli import main

    out = tmp_path / "run"
    code = main(["train", *_overrides(tiny_dir, out, 2, "trainer.wandb=true")])
    assert code == 2 and not out.exists()
    monkeypatch.setenv("WANDB_MODE", "offline")
    from tether.records.sinks import wandb_problem

    assert wandb_problem() == ""


def test_wandb_message_names_the_fixes(monkeypatch, tmp_path):
    import importlib.machinery
    import types

    from tether.records.sinks import wandb_problem

    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for k in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    msg = wandb_problem()
    assert "WANDB_API_KEY" in msg and "WANDB_MODE=offline" in msg
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_problem() == ""


@pytest.mark.slow
def test_sigterm_during_the_step_0_evaluation_stops_at_once_says_so_and_the_run_resumes(tiny_dir, tmp_path):
    """Issue 49, defect 1: a SIGTERM during the step-0 evaluation printed "stopping after the step under way has
    finished (it has updated the weights)" and went on evaluating. It stops now, says what it abandoned, and
    the run resumes from scratch."""
    run, log = tmp_path / "run", tmp_path / "out.log"
    slow_eval = ["data.eval_size=400", "trainer.eval_batch_size=1", "trainer.progress=true"]
    proc, f = _start(["train", *_overrides(tiny_dir, run, 2, *slow_eval)], log)
    deadline = time.time() + 240
    while time.time() < deadline and "run directory:" not in log.read_text():
        time.sleep(0.1)
    time.sleep(1.0)  # the model is loaded and the evaluation under way (it takes tens of seconds)
    assert "step 0: held-out accuracy" not in log.read_text()
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143, log.read_text()[-3000:]
    assert time.time() - sent < 10  # within seconds, not after the evaluation
    f.close()
    text = log.read_text()
    assert "SIGTERM: stopping now, during the step-0 evaluation; no step has run" in text
    assert "has updated the weights" not in text and "Traceback" not in text
    assert (
        f"interrupted during the step-0 evaluation, before any step (nothing to lose); resume with: tether train --resume {run}"
        in text
    )
    done = subprocess.run(
        [sys.executable, str(RUNNER), "train", "--resume", str(run)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in _rows(run)] == [0, 1, 2]


def test_the_heartbeat_names_the_phase_under_way():
    """Issue 49, defect 4: during the step-0 evaluation the heartbeat said "step 1/20 under way for 7m01s"."""
    from tether.records.sinks import PlainProgress

    lines: list[str] = []
    progress = PlainProgress(20, log=lines.append, heartbeat_s=0.05)
    try:
        progress.phase("the step-0 evaluation")
        time.sleep(0.3)
        assert lines and all(line.startswith("the step-0 evaluation under way for") for line in lines)
        progress.phase(None)
        lines.clear()
        time.sleep(0.3)
        assert lines and lines[-1].startswith("step 1/20 under way for")
    finally:
        progress.close()


def test_the_closing_line_names_an_export_command_that_works(tmp_path):
    """Issue 49, defect 5: the closing line recommended `--step best` when no checkpoint had a recorded accuracy,
    where `tether export` then failed."""
    from tether.trainer.loop import _export_hint

    def run(name, accuracies):
        path = tmp_path / name
        for step, acc in accuracies.items():
            ckpt = path / "checkpoints" / f"step_{step:06d}"
            ckpt.mkdir(parents=True)
            (ckpt / "manifest.json").write_text(json.dumps({"files": {}, "accuracy": acc}))
        path.mkdir(exist_ok=True)
        return path

    with_acc, without, none = run("a", {2: None, 4: 0.5}), run("b", {2: None}), run("c", {})
    assert _export_hint(with_acc) == f" (`tether export {with_acc} --step best OUT`)"
    assert "--step last OUT`: no checkpoint recorded a held-out accuracy" in _export_hint(without)
    assert _export_hint(none) == ""
