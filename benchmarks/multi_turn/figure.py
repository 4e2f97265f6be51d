"""What RL changes in a multi-turn job, drawn and tabulated from the committed runs.

    python benchmarks/multi_turn/figure.py                 # configs/multi_turn.yaml: benchmarks/results/multi_turn_cpu
    python benchmarks/multi_turn/figure.py --job tool_use  # configs/tool_use.yaml: benchmarks/results/tool_use_cpu

Reads RESULTS/seed*/metrics.jsonl and writes RESULTS/plots/learning.png and RESULTS/table.md. The retry job's three
panels: held-out first-turn accuracy (one greedy episode per problem, `eval/solved_turn_1`), the training episodes'
first-turn accuracy (`env/solved_turn_1`, temperature 0.6) and the turns they used (`env/turns`). The tool job's:
held-out accuracy (`eval/accuracy`, the strict verifier; step 0 is after the warm start), the training episodes' valid
tool calls (`env/tool_calls - env/tool_errors`; the held-out ones, greedy, are in the table) and the training reward,
with the untrained model's calibration (before the warm start) as a cross at step -1. One line per seed and their
mean. The table gives each seed's numbers at the start and the end; the training columns average the first and the
last three steps, since one step's 32 episodes are noisy; the tool job's table adds what its training episodes did (`outcome`, from
samples.jsonl) in the first and last three steps. Remade from the files alone, so the picture follows the results it shows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import mean_curve, save_figure, seed_runs  # noqa: E402

from tether.records.plots import pyplot  # noqa: E402
from tether.records.runlog import read_metrics, series, values  # noqa: E402

JOBS = {
    "retry": {
        "results": ROOT / "benchmarks" / "results" / "multi_turn_cpu",
        "title": "Retry-on-feedback episodes (up to 3 turns), SmolLM2-135M-Instruct, LoRA, GRPO, 2 CPU cores",
        "panels": (
            ("eval/solved_turn_1", "held-out first-turn accuracy (greedy, 40)", (0, 1)),
            ("env/solved_turn_1", "training first-turn accuracy (T=0.6)", (0, 1)),
            ("env/turns", "turns per training episode", (1, 3)),
        ),
        "columns": (  # (header, metric, how: "evals" = first/last evaluation, "steps" = mean of first/last 3 steps)
            ("held-out first-turn acc", "eval/solved_turn_1", "evals"),
            ("held-out turns", "eval/turns", "evals"),
            ("train first-turn acc", "env/solved_turn_1", "steps"),
            ("train reward", "reward/mean", "steps"),
            ("train turns", "env/turns", "steps"),
            ("model tokens / episode", "env/model_tokens", "steps"),
        ),
    },
    "tool_use": {
        "results": ROOT / "benchmarks" / "results" / "tool_use_cpu",
        "title": "Learning to call a tool (town_population), SmolLM2-135M-Instruct, warm start then LoRA GRPO, 2 CPU cores",
        "panels": (
            ("eval/accuracy", "held-out accuracy (greedy, 50 towns, strict)", (0, 1)),
            ("env/valid_calls", "training valid tool calls per episode (T=0.7)", (0, 1.3)),
            ("reward/mean", "training reward (T=0.7)", (0, 1)),
        ),
        "columns": (
            ("held-out acc", "eval/accuracy", "evals"),
            ("held-out valid calls", "eval/valid_calls", "evals"),
            ("held-out calls", "eval/tool_calls", "evals"),
            ("train reward", "reward/mean", "steps"),
            ("train valid calls", "env/valid_calls", "steps"),
            ("train turns", "env/turns", "steps"),
        ),
        "outcomes": True,
        # The untrained model, before the warm start (tether eval, 16 held-out towns x 4 samples at T=1; the
        # calibration in docs/environments.md): no valid call, no right answer. Drawn at step -1.
        "untrained": {"eval/accuracy": 0.0, "env/valid_calls": 0.0},
    },
}
DERIVED = {  # metrics computed per row from two logged ones
    "eval/valid_calls": ("eval/tool_calls", "eval/tool_errors"),
    "env/valid_calls": ("env/tool_calls", "env/tool_errors"),
}


def with_derived(rows: list[dict]) -> list[dict]:
    """The rows with each DERIVED metric (a difference of two logged ones) where both were logged."""
    out = []
    for r in rows:
        r = dict(r)
        for name, (a, b) in DERIVED.items():
            if r.get(a) is not None and r.get(b) is not None:
                r[name] = r[a] - r[b]
        out.append(r)
    return out


def ends(rows: list[dict], metric: str, how: str) -> tuple[float, float]:
    """(start, end) of `metric`: the first and last evaluation, or the means of the first and last 3 steps."""
    v = values(rows, metric)
    if not v:
        raise SystemExit(f"{metric} is not in the metrics: is this a multi-turn run?")
    return (v[0], v[-1]) if how == "evals" else (statistics.fmean(v[:3]), statistics.fmean(v[-3:]))


def table(results: Path, columns) -> str:
    head = "| seed | " + " | ".join(h for h, _, _ in columns) + " |"
    lines = [head, "|" + "---|" * (len(columns) + 1)]
    per_column: list[list[tuple[float, float]]] = [[] for _ in columns]
    for run in seed_runs(results):
        rows = with_derived(read_metrics(run))
        cells = []
        for i, (_, metric, how) in enumerate(columns):
            a, b = ends(rows, metric, how)
            per_column[i].append((a, b))
            cells.append(f"{a:.3g} -> {b:.3g}")
        lines.append(f"| {run.name} | " + " | ".join(cells) + " |")
    mean = [
        f"{statistics.fmean(a for a, _ in col):.3g} -> {statistics.fmean(b for _, b in col):.3g}" for col in per_column
    ]
    lines.append("| mean | " + " | ".join(mean) + " |")
    return "\n".join(lines) + "\n"


OUTCOMES = (
    "solved",
    "no tool call",
    "failed call (unknown town, bad JSON)",
    "looked up another town",
    "echoed the tool's response",
    "right lookup, no right \\boxed{}",
)


def outcome(sample: dict) -> str:
    """What a tool-job episode of samples.jsonl did, as one of OUTCOMES: the reward first, then the turns."""
    if sample["reward"] >= 1.0:
        return OUTCOMES[0]
    tool = [text for role, text in sample["turns"] if role == "tool"]
    if not tool:
        return OUTCOMES[1]
    if any("error" in text for text in tool):
        return OUTCOMES[2]
    if not any(sample["answer"] in text for text in tool):
        return OUTCOMES[3]
    last = [text for role, text in sample["turns"] if role == "model"][-1]
    return OUTCOMES[4] if "<tool_response>" in last or "population of" in last else OUTCOMES[5]


def outcomes(results: Path, first: int = 3) -> str:
    """The training episodes' outcomes in the first and last `first` steps of every seed: the episodes samples.jsonl
    keeps (`trainer.log_samples` per step, 4 by default), so the shares are of a sample of each step's batch."""
    counts: dict[str, list[int]] = {o: [0, 0] for o in OUTCOMES}
    for run in seed_runs(results):
        samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
        last = max(s["step"] for s in samples)
        for s in samples:
            side = 0 if s["step"] <= first else 1 if s["step"] > last - first else None
            if side is not None:
                counts[outcome(s)][side] += 1
    totals = [sum(c[i] for c in counts.values()) for i in (0, 1)]
    lines = [
        f"| training episode | steps 1-{first} | last {first} steps |",
        "|---|---|---|",
        *(f"| {o} | {c[0] / totals[0]:.1%} | {c[1] / totals[1]:.1%} |" for o, c in counts.items()),
        f"| episodes | {totals[0]} | {totals[1]} |",
    ]
    return "\n".join(lines) + "\n"


