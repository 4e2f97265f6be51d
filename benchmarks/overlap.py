"""Benchmark: RL step time with and without `trainer.overlap` (sampling step t+1 while step t trains).

    python benchmarks/overlap.py                                  # the default run's shapes, s = 1
    python benchmarks/overlap.py --sizes 128x4 512x4 --steps 12 --out benchmarks/results/performance/overlap_cpu.md

The same run (the default config: task, prompts, group size, token budget, mini-batches; no warm start;
`trainer.staleness=S`), built by the trainer's own `start_run` and stepped by its `rl_step`, two or three ways:
sequential with the trainer's default threads (auto: 1 on 2 cores), overlapped with the same threads (the
background decode is a second thread, so the two use both cores), and with `--two-threads` sequential with 2
torch threads (the other way to use the second core). The ways take turns run by run (`--repeats` rounds),
each a fresh run of `--steps` steps timed end to end, the last prefetch waited for; a row's step time is the
median over its runs of wall time / steps. `sampling share` is the sequential run's share of the step spent
in the engine's `generate`: with sampling share f the overlap can at best take a step from 1 to max(f, 1 - f)
(both halves on separate cores, nothing shared). The overlapped runs' `time/overlap_wait_s` says how long the
trainer waited for the prefetched batch. On a loaded 2-core machine the second core is not free, so expect much less.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_model, emit, median, table  # noqa: E402

WAYS = {"sequential, 1 thread": ("false", 1), "overlap, 1 thread each": ("true", 1)}
TWO_THREADS = {"sequential, 2 threads": ("false", 2)}
"""--two-threads: the other way to use the second core (slow under contention: docs/performance.md)."""


class _Timed:
    """An engine whose `generate` calls are timed (the sequential runs' sampling share)."""

    def __init__(self, engine):
        self.engine, self.seconds = engine, 0.0

    def generate(self, *args, **kwargs):
        tic = time.perf_counter()
        try:
            return self.engine.generate(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - tic


def one_run(model_dir: Path, out: Path, overlap: str, threads: int, a) -> dict[str, float]:
    """A fresh run of `a.steps` RL steps; its wall time per step, sampling share and mean overlap wait."""
    from tether.config.loading import load_config
    from tether.trainer.step import rl_step
    from tether.trainer.setup import start_run

    cfg = load_config(
        None,
        [
            f"model.name_or_path={model_dir}",
            f"output_dir={out}",
            "warm_start.enabled=false",
            f"trainer.staleness={a.staleness}",
            f"trainer.overlap={overlap}",
            f"trainer.threads={threads}",
            f"trainer.total_steps={a.steps}",
            "trainer.plots=false",
            "trainer.tensorboard=false",
            "trainer.progress=false",
            "data.eval_size=8",
        ],
    )
    run = start_run(cfg, log=lambda *_: None)
    sampler = run.parts.source.sampler
    timed = None if cfg.trainer.overlap else _Timed(sampler.engine)  # the stale sampler's engine
    if timed:
        sampler.engine = timed
    waits = []
    tic = time.perf_counter()
    for step in range(1, a.steps + 1):  # the trainer's own step on the trainer's own parts
        waits.append(rl_step(run.parts, run.progress.counters, step)[1].get("time/overlap_wait_s", 0.0))
    sampler.close()
    wall = time.perf_counter() - tic
    return {
        "step_s": wall / a.steps,
        "share": timed.seconds / wall if timed else float("nan"),
        "wait_s": sum(waits[1:]) / max(1, len(waits) - 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--sizes", nargs="+", default=["128x4"], help="tiny models as HIDDENxLAYERS (default: the default tiny)"
    )
    p.add_argument("--steps", type=int, default=10, help="RL steps per run")
    p.add_argument("--repeats", type=int, default=3, help="runs per way (the ways take turns)")
    p.add_argument("--staleness", type=int, default=1, help="trainer.staleness (>= 1)")
    p.add_argument("--two-threads", action="store_true", help="also time the sequential run with 2 torch threads")
    p.add_argument("--out", default=None, help="also write the Markdown to this file")
    a = p.parse_args()
    ways = {**WAYS, **(TWO_THREADS if a.two_threads else {})}
    from safetensors.torch import load_file

    from tether.model.loading import init_model

    load_start = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in a.sizes:
            hidden, layers = (int(x) for x in size.split("x"))
            model_dir = init_model(Path(tmp) / f"model_{size}", hidden_size=hidden, num_layers=layers, seed=0)
            n_params = sum(v.numel() for v in load_file(str(Path(model_dir) / "model.safetensors")).values())
            results = {way: [] for way in ways}
            for r in range(a.repeats):
                for way, (overlap, threads) in ways.items():
                    res = one_run(
                        model_dir,
                        Path(tmp) / f"run_{size}_{r}_{len(results[way])}_{overlap}{threads}",
                        overlap,
                        threads,
                        a,
                    )
                    results[way].append(res)
                    print(f"{size} round {r}: {way}: {res['step_s']:.3f} s/step", file=sys.stderr)
            base = median([x["step_s"] for x in results["sequential, 1 thread"]])
            for way, res in results.items():
                step = median([x["step_s"] for x in res])
                share = median([x["share"] for x in res])
                wait = median([x["wait_s"] for x in res])
                rows.append(
                    [
                        f"{size} ({n_params:_})",
                        way,
                        f"{step:.3f} s",
                        f"{base / step:.2f}x",
                        "" if share != share else f"{share:.0%}",
                        f"{wait:.3f} s" if way.startswith("overlap") else "",
                        " ".join(f"{x['step_s']:.3f}" for x in res),
                    ]
                )
    end = os.getloadavg()
    text = "\n".join(
        [
            f"### RL step time with and without trainer.overlap (staleness {a.staleness})",
            "",
            f"{cpu_model()}, {os.cpu_count()} logical cores; torch {torch.__version__}; load average (1, 5, 15 min) "
            f"{load_start[0]:.1f}, {load_start[1]:.1f}, {load_start[2]:.1f} at the start, {end[0]:.1f}, {end[1]:.1f}, "
            f"{end[2]:.1f} at the end. The default run's shapes, {a.steps} steps per run, median of {a.repeats} runs "
            "per way, the ways taking turns.",
            "",
            table(
                [
                    "model (parameters)",
                    "way",
                    "step",
                    "speed-up vs sequential 1 thread",
                    "sampling share",
                    "overlap wait",
                    "runs (s/step)",
                ],
                rows,
            ),
        ]
    )
    emit(text, a.out)


if __name__ == "__main__":
    main()
