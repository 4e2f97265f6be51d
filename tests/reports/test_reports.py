"""Reports that say what is true (issue 24, items 6-13): the objective by the name the user chose,
the reward as configured, the best checkpoint worded by what `tether export --step best` takes, a
run with one evaluation, claims with too few seeds or methods not run, the default model's size in
the docs, the progress line's accuracy step, `tether report --help`, and y labels on every plot.
Runs here are synthetic (config.yaml, metrics.jsonl, manifests): no training."""

import contextlib
import io
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from tether.records import plots
from tether.config.sections import config_differences
from tether.config.loading import load_config, save_config
from tether.records.summary import best_text, reward_text, summary_header, summary_table

ROOT = Path(__file__).resolve().parents[2]


def _run(path: Path, overrides: list[str], rows: list[dict], checkpoints: dict[int, float | None] = {}) -> Path:
    """A run directory: the config.yaml `tether train` would record for `overrides`, metrics.jsonl
    from `rows`, and a manifest per checkpoint step with its recorded accuracy (None: none)."""
    path.mkdir(parents=True)
    save_config(load_config(None, [*overrides, f"output_dir={path}"]), path / "config.yaml")
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for step, acc in checkpoints.items():
        ckpt = path / "checkpoints" / f"step_{step:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / "manifest.json").write_text(json.dumps({"files": {}, "accuracy": acc}))
    return path


def _rows(evals: dict[int, float], last: int) -> list[dict]:
    """Steps 0..last: accuracy at the `evals` steps, reward and entropy at every step after 0."""
    rows = []
    for s in range(last + 1):
        r = {"step": s}
        if s in evals:
            r["eval/accuracy"] = evals[s]
        if s:
            r |= {
                "reward/mean": 0.1 * s,
                "policy/entropy": 2.0 - 0.1 * s,
                "policy/clipfrac_low": 0.01,
                "policy/clipfrac_high": 0.02,
                "policy/kl_old": 1e-3,
                "rollout/len_mean": 5.0 + s,
            }
        rows.append(r)
    return rows


# ---------------------------------------------------------------- item 6: the chosen name


@pytest.mark.parametrize(
    "override, label, name",
    [
        (None, "atr_grpo", "divergence_clip"),  # the default preset
        ("objective=grpo", "grpo", "ppo_clip"),
        ("objective=ppo_clip", "ppo_clip", "ppo_clip"),  # an objective named directly is its own label
        ("objective={preset: dapo, eps_high: 0.3}", "dapo", "ppo_clip"),
        ("objective.label=my_grpo", "my_grpo", "divergence_clip"),  # a label of one's own
    ],
)
def test_the_chosen_name_is_recorded_beside_the_objective_it_builds(tmp_path, override, label, name):
    cfg = load_config(None, [override] if override else [])
    assert cfg.objective["label"] == label and cfg.objective["name"] == name
    save_config(cfg, tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())["objective"]
    assert list(saved)[:2] == ["label", "name"] and "preset" not in saved  # resolved: no preset file needed
    assert load_config(str(tmp_path / "config.yaml")).objective == cfg.objective  # loads back the same


def test_a_run_recorded_before_labels_still_matches_its_settings(tmp_path):
    # A config.yaml written before the label existed loads with the objective's name as its label;
    # the label is no setting, so `tether compare` still resumes such a run.
    new = load_config(None, ["objective=grpo"])
    old = {
        k: v
        for k, v in yaml.safe_load(yaml.safe_dump({"objective": new.objective}))["objective"].items()
        if k != "label"
    }
    (tmp_path / "old.yaml").write_text(yaml.safe_dump({"objective": old}))
    before = load_config(str(tmp_path / "old.yaml"))
    assert before.objective["label"] == "ppo_clip" and config_differences(new, before) == []
    assert config_differences(new, load_config(None, ["objective=dapo"]))  # a real difference still shows


def test_summary_plots_and_report_show_the_chosen_name(tmp_path):
    from tether.reports.report import write_report

    rows = _rows({0: 0.2, 3: 0.4}, 3)
    atr = _run(tmp_path / "a", ["trainer.total_steps=3"], rows)
    grpo = _run(tmp_path / "g", ["objective=grpo", "trainer.total_steps=3"], rows)
    cfg = load_config(str(atr / "config.yaml"))
    head = summary_header(cfg, atr, 0, 3, 1.0, torch.device("cpu"))
    assert "- objective: **atr_grpo** (divergence_clip: measure=kl3, delta=0.0231, advantage=grpo" in head
    grpo_head = summary_header(load_config(str(grpo / "config.yaml")), grpo, 0, 3, 1.0, torch.device("cpu"))
    assert "- objective: **grpo** (ppo_clip: eps_low=0.2, eps_high=0.2" in grpo_head
    assert plots.objective_label(atr).splitlines()[0] == "atr_grpo (divergence_clip)"
    assert plots.objective_label(grpo).splitlines()[0] == "grpo (ppo_clip)"
    # tether report over run directories that are not in a compare layout: rows by the chosen name.
    text = write_report({"r": [atr, grpo]}, tmp_path / "rep", threshold=0.3).read_text()
    assert "| atr_grpo | 1 |" in text and "| grpo | 1 |" in text
    assert "divergence_clip" not in text and "ppo_clip" not in text


