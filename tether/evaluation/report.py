"""The report: per-source metrics over the per-problem records, the per-problem rows, and the
results as JSON (`results.json`) and Markdown (`results.md`, the printed summary)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from ..config.sections import one_line
from ..rollout.base import truncated
from .metrics import maj_at_k, majority_vote, pass_at_k
from .settings import EvalSettings


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def source_metrics(records: list[dict[str, Any]], n: int, ks: Sequence[int]) -> dict[str, float]:
    """avg@n, pass@k and maj@k for each k, mean length, truncation rate and count of `records`."""
    metrics: dict[str, float] = {"problems": len(records)}
    metrics[f"avg@{n}"] = _mean([sum(r["correct"]) / n for r in records])
    for k in ks:
        metrics[f"pass@{k}"] = _mean([pass_at_k(n, sum(r["correct"]), k) for r in records])
    for k in ks:
        metrics[f"maj@{k}"] = _mean([maj_at_k(r["answers"], r["correct"], k) for r in records])
    metrics["len_mean"] = _mean([x for r in records for x in r["lengths"]])
    metrics["truncated"] = _mean([float(truncated(f)) for r in records for f in r["finish"]])
    episodes = [i for r in records for i in r.get("info", [])]
    if episodes:  # multi-turn: the model's turns, and its tool calls per episode (valid: not an error)
        metrics["turns"] = _mean([sum(role == "model" for role, _ in t) for r in records for t in r["turns"]])
        calls = [float(i.get("tool_calls", 0)) for i in episodes]
        valid = [c - float(i.get("tool_errors", 0)) for c, i in zip(calls, episodes)]
        metrics["tool_calls"], metrics["valid_calls"] = _mean(calls), _mean(valid)
        metrics["with_valid_call"] = _mean([float(v > 0) for v in valid])
    return metrics


def summarize(records: list[dict[str, Any]], n: int, ks: Sequence[int]) -> dict[str, dict[str, float]]:
    """`source_metrics` per source (in order of appearance), plus "all" when there are several."""
    by_source: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_source.setdefault(r["source"], []).append(r)
    if len(by_source) > 1:
        by_source["all"] = records
    return {source: source_metrics(rs, n, ks) for source, rs in by_source.items()}


def problem_row(record: dict[str, Any], n: int, ks: Sequence[int]) -> dict[str, Any]:
    """One row of the per-problem table: c of n, pass@k, and the majority answer of all n."""
    c = sum(record["correct"])
    vote = majority_vote(record["answers"], n)
    return {
        "source": record["source"],
        "id": record["id"],
        "answer": record["answer"],
        "c": c,
        "n": n,
        **{f"pass@{k}": pass_at_k(n, c, k) for k in ks},
        "maj_answer": None if vote is None else record["answers"][vote],
        "maj_correct": vote is not None and bool(record["correct"][vote]),
    }


def _cell(value: Any, width: int = 40) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    text = "" if value is None else str(value)
    text = text if len(text) <= width else text[: width - 3] + "..."
    return text.replace("\n", " ").replace("|", "\\|")


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def summary_markdown(results: dict[str, Any]) -> str:
    """The per-source summary table of `results` (as printed by `tether eval`)."""
    summary = results["summary"]
    header = list(next(iter(summary.values()))) if summary else []
    return _table(["source", *header], [[s, *m.values()] for s, m in summary.items()])


def results_markdown(results: dict[str, Any]) -> str:
    """results.md: the settings, the summary per source, and the per-problem table."""
    s, ks = results["settings"], results["ks"]
    settings = ", ".join(f"{k}={one_line(v)}" for k, v in s.items())
    header = ["source", "id", "gold", "c/n", *[f"pass@{k}" for k in ks], "maj answer", "maj correct"]
    rows = [
        [
            p["source"],
            p["id"],
            p["answer"],
            f"{p['c']}/{p['n']}",
            *[p[f"pass@{k}"] for k in ks],
            p["maj_answer"],
            "yes" if p["maj_correct"] else "no",
        ]
        for p in results["problems"]
    ]
    return (
        f"# Evaluation of {s['model']}\n\n{settings}\n\n## Summary\n\n{summary_markdown(results)}\n\n"
        f"## Problems\n\n{_table(header, rows)}\n"
    )


def write_results(
    out: Path, settings: EvalSettings, ks: list[int], specs: list[str], records: list[dict[str, Any]]
) -> dict[str, Any]:
    """results.json and results.md of `records` in `out`; returns the results, with "out_dir"."""
    results = {
        "settings": settings.to_json(),
        "ks": ks,
        "data": specs,
        "summary": summarize(records, settings.n, ks),
        "problems": [problem_row(r, settings.n, ks) for r in records],
    }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(results_markdown(results))
    return {**results, "out_dir": str(out)}  # where they are (not in results.json: a folder can move)


__all__ = ["problem_row", "results_markdown", "source_metrics", "summarize", "summary_markdown", "write_results"]
