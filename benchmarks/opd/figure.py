"""On-policy distillation beside RL from the same start, drawn and tabulated from the committed runs.

    python benchmarks/opd/figure.py

Reads benchmarks/results/opd_cpu/seed*/metrics.jsonl (the OPD job: `tether train configs/real_model.yaml
objective=opd teacher.name_or_path=TEACHER trainer.seed=S`) and benchmarks/results/real_model_cpu/seed*/metrics.jsonl
(RL on the task's reward, the same config and seeds), and writes opd_cpu/plots/learning.png and opd_cpu/table.md:
held-out greedy accuracy at each evaluation for both (one line per seed, their mean), the student's reverse KL to
the teacher on its own samples (`distill/reverse_kl`) and the training reward, and each OPD run's median step time with
its teacher pass (`time/teacher_logprobs_s`; RL's runs were timed in another session, three at a time, so theirs
are left out). Remade from the files alone.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import mean_curve, save_figure, seed_runs  # noqa: E402

from tether.records.plots import pyplot  # noqa: E402
from tether.records.runlog import read_metrics, series, values  # noqa: E402

OPD = ROOT / "benchmarks" / "results" / "opd_cpu"
RL = ROOT / "benchmarks" / "results" / "real_model_cpu"


def table() -> str:
    evals = sorted({s for run in seed_runs(OPD) + seed_runs(RL) for s, _ in series(read_metrics(run), "eval/accuracy")})
    head = "| job | seed | " + " | ".join(f"acc @{s}" for s in evals) + " | median step s | teacher pass s |"
    lines = [head, "|" + "---|" * (len(evals) + 4)]
    for job, results in (("OPD", OPD), ("RL", RL)):
        for run in seed_runs(results):
            rows = read_metrics(run)
            acc = dict(series(rows, "eval/accuracy"))
            teacher = values(rows, "time/teacher_logprobs_s")
            cells = [f"{acc[s]:.3f}" if s in acc else "-" for s in evals]
            step = statistics.median(values(rows, "time/step_s")) if job == "OPD" else None  # RL's: another session
            teacher_s = f"{statistics.median(teacher):.1f}" if teacher else "-"
            lines.append(
                f"| {job} | {run.name} | "
                + " | ".join(cells)
                + f" | {'-' if step is None else f'{step:.1f}'} | {teacher_s} |"
            )
    return "\n".join(lines) + "\n"


def draw() -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(12.6, 3.6), dpi=120)
    for ax, (metric, name, jobs) in zip(
        axes,
        (
            ("eval/accuracy", "held-out accuracy (greedy, 40 problems)", (("OPD", OPD, "C0"), ("RL", RL, "C3"))),
            ("distill/reverse_kl", "OPD: reverse KL to the teacher (nats/token)", (("OPD", OPD, "C0"),)),
            ("reward/mean", "training reward (T=0.6)", (("OPD", OPD, "C0"), ("RL", RL, "C3"))),
        ),
    ):
        for job, results, color in jobs:
            curves = [series(read_metrics(run), metric) for run in seed_runs(results)]
            for points in curves:
                ax.plot([s for s, _ in points], [v for _, v in points], color=color, lw=0.8, alpha=0.35)
            ax.plot(*mean_curve(curves), color=color, lw=2, label=f"{job}, mean of {len(curves)} seeds")
        ax.set(title=name, xlabel="step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("On-policy distillation from an RL-trained teacher vs RL, SmolLM2-135M-Instruct, LoRA, 2 CPU cores")
    fig.tight_layout()
    return save_figure(fig, OPD / "plots" / "learning.png")


def main() -> None:
    text = table()
    (OPD / "table.md").write_text(text)
    print(draw())
    print(text)


if __name__ == "__main__":
    main()