def draw(results: Path, panels, title: str, untrained: dict | None = None) -> Path:
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(panels), figsize=(12.6, 3.6), dpi=120)
    found = seed_runs(results)
    for ax, (metric, name, limits) in zip(axes, panels):
        curves = [series(with_derived(read_metrics(run)), metric) for run in found]
        for run, points in zip(found, curves):
            ax.plot([s for s, _ in points], [v for _, v in points], lw=1, alpha=0.55, marker="o", ms=2, label=run.name)
        ax.plot(*mean_curve(curves), color="black", lw=2, label=f"mean of {len(found)} seeds")
        low = limits[0]
        if untrained and metric in untrained:
            ax.plot([-1], [untrained[metric]], "rx", ms=7, mew=2, label="untrained (step -1)")
            low -= 0.06 * (limits[1] - limits[0])  # the cross sits on the axis: keep it inside
        ax.set(title=name, xlabel="RL step")
        ax.set_ylim(low, limits[1])
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right" if untrained and metric in untrained else "best")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, results / "plots" / "learning.png")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", choices=sorted(JOBS), default="retry")
    p.add_argument("--results", type=Path, default=None, help="default: the job's committed results")
    a = p.parse_args()
    job = JOBS[a.job]
    results = a.results or job["results"]
    text = table(results, job["columns"])
    if job.get("outcomes"):
        text += "\n" + outcomes(results)
    (results / "table.md").write_text(text)
    print(draw(results, job["panels"], job["title"], job.get("untrained")))
    print((results / "table.md").read_text())


if __name__ == "__main__":
    main()