# ---------------------------------------------------------------- item 7: reward and best checkpoint


@pytest.mark.parametrize(
    "overrides, text",
    [
        ([], "exact_match (the task's own verifier)"),
        (["data.task=countdown"], "countdown (the task's own verifier)"),
        (["reward.name=format"], "format"),
        (["reward.weights={exact_match: 1.0, format: 0.1}"], "weighted: 1 x exact_match + 0.1 x format"),
        (
            [
                "reward.name=format",
                "reward.weights={exact_match: 1.0, overlong: {weight: 0.5, max_tokens: 8, cache: 2}}",
            ],
            "weighted: 1 x exact_match + 0.5 x overlong (max_tokens=8, cache=2)",
        ),  # weights win over the name
        # the trainer scores episodes by the environment's rewards here (it said the task's verifier)
        (["env.name=retry", "env.reward=env"], "episode (the environment's rewards: env.reward=env)"),
        (["env.name=retry"], "exact_match (the task's own verifier)"),  # env.reward=task: the last turn
        (["env.name=retry", "env.reward=env", "reward.name=format"], "format"),  # a named reward wins
    ],
)
def test_the_summary_names_the_reward_actually_used(overrides, text):
    cfg = load_config(None, overrides)
    assert reward_text(cfg.reward, cfg.data.task, cfg.env) == text


def test_the_best_checkpoint_is_worded_by_what_export_takes(tmp_path):
    evals = {0: 0.5, 2: 0.25, 4: 0.5}
    # The best (0.5) is first at step 0, the initial model; step 4's checkpoint scores the same.
    tie = _run(tmp_path / "tie", [], _rows(evals, 4), {2: 0.25, 4: 0.5})
    assert best_text(_rows(evals, 4), tie) == (
        f"0.500 at step 0 (the initial model); checkpoint `{tie}/checkpoints/step_000004` (step 4) scores the same "
        f"(`tether export {tie} --step best OUT`)"
    )
    # The best step has its own checkpoint.
    up = {0: 0.1, 2: 0.5, 4: 0.25}
    own = _run(tmp_path / "own", [], _rows(up, 4), {2: 0.5, 4: 0.25})
    assert best_text(_rows(up, 4), own) == (
        f"0.500 at step 2, in checkpoint `{own}/checkpoints/step_000002` (`tether export {own} --step best OUT`)"
    )
    # The initial model was best and every checkpoint is worse: said so, with the one export takes.
    worse = _run(tmp_path / "worse", [], _rows(evals, 4), {2: 0.25})
    assert best_text(_rows(evals, 4), worse) == (
        f"0.500 at step 0 (the initial model), which no checkpoint holds; the best checkpoint is "
        f"`{worse}/checkpoints/step_000002` (step 2, 0.250; `tether export {worse} --step best OUT`)"
    )
    # An interrupted run: checkpoints without an accuracy, one evaluation.
    bare = _run(tmp_path / "bare", [], _rows({0: 0.125}, 3), {3: None})
    assert best_text(_rows({0: 0.125}, 3), bare) == (
        "0.125 at step 0 (the initial model); no checkpoint records a held-out accuracy"
    )
    assert best_text([{"step": 1, "reward/mean": 0.5}], bare) == "none measured"


# ---------------------------------------------------------------- item 8: one evaluation


