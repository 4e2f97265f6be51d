"""Every GPU table and the GPU-marked tests in one call, written as Markdown to one directory.

    python benchmarks/gpu_all.py OUT_DIR                          # on a machine with one CUDA GPU (< 10 min)
    python benchmarks/gpu_all.py OUT_DIR --device cpu --tiny      # the same pipeline on CPU, tiny sizes (a test)
    python benchmarks/gpu_all.py OUT_DIR --only rollout rl_step   # some of them
    python benchmarks/gpu_all.py OUT_DIR --dry-run                # the commands, nothing run
    python benchmarks/gpu_all.py OUT_DIR --verl-model PATH        # also verl's trainer with a tether preset (+8 min)

GPU machines are rarely lent to this project: whoever has one measures everything with this
one command, then commits OUT_DIR's tables under benchmarks/results/performance/. Each job runs
in its own process with its own time limit (a failing or slow one does not stop the others) and
writes OUT_DIR/<job>.md; OUT_DIR/index.md lists every job with its command, exit status, time
and its table (or the end of its output when it failed). Jobs: the GPU-marked tests; the fused
head (logprobs, heads); rollout tokens/s of the hf engine (eager and compiled) and the vLLM
engine; one RL step of tether vs TRL; MFU; shared prompts; the main job (`tether train`, the
default task, timed end to end). With --tiny every job runs at toy sizes, for checking the
pipeline (the numbers mean nothing). With --verl-model (a local ~0.5B model directory: nothing is
downloaded), the `verl` job runs verl's own trainer with a tether preset for a few steps
(benchmarks/verl_one_gpu.py, examples/verl/one_gpu.sh); it has its own 480 s limit on top of the
ten minutes, and no tiny form (verl's trainer does not run on a CPU).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def jobs(device: str, tiny: bool, out: Path, verl_model: Path | None = None) -> dict[str, tuple[list[str], int]]:
    """name -> (command, time limit in seconds). Sizes: the GPU tables', or toy ones with `tiny`; the
    `verl` job only with a model directory on a GPU."""
    table = _jobs(device, tiny, out)
    if verl_model is not None and not tiny:
        table["verl"] = (
            [
                sys.executable,
                str(HERE / "verl_one_gpu.py"),
                "--model",
                str(verl_model),
                "--run-dir",
                str(out / "verl_run"),
            ],
            480,
        )
    return table


def _jobs(device: str, tiny: bool, out: Path) -> dict[str, tuple[list[str], int]]:
    py = [sys.executable]
    bench = lambda name: [*py, str(HERE / f"{name}.py")]  # noqa: E731
    dt = ["--device", device, "--dtype", "bfloat16" if device == "cuda" else "float32"]
    run_dir = out / "main_job_run"
    if tiny:
        return {
            "tests": (
                [*py, "-m", "pytest", "-q", "-m", "gpu", "-x", str(ROOT / "tests" / "rollout" / "test_hf_engine.py")],
                300,
            ),
            "logprobs": (
                [*bench("logprobs"), *dt, "--vocab", "512", "--hidden", "64", "--tokens", "64", "--reps", "1"],
                300,
            ),
            "heads": (
                [*bench("heads"), *dt, "--vocab", "512", "--hiddens", "64", "--tokens", "64", "--reps", "1"],
                300,
            ),
            "rollout": (
                [
                    *bench("rollout"),
                    *dt,
                    "--sizes",
                    "64x2",
                    "--heads",
                    "2",
                    "--prompts",
                    "2",
                    "--group",
                    "2",
                    "--max-new-tokens",
                    "4",
                    "--reps",
                    "1",
                    "--skip-hf",
                    "--bandwidth",
                    "10",
                    "--vllm",
                ],
                300,
            ),
            "rl_step": (
                [
                    *bench("rl_step"),
                    *dt,
                    "--hidden",
                    "64",
                    "--layers",
                    "1",
                    "--heads",
                    "2",
                    "--prompts",
                    "2",
                    "--group",
                    "2",
                    "--max-new-tokens",
                    "4",
                    "--steps",
                    "1",
                ],
                300,
            ),
            "mfu": ([*bench("mfu"), *dt, "--sizes", "64x1", "--batch", "2", "--length", "32", "--reps", "1"], 300),
            "main_job": (
                [
                    *py,
                    "-m",
                    "tether.cli",
                    "train",
                    f"output_dir={run_dir}",
                    f"trainer.device={device}",
                    "warm_start.enabled=false",
                    "trainer.total_steps=2",
                    "data.eval_size=4",
                    "rollout.prompts_per_step=2",
                    "rollout.group_size=2",
                    "trainer.progress=false",
                    "model.tiny_layers=1",
                ],
                300,
            ),
        }
    vocab = ["--vocab", "151936"]
    # time limits sum to 600 s: the whole call stays under ten minutes whatever hangs
    return {
        "tests": ([*py, "-m", "pytest", "-q", "-m", "gpu", str(ROOT / "tests")], 120),
        "logprobs": ([*bench("logprobs"), *dt, "--tokens", "1024", "4096", "--reps", "3"], 60),
        "heads": ([*bench("heads"), *dt, "--reps", "3"], 45),
        "rollout": (
            [*bench("rollout"), *dt, "--preset", "qwen0.5b", "--compile", "--vllm", "--skip-hf", "--reps", "2"],
            90,
        ),
        "rollout_small": ([*bench("rollout"), *dt, "--sizes", "512x8", "1024x16", "--compile", "--reps", "2"], 45),
        "rl_step": ([*bench("rl_step"), *dt, *vocab, "--steps", "4", "--vllm"], 60),
        "mfu": ([*bench("mfu"), *dt, "--sizes", "512x8", "1024x16", "2048x24", *vocab], 30),
        "shared_prompts": ([*bench("shared_prompts"), *dt, "--size", "1024x16", *vocab], 30),
        # the main job (cached warm start), 200 of its 1000 steps: time per step and start-up
        "main_job": (
            [
                *py,
                "-m",
                "tether.cli",
                "train",
                f"output_dir={run_dir}",
                f"trainer.device={device}",
                "trainer.progress=false",
                "trainer.total_steps=200",
            ],
            120,
        ),
    }


def run_job(name: str, command: list[str], limit: int, out: Path) -> dict:
    """Run one job (its table to out/<name>.md when the script takes --out); a record for the index."""
    table = out / f"{name}.md"
    if "benchmarks" in " ".join(command[:2]):
        command = [*command, "--out", str(table)]
    tic = time.perf_counter()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=limit, cwd=ROOT)
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, output = "timeout", f"{exc.stdout or ''}{exc.stderr or ''}"
        output = output.decode() if isinstance(output, bytes) else output
    seconds = time.perf_counter() - tic
    if not table.exists():  # tests and the main job: their output's end is their table
        table.write_text(f"### {name}\n\n```\n{output[-4000:]}\n```\n")
    return {"name": name, "command": shlex.join(command), "rc": rc, "seconds": seconds, "table": table}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="directory for the Markdown tables (created)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="toy sizes: check the pipeline, not the machine")
    p.add_argument("--only", nargs="+", default=None, help="run only these jobs")
    p.add_argument("--dry-run", action="store_true", help="print the commands and stop")
    p.add_argument(
        "--verl-model",
        type=Path,
        default=None,
        help="a local ~0.5B model directory: adds the `verl` job (verl's trainer, a tether preset, 5 steps)",
    )
    args = p.parse_args(argv)
    if args.verl_model is not None and args.tiny:
        p.error("--verl-model has no --tiny form: verl's trainer needs a CUDA GPU")
    todo = jobs(args.device, args.tiny, args.out.resolve(), args.verl_model)
    unknown = sorted(set(args.only or ()) - set(todo))
    if unknown:
        p.error(f"--only: unknown job(s) {', '.join(unknown)}; valid: {', '.join(todo)}")
    todo = {k: v for k, v in todo.items() if not args.only or k in args.only}
    if args.dry_run:
        for name, (command, limit) in todo.items():
            print(f"{name} ({limit} s): {shlex.join(command)}")
        return 0
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda: no CUDA device here; use --device cpu --tiny to check the pipeline")
    args.out.mkdir(parents=True, exist_ok=True)
    records = []
    for name, (command, limit) in todo.items():
        print(f"{name} ...", file=sys.stderr, flush=True)
        records.append(run_job(name, command, limit, args.out.resolve()))
        print(f"{name}: exit {records[-1]['rc']} in {records[-1]['seconds']:.0f} s", file=sys.stderr, flush=True)
    lines = [
        f"# GPU tables ({args.device}{', tiny sizes' if args.tiny else ''})",
        "",
        "| job | exit | seconds | command |",
        "|---|---|---|---|",
    ]
    lines += [f"| {r['name']} | {r['rc']} | {r['seconds']:.0f} | `{r['command']}` |" for r in records]
    for r in records:
        lines += ["", r["table"].read_text().strip()]
    (args.out / "index.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out / 'index.md'}", file=sys.stderr)
    return 0 if all(r["rc"] == 0 for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
