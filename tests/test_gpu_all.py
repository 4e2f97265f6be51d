"""benchmarks/gpu_all.py: the one command for the GPU tables runs its jobs and writes their Markdown
(checked on CPU at toy sizes; on a GPU it is the same code with the GPU sizes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_all.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


def test_every_gpu_table_and_the_gpu_tests_are_jobs(tmp_path):
    out = run(str(tmp_path), "--dry-run")
    assert out.returncode == 0, out.stderr
    jobs = {line.split(" ")[0] for line in out.stdout.splitlines()}
    assert jobs == {"tests", "logprobs", "heads", "rollout", "rollout_small", "rl_step", "mfu", "shared_prompts",
                    "main_job"}
    assert "-m gpu" in out.stdout and "--vllm" in out.stdout and "--compile" in out.stdout
    assert not list(tmp_path.iterdir())  # a dry run writes nothing


@pytest.mark.slow
def test_a_tiny_cpu_run_writes_each_table_and_an_index(tmp_path):
    out = run(str(tmp_path / "tables"), "--device", "cpu", "--tiny", "--only", "mfu", "main_job")
    assert out.returncode == 0, out.stdout + out.stderr
    index = (tmp_path / "tables" / "index.md").read_text()
    assert "| mfu | 0 |" in index and "| main_job | 0 |" in index
    assert "MFU" in (tmp_path / "tables" / "mfu.md").read_text()
    assert (tmp_path / "tables" / "main_job_run" / "metrics.jsonl").exists()


def test_an_unknown_job_is_an_error(tmp_path):
    out = run(str(tmp_path), "--only", "rollout", "nope", "--dry-run")
    assert out.returncode == 2 and "unknown job(s) nope" in out.stderr
