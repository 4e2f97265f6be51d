"""Single-run plots smooth, label and title; the smoothing is checked by hand (issue 17, item 4)."""

import json

import pytest
import yaml

from tether.records import plots


def test_rolling_mean_by_hand():
    # reward/mean at steps 1..5 = 0, 1, 0, 1, 1; step 3 has no reward (null) and is skipped, not a zero.
    rows = [
        {"step": 1, "r": 0.0},
        {"step": 2, "r": 1.0},
        {"step": 3, "r": None},
        {"step": 4, "r": 0.0},
        {"step": 5, "r": 1.0},
        {"step": 6, "r": 1.0},
        {"step": 7},
    ]
    got = plots.rolling_mean(rows, "r", window=3)
    # Trailing window of 3 logged points:
    #   1: [0] = 0;  2: [0, 1] = 0.5;  4: [0, 1, 0] = 1/3;  5: [1, 0, 1] = 2/3;  6: [0, 1, 1] = 2/3
    assert got == pytest.approx({1: 0.0, 2: 0.5, 4: 1 / 3, 5: 2 / 3, 6: 2 / 3}, abs=1e-15)
    assert plots.rolling_mean(rows, "r", window=1) == {1: 0.0, 2: 1.0, 4: 0.0, 5: 1.0, 6: 1.0}


@pytest.mark.parametrize("n, window", [(0, 1), (9, 1), (10, 1), (25, 2), (60, 6), (200, 20), (5000, 20)])
def test_the_window_is_a_tenth_of_the_points_within_1_and_20(n, window):
    assert plots.window_for(n) == window


