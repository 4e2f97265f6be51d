"""The README's picture: SmolLM2-135M-Instruct learning by RL on 2 CPU cores, drawn from the committed runs.

    python benchmarks/real_model/figure.py      # writes docs/images/real_model_learning.png

Two panels from benchmarks/results/real_model_cpu/seed*/metrics.jsonl (configs/real_model.yaml, three seeds):
held-out greedy accuracy at each evaluation, one line per seed and their mean; the training reward (temperature
0.6) per step, one line per seed. Remade from the files alone, so the picture follows the results it shows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tether.records.plots import pyplot  # noqa: E402
from tether.records.runlog import accuracy, read_metrics, series  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "real_model_cpu"
OUT = ROOT / "docs" / "images" / "real_model_learning.png"


def draw(results: Path = RESULTS, out: Path = OUT) -> Path:
    runs = sorted(p for p in results.glob("seed*") if (p / "metrics.jsonl").exists())
    if not runs:
        raise SystemExit(f"no seed*/metrics.jsonl under {results}")
    plt = pyplot()
    fig, (acc_ax, rew_ax) = plt.subplots(1, 2, figsize=(9.6, 3.6), dpi=120)
    curves = []
    for run in runs:
        rows = read_metrics(run)
        evals = accuracy(rows)
        curves.append(evals)
        acc_ax.plot([s for s, _ in evals], [a for _, a in evals], marker="o", ms=3, lw=1, alpha=0.55, label=run.name)
        reward = series(rows, "reward/mean")
        rew_ax.plot([s for s, _ in reward], [r for _, r in reward], lw=1, alpha=0.7, label=run.name)
    steps = [s for s, _ in curves[0]]
    mean = [statistics.fmean(c[i][1] for c in curves) for i in range(len(steps))]
    acc_ax.plot(steps, mean, color="black", lw=2, marker="o", ms=4, label=f"mean of {len(runs)} seeds")
    acc_ax.set(title="held-out accuracy (greedy, 40 problems)", xlabel="RL step", ylabel="accuracy", ylim=(0, 1))
    rew_ax.set(title="training reward (temperature 0.6)", xlabel="RL step", ylabel="mean reward", ylim=(0, 1))
    from matplotlib.ticker import MaxNLocator

    for ax in (acc_ax, rew_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("SmolLM2-135M-Instruct, LoRA, ATR-GRPO, on 2 CPU cores (configs/real_model.yaml)", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args()
    print(draw(a.results, a.out))


if __name__ == "__main__":
    main()
