"""The binding-regime comparison's per-run table and per-step values, from its compare directory.

    tether compare configs/real_model_compare.yaml --objectives grpo,dapo,atr_grpo,rpg_urkl,etr --seeds 6 \
        --null-control grpo --jobs 2 --claims configs/claims_real_model.yaml --out RUNS
    tether report RUNS --claims configs/claims_real_model.yaml --out benchmarks/results/real_model_compare_cpu/binding
    python benchmarks/real_model/binding.py RUNS --out benchmarks/results/real_model_compare_cpu/binding

Writes OUT/table.md (one row per finished run, seed by seed, then each method's mean ± std over its seeds: the
fraction of tokens its trust region constrained, `constrained_frac` of tether.reports.claims; the mean KL(old, new)
per update; the held-out accuracy at every evaluation; the final entropy; the train time; then, from the
OUT/summary.json `tether report` wrote, each claim's and the null control's spread of paired differences and the
seeds that spread needs to detect a difference of 0.05, `tether.reports.stats.seeds_for`) and OUT/metrics.json
(every finished run's logged rows, without the timings). Runs still training are left out, as `tether report`
leaves them out, so the files can be remade while the comparison runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tether.records.runlog import accuracy, read_metrics, values  # noqa: E402
from tether.reports.claims import METRICS, aligned  # noqa: E402
from tether.reports.report import discover, mean_std  # noqa: E402
from tether.reports.stats import seeds_for  # noqa: E402

ACCURACIES = ("final_accuracy", "best_accuracy", "auc")
"""The metrics in units of held-out accuracy, where a difference of 0.05 means 5 problems in 100."""
ARMS = ["grpo", "dapo", "atr_grpo", "rpg_urkl", "etr", "grpo_null"]


def row(rows: list[dict]) -> dict:
    return {
        "constrained": METRICS["constrained_frac"](rows),
        "kl_old": statistics.fmean(values(rows, "policy/kl_old")),
        "acc": [a for _, a in accuracy(rows)],
        "entropy": METRICS["final_entropy"](rows),
        "time_s": sum(values(rows, "time/step_s")),
    }


def table(runs: dict[str, dict[int, dict]]) -> list[str]:
    lines = [
        "| method | seed | constrained | mean KL(old, new) | held-out acc at each evaluation | final entropy | train time |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm, seeds in runs.items():
        for seed, r in seeds.items():
            acc = " / ".join(f"{a:.3f}" for a in r["acc"])
            lines.append(
                f"| {arm} | {seed} | {r['constrained']:.1%} | {r['kl_old']:.3f} | {acc} | {r['entropy']:.2f} | "
                f"{r['time_s']:.0f} s |"
            )
    lines += ["", "Mean ± std over seeds:", "", *lines[:2]]
    for arm, seeds in runs.items():
        rs = list(seeds.values())
        evals = zip(*(r["acc"] for r in rs))
        acc = " / ".join(mean_std(list(a)) for a in evals)
        lines.append(
            f"| {arm} | {len(rs)} seeds | {mean_std([100 * r['constrained'] for r in rs], 1)}% | "
            f"{mean_std([r['kl_old'] for r in rs])} | {acc} | {mean_std([r['entropy'] for r in rs], 2)} | "
            f"{mean_std([r['time_s'] for r in rs], 0)} s |"
        )
    return lines


def seeds_needed(summary: dict, difference: float = 0.05) -> list[str]:
    """Per claim and null-control test on an accuracy (ACCURACIES) of a one-regime summary.json: the spread of
    its paired differences (paired as the test pairs them, `claims.aligned`) and the seeds that spread needs for
    `difference` (80% power, 5% per test; Holm's correction over the claims asks for more)."""
    (regime,) = summary["regimes"].values()
    methods = regime["methods"]
    lines = [
        f"Seeds to detect a difference of {difference} (80% power, alpha 0.05 per test), from the spread of the"
        " paired per-seed differences so far:",
        "",
        f"| test | metric | seeds | sd of the differences | detectable now | seeds for {difference} |",
        "|---|---|---|---|---|---|",
    ]
    tests = [(c["claim"], c) for c in summary.get("claims", [])]
    tests += [(f"null control ({c['method']} vs {c['baseline']})", c) for c in summary.get("null_control", [])]
    for name, c in tests:
        if c["metric"] not in ACCURACIES:
            continue
        a, b, paired = aligned(methods[c["method"]], methods[c["baseline"]], c["metric"])
        if not paired or len(a) < 2:
            continue
        sd = statistics.stdev([x - y for x, y in zip(a, b)])
        mde = "n/a" if c.get("mde80") is None else f"{c['mde80']:.3f}"
        lines.append(f"| {name} | {c['metric']} | {len(a)} | {sd:.3f} | {mde} | {seeds_for(sd, difference)} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", help="the comparison's --out directory")
    ap.add_argument("--out", required=True, help="where table.md and metrics.json go")
    args = ap.parse_args(argv)
    left_out: list[str] = []
    found = discover([args.runs], left_out)
    runs: dict[str, dict[int, dict]] = {}
    logged: dict[str, dict[str, list[dict]]] = {}
    for run in sorted(found, key=lambda p: (ARMS.index(p.parent.name), int(p.name[4:]))):
        rows = read_metrics(run)
        runs.setdefault(run.parent.name, {})[int(run.name[4:])] = row(rows)
        logged.setdefault(run.parent.name, {})[run.name] = [
            {k: v for k, v in r.items() if not k.startswith("time/")} for r in rows
        ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(logged, indent=0) + "\n")
    lines = table(runs)
    if (out / "summary.json").exists():
        lines += ["", *seeds_needed(json.loads((out / "summary.json").read_text()))]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    for run in left_out:
        print(f"left out, not finished: {run}", file=sys.stderr)
    print(f"{out / 'table.md'}: {len(found)} finished runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
