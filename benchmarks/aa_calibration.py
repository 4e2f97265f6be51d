"""How often tether's comparison procedure, looks and Holm included, publishes a false verdict when there is nothing
to find: simulated null studies driven through tether's API, and real A/A pairs of the built-in tiny model.

    tether compare --objectives grpo --null-control grpo --seeds 40 trainer.total_steps=100 trainer.eval_every=25 \
        trainer.save_every=100 --out RUNS        # the A/A pairs (about 2.5 hours on 2 cores)
    python benchmarks/aa_calibration.py --runs RUNS --out benchmarks/results/aa_calibration

Part 1, simulated (no runs needed): 2,000 null studies per row, each run look by look as `tether compare` runs a
design (claims.judge at 4, 6 and 9 seeds, stopping once every claim is decided), three claims and the null control
in one Holm family; the values Gaussian, heavy-tailed (t with 3 df) or 200-problem accuracies, beside a shared
seed effect. For contrast, the procedure the binding study followed before designs existed: a fixed-look t at 4
and at 6 seeds, extended to 9 when a p-value just missed (0.05-0.2), and the combination test given that same
extension.

Part 2, real A/A pairs: seed k of GRPO and of its null control (the same initial model, data, held-out set and
sampling stream, another mini-batch order) on the tiny model's 100-step job. Each resampled study draws 9 of the
40 seeds without replacement, in a random order that becomes seeds 0-8 (so the null control's label coins and the
looks' seed order are drawn anew), and tests the pair on auc, final_accuracy, best_accuracy, final_entropy,
entropy_retained and clipfrac as one Holm family at the design's looks. The 95% interval of each rate is the
2.5-97.5% range over bootstrap samples of the 40 seeds (resampled studies share seeds, so a binomial interval over
studies would be too narrow). Beside it: the same family at one fixed look of 9 seeds, and a test that pools the
held-out problems of every seed (a two-proportion z-test on final accuracy over seeds x problems), which tether
refuses: its false-verdict rate shows why.

Writes OUT/README.md's tables (table.md) and OUT/summary.json (the per-seed values of the A/A runs, so the
tables can be remade without the runs).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tether.records.runlog import heldout  # noqa: E402
from tether.reports.claims import Claim, judge  # noqa: E402
from tether.reports.report import pilot_values  # noqa: E402
from tether.reports.sequential import Design  # noqa: E402
from tether.reports.stats import incomplete_beta, paired_t  # noqa: E402

LOOKS = (4, 6, 9)
AA_METRICS = ("auc", "final_accuracy", "best_accuracy", "final_entropy", "entropy_retained", "clipfrac")
DECIDED = ("supported", "contradicted", "false verdict")


def clopper_pearson(k: int, n: int) -> tuple[float, float]:
    """The exact 95% binomial interval: the Beta quantiles, by bisection on the incomplete beta function."""

    def quantile(q: float, a: float, b: float) -> float:
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if incomplete_beta(a, b, mid) < q else (lo, mid)
        return (lo + hi) / 2

    lo = 0.0 if k == 0 else quantile(0.025, k, n - k + 1)
    hi = 1.0 if k == n else quantile(0.975, k + 1, n - k)
    return lo, hi


# ---------------------------------------------------------------- part 1: simulated null studies


def _null_study(rng, design: Design, shape: str) -> bool:
    claims = [Claim(claim=f"{m} beats b", metric="auc", method=m, baseline="b") for m in ("m1", "m2", "m3")]
    seed_effect = rng.normal(0, 0.08, design.max_seeds)
    draw = {
        "Gaussian": lambda: rng.normal(0, 0.04, design.max_seeds),
        "t, 3 df": lambda: rng.standard_t(3, design.max_seeds) * 0.03,
        "200-problem accuracy": lambda: rng.binomial(200, 0.8, design.max_seeds) / 200 - 0.8,
    }[shape]
    values = {m: seed_effect + draw() for m in ("b", "m1", "m2", "m3", "b_null")}
    for n in design.looks:
        regime = {"r": {m: {"seeds": list(range(n)), "auc": list(v[:n])} for m, v in values.items()}}
        results, nulls = judge(claims, regime, design, [("b", "b_null")], p_values=False)
        if any(r["verdict"] in DECIDED for r in results + nulls):
            return True
        if not any(r["verdict"].startswith("continuing") for r in results):
            return False
    return False


def _extension(rng, n_trials: int) -> tuple[int, int]:
    from tether.reports import sequential as sq

    comb, t_false, c_false = Design(LOOKS, test="combination"), 0, 0
    for _ in range(n_trials):
        d = rng.standard_normal(9)
        p4, p6 = paired_t(d[:4]).p, paired_t(d[:6]).p
        extend = 0.05 <= p6 < 0.2
        t_false += p4 < 0.05 or p6 < 0.05 or (extend and paired_t(d).p < 0.05)
        ns = LOOKS if extend else LOOKS[:2]
        c_false += sq.crossed(comb, sq.statistics_at(comb, list(d), ns), ns, 0.05) is not None
    return t_false, c_false


def simulated(trials: int) -> list[str]:
    rng = np.random.default_rng(48)
    lines = [
        "| procedure | values | studies | false verdict published at some look | 95% interval |",
        "|---|---|---|---|---|",
    ]
    for test in ("t", "combination"):
        for shape in ("Gaussian", "t, 3 df", "200-problem accuracy"):
            k = sum(_null_study(rng, Design(LOOKS, test=test), shape) for _ in range(trials))
            lo, hi = clopper_pearson(k, trials)
            name = f"design, {test} test, O'Brien-Fleming looks 4/6/9, 3 claims + null control, Holm"
            lines.append(f"| {name} | {shape} | {trials} | {k / trials:.2%} | {lo:.2%}-{hi:.2%} |")
    t_false, c_false = _extension(rng, trials)
    for name, k in (
        ("no design: t at 4 and 6 seeds, extended to 9 when p was 0.05-0.2 (one claim)", t_false),
        ("combination test given the same extension (one claim)", c_false),
    ):
        lo, hi = clopper_pearson(k, trials)
        lines.append(f"| {name} | Gaussian | {trials} | {k / trials:.2%} | {lo:.2%}-{hi:.2%} |")
    return lines


# ---------------------------------------------------------------- part 2: the tiny model's A/A pairs


def aa_values(runs: Path) -> dict:
    """{"grpo": {...}, "grpo_null": {...}} per-seed values, and the per-problem final correctness of each run."""
    methods = pilot_values(runs)[runs.name]
    pooled = {}
    for label in ("grpo", "grpo_null"):
        pooled[label] = {}
        for seed in methods[label]["seeds"]:
            outcomes = heldout(runs / label / f"seed{seed}")
            pooled[label][seed] = outcomes[max(outcomes)]["correct"] if outcomes else None
    return {"methods": {k: methods[k] for k in ("grpo", "grpo_null")}, "final_correct": pooled}


def _resampled_study(rng, data: dict, seeds: list[int], design) -> bool:
    """One study on 9 of the seeds, renumbered 0-8 in a random order; True when it published a false verdict."""
    chosen = list(rng.choice(seeds, size=LOOKS[-1], replace=False))
    claims = [Claim(claim=m, metric=m, method="grpo_null", baseline="grpo") for m in AA_METRICS]
    looks = design.looks if design is not None else (LOOKS[-1],)
    for n in looks:
        regime = {"r": {}}
        for label in ("grpo", "grpo_null"):
            by_seed = {s: i for i, s in enumerate(data["methods"][label]["seeds"])}
            vals = {m: [data["methods"][label][m][by_seed[s]] for s in chosen[:n]] for m in AA_METRICS}
            regime["r"][label] = {"seeds": list(range(n)), **vals}
        # the A/A pair as the null control alone (the claims list only names its metrics)
        _, nulls = judge(claims, regime, design, [("grpo", "grpo_null")], p_values=False)
        if any(r["verdict"] in DECIDED for r in nulls):
            return True
    return False


def _pooled_study(rng, data: dict, seeds: list[int], same_seeds: bool = False) -> bool:
    """The refused test: final accuracy's seeds x problems outcomes pooled per arm, a two-proportion z-test that
    treats every outcome as independent. The arms on 9 seeds each, other seeds for each arm (as a pooled test is
    used when runs do not pair), or the same seeds (`same_seeds`: the coupled pair)."""
    chosen = rng.choice(seeds, size=2 * LOOKS[-1], replace=False)
    mine, theirs = (chosen[: LOOKS[-1]], chosen[: LOOKS[-1]]) if same_seeds else (chosen[:9], chosen[9:])
    a = [c for s in mine for c in data["final_correct"]["grpo_null"][int(s)]]
    b = [c for s in theirs for c in data["final_correct"]["grpo"][int(s)]]
    pa, pb, n = statistics.fmean(a), statistics.fmean(b), len(a)
    pool = (pa + pb) / 2
    se = math.sqrt(2 * pool * (1 - pool) / n) if 0 < pool < 1 else 0.0
    return se > 0 and abs(pa - pb) / se > 1.959964


def tiny(data: dict, studies: int, boots: int) -> list[str]:
    seeds = [s for s in data["methods"]["grpo"]["seeds"] if s in data["methods"]["grpo_null"]["seeds"]]
    rows = [
        ("design: t test, O'Brien-Fleming looks 4/6/9, 6 A/A tests as one Holm family", Design(LOOKS), "design"),
        ("one fixed look at 9 seeds, the same family", None, "design"),
        ("pooled problems, final accuracy, other seeds per arm (refused by tether)", None, "pooled"),
        ("pooled problems, final accuracy, the same seeds (refused by tether)", None, "pooled_same"),
    ]
    lines = [
        f"| procedure | A/A studies (9 of {len(seeds)} seeds each) | tests per study | false verdicts | 95% interval "
        "(seed bootstrap) |",
        "|---|---|---|---|---|",
    ]
    for name, design, kind in rows:
        if kind.startswith("pooled") and any(v is None for v in data["final_correct"]["grpo"].values()):
            continue
        if kind.startswith("pooled"):
            study = lambda r, d, s, same=kind == "pooled_same": _pooled_study(r, d, s, same)  # noqa: E731
        else:
            study = lambda r, d, s, design=design: _resampled_study(r, d, s, design)  # noqa: E731
        rng = np.random.default_rng(7)
        rate = statistics.fmean(study(rng, data, seeds) for _ in range(studies))
        boot = []
        for _ in range(boots):
            sample = [int(s) for s in rng.choice(seeds, size=len(seeds), replace=True)]
            boot_data = _relabel(data, sample)  # a seed drawn twice stands for two seeds
            boot.append(statistics.fmean(study(rng, boot_data, list(range(len(sample)))) for _ in range(studies // 10)))
        lo, hi = np.percentile(boot, [2.5, 97.5])
        tests = 1 if kind.startswith("pooled") else len(AA_METRICS)
        lines.append(f"| {name} | {studies} | {tests} | {rate:.2%} | {lo:.2%}-{hi:.2%} |")
    return lines


def _relabel(data: dict, sample: list[int]) -> dict:
    """The data of a bootstrap sample of seeds, renumbered 0..len(sample)-1 (a seed drawn twice: two seeds)."""
    out = {"methods": {}, "final_correct": {}}
    for label, vals in data["methods"].items():
        index = {s: i for i, s in enumerate(vals["seeds"])}
        out["methods"][label] = {"seeds": list(range(len(sample)))}
        for m in AA_METRICS:
            out["methods"][label][m] = [vals[m][index[s]] for s in sample]
        out["final_correct"][label] = {i: data["final_correct"][label][s] for i, s in enumerate(sample)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, default=None, help="the A/A compare directory (part 2)")
    ap.add_argument("--summary", type=Path, default=None, help="or its summary.json written by this script")
    ap.add_argument("--trials", type=int, default=2000)
    ap.add_argument("--studies", type=int, default=2000)
    ap.add_argument("--boots", type=int, default=100)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    tic = time.time()
    lines = ["## Simulated null studies, through tether's API", "", *simulated(args.trials), ""]
    data = None
    if args.runs is not None:
        data = aa_values(args.runs)
    elif args.summary is not None:
        data = json.loads(args.summary.read_text())
        data["final_correct"] = {k: {int(s): v for s, v in d.items()} for k, d in data["final_correct"].items()}
    if data is not None:
        lines += ["## A/A pairs of the built-in tiny model", "", *tiny(data, args.studies, args.boots), ""]
    lines.append(f"({time.time() - tic:.0f} s)")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "table.md").write_text(text + "\n")
        if data is not None and args.runs is not None:
            (args.out / "summary.json").write_text(json.dumps(data) + "\n")


if __name__ == "__main__":
    main()