def test_a_run_with_one_evaluation_says_so_in_the_summary_and_the_plot(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    run = _run(tmp_path / "run", ["trainer.total_steps=50"], _rows({0: 0.125}, 3))  # stopped at step 3
    table = summary_table(run)
    acc = next(line for line in table.splitlines() if line.startswith("| eval/accuracy"))
    assert acc == "| eval/accuracy | 0.1250 (step 0) | 0.1250 (step 0), the only value | 0.1250 (step 0) |"
    reward = next(line for line in table.splitlines() if line.startswith("| reward/mean"))
    assert reward == "| reward/mean | 0.1000 (step 1) | 0.3000 (step 3) | 0.3000 (step 3) |"  # end: the last step
    assert "Held-out accuracy was measured once, at step 0: the run ended at step 3" in table
    seen = {}
    real_savefig = plt.Figure.savefig

    def record(fig, path, *a, **k):
        ax = fig.axes[0]
        seen[path.name] = {
            "xlim": ax.get_xlim(),
            "y": ax.get_ylabel(),
            "legend": ax.get_legend().get_title().get_text() if ax.get_legend() else "",
        }
        return real_savefig(fig, path, *a, **k)

    monkeypatch.setattr(plt.Figure, "savefig", record)
    plots.plot_run(run)
    lo, hi = seen["accuracy.png"]["xlim"]
    assert lo < 0 and 3 < hi < 3.5  # the run's steps 0..3 (3% margin), not -0.04..0.04 around the point
    assert seen["accuracy.png"]["legend"] == "one value only, at step 0; the run ended at step 3"
    assert seen["reward.png"]["legend"] == ""  # three values: no note, no smoothing at this length
    # A finished run's table has no note, and each end is the last evaluated step.
    done = _run(tmp_path / "done", [], _rows({0: 0.1, 2: 0.3, 4: 0.2}, 4))
    t = summary_table(done)
    assert "| eval/accuracy | 0.1000 (step 0) | 0.2000 (step 4) | 0.3000 (step 2) |" in t and "measured once" not in t


# ---------------------------------------------------------------- item 9: claims through the CLI


def test_report_claims_with_one_seed_per_method(tmp_path, capsys):
    from tether.cli import main

    for obj, acc in (("grpo", 0.2), ("atr_grpo", 0.5)):
        _run(
            tmp_path / "cmp" / obj / "seed0", [f"objective={obj}", "trainer.total_steps=3"], _rows({0: 0.1, 3: acc}, 3)
        )
    claims = tmp_path / "claims.yaml"
    claims.write_text(
        "- {claim: ATR beats GRPO, metric: final_accuracy, method: atr_grpo, baseline: grpo}\n"
        "- {claim: ETR beats GRPO, metric: final_accuracy, method: etr, baseline: grpo}\n"
    )
    assert main(["report", str(tmp_path / "cmp"), "--claims", str(claims), "--threshold", "0.3"]) == 0
    text = (tmp_path / "cmp" / "report.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| ATR beats GRPO"))
    assert (
        "atr_grpo vs grpo (1 seed, paired)" in row
        and "+0.3000 | n/a | n/a | n/a | n/a | n/a | **not enough seeds**" in row
    )
    assert "supported" not in row and "contradicted" not in row
    assert "- ETR beats GRPO (regime cmp): 'etr' not run here (methods run: atr_grpo, grpo)" in text
    summary = json.loads((tmp_path / "cmp" / "summary.json").read_text())
    assert summary["claims"][0]["verdict"] == "not enough seeds" and summary["claims"][0]["paired"]
    assert [s["claim"] for s in summary["skipped_claims"]] == ["ETR beats GRPO"]


# ---------------------------------------------------------------- a comparison still running (issue 40)


def test_a_comparison_in_progress_is_reported_from_its_finished_runs_and_names_the_others(tmp_path, capsys):
    """Its runs still training were read as finished (a run at step 1 of 12 counted as a seed ending at its
    step-0 accuracy); they are left out, named on stderr and in report.md, and a run named directly is taken."""
    from tether.cli import main

    cmp = tmp_path / "cmp"
    for seed, last in ((0, 3), (1, 1)):
        _run(cmp / "grpo" / f"seed{seed}", ["trainer.total_steps=3"], _rows({0: 0.1, 3: 0.5}, last))
    assert main(["report", str(cmp), "--threshold", "0.3"]) == 0
    text = (cmp / "report.md").read_text()
    assert f"Not finished, so left out: {cmp / 'grpo' / 'seed1'} (step 1 of 3)." in text
    assert "| grpo | 1 | 0.100 | 0.500 |" in text
    assert f"left out, not finished: {cmp / 'grpo' / 'seed1'} (step 1 of 3)" in capsys.readouterr().err
    assert main(["report", str(cmp / "grpo" / "seed1"), "--out", str(tmp_path / "one"), "--threshold", "0.3"]) == 0
    assert "| grpo | 1 | 0.100 | 0.100 |" in (tmp_path / "one" / "report.md").read_text()
    shutil.rmtree(cmp / "grpo" / "seed0")
    assert main(["report", str(cmp)]) != 0
    assert re.search(r"no finished run.*seed1 \(step 1 of 3\).*name a run directory", capsys.readouterr().err)


