"""verl's own trainer with a tether preset on one GPU: runs examples/verl/one_gpu.sh and writes its
metrics as a Markdown table.

    python benchmarks/verl_one_gpu.py --model ~/models/Qwen2.5-0.5B-Instruct --out verl.md
    python benchmarks/verl_one_gpu.py --model PATH --objective rpg_urkl --steps 10 --out verl.md

Needs a CUDA GPU, verl 0.9.x with a vLLM it supports, and a local model directory (nothing is
downloaded). `benchmarks/gpu_all.py OUT_DIR --verl-model PATH` runs it as its `verl` job. The
table has one row per training step: verl's policy loss and clip fraction, tether's clip
fractions, the mean reward and response length, and the step time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "verl" / "one_gpu.sh"
COLUMNS = [
    ("step", "step"),
    ("actor/pg_loss", "pg_loss"),
    ("actor/pg_clipfrac", "pg_clipfrac"),
    ("actor/tether/policy/clipfrac_low", "clipfrac_low"),
    ("actor/tether/policy/clipfrac_high", "clipfrac_high"),
    ("actor/tether/policy/kl_old", "kl_old"),
    ("critic/score/mean", "reward"),
    ("response_length/mean", "length"),
    ("timing_s/step", "step s"),
]


def table(rows: list[dict], title: str) -> str:
    """verl's file-logger lines ({"step", "data"}) as a Markdown table of COLUMNS ("-" where absent)."""

    def cell(row: dict, key: str) -> str:
        value = row["step"] if key == "step" else row["data"].get(key)
        return "-" if value is None else (f"{value:.4g}" if isinstance(value, float) else str(value))

    lines = [f"### {title}", "", "| " + " | ".join(name for _, name in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r, key) for key, _ in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=Path, help="a local model directory (about 0.5B parameters)")
    p.add_argument("--objective", default="atr_grpo", help="a tether preset (default atr_grpo)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--run-dir", type=Path, default=None, help="where the run writes (default: beside --out)")
    p.add_argument("--out", type=Path, required=True, help="the Markdown table")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        p.error("no CUDA device here: verl's trainer needs one (nothing was measured)")
    run_dir = args.run_dir or args.out.with_suffix("").parent / f"verl_{args.objective}_run"
    env = {**os.environ, "OBJECTIVE": args.objective, "STEPS": str(args.steps), "PYTHON": sys.executable}
    tic = time.perf_counter()
    proc = subprocess.run(["bash", str(SCRIPT), str(args.model), str(run_dir)], env=env, cwd=ROOT)
    seconds = time.perf_counter() - tic
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    gpu = torch.cuda.get_device_name(0)
    title = (
        f"verl {args.objective} on one GPU ({gpu}): {len(rows)} of {args.steps} steps, "
        f"{seconds:.0f} s end to end, exit {proc.returncode}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table(rows, title))
    print(args.out.read_text())
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
