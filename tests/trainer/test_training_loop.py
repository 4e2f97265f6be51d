"""End to end: the trainer runs, writes well-formed outputs, resumes exactly, and rejects bad config."""

import json
import math
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tether.schema import ConfigError
from tether.config.loading import load_config
from tether.trainer.loop import train

from conftest import metrics_rows as _rows, untimed
from conftest import train_config as _cfg


@pytest.mark.slow
def test_smoke_run_writes_everything_and_changes_the_parameters(tiny_dir, tmp_path):
    run = train(_cfg(tiny_dir, tmp_path / "run", "trainer.total_steps=3", "objective=grpo"), log=lambda *_: None)
    rows = _rows(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for key in (
        "reward/mean",
        "reward/pass_rate",
        "rollout/len_mean",
        "rollout/len_max",
        "rollout/truncation_rate",
        "adv/zero_var_frac",
        "policy/entropy",
        "policy/clipfrac_low",
        "policy/clipfrac_high",
        "policy/ratio_mean",
        "policy/kl_old",
        "kl/ref",
        "loss/kl_penalty",
        "optim/grad_norm",
        "optim/lr",
    ):
        assert all(key in r and math.isfinite(r[key]) for r in rows[1:]), key
    assert all("eval/accuracy" in rows[i] for i in (0, 2, 3)) and "eval/accuracy" not in rows[1]
    # Two mini-batches per rollout: the second update is off-policy, so ratios move off 1.
    assert any(r["policy/ratio_max"] != 1.0 for r in rows[1:])
    before = load_file(str(tiny_dir / "model.safetensors"))
    after = load_file(str(run / "checkpoints" / "step_000003" / "model" / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert (run / "config.yaml").exists() and (run / "summary.md").exists()
    assert list((run / "tb").glob("events.out.tfevents.*"))
    assert {p.name for p in (run / "plots").glob("*.png")} >= {
        "reward.png",
        "accuracy.png",
        "entropy.png",
        "clip_fractions.png",
        "kl.png",
        "response_length.png",
    }
    samples = [json.loads(s) for s in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3 * 4 and {"prompt", "completion", "reward"} <= set(samples[0])
    # keep_last = 2 checkpoints: steps 2 and 3.
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000003"]


@pytest.mark.slow
def test_resume_matches_an_uninterrupted_run(tiny_dir, tmp_path):
    full = train(_cfg(tiny_dir, tmp_path / "full", "trainer.total_steps=4", "objective=dapo"), log=lambda *_: None)
    part = train(_cfg(tiny_dir, tmp_path / "part", "trainer.total_steps=2", "objective=dapo"), log=lambda *_: None)
    # Simulate a kill after step 3's metrics line but before its checkpoint: the torn tail must go.
    with (part / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "reward/mean": 0.5}\n{"step": 4, "rew')
    resumed = train(
        _cfg(tiny_dir, tmp_path / "part", "trainer.total_steps=4", "objective=dapo"),
        resume_dir=str(part),
        log=lambda *_: None,
    )
    a, b = _rows(full), _rows(resumed)
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4]
    for ra, rb in zip(a, b):  # time/*: wall clock
        assert untimed(ra) == untimed(rb)
    wa = load_file(str(full / "checkpoints" / "step_000004" / "model" / "model.safetensors"))
    wb = load_file(str(resumed / "checkpoints" / "step_000004" / "model" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_resuming_a_finished_run_changes_nothing_and_says_how_to_extend_it(tiny_dir, tmp_path):
    """It rewrote summary.md's wall time to 0 s and added a second TensorBoard file."""
    cfg = _cfg(tiny_dir, tmp_path / "run", "trainer.total_steps=2", "trainer.tensorboard=true")
    run = train(cfg, log=lambda *_: None)
    before = {p.name: p.read_bytes() for p in [run / "summary.md", run / "metrics.jsonl"]}
    events = sorted(p.name for p in (run / "tb").iterdir())
    logs: list[str] = []
    assert train(cfg, resume_dir=str(run), log=logs.append) == run
    assert {p.name: p.read_bytes() for p in [run / "summary.md", run / "metrics.jsonl"]} == before
    assert sorted(p.name for p in (run / "tb").iterdir()) == events
    assert any("already finished its 2 steps" in line and "trainer.total_steps=N" in line for line in logs), logs


def test_reference_refresh_and_dynamic_sampling(tiny_dir, tmp_path):
    run = train(
        _cfg(
            tiny_dir,
            tmp_path / "run",
            "trainer.total_steps=2",
            "objective=rpg_urkl",
            "objective.anchor=ref",
            "trainer.ref_update_every=3",
            "rollout.dynamic_sampling=true",
        ),
        log=lambda *_: None,
    )
    rows = _rows(run)
    assert rows[-1]["ref/updates"] == 1.0  # 4 optimiser steps, refreshed after the 3rd
    assert "rpg/kl_anchor" in rows[1] and "rollout/dynamic_kept_frac" in rows[1]
    assert (run / "checkpoints" / "step_000002" / "reference.safetensors").exists()


def test_an_existing_run_is_not_overwritten(tiny_dir, tmp_path):
    cfg = _cfg(tiny_dir, tmp_path / "run", "trainer.total_steps=1", "trainer.plots=false")
    train(cfg, log=lambda *_: None)
    with pytest.raises(FileExistsError, match="--resume"):
        train(cfg, log=lambda *_: None)


@pytest.mark.parametrize(
    "override, match",
    [
        ("trainer.totl_steps=3", "total_steps"),
        ("trainer.lr=fast", "trainer.lr"),
        ("objective=grpoo", "grpo"),
        ("objective.eps_hig=0.3", "eps_high"),
        ("rollout.group_size=1", "group_size"),
        ("trainer.schedule=linear", "cosine"),
        ("trainer.mini_batches=99", "mini_batches"),
        ("modell.dtype=float32", "model"),
    ],
)
def test_config_errors_name_the_key_and_the_fix(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["objective=dapo", override] if override.startswith("objective.") else [override])


def test_yaml_file_then_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("objective: {preset: dapo, eps_high: 0.3}\ntrainer: {total_steps: 7, lr: 1.0e-4}\n")
    cfg = load_config(str(p), ["trainer.total_steps=9", "objective.eps_low=0.1"])
    assert cfg.trainer.total_steps == 9 and cfg.trainer.lr == 1e-4
    # Resolved on load: the preset's every parameter, the overrides on top, max_len = the generation budget.
    assert cfg.objective == {
        "label": "dapo",
        "name": "ppo_clip",
        "aggregation": "token-mean",
        "kl_penalty": None,
        "entropy_coef": 0.0,
        "advantage": "grpo",
        "reward_aggregation": "sum",
        "max_len": 16,
        "rollout_correction": None,
        "off_policy_mask": None,
        "sampler_kl_coef": 0.0,
        "top_entropy_frac": None,
        "distill": None,
        "eps_low": 0.1,
        "eps_high": 0.3,
        "dual_clip_c": None,
    }


@pytest.mark.slow
def test_cli_reports_config_errors_without_a_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "tether.cli", "train", "trainer.totl_steps=3"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "total_steps" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_damaged_checkpoint_is_detected_and_the_previous_one_used(tiny_dir, tmp_path):
    from tether.records import checkpoint

    cfg = _cfg(tiny_dir, tmp_path / "run", "trainer.total_steps=4", "trainer.plots=false")
    run = train(cfg, log=lambda *_: None)
    newest = run / "checkpoints" / "step_000004"
    weights = newest / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # a truncated copy
    assert "truncated" in checkpoint.verify(newest)
    logs = []
    assert checkpoint.latest(run, log=logs.append).name == "step_000002"
    assert "damaged" in logs[0] and "step_000004" in logs[0]
    # Resuming uses step 2, redoes steps 3-4, and leaves no duplicated or missing step.
    train(cfg, resume_dir=str(run), log=lambda *_: None)
    assert [r["step"] for r in _rows(run)] == [0, 1, 2, 3, 4]
    assert checkpoint.verify(run / "checkpoints" / "step_000004") == ""


def test_pruning_never_deletes_the_newest_good_checkpoint(tiny_dir, tmp_path):
    from tether.records import checkpoint

    run = train(
        _cfg(
            tiny_dir,
            tmp_path / "run",
            "trainer.total_steps=2",
            "trainer.save_every=1",
            "trainer.keep_last=2",
            "trainer.plots=false",
        ),
        log=lambda *_: None,
    )
    (run / "checkpoints" / "step_000002" / "manifest.json").unlink()  # damage the newest
    checkpoint._prune(run, keep_last=1)
    # The damaged step 2 does not count as a kept checkpoint, so the good step 1 survives.
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    assert checkpoint.latest(run, log=lambda *_: None).name == "step_000001"


def test_non_finite_updates_are_skipped_then_the_run_stops_with_a_checkpoint(tiny_dir, tmp_path, monkeypatch):
    import dataclasses

    import tether.trainer.step
    from tether.records import checkpoint

    # NaN rewards reach the loss. A reward can no longer be their source (a NaN score is 0 and counted,
    # issue 32), so they are put into the scored batch after scoring: the trainer's guard is what is tested.
    real = tether.trainer.step.collect

    def poisoned(*args, **kwargs):
        scored, metrics = real(*args, **kwargs)
        return dataclasses.replace(
            scored, results=[dataclasses.replace(r, score=float("nan")) for r in scored.results]
        ), metrics

    monkeypatch.setattr(tether.trainer.step, "collect", poisoned)
    cfg = _cfg(
        tiny_dir, tmp_path / "run", "trainer.total_steps=5", "trainer.max_nonfinite_steps=2", "trainer.plots=false"
    )
    logs = []
    with pytest.raises(RuntimeError, match="2 steps in a row had a non-finite"):
        train(cfg, log=logs.append)
    run = tmp_path / "run"
    rows = _rows(run)
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[2]["optim/skipped_updates"] == 2.0
    assert rows[2]["optim/skipped_nonfinite_loss"] == 2.0 and rows[2]["optim/skipped_nonfinite_grad"] == 0.0
    assert any("step 1: 2 update(s) skipped: 2 with a non-finite loss" in line for line in logs), logs
    ckpt = checkpoint.latest(run, log=lambda *_: None)
    assert ckpt.name == "step_000002"
    before = load_file(str(tiny_dir / "model.safetensors"))
    after = load_file(str(ckpt / "model" / "model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before)  # no NaN update reached the weights


def _runs_with(tiny_dir, tmp_path, objective, key, log=lambda *_: None):
    """Two 2-step runs with trainer.<key> true and false; their metrics rows."""
    runs = {
        flag: _rows(
            train(
                _cfg(
                    tiny_dir,
                    tmp_path / flag,
                    "trainer.total_steps=2",
                    f"objective={objective}",
                    "trainer.plots=false",
                    f"trainer.{key}={flag}",
                ),
                log=log,
            )
        )
        for flag in ("true", "false")
    }
    return runs["true"], runs["false"]


def _assert_same_metrics(on, off, differ=()):
    """Every logged loss and metric equal to float32 rounding, and the comparison not of zeros; `differ` names
    metrics that measure the switch itself (they may change)."""
    assert [r["step"] for r in on] == [r["step"] for r in off] == [0, 1, 2]
    for a, b in zip(on, off):
        assert set(a) == set(b)
        for key in a:
            if not key.startswith("time/") and key not in differ:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)
    assert any(abs(r["loss/policy"]) > 1e-4 for r in on[1:])


@pytest.mark.slow
def test_the_fused_head_leaves_the_losses_unchanged(tiny_dir, tmp_path):
    """trainer.fused_logprobs on vs off: the same losses and metrics to float32 rounding."""
    _assert_same_metrics(*_runs_with(tiny_dir, tmp_path, "etr", "fused_logprobs"))


@pytest.mark.slow
def test_shared_prompts_leave_the_losses_unchanged(tiny_dir, tmp_path):
    """trainer.share_prompts on vs off (objective with a reference, so all three passes share):
    the same losses and metrics to float32 rounding."""
    logged = []
    on, off = _runs_with(tiny_dir, tmp_path, "rpg_fkl", "share_prompts", log=logged.append)
    assert not [line for line in logged if "shared prompts off" in str(line)]  # sharing really ran
    # tokens/pad_frac counts the positions the passes compute: sharing computes each prompt once, so it changes.
    _assert_same_metrics(on, off, differ={"tokens/pad_frac"})


@pytest.mark.slow
def test_old_logprobs_from_the_sampler_match_a_recompute(tiny_dir, tmp_path):
    """The hf engine's log-probs are the policy's: training on them gives the same step to rounding."""
    runs = {
        mode: _rows(
            train(
                _cfg(
                    tiny_dir,
                    tmp_path / mode,
                    "trainer.total_steps=2",
                    "objective=dapo",
                    "trainer.plots=false",
                    f"trainer.old_logprobs={mode}",
                ),
                log=lambda *_: None,
            )
        )
        for mode in ("recompute", "sampler")
    }
    a, b = runs["recompute"], runs["sampler"]
    for key in ("loss/policy", "policy/kl_old", "policy/entropy", "reward/mean", "eval/accuracy"):
        rows = [(ra[key], rb[key]) for ra, rb in zip(a, b) if key in ra]
        assert rows and all(x == pytest.approx(y, rel=1e-3, abs=1e-5) for x, y in rows), (key, rows)
    # the ratio moves off 1 only through the first mini-batch's update, the same in both modes
    ratios = [(ra["policy/ratio_mean"], rb["policy/ratio_mean"]) for ra, rb in zip(a, b) if "policy/ratio_mean" in ra]
    assert ratios and all(x == pytest.approx(y, abs=1e-5) for x, y in ratios), ratios
    with pytest.raises(ConfigError, match="old_logprobs=sampler"):
        load_config(None, ["trainer.old_logprobs=sampler", "rollout.top_p=0.9"])


# ---------------------------------------------------------------- micro-batching, eval mode, reference refresh


class _RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of every gradient it applies."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.grads = []

    def step(self, closure=None):
        self.grads.append([p.grad.detach().clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


class _NoSchedule:
    def step(self):
        pass


def _etr_update(tiny_dir, micro: int):
    """One rollout step's update of ETR on a fixed batch (float64), with micro_batch_size=micro:
    8 prompts x 8 samples, pass rates 1/8 ... 7/8 and 0, two mini-batches (the second off-policy)."""
    from tether import objectives
    from tether.model.loading import load_model
    from tether.rollout import SamplingParams, get_engine
    from tether.model.causal_lm import LogProbSettings, Precision, to_tokens, Tokens
    from tether.trainer.step import old_logprobs_of
    from tether.trainer.update import Policy, UpdateBatch, update

    torch.manual_seed(0)
    model, tok = load_model(str(tiny_dir), device="cpu")
    model = model.double()
    cfg = _cfg(
        tiny_dir,
        "unused",
        "objective=etr",
        "rollout.prompts_per_step=8",
        "rollout.group_size=8",
        f"trainer.micro_batch_size={micro}",
        "trainer.mini_batches=2",
        "trainer.max_grad_norm=0",
    )
    engine = get_engine("hf", model=model, tokenizer=tok)
    rollout = engine.generate([f"{i}+{i}=" for i in range(8)], n=8, params=SamplingParams(max_new_tokens=6), seed=3)
    groups = torch.tensor(rollout.prompt_index)
    rewards = torch.tensor(
        [float(j < g) for g, j in zip(groups.tolist(), [i % 8 for i in range(64)])], dtype=torch.float64
    )  # group g has g successes out of 8
    obj = objectives.build(cfg.objective)
    tokens = to_tokens(rollout, tok.pad_token_id, torch.device("cpu"))
    tokens = Tokens(
        tokens.input_ids,
        tokens.attention_mask,
        tokens.position_ids,
        tokens.completion_ids,
        tokens.loss_mask.double(),
        tokens.prompt_len,
    )
    settings, cpu = LogProbSettings.of(cfg.trainer, cfg.rollout), torch.device("cpu")
    opt = _RecordingSGD(model.parameters(), lr=0.5)
    policy = Policy(model, None, opt, _NoSchedule(), cpu, Precision.of("off", cpu), settings)
    old = old_logprobs_of(policy, tokens, rollout, cfg.trainer)
    batch = UpdateBatch(tokens, obj.advantages(rewards, groups), rewards, groups, old)
    metrics, _ = update(policy, obj, batch, cfg.trainer, torch.Generator().manual_seed(7))
    return metrics, opt.grads


def test_etr_loss_gradient_and_metrics_do_not_depend_on_the_micro_batch_size(tiny_dir):
    # Issue 13, item 2: with one group per micro-batch (8), ETR's macro factor used to vanish
    # (nu_bar taken per micro-batch), and averaged metrics weighted micro-batches equally.
    ref_metrics, ref_grads = _etr_update(tiny_dir, 64)
    assert ref_metrics["policy/ratio_max"] != 1.0  # the second mini-batch is off-policy: clipping can act
    assert (
        ref_metrics["etr/nu_mean"] > 0
        and ref_metrics["etr/eps_high_pass_25-50"] != ref_metrics["etr/eps_high_pass_0-25"]
    )
    for micro in (8, 16):
        metrics, grads = _etr_update(tiny_dir, micro)
        assert set(metrics) == set(ref_metrics)
        for k, v in ref_metrics.items():
            assert metrics[k] == pytest.approx(v, rel=1e-9, abs=1e-12, nan_ok=True), (micro, k)
        for step_a, step_b in zip(grads, ref_grads, strict=True):
            for a, b in zip(step_a, step_b):
                torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_old_logprobs_are_recomputed_without_dropout(tiny_dir, tmp_path):
    # Issue 13, item 5: sampling runs in eval mode, so pi_old must too; in train mode a model
    # with dropout gives a dropout sample of pi_old. The model's own mode is restored after.
    from tether.model.loading import load_model
    from tether.rollout import SamplingParams, get_engine
    from tether.model.causal_lm import LogProbSettings, Precision, to_tokens
    from tether.trainer.step import old_logprobs_of
    from tether.trainer.update import Policy

    model, tok = load_model(str(tiny_dir), device="cpu")
    model.config.attention_dropout = 0.5
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    rollout = get_engine("hf", model=model.eval(), tokenizer=tok).generate(
        ["1+2=", "3+4="], n=2, params=SamplingParams(max_new_tokens=5), seed=0
    )
    tokens = to_tokens(rollout, tok.pad_token_id, torch.device("cpu"))
    cfg = _cfg(tiny_dir, "unused")
    model.train()
    settings, cpu = LogProbSettings.of(cfg.trainer, cfg.rollout), torch.device("cpu")
    policy = Policy(model, None, None, None, cpu, Precision.of("off", cpu), settings)
    a = old_logprobs_of(policy, tokens, rollout, cfg.trainer)
    b = old_logprobs_of(policy, tokens, rollout, cfg.trainer)
    assert model.training
    torch.testing.assert_close(a, b, rtol=0, atol=0)  # no dropout noise
    torch.testing.assert_close(a, rollout.sampler_logprobs * tokens.loss_mask, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "every, kl, before, after, window, want",
    [
        (3, 0.0, 0, 2, [], False),  # 2 optimiser steps: no multiple of 3 reached
        (3, 0.0, 2, 4, [], True),  # 3 reached inside this rollout step: refreshed at its end
        (3, 0.0, 4, 6, [], True),  # 6 reached exactly
        (2, 0.0, 2, 3, [], False),
        (0, 0.1, 0, 2, [0.05, 0.05, 0.05, 0.3], True),  # mean of (0.05, 0.05, 0.05, 0.3, 0.1) = 0.11 > 0.1
        (0, 0.1, 0, 2, [0.05, 0.05, 0.05, 0.05], False),  # mean 0.06
    ],
)
def test_reference_refresh_is_checked_once_per_rollout_step(every, kl, before, after, window, want):
    from types import SimpleNamespace

    from tether.trainer.progress import Counters
    from tether.trainer.step import Reference, refresh_reference

    policy, reference = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    t = SimpleNamespace(ref_update_every=every, ref_update_kl=kl, ref_update_mix=1.0)  # the hard copy
    counters = Counters(opt_steps=after, kl_window=list(window))  # `after - before` steps taken in this rollout step
    done = refresh_reference(Reference(reference), policy, t, counters, after - before, 0.1)
    assert done == want and counters.ref_updates == int(want)
    assert torch.equal(reference.weight, policy.weight) == want
    assert counters.kl_window == ([] if want else (window + [0.1] if kl else window)[-5:])


# ---------------------------------------------------------------- devices and precision (issue 14, item 3)


def test_auto_device_keeps_a_small_model_on_the_cpu_and_says_why(monkeypatch):
    from tether.model.devices import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    device, why = pick_device("auto", 4_200_000, 20_000_000)
    assert device.type == "cpu" and "4.2M parameters" in why and "trainer.device=cuda" in why
    assert pick_device("auto", 500_000_000, 20_000_000) == (torch.device("cuda"), "")
    assert pick_device("auto", 4_200_000, 0) == (torch.device("cuda"), "")  # 0: always the GPU
    assert pick_device("cpu", 500_000_000, 20_000_000) == (torch.device("cpu"), "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device("auto", 500_000_000, 20_000_000) == (torch.device("cpu"), "")
    with pytest.raises(ConfigError, match="trainer.device=cpu"):  # a config error (CLI: exit 2), not a crash
        pick_device("cuda", 1, 0)


def test_one_update_per_batch_skips_the_old_logprob_pass_exactly(tiny_dir):
    # ppo_epochs x mini_batches = 1: pi_old is the policy being differentiated, so the recompute
    # pass is skipped; the gradient is the one a recomputed pi_old gives (float64, no dropout).
    from tether import objectives
    from tether.model.loading import load_model
    from tether.rollout import SamplingParams, get_engine
    from tether.model.causal_lm import batched_logprobs, LogProbSettings, Precision, to_tokens, Tokens
    from tether.trainer.step import old_logprobs_of
    from tether.trainer.update import Policy, UpdateBatch, update

    model, tok = load_model(str(tiny_dir), device="cpu")
    model = model.double()
    cfg = _cfg(tiny_dir, "unused", "objective=dapo", "trainer.mini_batches=1", "trainer.max_grad_norm=0")
    rollout = get_engine("hf", model=model, tokenizer=tok).generate(
        ["1+2=", "3+4="], n=4, params=SamplingParams(max_new_tokens=6), seed=0
    )
    tokens = to_tokens(rollout, tok.pad_token_id, torch.device("cpu"))
    tokens = Tokens(
        tokens.input_ids,
        tokens.attention_mask,
        tokens.position_ids,
        tokens.completion_ids,
        tokens.loss_mask.double(),
        tokens.prompt_len,
    )
    settings, cpu = LogProbSettings.of(cfg.trainer, cfg.rollout), torch.device("cpu")
    assert (
        old_logprobs_of(
            Policy(model, None, None, None, cpu, Precision.of("off", cpu), settings), tokens, rollout, cfg.trainer
        )
        is None
    )
    recomputed = batched_logprobs(model, tokens, LogProbSettings(temperature=1.0, micro_batch_size=64))
    obj = objectives.build(cfg.objective)
    groups, rewards = torch.tensor(rollout.prompt_index), torch.tensor([1.0, 0, 1, 0, 0, 0, 1, 1], dtype=torch.float64)
    grads = []
    for old in (None, recomputed):
        opt = _RecordingSGD(model.parameters(), lr=0.0)
        policy = Policy(model, None, opt, _NoSchedule(), cpu, Precision.of("off", cpu), settings)
        batch = UpdateBatch(tokens, obj.advantages(rewards, groups), rewards, groups, old)
        m, _ = update(policy, obj, batch, cfg.trainer, torch.Generator().manual_seed(0))
        assert m["policy/ratio_max"] == pytest.approx(1.0, abs=1e-12)
        grads.append(opt.grads[0])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)


def test_bf16_autocast_trains_on_fp32_master_weights(tiny_dir, tmp_path):
    # trainer.autocast=bf16 (auto's choice on CUDA) on the CPU: forward passes in bfloat16, float32
    # weights and optimiser state, finite metrics, and the weights move.
    run = train(
        _cfg(
            tiny_dir,
            tmp_path / "run",
            "trainer.total_steps=2",
            "objective=dapo",
            "trainer.autocast=bf16",
            "trainer.plots=false",
        ),
        log=lambda *_: None,
    )
    rows = _rows(run)
    assert all(math.isfinite(r[k]) for r in rows[1:] for k in ("loss/total", "policy/entropy", "optim/grad_norm"))
    after = load_file(str(run / "checkpoints" / "step_000002" / "model" / "model.safetensors"))
    assert all(v.dtype == torch.float32 for v in after.values())
    before = load_file(str(tiny_dir / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.gpu
def test_three_step_train_on_cuda_in_bf16(tiny_dir, tmp_path):
    run = train(
        _cfg(
            tiny_dir,
            tmp_path / "run",
            "trainer.total_steps=3",
            "objective=etr",
            "trainer.device=cuda",
            "trainer.plots=false",
        ),
        log=lambda *_: None,
    )
    rows = _rows(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(math.isfinite(r["loss/total"]) and math.isfinite(r["optim/grad_norm"]) for r in rows[1:])


def test_held_out_accuracy_is_the_task_verifiers_never_the_training_reward(tiny_dir):
    # Issue 15, item 4: one definition of accuracy. A shaped or weighted training reward is logged
    # as reward/*, and eval/accuracy (and the warm start) use the task's own 0/1 verifier.
    from tether.rewards import REWARDS, accuracy
    from tether.trainer.setup import build_task_and_reward

    task, reward, verifier = build_task_and_reward(
        _cfg(tiny_dir, "unused", "reward.weights={exact_match: 1.0, format: 0.5}")
    )
    assert verifier is REWARDS.get(task.reward) and reward is not verifier
    task, reward, verifier = build_task_and_reward(_cfg(tiny_dir, "unused", "reward.name=auto"))
    assert reward is verifier  # the task's own reward: one object
    with pytest.raises(ValueError, match="0/1 verifier"):
        from tether.rewards import RewardResult

        accuracy([RewardResult(1.5)], "a weighted reward")


def test_a_step_logs_where_its_time_went(tiny_dir, tmp_path):
    """time/step_s was the only timing: a user could not tell where a 100 s step went. Each phase is
    now logged: sampling, scoring, pi_old's and the reference's log-probs, the update; they are parts
    of the step (their sum is at most its time), the skipped passes read 0."""
    phases = ["time/sample_s", "time/score_s", "time/old_logprobs_s", "time/ref_logprobs_s", "time/update_s"]
    run = train(_cfg(tiny_dir, tmp_path / "r", "trainer.total_steps=1", "objective=dapo"), log=lambda *_: None)
    for row in _rows(run)[1:]:
        assert all(row[k] >= 0 for k in phases) and sum(row[k] for k in phases) <= row["time/step_s"]
        assert row["time/sample_s"] > 0 and row["time/update_s"] > 0 and row["time/old_logprobs_s"] > 0
        assert row["time/ref_logprobs_s"] == 0  # DAPO has no KL term: no reference pass


def test_held_out_evaluation_runs_in_batches_of_eval_batch_size(tiny_dir):
    """Held-out evaluation generated all data.eval_size problems in one call (8 GSM8K problems at 128
    tokens took 2 minutes on a loaded CPU, memory growing with eval_size): trainer.eval_batch_size
    problems per call now, with the accuracy and lengths of one call."""
    from tether.model.loading import load_model
    from tether.rewards import get_reward, greedy_accuracy
    from tether.rollout import get_engine
    from tether.tasks import get_task

    model, tok = load_model(tiny_dir)
    hf = get_engine("hf", model=model, tokenizer=tok)
    calls = []

    class Counting:
        def generate(self, prompts, n, params, seed=None):
            calls.append(len(prompts))
            return hf.generate(prompts, n, params, seed)

    examples = get_task("arithmetic").examples("test", 10)
    verifier = get_reward("exact_match")
    whole = greedy_accuracy(Counting(), examples, verifier, 6)
    batched = greedy_accuracy(Counting(), examples, verifier, 6, batch_size=4)
    assert calls == [10, 4, 4, 2] and batched == whole
    assert _cfg(tiny_dir, "unused").trainer.eval_batch_size == 64