# ---------------------------------------------------------------- item 10: the default model's size


def test_the_docs_give_the_default_tiny_models_parameter_count(tmp_path):
    from tether.model.loading import load_model
    from tether.trainer.warmstart import _tiny_model

    cfg = load_config(None, [f"warm_start.cache_dir={tmp_path}"])
    model, _ = load_model(str(_tiny_model(cfg)), device="cpu")  # the model a default run trains
    n = f"{sum(p.numel() for p in model.parameters()):,}"
    # Embedding and head 2 x (100 x 128) = 25,600; each of 4 layers 4 x 128^2 (attention) + 3 x 128 x 512
    # (MLP) + 2 x 128 (norms) = 262,400; the final norm 128: 25,600 + 1,049,600 + 128 = 1,075,328.
    assert n == "1,075,328"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        from tether.cli import main

        assert main(["train", "--help-config"]) == 0
    help_line = next(line for line in out.getvalue().splitlines() if line.startswith("trainer.small_model_params"))
    assert f"default tiny model ({n} parameters)" in help_line
    assert f"default tiny model ({n} parameters)" in (ROOT / "docs" / "training.md").read_text()
    assert f"128 x 4 model has {n}" in re.sub(r"\s+", " ", (ROOT / "docs" / "performance.md").read_text())


# ---------------------------------------------------------------- item 11: progress lines


def test_a_progress_line_says_which_step_its_accuracy_is_from():
    from tether.records.sinks import PlainProgress

    lines = []
    p = PlainProgress(total=10, every=2, log=lines.append)
    p.update(0, {"eval/accuracy": 0.25})
    p.update(2, {"reward/mean": 0.5})
    p.update(3, {"reward/mean": 0.5, "eval/accuracy": 0.5})
    p.update(4, {"reward/mean": 0.5})
    assert [re.search(r"  acc (.*?)  ETA", line).group(1) for line in lines] == ["0.250 @0", "0.500 @3", "0.500 @3"]
    assert not any("(new)" in line for line in lines)


# ---------------------------------------------------------------- items 12 and 13


def test_report_help_names_a_claims_file_that_exists(capsys):
    from tether.cli import main

    with pytest.raises(SystemExit):
        main(["report", "--help"])
    text = re.sub(r"\s+", " ", capsys.readouterr().out)
    named = re.findall(r"e\.g\. (\S+?)[,)]", text)
    assert named == ["configs/claims.yaml"] and (ROOT / named[0]).is_file() and "papers.yaml" not in text


def test_comparison_plots_say_their_window_which_is_the_run_plots(tmp_path, monkeypatch):
    """Issue 32, item 8: 40 steps are smoothed over 4 (a tenth), not 20, and the legend says so."""
    import matplotlib.pyplot as plt

    from tether.reports.report import plot_comparison

    runs = {
        obj: [_run(tmp_path / obj / "seed0", [f"objective={obj}"], _rows({0: 0.1, 20: 0.2, 40: 0.3}, 40))]
        for obj in ("grpo", "dapo")
    }
    legends = {}
    real_savefig = plt.Figure.savefig

    def record(fig, path, *a, **k):
        legend = fig.axes[0].get_legend()
        legends[path.name] = (legend.get_title().get_text(), [t.get_text() for t in legend.get_texts()])
        return real_savefig(fig, path, *a, **k)

    monkeypatch.setattr(plt.Figure, "savefig", record)
    plot_comparison(runs, tmp_path / "plots")
    assert legends["reward.png"][0] == "line: mean of the last 4 steps, mean over seeds; band: min..max"
    # Both methods have the same metrics: grpo's line is drawn first, under dapo's, and says so.
    assert legends["reward.png"][1] == ["grpo (hidden under dapo: the same values)", "dapo"]


