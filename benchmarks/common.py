"""Shared by the benchmark scripts: the machine, Markdown tables, timing, --out.

Every script prints a Markdown table with a header naming the machine and its load, and
writes the same text to `--out FILE.md` when given.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

import torch


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="parameter and activation dtype (bfloat16 for the GPU tables)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0: torch's default)")
    parser.add_argument("--out", default=None, help="also write the Markdown to this file")


MODEL_PRESETS = {
    # Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, vocabulary 151,936) as a tiny-model Llama:
    # MLP 4 x hidden, full K/V heads, untied head: 0.58B parameters; and the issue-14 workload, 256 new tokens.
    "qwen0.5b": {"hidden": 896, "layers": 24, "heads": 14, "vocab": 151936, "max_new_tokens": 256},
}
"""Named model shapes for the GPU tables; `--preset NAME` sets these arguments (explicit flags win)."""


def add_preset_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset",
        choices=sorted(MODEL_PRESETS),
        default=None,
        help="a documented model shape: "
        + "; ".join(
            f"{k} = {', '.join(f'--{a.replace(chr(95), chr(45))} {v}' for a, v in p.items())}"
            for k, p in MODEL_PRESETS.items()
        ),
    )


def apply_preset(args, parser: argparse.ArgumentParser) -> None:
    """Fill the preset's values into arguments the command line left at their defaults."""
    if getattr(args, "preset", None) is None:
        return
    for key, value in MODEL_PRESETS[args.preset].items():
        if hasattr(args, key) and getattr(args, key) == parser.get_default(key):
            setattr(args, key, value)


def setup(args) -> torch.device:
    """Threads and device from the arguments; remembers the load average at the start."""
    args.load_start = os.getloadavg()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no CUDA device")
    return device


def dtype_of(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine(device: torch.device, args) -> str:
    """One line: the processor (or GPU), cores, torch threads, versions, and the load at start and end."""
    if device.type == "cuda":
        where = f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    else:
        where = f"{cpu_model()}, {os.cpu_count()} logical cores, {torch.get_num_threads()} torch threads"
    start, end = args.load_start, os.getloadavg()
    return (
        f"{where}; torch {torch.__version__}; load average (1, 5, 15 min) "
        f"{start[0]:.1f}, {start[1]:.1f}, {start[2]:.1f} at the start, {end[0]:.1f}, {end[1]:.1f}, {end[2]:.1f} at the end"
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    sync(device)
    tic = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - tic


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def emit(text: str, out: str | None) -> None:
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
        print(f"\nwritten to {out}")


def seed_runs(results: Path) -> list[Path]:
    """The run directories `results/seed*` that hold a metrics.jsonl, in name order; exits naming `results` if none."""
    found = sorted(p for p in results.glob("seed*") if (p / "metrics.jsonl").exists())
    if not found:
        raise SystemExit(f"no seed*/metrics.jsonl under {results}")
    return found


def mean_curve(curves: Sequence[Sequence[tuple[int, float]]]) -> tuple[list[int], list[float]]:
    """(steps, means) of per-seed (step, value) series over the steps every seed reached (the first's steps)."""
    n = min(len(c) for c in curves)
    return [s for s, _ in curves[0][:n]], [statistics.fmean(c[i][1] for c in curves) for i in range(n)]


def save_figure(fig, out: Path) -> Path:
    """Write a matplotlib figure to `out` (its folder made) and close it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return out