def _run(tmp_path, objective):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"tether_version": "0", "objective": objective}, sort_keys=False))
    rows = []
    for s in range(41):
        row = {"step": s}
        if s % 10 == 0:
            row["eval/accuracy"] = s / 100
        if s:
            row |= {
                "reward/mean": (s % 3) / 2,
                "policy/entropy": 2.0 - s / 40,
                "policy/clipfrac_low": 0.01 * (s % 5 == 0),
                "policy/clipfrac_high": 0.02 * (s % 7 == 0),
                "policy/clipfrac_dual": 0.0,
                "policy/kl_old": 1e-3,
                "kl/ref": s / 1000,
                "rollout/len_mean": 10.0 + s,
            }
        rows.append(row)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_plot_run_writes_every_panel_labelled_and_titled(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    run = _run(
        tmp_path,
        {
            "name": "ppo_clip",
            "eps_low": 0.2,
            "eps_high": 0.28,
            "advantage": "grpo",
            "kl_penalty": {"estimator": "k3", "coef": 0.0},
            "rollout_correction": None,
        },
    )
    seen = {}
    real_savefig = plt.Figure.savefig

    def record(fig, path, *a, **k):  # what each PNG shows, read off the figure as it is saved
        ax = fig.axes[0]
        seen[path.name] = {
            "suptitle": fig._suptitle.get_text() if fig._suptitle else "",
            "title": ax.get_title(),
            "x": ax.get_xlabel(),
            "y": ax.get_ylabel(),
            "lines": [(ln.get_label(), len(ln.get_xdata()), ln.get_linestyle()) for ln in ax.lines],
            "markers": [ln.get_marker() for ln in ax.lines],
            "legend": ax.get_legend().get_title().get_text() if ax.get_legend() else "",
        }
        return real_savefig(fig, path, *a, **k)

    monkeypatch.setattr(plt.Figure, "savefig", record)
    written = plots.plot_run(run)
    assert {p.name for p in written} == {
        "reward.png",
        "accuracy.png",
        "entropy.png",
        "clip_fractions.png",
        "kl.png",
        "response_length.png",
    }
    assert all(p.stat().st_size > 1000 for p in written)
    for name, s in seen.items():
        assert s["x"] == "rollout step" and s["y"], name
        assert s["suptitle"].endswith(": ppo_clip"), name
        # The objective's own parameters lead; null ones are left out.
        assert s["title"].startswith("eps_low=0.2, eps_high=0.28, advantage=grpo"), name
        assert "rollout_correction" not in s["title"]
    assert seen["clip_fractions.png"]["y"] == "fraction of tokens" and seen["kl.png"]["y"] == "nats per token"
    assert seen["entropy.png"]["y"] == "nats per token" and seen["response_length.png"]["y"].startswith("tokens")
    # 40 steps: window 4; each metric drawn as faint unlabelled dots (40 points) and a labelled line.
    reward = seen["reward.png"]
    assert [(lbl.startswith("_"), n, ls) for lbl, n, ls in reward["lines"]] == [(True, 40, "None"), (False, 40, "-")]
    assert reward["legend"] == "line: mean of the last 4 steps; dots: each step"
    # The dual clip is 0 throughout: left out beside the two clip fractions that move.
    assert [lbl for lbl, _, ls in seen["clip_fractions.png"]["lines"] if ls == "-"] == [
        "policy/clipfrac_low",
        "policy/clipfrac_high",
    ]
    # Held-out accuracy is not smoothed: one line through its 5 evaluations, each one marked.
    assert seen["accuracy.png"]["lines"] == [("eval/accuracy", 5, "-")] and seen["accuracy.png"]["legend"] == ""
    assert seen["accuracy.png"]["markers"] == ["o"]


def test_a_line_exactly_under_another_is_named_in_the_legend():
    # Drawn in this order, b covers a (the same steps and values); c differs at its second step.
    curves = {"a": ([1, 2], [0.0, 0.5]), "b": ([1, 2], [0.0, 0.5]), "c": ([1, 2], [0.0, 0.6])}
    assert plots.coinciding(curves) == {"a": "a (hidden under b: the same values)", "b": "b", "c": "c"}
    assert plots.coinciding({"a": ([1], [0.0]), "b": ([2], [0.0])}) == {"a": "a", "b": "b"}  # other steps


def test_equal_clip_fractions_are_noted_in_the_run_plot(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    run = _run(tmp_path, "grpo")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for row in rows[1:]:
        row["policy/clipfrac_high"] = row["policy/clipfrac_low"]  # the same every step: one line hides the other
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    labels = {}
    real_savefig = plt.Figure.savefig

    def record(fig, path, *a, **k):
        labels[path.name] = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        return real_savefig(fig, path, *a, **k)

    monkeypatch.setattr(plt.Figure, "savefig", record)
    plots.plot_run(run)
    assert labels["clip_fractions.png"] == [
        "policy/clipfrac_low (hidden under policy/clipfrac_high: the same values)",
        "policy/clipfrac_high",
    ]


def test_plot_run_without_a_config_or_with_an_objective_name_only(tmp_path):
    run = _run(tmp_path, "grpo")
    assert plots.objective_label(run) == "grpo"
    (run / "config.yaml").unlink()
    assert plots.objective_label(run) == ""
    assert len(plots.plot_run(run)) == 6


def test_a_long_objective_is_wrapped_in_the_title_not_cut(tmp_path):
    """The objective's parameters go on as many title lines as they need ("entrop..." was cut at 100 characters)."""
    params = {f"knob_{i}": 0.125 for i in range(12)}
    (tmp_path / "config.yaml").write_text(
        yaml.safe_dump({"objective": {"name": "ppo_clip", **params, "entropy_coef": 0}})
    )
    label = plots.objective_label(tmp_path)
    lines = label.splitlines()
    assert lines[0] == "ppo_clip" and len(lines) >= 3 and all(len(line) <= 90 for line in lines)
    assert "entropy_coef=0" in label and "..." not in label


@pytest.mark.parametrize("last", [10, 12, 20, 1000])
def test_a_runs_last_step_is_a_tick_of_its_x_axis(last):
    plt = plots.pyplot()
    fig, ax = plt.subplots()
    plots._x_axis(ax, list(range(0, last + 1)), list(range(1, last + 1)))
    ax.plot(range(last + 1), range(last + 1))
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    plt.close(fig)
    assert ticks[0] == 0 and ticks[-1] == last, ticks