def test_every_comparison_plot_has_a_y_label(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from tether.reports.report import CURVES, plot_comparison

    runs = {
        obj: [
            _run(
                tmp_path / obj / f"seed{s}",
                [f"objective={obj}", f"trainer.seed={s}"],
                _rows({0: 0.1, 5: 0.2 + 0.1 * s}, 5),
            )
            for s in range(2)
        ]
        for obj in ("grpo", "dapo")
    }
    labels, legends, markers = {}, {}, {}
    real_savefig = plt.Figure.savefig

    def record(fig, path, *a, **k):
        ax = fig.axes[0]
        labels[path.name] = ax.get_ylabel()
        legends[path.name] = ax.get_legend().get_title().get_text()
        markers[path.name] = [ln.get_marker() for ln in ax.lines]
        return real_savefig(fig, path, *a, **k)

    monkeypatch.setattr(plt.Figure, "savefig", record)
    written = plot_comparison(runs, tmp_path / "plots")
    assert len(written) == len(CURVES) == 7
    # 5 steps: a tenth of 5 points is a window of 1 (the run plots' rule, not a fixed 20): nothing smoothed.
    assert legends["reward.png"] == "each step, mean over seeds; band: min..max"
    assert legends["accuracy.png"] == "mean over seeds (markers: evaluations); band: min..max"
    assert markers["accuracy.png"] == ["o", "o"] and markers["reward.png"] == ["None", "None"]
    assert labels == {
        "accuracy.png": "fraction of test prompts correct",
        "reward.png": "mean reward per completion",
        "entropy.png": "nats per token",
        "clipfrac_high.png": "fraction of tokens",
        "clipfrac_low.png": "fraction of tokens",
        "kl_old.png": "nats per token",
        "response_length.png": "tokens (mean per completion)",
    }


def test_a_setting_with_a_newline_stays_on_its_line_in_the_report_and_the_eval_results(tmp_path):
    # Was: the real-model comparison's report broke its settings sentence in two at the prompt
    # template's newline ("{problem}\nAnswer with the number only.").
    from tether.evaluation.report import results_markdown
    from tether.reports.report import write_report

    task = [
        "data.task=math",
        "data.task_args.train=tether:word1_train.jsonl",
        "data.task_args.test=tether:word1_test.jsonl",
        "data.task_args.template={problem}\nAnswer with the number only.",
        "trainer.total_steps=3",
    ]
    runs = [
        _run(tmp_path / n, [*task, *extra], _rows({0: 0.2, 3: 0.4}, 3))
        for n, extra in (("a", []), ("g", ["objective=grpo"]))
    ]
    text = write_report({"r": runs}, tmp_path / "rep", threshold=0.3).read_text()
    settings = next(line for line in text.splitlines() if "Settings that differ" in line)
    assert "`data.task_args.template={problem}\\nAnswer with the number only.`" in settings
    results = {
        "settings": {"model": "m", "template": "{problem}\nAnswer.", "n": 1},
        "ks": [1],
        "summary": {},
        "problems": [],
    }
    first = results_markdown(results).splitlines()
    assert any("template={problem}\\nAnswer., n=1" in line for line in first), first


def test_a_summary_alone_is_tested_again_and_its_report_rewritten(tmp_path):
    """`tether report SUMMARY.json --claims C`: the claims are tested again from the per-seed values (the runs
    may be gone), report.md's claims section is replaced and its regime sections kept; `--out F` writes only the
    claims to F."""
    from tether.cli import main

    for obj, acc in (("grpo", 0.2), ("atr_grpo", 0.5)):
        for seed in range(4):
            _run(
                tmp_path / "cmp" / obj / f"seed{seed}",
                [f"objective={obj}", "trainer.total_steps=3", f"trainer.seed={seed}"],
                _rows({0: 0.1, 3: acc + 0.01 * seed * (obj == "grpo")}, 3),
            )
    claims = tmp_path / "claims.yaml"
    claims.write_text("- {claim: ATR beats GRPO, metric: final_accuracy, method: atr_grpo, baseline: grpo}\n")
    assert main(["report", str(tmp_path / "cmp"), "--threshold", "0.3"]) == 0
    before = (tmp_path / "cmp" / "report.md").read_text()
    assert "## Claims" not in before
    shutil.rmtree(tmp_path / "cmp" / "grpo")  # the runs are gone: the summary is enough
    summary = tmp_path / "cmp" / "summary.json"
    assert main(["report", str(summary), "--claims", str(claims)]) == 0
    after = (tmp_path / "cmp" / "report.md").read_text()
    assert after.startswith(before.rstrip("\n")) and "## Claims" in after
    (r,) = json.loads(summary.read_text())["claims"]
    assert r["verdict"] == "supported" and r["test"] == "paired t" and r["seeds"] == [4, 4]
    assert "![claims](plots/claims.png)" in after and (tmp_path / "cmp" / "plots" / "claims.png").stat().st_size > 1000
    # Again: the claims section is replaced, not appended.
    assert main(["report", str(summary), "--claims", str(claims)]) == 0
    assert (tmp_path / "cmp" / "report.md").read_text() == after
    assert main(["report", str(summary), "--claims", str(claims), "--out", str(tmp_path / "c.md")]) == 0
    assert "| ATR beats GRPO |" in (tmp_path / "c.md").read_text() and (tmp_path / "cmp" / "plots" / "c.png").exists()
    assert (tmp_path / "cmp" / "report.md").read_text() == after
