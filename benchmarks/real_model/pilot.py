"""Pilot: where does the trust region bind on the real model? DAPO's constrained fraction against updates per batch,
learning rate and staleness (both anchorings), on SmolLM2-135M-Instruct with LoRA (configs/real_model.yaml).

    python benchmarks/real_model/pilot.py --out runs/real_model_pilot --jobs 2 \
        --results benchmarks/results/real_model_pilot_cpu/table.md

Each setting is one `tether train` run (seed 0) of `--steps` steps; two at a time with `--jobs 2` (1 torch thread
each), their logs under OUT/logs/. Finished runs are skipped and interrupted ones resumed, so the command can be
rerun after a stop. Then one table row per setting: the fraction of tokens the trust region clipped or masked
(`constrained_frac`, tether.reports.claims), its low and high parts, the training reward over the first and the last
three steps, the held-out accuracy at the first and the last evaluation, and the median step time.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tether.records.runlog import accuracy, finished, read_metrics, values  # noqa: E402
from tether.reports.claims import METRICS  # noqa: E402

SETTINGS = [  # (name, what it varies, overrides on configs/real_model.yaml with objective=dapo)
    ("mb2", "2 updates per batch (the main job's)", ["trainer.mini_batches=2"]),
    ("mb4", "4 updates per batch", ["trainer.mini_batches=4"]),
    ("mb8", "8 updates per batch", ["trainer.mini_batches=8"]),
    ("mb8x2", "16 updates per batch (8 mini-batches x 2 epochs)", ["trainer.mini_batches=8", "trainer.ppo_epochs=2"]),
    ("mb4_lr3e-4", "4 updates per batch, lr 3e-4", ["trainer.mini_batches=4", "trainer.lr=3e-4"]),
    (
        "mb8x2_lr3e-4",
        "16 updates per batch, lr 3e-4",
        ["trainer.mini_batches=8", "trainer.ppo_epochs=2", "trainer.lr=3e-4"],
    ),
    ("s4_recompute", "staleness 4, pi_old recomputed (decoupled)", ["trainer.staleness=4"]),
    (
        "s4_sampler",
        "staleness 4, pi_old = the sampler (bypass)",
        ["trainer.staleness=4", "trainer.old_logprobs=sampler"],
    ),
]


def command(config: str, name: str, overrides: list[str], out: Path, steps: int) -> list[str]:
    run = out / name
    resume = ["--resume", str(run)] if (run / "checkpoints").exists() and any((run / "checkpoints").iterdir()) else []
    return [
        sys.executable,
        "-m",
        "tether.cli",
        "train",
        config,
        "objective=dapo",
        *overrides,
        f"trainer.total_steps={steps}",
        f"trainer.eval_every={steps}",
        f"trainer.save_every={max(1, steps // 5)}",
        "trainer.threads=1",
        "trainer.seed=0",
        f"output_dir={run}",
        *resume,
    ]


def run_all(args) -> None:
    out = Path(args.out)
    queue = [(n, o) for n, _, o in SETTINGS if not finished(out / n)]
    running: list[tuple[str, subprocess.Popen]] = []
    while queue or running:
        while queue and len(running) < args.jobs:
            name, overrides = queue.pop(0)
            log = out / "logs" / f"{name}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            with log.open("a") as f:
                running.append(
                    (
                        name,
                        subprocess.Popen(
                            command(args.config, name, overrides, out, args.steps),
                            stdout=f,
                            stderr=subprocess.STDOUT,
                            cwd=ROOT,
                        ),
                    )
                )
            print(f"{name}: started (log {log})", flush=True)
        time.sleep(2)
        for item in [r for r in running if r[1].poll() is not None]:
            running.remove(item)
            print(f"{item[0]}: exit {item[1].returncode}", flush=True)


def row(name: str, what: str, run: Path) -> str:
    rows = read_metrics(run)
    steps = [r for r in rows if r.get("reward/mean") is not None]
    reward = [r["reward/mean"] for r in steps]
    acc = accuracy(rows)
    low, high = values(rows, "policy/clipfrac_low"), values(rows, "policy/clipfrac_high")
    step_s = values(rows, "time/step_s")
    return (
        f"| {name} | {what} | {100 * METRICS['constrained_frac'](rows):.2f}% | {100 * statistics.fmean(low):.2f}% / "
        f"{100 * statistics.fmean(high):.2f}% | {statistics.fmean(reward[:3]):.3f} -> {statistics.fmean(reward[-3:]):.3f} | "
        f"{acc[0][1]:.3f} -> {acc[-1][1]:.3f} | {statistics.median(step_s):.1f} s |"
    )


def table(args) -> str:
    out = Path(args.out)
    lines = [
        "| setting | what varies (DAPO, seed 0) | constrained | clip low / high | reward, first 3 -> last 3 steps | "
        "held-out accuracy, first -> last evaluation | median step |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, what, _ in SETTINGS:
        run = out / name
        lines.append(row(name, what, run) if finished(run) else f"| {name} | {what} | not finished | | | | |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/real_model.yaml")
    p.add_argument("--out", default="runs/real_model_pilot")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--results", default=None, help="also write the table to this markdown file")
    p.add_argument("--table-only", action="store_true", help="only print the table of the runs already there")
    args = p.parse_args()
    if not args.table_only:
        run_all(args)
    text = table(args)
    print(text)
    if args.results:
        Path(args.results).parent.mkdir(parents=True, exist_ok=True)
        Path(args.results).write_text(text + "\n")


if __name__ == "__main__":
    main()
