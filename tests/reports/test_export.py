"""`tether export` writes a model directory that from_pretrained loads and that
generates with the run's sampling settings; bad input is refused with nothing written; the Hub
push is tested against a fake HfApi; pruning keeps the checkpoint with the best recorded accuracy
(issue 17, item 8)."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tether.records import checkpoint
from tether.cli import main
from tether.config.loading import load_config, save_config
from tether.trainer.loop import train

from conftest import DIGIT_REWARD, tiny_run


def _cfg(tiny_dir, out, *extra):
    sampling = [
        "rollout.prompts_per_step=2",
        "rollout.max_new_tokens=5",
        "rollout.temperature=0.7",
        "rollout.top_p=0.9",
    ]
    steps = ["trainer.mini_batches=1", "trainer.micro_batch_size=8", "data.eval_size=4", "trainer.eval_every=1"]
    quiet = ["trainer.progress=false", "trainer.save_every=1", "trainer.keep_last=3", "trainer.plots=false"]
    return load_config(
        None,
        tiny_run(tiny_dir, *sampling, *steps, *quiet, "trainer.tensorboard=false", "objective=dapo", *extra, out=out),
    )


@pytest.fixture(scope="module")
def real_run(tiny_dir, tmp_path_factory):
    """A real 2-step run: checkpoints at steps 1 and 2, accuracy evaluated at 0, 1 and 2."""
    out = tmp_path_factory.mktemp("export") / "run"
    return train(_cfg(tiny_dir, out, "trainer.total_steps=2"), log=lambda *_: None)


def _model(tiny_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_dir), AutoTokenizer.from_pretrained(tiny_dir)


def _synthetic_run(tiny_dir, run: Path, accuracies: dict[int, float | None], keep_last: int = 10) -> Path:
    """A run directory with config.yaml, metrics.jsonl and a checkpoint per step of `accuracies`,
    written by checkpoint.save with that accuracy recorded (None: none): no training."""
    run.mkdir(parents=True)
    save_config(_cfg(tiny_dir, run), run / "config.yaml")
    rows = [{"step": s, "eval/accuracy": a} for s, a in accuracies.items() if a is not None]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    model, tok = _model(tiny_dir)
    for step, acc in accuracies.items():
        checkpoint.save(run, step, model, tok, {"position": step}, keep_last=keep_last, accuracy=acc)
    return run


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _steps(run: Path) -> list[int]:
    return [int(c.name.split("_")[1]) for c in checkpoint.list_checkpoints(run)]


# ---------------------------------------------------------------- keeping the best checkpoint


def test_pruning_keeps_the_best_checkpoint_the_earliest_of_equals(tiny_dir, tmp_path):
    # keep_last=2 keeps steps 4 and 5; the best accuracy, 0.5, is at steps 2 and 4: the earliest, 2, is kept too.
    run = _synthetic_run(tiny_dir, tmp_path / "run", {1: 0.2, 2: 0.5, 3: 0.3, 4: 0.5, 5: 0.1}, keep_last=2)
    assert _steps(run) == [2, 4, 5]
    assert checkpoint.best(run).name == "step_000002"
    assert checkpoint.latest(run).name == "step_000005"  # resume still reads the newest
    assert checkpoint.recorded_accuracy(checkpoint.best(run)) == 0.5


def test_without_recorded_accuracies_pruning_is_unchanged(tiny_dir, tmp_path):
    run = _synthetic_run(tiny_dir, tmp_path / "run", {1: None, 2: None, 3: None}, keep_last=2)
    assert _steps(run) == [2, 3]
    assert checkpoint.best(run) is None
    # A non-finite accuracy is not recorded (json has no NaN).
    model, tok = _model(tiny_dir)
    checkpoint.save(run, 4, model, tok, {}, keep_last=2, accuracy=float("nan"))
    assert checkpoint.recorded_accuracy(run / "checkpoints" / "step_000004") is None


def test_a_damaged_best_checkpoint_is_skipped_and_the_next_best_kept(tiny_dir, tmp_path):
    run = _synthetic_run(tiny_dir, tmp_path / "run", {1: 0.9, 2: 0.6, 3: 0.1}, keep_last=1)
    assert _steps(run) == [1, 3]
    weights = run / "checkpoints" / "step_000001" / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated: fails the size check
    logs = []
    assert checkpoint.best(run, log=logs.append).name == "step_000003"  # the only good one left
    assert len(logs) == 1 and "step_000001 is damaged" in logs[0]
    model, tok = _model(tiny_dir)
    checkpoint.save(run, 4, model, tok, {}, keep_last=1, accuracy=0.4)
    # Step 1 is damaged (left for inspection, never protected); the good ones are 3 (0.1) and 4 (0.4):
    # 4 is both the newest and the best.
    assert _steps(run) == [1, 4]
    assert checkpoint.best(run, log=lambda *_: None).name == "step_000004"


# ---------------------------------------------------------------- export of a real run


def test_an_exported_run_loads_with_from_pretrained_and_generates(real_run, tmp_path):
    out = tmp_path / "model"
    assert main(["export", str(real_run), str(out)]) == 0
    names = {p.name for p in out.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "README.md",
        "tether_config.yaml",
        "tokenizer.json",
    } <= names and not [n for n in names if n.endswith(".bin")]
    # The last checkpoint's weights, byte for byte.
    assert (out / "model.safetensors").read_bytes() == (
        real_run / "checkpoints" / "step_000002" / "model" / "model.safetensors"
    ).read_bytes()
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    gen = model.generation_config
    assert (gen.do_sample, gen.temperature, gen.top_p, gen.top_k, gen.max_new_tokens) == (True, 0.7, 0.9, 0, 5)
    assert tok.eos_token_id in gen.eos_token_id
    inputs = tok("12+3=", return_tensors="pt")
    torch.manual_seed(0)
    ids = model.generate(**inputs)
    new = ids[0, inputs.input_ids.shape[1] :]
    assert 1 <= len(new) <= 5  # max_new_tokens from the run's rollout settings
    assert isinstance(tok.decode(new, skip_special_tokens=True), str)


def test_the_model_card_names_the_objective_data_and_metrics(real_run, tmp_path):
    out = tmp_path / "model"
    assert main(["export", str(real_run), "--step", "1", str(out)]) == 0
    card = (out / "README.md").read_text()
    rows = [json.loads(line) for line in (real_run / "metrics.jsonl").read_text().splitlines()]
    acc = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    assert card.startswith("---\nlibrary_name: transformers\n")
    assert "step 1" in card and "task `arithmetic`" in card and f"- reward: {DIGIT_REWARD}\n" in card
    assert "eps_high: 0.28" in card  # dapo's resolved parameters, from config.yaml
    assert "(objective **dapo (ppo_clip)**)" in card and "- dapo\n" in card  # the chosen name, also as a tag
    assert f"| start | 0 | {acc[0]:.4f} |" in card and f"| end | 2 | {acc[2]:.4f} |" in card
    assert f"| **this model** | 1 | {acc[1]:.4f} |" in card
    assert "temperature 0.7, top_p 0.9, max_new_tokens 5" in card


# ---------------------------------------------------------------- bad input: exit 2, nothing written


def _refused(capsys, argv, *fragments):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err, err
    for f in fragments:
        assert f in err, err
    return err


def test_a_run_without_checkpoints_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("objective: grpo\n")
    _refused(capsys, ["export", str(run), str(tmp_path / "out")], "has no checkpoints")
    _refused(capsys, ["export", str(tmp_path / "nowhere"), str(tmp_path / "out")], "no config.yaml")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_missing_step_lists_the_available_ones(real_run, tmp_path, capsys):
    _refused(capsys, ["export", str(real_run), "--step", "7", str(tmp_path / "out")], "available: 1, 2")
    _refused(capsys, ["export", str(real_run), "--step", "first", str(tmp_path / "out")], "'best' or 'last'")
    assert list(tmp_path.iterdir()) == []


def test_a_real_run_records_its_best_checkpoint_and_exports_it(real_run, tmp_path):
    from tether.cli import main

    # The trainer checkpoints every new best held-out accuracy with it recorded (tether.trainer.loop).
    best = checkpoint.best(real_run)
    evals = {r["step"]: r["eval/accuracy"] for r in _rows(real_run) if r["step"] > 0 and "eval/accuracy" in r}
    assert best is not None and checkpoint.recorded_accuracy(best) == max(evals.values())
    assert main(["export", str(real_run), "--step", "best", str(tmp_path / "out")]) == 0


def test_best_without_recorded_accuracies_lists_the_steps(tiny_dir, tmp_path, capsys):
    # Checkpoints without an accuracy (a run from before `accuracy=`): the steps and their logged
    # accuracies are listed instead.
    run = _synthetic_run(tiny_dir, tmp_path / "run", {1: None, 2: None})
    (run / "metrics.jsonl").write_text('{"step": 1, "eval/accuracy": 0.25}\n{"step": 2, "eval/accuracy": 0.5}\n')
    _refused(
        capsys,
        ["export", str(run), "--step", "best", str(tmp_path / "out")],
        "no checkpoint",
        "--step N",
        "1 (eval/accuracy",
    )
    assert not (tmp_path / "out").exists()


def test_a_non_empty_out_is_refused_unless_forced(real_run, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    _refused(capsys, ["export", str(real_run), str(out)], "not empty", "--force")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert main(["export", str(real_run), str(out), "--force"]) == 0
    assert (out / "model.safetensors").exists() and not (out / "keep.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary directory left beside it
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["export", str(real_run), str(empty)]) == 0  # an empty OUT is fine


def test_best_exports_the_checkpoint_with_the_best_recorded_accuracy(tiny_dir, tmp_path, capsys):
    run = _synthetic_run(tiny_dir, tmp_path / "run", {1: 0.25, 2: 0.75, 3: 0.5})
    assert main(["export", str(run), "--step", "best", str(tmp_path / "out")]) == 0
    card = (tmp_path / "out" / "README.md").read_text()
    assert "# run, step 2" in card and "| best | 2 | 0.7500 |" in card and "| **this model** | 2 | 0.7500 |" in card


# ---------------------------------------------------------------- --push-to-hub, never the network


class FakeApi:
    def __init__(self, token=None):
        self.token, self.calls = token, []
        FakeApi.last = self

    def create_repo(self, repo_id, repo_type, exist_ok):
        self.calls.append(("create_repo", repo_id, repo_type, exist_ok))

    def upload_folder(self, folder_path, repo_id, repo_type, commit_message):
        files = sorted(p.name for p in Path(folder_path).iterdir())
        self.calls.append(("upload_folder", repo_id, files, commit_message))
        return type("CommitInfo", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/abc"})()


def test_push_to_hub_uploads_the_exported_folder(real_run, tmp_path, monkeypatch, capsys):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_fake")
    assert main(["export", str(real_run), str(tmp_path / "out"), "--push-to-hub", "me/tiny-rl"]) == 0
    api = FakeApi.last
    assert api.token == "hf_fake"
    assert api.calls[0] == ("create_repo", "me/tiny-rl", "model", True)
    kind, repo, files, message = api.calls[1]
    assert (kind, repo) == ("upload_folder", "me/tiny-rl") and {"README.md", "model.safetensors"} <= set(files)
    assert "step 2" in message
    assert "https://huggingface.co/me/tiny-rl/commit/abc" in capsys.readouterr().out


def test_push_to_hub_without_a_token_or_the_package_fails_first(real_run, tmp_path, monkeypatch, capsys):
    import sys

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    _refused(capsys, ["export", str(real_run), str(tmp_path / "out"), "--push-to-hub", "me/x"], "HF_TOKEN", "login")
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # not installed
    _refused(
        capsys, ["export", str(real_run), str(tmp_path / "out"), "--push-to-hub", "me/x"], "pip install huggingface_hub"
    )
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


def test_a_lora_run_exports_its_adapter_merged_into_the_base(tiny_dir, tmp_path):
    pytest.importorskip("peft")
    from peft import PeftModel

    run = train(
        _cfg(
            tiny_dir,
            tmp_path / "run",
            "trainer.total_steps=1",
            "model.lora={r: 4, alpha: 8}",
            "trainer.lr=1e-2",
            "objective=grpo",
        ),
        log=lambda *_: None,
    )
    out = tmp_path / "model"
    assert main(["export", str(run), str(out)]) == 0
    assert not list(out.glob("adapter_*")) and (out / "model.safetensors").exists()
    assert "trained as a LoRA adapter (r 4, alpha 8" in (out / "README.md").read_text()
    merged = AutoModelForCausalLM.from_pretrained(out)
    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_dir), str(run / "checkpoints" / "step_000001" / "model")
    )
    base = AutoModelForCausalLM.from_pretrained(tiny_dir)
    ids = torch.tensor([[1, 5, 7, 9, 11]])
    with torch.no_grad():
        want, got, before = adapted(ids).logits, merged(ids).logits, base(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # W + (alpha/r) B A, up to float32 rounding
    assert (got - before).abs().max() > 1e-4  # the adapter did train
    tok = AutoTokenizer.from_pretrained(out)
    assert merged.generate(**tok("1+2=", return_tensors="pt")).shape[1] > 4


def test_a_lora_checkpoint_whose_base_is_gone_is_refused(tiny_dir, tmp_path, capsys):
    pytest.importorskip("peft")
    import shutil

    base = tmp_path / "base"
    shutil.copytree(tiny_dir, base)
    run = train(
        _cfg(
            base,
            tmp_path / "run",
            "trainer.total_steps=1",
            "model.lora={r: 4, alpha: 8}",
            "objective=grpo",
            "data.eval_size=2",
        ),
        log=lambda *_: None,
    )
    shutil.rmtree(base)
    _refused(capsys, ["export", str(run), str(tmp_path / "out")], f"trained on {base}", "no longer there")
    assert not (tmp_path / "out").exists()


def test_the_model_card_names_the_reward_as_the_summary_does():
    """`reward.name: auto` is the task's own verifier: the card says which, as summary.md does (it said `auto`)."""
    from tether.reports.export import model_card

    cfg = {"data": {"task": "arithmetic"}, "reward": {"name": "auto"}, "objective": {"name": "ppo_clip"}}
    card = model_card(Path("/nowhere/run"), Path("/nowhere/run/checkpoints/step_000003"), cfg)
    assert "- reward: exact_match (the task's own verifier)\n" in card and "`auto`" not in card
