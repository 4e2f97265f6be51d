"""benchmarks/gpu_all.py: the one command for the GPU tables runs its jobs and writes their Markdown
(checked on CPU at toy sizes; on a GPU it is the same code with the GPU sizes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_all.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


def test_every_gpu_table_and_the_gpu_tests_are_jobs(tmp_path):
    out = run(str(tmp_path), "--dry-run")
    assert out.returncode == 0, out.stderr
    jobs = {line.split(" ")[0] for line in out.stdout.splitlines()}
    assert jobs == {
        "tests",
        "logprobs",
        "heads",
        "rollout",
        "rollout_small",
        "rl_step",
        "mfu",
        "shared_prompts",
        "main_job",
    }
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


def _rl_step_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("rl_step_bench", SCRIPT.parent / "rl_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rl_step_args(**kw):
    import argparse

    base = dict(
        device="cpu",
        dtype="float32",
        threads=1,
        load_start=(1.0, 1.0, 1.0),
        hidden=64,
        layers=1,
        n_params=1e5,
        vocab=None,
        prompts=2,
        group=2,
        max_new_tokens=4,
        mini_batches=2,
        warmup=1,
        uses_reference=False,
        trl_mean_length=4.0,
    )
    return argparse.Namespace(**{**base, **kw})


STEP = {"total": 2.0, "generation": 1.0, "logprobs": 0.5, "update": 0.5, "tokens": 16.0, "sync": 0.1, "start": 30.0}
STEP["pad"] = 0.25


def test_rl_step_reports_packing_as_a_column_beside_the_padded_one_with_the_padding_share():
    rl_step = _rl_step_module()
    packed = {**STEP, "total": 1.6, "logprobs": 0.4, "update": 0.2, "pad": 0.0}
    out = rl_step.report(_rl_step_args(packed_rows=[packed]), torch_device(), [STEP], [STEP], [dict(STEP, total=4.0)])
    header = [c.strip() for c in [line for line in out.splitlines() if line.startswith("|  |")][0].split("|")]
    assert header[2:4] == ["tether (recompute)", "tether (trainer.packing=true)"]
    pad = [line for line in out.splitlines() if line.startswith("| padding share")][0]
    assert [c.strip() for c in pad.split("|")][2:4] == ["25.0%", "0.0%"]
    assert "the step 1.25x as fast, the log-prob passes 1.25x, the update 2.50x" in out


def test_rl_step_reports_trl_with_vllm_as_a_column_or_as_the_error_that_stops_it():
    rl_step = _rl_step_module()
    step = dict(STEP)
    trl = [{"total": 4.0, "generation": 1.0, "sync": 0.2, "start": 50.0}]
    args = _rl_step_args()
    failed = rl_step.report(
        args,
        torch_device(),
        [step],
        [step],
        trl,
        [step],
        {
            "error": "AttributeError: 'Parameter' object has no attribute 'weight_loader'",
            "raised_at": "vllm/model_executor/layers/linear.py:1341 (load_weights)",
            "trl_call": "trl/generation/vllm_generation.py:511 (sync_weights)",
        },
    )
    header = [line for line in failed.splitlines() if line.startswith("|  |")][0]
    cells = [c.strip() for c in header.split("|")]
    assert cells[5:8] == ["TRL GRPOTrainer", "TRL GRPOTrainer + vLLM (colocate)", "TRL / tether"]  # before the ratios
    assert "| does not run |" in failed and "weight_loader" in failed and "vllm_generation.py:511" in failed
    ran = rl_step.report(
        args,
        torch_device(),
        [step],
        [step],
        trl,
        [step],
        {"rows": [{"total": 3.0, "generation": 1.5, "sync": 0.25, "start": 40.0}], "mean_length": 4.0},
    )
    assert "3.000 s" in ran and "weight sync 0.250 s" in ran and "40.0 s (the trainer's construction)" in ran
    assert "does not run" not in ran


def torch_device():
    import torch

    return torch.device("cpu")


def test_the_verl_job_runs_with_a_model_directory_only(tmp_path):
    out = run(str(tmp_path), "--dry-run", "--verl-model", str(tmp_path / "model"))
    assert out.returncode == 0, out.stderr
    verl = [line for line in out.stdout.splitlines() if line.startswith("verl ")]
    assert len(verl) == 1 and "verl_one_gpu.py --model" in verl[0] and "(480 s)" in verl[0]
    out = run(str(tmp_path), "--device", "cpu", "--tiny", "--verl-model", str(tmp_path), "--dry-run")
    assert out.returncode == 2 and "no --tiny form" in out.stderr


def test_the_verl_table_reads_verls_file_logger():
    import importlib.util

    spec = importlib.util.spec_from_file_location("verl_one_gpu", SCRIPT.with_name("verl_one_gpu.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = [{"step": 1, "data": {"actor/pg_loss": 0.25, "critic/score/mean": 0.5, "timing_s/step": 12.0}}]
    text = module.table(rows, "t")
    assert "| 1 | 0.25 | - | - | - | - | 0.5 | - | 12 |" in text
