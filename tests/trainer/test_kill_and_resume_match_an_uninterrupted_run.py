"""A run SIGKILLed at any point resumes exactly.

Each test starts `tether train` in a child process that kills itself (SIGKILL, no cleanup) at a
chosen point of a chosen step (tether.faults), resumes it with `tether train --resume`, and
compares every metrics row and the final weights with a run that was never interrupted:
bitwise, on CPU with one thread. The soak test kills a longer run from outside at random
moments, several times, and checks it still learns and its metrics file is complete.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import CLI_RUNNER as RUNNER, untimed
from conftest import KILL_RESUME_STEPS as STEPS
from conftest import checkpoint_weights as _weights
from conftest import kill_resume_overrides as _overrides
from conftest import metrics_rows as _rows
from conftest import tether_child as _tether


@pytest.fixture(scope="module")
def uninterrupted(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("kill") / "full"
    done = _tether("train", *_overrides(tiny_dir, out))
    assert done.returncode == 0, done.stderr[-2000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "kill_at, resumes_from",
    [
        ("update:5", None),  # mid-update of step 2, before any checkpoint: resume starts over
        ("rollout:3", 2),  # mid-rollout of step 3
        ("logged:4", 2),  # step 4 logged, its checkpoint not yet written: the step-3 and 4 rows go
        ("checkpoint:2", 2),  # inside the write of the step-4 checkpoint
    ],
)
def test_a_kill_at_any_point_resumes_exactly(tiny_dir, tmp_path, uninterrupted, kill_at, resumes_from):
    run = tmp_path / "run"
    killed = _tether("train", *_overrides(tiny_dir, run), kill_at=kill_at)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    if kill_at.startswith("checkpoint"):
        assert list((run / "checkpoints").glob(".tmp_step_*")), "the kill should leave a partial write"
    resumed = _tether("train", "--resume", str(run))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    expected = f"resuming {run} from step {resumes_from}" if resumes_from else "step 0: held-out accuracy"
    assert expected in resumed.stdout, resumed.stdout[-2000:]
    a, b = _rows(uninterrupted), _rows(run)
    assert [r["step"] for r in b] == list(range(STEPS + 1))  # no step missing, none twice
    for ra, rb in zip(a, b):
        ra, rb = (untimed(r) for r in (ra, rb))  # wall clock
        assert ra == rb, (ra["step"], {k: (ra[k], rb.get(k)) for k in ra if ra[k] != rb.get(k)})
    wa, wb = _weights(uninterrupted, STEPS), _weights(run, STEPS)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not list((run / "checkpoints").glob(".*")), "partial writes are cleaned up on resume"
    samples = [json.loads(s)["step"] for s in (run / "samples.jsonl").read_text().splitlines()]
    assert (
        samples == sorted(samples)
        and len(samples) == len(set(samples)) * 4
        and set(samples) == set(range(1, STEPS + 1))
    )
    # the per-problem outcomes of each evaluation: once each, equal to the uninterrupted run's
    outcomes = [(run_dir / "heldout.jsonl").read_text().splitlines() for run_dir in (uninterrupted, run)]
    assert outcomes[0] == outcomes[1] and [json.loads(x)["step"] for x in outcomes[1]] == sorted(
        {r["step"] for r in b if "eval/accuracy" in r}
    )


@pytest.mark.soak
def test_soak_repeated_kills_at_random_moments_keep_learning(tmp_path, default_warm_start_cache):
    """The default pipeline (warm start, arithmetic, ATR-GRPO), killed from outside 4 times."""
    steps, run = 240, tmp_path / "run"
    args = [
        f"output_dir={run}",
        f"trainer.total_steps={steps}",
        "trainer.eval_every=120",
        "trainer.save_every=15",
        "trainer.progress=false",
        "trainer.plots=false",
        "trainer.seed=0",
        "trainer.threads=2",
    ]
    env = {**os.environ, "TETHER_CACHE": str(default_warm_start_cache), "TETHER_KILL_AT": ""}
    rng = random.Random(0)
    kills = 0
    cmd = [sys.executable, str(RUNNER), "train", *args]
    while True:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if kills < 4:
            # Kill while training: once this process has logged a new step, at a random moment
            # of the next few seconds (a rollout, an update, a log write or a checkpoint write).
            seen = len(_rows(run)) if (run / "metrics.jsonl").exists() else 0
            while proc.poll() is None and not ((run / "metrics.jsonl").exists() and len(_rows(run)) > seen):
                time.sleep(0.2)
            time.sleep(rng.uniform(0.0, 6.0))
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                kills += 1
                cmd = [sys.executable, str(RUNNER), "train", "--resume", str(run)]
                continue
        _, err = proc.communicate(timeout=1200)
        assert proc.returncode == 0, err[-3000:]
        break
    assert kills == 4
    rows = _rows(run)
    assert [r["step"] for r in rows] == list(range(steps + 1))
    acc = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    assert set(acc) == {0, 120, 240}
    # Still learning after the kills: the training reward rises (60 steps x 128 samples per window;
    # a 200-problem held-out delta is within its noise at this budget, see test_a_tiny_model_learns.py), and
    # held-out accuracy does not collapse.
    reward = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert sum(reward[-60:]) / 60 >= sum(reward[:60]) / 60 + 0.02, reward
    assert acc[240] >= acc[0] - 0.1, acc
    assert not list((run / "checkpoints").glob(".*"))


def test_a_kill_between_the_two_renames_of_a_redone_step_loses_nothing(tmp_path):
    """Re-saving step N moves the old step_N aside, then renames the new one in: a kill in between
    leaves only .old_step_N, which resume puts back; a .tmp_step_N is an unfinished write, deleted."""
    from tether.records import checkpoint

    root = tmp_path / "checkpoints"
    (root / ".old_step_000002").mkdir(parents=True)
    (root / ".old_step_000002" / "state.pt").write_bytes(b"complete copy")
    (root / ".tmp_step_000002").mkdir()
    (root / "step_000001").mkdir()
    (root / ".old_step_000001").mkdir()  # its step_000001 exists: a stale copy
    logs = []
    checkpoint.remove_partial(tmp_path, log=logs.append)
    assert sorted(p.name for p in root.iterdir()) == ["step_000001", "step_000002"]
    assert (root / "step_000002" / "state.pt").read_bytes() == b"complete copy"
    assert len(logs) == 2 and all("interrupted checkpoint write" in line for line in logs)
