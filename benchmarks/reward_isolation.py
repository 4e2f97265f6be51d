"""Benchmark: the per-step cost of running a user's reward in a worker process (`reward.isolate`).

    python benchmarks/reward_isolation.py --out benchmarks/results/performance/reward_isolation_cpu.md

Scores one batch of completions (the default run's 16 prompts x 8 samples = 128, and larger ones)
with a reward from a user's module (`benchmarks/user_reward_examples.py`, imported by its path as
`reward.name=user_reward_examples:NAME` would import it), in the trainer's process (`reward.isolate=
false`) and in the worker (`tether.rewards.Isolated`, the default), taking turns batch by batch so
a change in the machine's load hits both alike. Two rewards: `exact` (a comparison, microseconds:
the worst case for the worker's relative cost) and `parse` (about 0.2 ms of Python per completion,
a reward that parses its completion). The worker's start (importing the reward's module and
tether.rewards in a fresh interpreter) is paid once per run and after each kill; it is timed
separately. Medians over --repeats batches. Not a test: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import os
import random
import string
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_model, emit, median, table  # noqa: E402

from tether.rewards import Isolated, get_reward, score_batch  # noqa: E402
from tether.tasks import get_task  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[128, 512, 2048], help="completions per batch")
    p.add_argument("--repeats", type=int, default=15, help="measured batches per setting and size")
    p.add_argument("--starts", type=int, default=5, help="worker starts timed")
    p.add_argument("--out", default=None, help="also write the Markdown table to this file")
    a = p.parse_args()
    load_start = os.getloadavg()
    rng = random.Random(0)
    task = get_task("arithmetic")
    rows = []
    for name in ("exact", "parse"):
        reward = get_reward(f"user_reward_examples:{name}")
        isolated = Isolated(reward, f"user_reward_examples:{name}", timeout_s=30.0)
        for n in a.sizes:
            examples = [task.examples("train", n, seed=1)[i % 64] for i in range(n)]
            completions = ["".join(rng.choices(string.digits + " +=", k=16)) for _ in range(n)]
            score_batch(isolated, completions, examples)  # the worker is started outside the measurement
            times = {"in": [], "worker": []}
            for _ in range(a.repeats):
                for key, fn in (("in", reward), ("worker", isolated)):
                    tic = time.perf_counter()
                    score_batch(fn, completions, examples)
                    times[key].append(time.perf_counter() - tic)
            t_in, t_w = median(times["in"]) * 1e3, median(times["worker"]) * 1e3
            rows.append([name, n, f"{t_in:.1f}", f"{t_w:.1f}", f"{t_w - t_in:.1f}", f"{(t_w - t_in) / n * 1e3:.0f}"])
        isolated.close()
    isolated = Isolated(get_reward("user_reward_examples:exact"), "user_reward_examples:exact")
    starts = []
    for _ in range(a.starts):
        isolated.close()
        tic = time.perf_counter()
        isolated._start()
        starts.append(time.perf_counter() - tic)
    isolated.close()
    end = os.getloadavg()
    text = "\n".join(
        [
            "# A user's reward in the trainer's process vs in the worker (`reward.isolate`)",
            "",
            f"{cpu_model()}, {os.cpu_count()} logical cores; load average (1, 5, 15 min) {load_start[0]:.1f}, "
            f"{load_start[1]:.1f}, {load_start[2]:.1f} at the start, {end[0]:.1f}, {end[1]:.1f}, {end[2]:.1f} at the end; "
            f"medians of {a.repeats} batches, the two settings taking turns.",
            "",
            table(
                [
                    "reward",
                    "completions",
                    "in process (ms)",
                    "in the worker (ms)",
                    "worker's extra (ms)",
                    "extra per completion (us)",
                ],
                rows,
            ),
            "",
            f"Worker start (a fresh interpreter importing tether.rewards and the reward's module), paid once per run "
            f"and after each kill: median {median(starts):.2f} s of {a.starts} (min {min(starts):.2f} s, max {max(starts):.2f} s).",
        ]
    )
    emit(text, a.out)


if __name__ == "__main__":
    main()
