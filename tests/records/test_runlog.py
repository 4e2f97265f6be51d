"""tether.records.runlog: the one reader of a run's metrics.jsonl that every report uses."""

from __future__ import annotations

import math

import pytest

from tether.records.runlog import accuracy, best, read_metrics, series, tail_mean, values


def test_a_metric_is_its_logged_points_without_missing_null_or_torn_rows(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "eval/accuracy": 0.5, "r": 1.0}\n{"step": 2, "eval/accuracy": null, "r": 2.0}\n'
        '{"step": 3, "r": 3.0}\n{"step": 4, "eval/accuracy": 0.5}\n{"step": 5, "eval/acc'
    )  # torn by a kill
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert accuracy(rows) == [(1, 0.5), (4, 0.5)]
    assert series(rows, "r") == [(1, 1.0), (2, 2.0), (3, 3.0)] and values(rows, "r") == [1.0, 2.0, 3.0]
    assert best(accuracy(rows)) == (1, 0.5)  # the earliest of equals, as checkpoint.best
    assert read_metrics(tmp_path / "absent", missing_ok=True) == []
    with pytest.raises(FileNotFoundError):
        read_metrics(tmp_path / "absent")


def test_tail_mean_is_the_mean_of_the_last_tenth_at_least_one_value():
    rows = [{"step": s, "e": float(s)} for s in range(1, 21)]
    assert tail_mean(rows, "e") == 19.5  # the last 2 of 20: (19 + 20) / 2
    assert tail_mean(rows[:9], "e") == 9.0  # 9 values: the last one
    assert math.isnan(tail_mean(rows, "absent"))
