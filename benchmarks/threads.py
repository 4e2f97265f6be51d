"""Benchmark: torch CPU threads for an RL step when other processes compete for the cores.

    python benchmarks/threads.py --compete 1 --steps 8       # one busy competing process
    python benchmarks/threads.py --compete 0 --steps 8       # no competitor of ours (the machine's own load only)

One tether RL step of the default run (the default tiny model, prompts, group size, token
budget and mini-batches of `tether train`; the trainer's own functions, as benchmarks/rl_step.py
runs them), timed with torch's default thread count (every core), with 1 thread and with 2.
The settings take turns step by step in one process (torch.set_num_threads between steps), so a
change in the machine's load hits each alike. `--compete K` starts K busy Python loops (each
bounded by --compete-limit seconds, stopped at the end) that compete for the cores throughout.
This measured the default of `trainer.threads` (docs/performance.md, "CPU threads under contention").

    python benchmarks/threads.py --config configs/real_model.yaml --compete 1 --steps 3 --threads 1,2

times a showcase config's step instead (its model, LoRA, batch and data; the reward is the benchmark's parity
reward, which does not change the step's cost). This measured the showcase configs' `trainer.threads`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median  # noqa: E402
from rl_step import tether_runner  # noqa: E402

BUSY = "import time\nend = time.time() + {limit}\nwhile time.time() < end:\n    pass\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compete", type=int, default=1, help="busy competing processes (default 1)")
    p.add_argument("--compete-limit", type=float, default=900.0, help="seconds after which a competitor stops")
    p.add_argument("--steps", type=int, default=8, help="measured RL steps per setting")
    p.add_argument("--warmup", type=int, default=1, help="rounds dropped before measuring")
    p.add_argument("--out", default=None, help="also write the Markdown table to this file")
    p.add_argument("--config", default=None, help="a config's workload (model, LoRA, batch, data) for the default's")
    p.add_argument("--threads", default="", help="comma-separated thread counts to compare (default: 1,2)")
    a = p.parse_args()
    from tether.config.loading import load_config
    from tether.config.sections import Config

    cfg = load_config(a.config) if a.config else Config()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    counts = [int(x) for x in a.threads.split(",")] if a.threads else [1, 2]
    settings = {f"torch default ({torch.get_num_threads()})": torch.get_num_threads()} if not a.threads else {}
    settings.update({str(n): n for n in counts})
    args = _workload(cfg, a.config)
    competitors = [
        subprocess.Popen([sys.executable, "-c", BUSY.format(limit=a.compete_limit)]) for _ in range(a.compete)
    ]
    times: dict[str, list[float]] = {name: [] for name in settings}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = _model(cfg, a.config, Path(tmp))
            run, n_params = tether_runner(model_dir, args, torch.device("cpu"))
            for i in range(a.warmup + a.steps):
                for name, n in settings.items():
                    torch.set_num_threads(n)
                    seconds = run()["total"]
                    if i >= a.warmup:
                        times[name].append(seconds)
                print(f"round {i}: " + "  ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items() if v), file=sys.stderr)
    finally:
        for c in competitors:
            c.terminate()
            c.wait()
    load = os.getloadavg()[0]
    fastest = min(median(v) for v in times.values())
    lines = [
        f"### One RL step of {a.config or 'the default run'}, by torch threads ({cores} cores, {a.compete} competing "
        f"busy process(es), load average {load:.1f} at the end)",
        "",
        f"{n_params:_} parameters{f' (LoRA r={args.lora})' if args.lora else ''}, {args.prompts} prompts x "
        f"{args.group}, {args.max_new_tokens} new tokens, "
        f"{args.mini_batches} mini-batches; median of {a.steps} steps per setting, settings alternating.",
        "",
        "| threads | median step | vs fastest | steps (s) |",
        "|---|---|---|---|",
    ]
    for name, v in times.items():
        lines.append(f"| {name} | {median(v):.2f} s | {median(v) / fastest:.2f}x | {' '.join(f'{x:.2f}' for x in v)} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)


def _workload(cfg, config: str | None) -> argparse.Namespace:
    """The benchmark's step: the config's batch, model precision and LoRA; the default run's objective when no
    config is given or the config's is a mapping (atr_grpo, the default run's), else the config's; its math data
    when it names one."""
    task_args = cfg.data.task_args or {}
    return argparse.Namespace(
        prompts=cfg.rollout.prompts_per_step,
        group=cfg.rollout.group_size,
        max_new_tokens=cfg.rollout.max_new_tokens,
        mini_batches=cfg.trainer.mini_batches,
        lr=cfg.trainer.lr,
        objective=cfg.objective if config and isinstance(cfg.objective, str) else "atr_grpo",
        dtype=cfg.model.dtype if config else "float32",
        threads=0,
        lora=cfg.model.lora.r if config and cfg.model.lora else 0,
        data=task_args.get("train") if config and cfg.data.task == "math" else None,
        test=task_args.get("test"),
        template=task_args.get("template", "plain"),
    )


def _model(cfg, config: str | None, tmp: Path) -> str | Path:
    """The config's model, or the default run's tiny model built from its config in `tmp`."""
    if config:
        return cfg.model.name_or_path
    from tether.model.loading import init_model

    m = cfg.model
    return init_model(tmp / "model", arch=m.tiny_arch, hidden_size=m.tiny_hidden_size, num_layers=m.tiny_layers, seed=0)


if __name__ == "__main__":
    main()
