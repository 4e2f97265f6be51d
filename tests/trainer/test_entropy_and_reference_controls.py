"""Three trainer keys of issue 51, end to end on the tiny model and by hand:
- `trainer.ref_update_mix`: TR-DPO's soft reference update at each refresh, ref <- a policy + (1 - a) ref;
- `trainer.entropy_target` (with `entropy_coef_step/min/max`): Skywork-OR1's adaptive entropy coefficient, carried
  in `Counters` so that a resumed run is the uninterrupted one, bitwise;
- `objective.top_entropy_frac` in the trainer: the policy loss of the highest-entropy tokens only.
Each key off (its default) leaves a run as it was; each refused setting names the fix."""

import math

import pytest
import torch
from safetensors.torch import load_file

from tether.config.loading import load_config
from tether.schema import ConfigError
from tether.trainer.loop import train
from tether.trainer.progress import Counters
from tether.trainer.step import Reference, mix_into, refresh_reference

from conftest import metrics_rows as _rows, untimed
from conftest import train_config as _cfg

QUIET = dict(log=lambda *_: None)
CONTROL = ("policy/entropy_coef", "policy/entropy_coef_next", "policy/entropy_rollout")


def _linear(*w):
    m = torch.nn.Linear(len(w), 1, bias=False).double()
    with torch.no_grad():
        m.weight.copy_(torch.tensor([w], dtype=torch.float64))
    return m


# ---------------------------------------------------------------- the soft reference update, by hand


def test_a_soft_refresh_moves_the_reference_a_share_of_the_way_to_the_policy():
    # a = 0.25: ref = 0.25 x (3, 6) + 0.75 x (1, 2) = (0.75 + 0.75, 1.5 + 1.5) = (1.5, 3.0), exactly in float64.
    from types import SimpleNamespace

    ref, policy = _linear(1.0, 2.0), _linear(3.0, 6.0)
    t = SimpleNamespace(ref_update_every=1, ref_update_kl=0.0, ref_update_mix=0.25)
    counters = Counters(opt_steps=1)
    assert refresh_reference(Reference(ref), policy, t, counters, 1, None) and counters.ref_updates == 1
    assert ref.weight.tolist() == [[1.5, 3.0]] and policy.weight.tolist() == [[3.0, 6.0]]
    # Again: 0.25 x (3, 6) + 0.75 x (1.5, 3.0) = (1.875, 3.75).
    counters.opt_steps = 2
    refresh_reference(Reference(ref), policy, t, counters, 1, None)
    assert ref.weight.tolist() == [[1.875, 3.75]] and counters.ref_updates == 2


def test_a_shared_weight_is_mixed_once_and_an_integer_buffer_is_copied():
    class Tied(torch.nn.Module):
        def __init__(self, w, count):
            super().__init__()
            self.a = _linear(w)
            self.b = self.a  # two names, one tensor (tied embeddings)
            self.register_buffer("count", torch.tensor(count))

    ref, policy = Tied(2.0, 3), Tied(4.0, 7)
    mix_into(ref, policy, 0.5)
    assert ref.a.weight.item() == 3.0  # 0.5 x 4 + 0.5 x 2 once; mixing twice would give 3.5
    assert ref.count.item() == 7


def test_the_soft_update_is_trls_sync_ref_model_bitwise():
    # TRL's SyncRefModelCallback._sync_target_model (TR-DPO's update behind sync_ref_model, ref_model_mixup_alpha),
    # called, on two different 2-layer Llamas in float64: the same weights, bitwise.
    trl_callbacks = pytest.importorskip("trl.trainer.callbacks")
    from conftest import tiny_float64_lm

    policy = tiny_float64_lm(seed=1)
    ours, theirs = tiny_float64_lm(seed=0), tiny_float64_lm(seed=0)
    mix_into(ours, policy, 0.6)
    trl_callbacks.SyncRefModelCallback._sync_target_model(policy, theirs, 0.6)
    a, b = ours.state_dict(), theirs.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], policy.state_dict()["lm_head.weight"])


# ---------------------------------------------------------------- end to end on the tiny model


def _run(tiny_dir, path, *extra):
    return train(_cfg(tiny_dir, path, "trainer.total_steps=3", "trainer.plots=false", *extra), **QUIET)


def _reference(run, step):
    return load_file(str(run / "checkpoints" / f"step_{step:06d}" / "reference.safetensors"))


def _model(run, step):
    return load_file(str(run / "checkpoints" / f"step_{step:06d}" / "model" / "model.safetensors"))


def test_the_soft_refresh_end_to_end(tiny_dir, tmp_path):
    # GRPO carries a KL penalty (a reference); 2 optimiser steps per rollout step, so ref_update_every=2 refreshes
    # after every step. The step-3 checkpoint's reference is 0.5 x the step-3 policy + 0.5 x the step-2 reference,
    # bitwise (the same float32 operations); with a = 1 it is the policy itself.
    refresh = ["objective=grpo", "trainer.ref_update_every=2"]
    hard = _run(tiny_dir, tmp_path / "hard", *refresh)
    soft = _run(tiny_dir, tmp_path / "soft", *refresh, "trainer.ref_update_mix=0.5")
    ref2, ref3, model3 = _reference(soft, 2), _reference(soft, 3), _model(soft, 3)
    assert set(ref3) == set(model3)
    assert all(torch.equal(ref3[k], ref2[k].mul(0.5).add(model3[k], alpha=0.5)) for k in ref3)
    assert all(torch.equal(_reference(hard, 3)[k], _model(hard, 3)[k]) for k in ref3)
    a, b = _rows(hard), _rows(soft)
    assert untimed(a[1]) == untimed(b[1])  # the first refresh happens after step 1's update
    assert a[2]["kl/ref"] != b[2]["kl/ref"] and b[-1]["ref/updates"] == 3.0


def test_the_default_keys_change_nothing(tiny_dir, tmp_path):
    # The defaults spelled out (a hard copy, no adaptive control, every token) are the default run, and add no metric.
    refresh = ["objective=grpo", "trainer.ref_update_every=2"]
    plain = _rows(_run(tiny_dir, tmp_path / "plain", *refresh))
    spelled = ["trainer.ref_update_mix=1.0", "trainer.entropy_target=null", "objective.top_entropy_frac=null"]
    same = _rows(_run(tiny_dir, tmp_path / "same", *refresh, *spelled))
    assert [untimed(r) for r in plain] == [untimed(r) for r in same]
    assert not any(k in r for r in plain for k in (*CONTROL, "policy/top_entropy_kept_frac"))


def _check_the_rule(rows, target, step, low, high, c0=0.0):
    """Every row's control against the rule (tether.core.entropy), from the row's own estimated entropy."""
    c = c0
    for r in rows[1:]:
        e = r["policy/entropy_rollout"]
        assert r["policy/entropy_coef"] == (c if e <= target else 0.0)
        if r["optim/flat_skipped"] or r["optim/skipped_updates"] == 2:  # no optimiser step: c stays
            want = c
        else:
            want = min(max(c + step if e < target else c - step, low), high)
        assert r["policy/entropy_coef_next"] == want
        assert ("loss/entropy" in r) == (r["policy/entropy_coef"] != 0)
        c = want


LARGE_STEPS = ["trainer.entropy_coef_step=0.005", "trainer.entropy_coef_max=0.5"]  # for round numbers


def test_adaptive_entropy_below_the_target_grows_the_bonus_step_by_step(tiny_dir, tmp_path):
    # The tiny model's entropy is about 4.6 nats: under a target of 10, c rises by 0.005 a step from
    # objective.entropy_coef = 0.001 (c_0): the bonus of steps 1, 2, 3 is 0.001, 0.006, 0.011.
    run = _run(tiny_dir, tmp_path / "run", "trainer.entropy_target=10", "objective.entropy_coef=0.001", *LARGE_STEPS)
    rows = _rows(run)
    _check_the_rule(rows, 10.0, 0.005, 0.0, 0.5, c0=0.001)
    assert [r["policy/entropy_coef"] for r in rows[1:]] == pytest.approx([0.001, 0.006, 0.011], abs=1e-15)
    for r in rows[1:]:  # the estimate from the rollout's log-probs and the update's exact entropy agree roughly
        assert abs(r["policy/entropy_rollout"] - r["policy/entropy"]) < 0.3, r
    plain = _rows(_run(tiny_dir, tmp_path / "plain", "objective.entropy_coef=0.001"))
    assert untimed(plain[1]) == {k: v for k, v in untimed(rows[1]).items() if k not in CONTROL}  # alpha_1 = c_0
    assert plain[2]["loss/total"] != rows[2]["loss/total"]  # alpha_2 = 0.006, not 0.001


def test_adaptive_entropy_above_the_target_applies_no_bonus_and_trains_as_without_it(tiny_dir, tmp_path):
    # Under a target of 0.2 nats the tiny model (4.6) is always above: alpha = 0 every step, c falls from
    # 0.01 by 0.005 to the lower bound 0; the run is the run without any entropy bonus, bitwise.
    rows = _rows(
        _run(tiny_dir, tmp_path / "run", "trainer.entropy_target=0.2", "objective.entropy_coef=0.01", *LARGE_STEPS)
    )
    _check_the_rule(rows, 0.2, 0.005, 0.0, 0.5, c0=0.01)
    assert [r["policy/entropy_coef_next"] for r in rows[1:]] == pytest.approx([0.005, 0.0, 0.0], abs=1e-15)
    plain = _rows(_run(tiny_dir, tmp_path / "plain"))
    assert [untimed(r) for r in plain] == [{k: v for k, v in untimed(r).items() if k not in CONTROL} for r in rows]


def test_top_entropy_frac_trains_only_a_share_of_the_tokens(tiny_dir, tmp_path):
    rows = _rows(_run(tiny_dir, tmp_path / "run", "objective.top_entropy_frac=0.2"))
    plain = _rows(_run(tiny_dir, tmp_path / "plain"))
    # ceil(0.2 n) of each micro-batch's n tokens (ties kept): at least 20%, at most 20% plus one token a micro-batch
    assert all(0.2 <= r["policy/top_entropy_kept_frac"] < 0.35 for r in rows[1:]), rows
    assert untimed(rows[0]) == untimed(plain[0]) and rows[1]["loss/policy"] != plain[1]["loss/policy"]
    assert math.isfinite(rows[-1]["loss/total"])


def test_a_resumed_run_continues_the_coefficient_and_the_soft_reference_bitwise(tiny_dir, tmp_path):
    # 4 steps at once, against 2 steps, a torn step-3 line, and a resume to 4: the adaptive coefficient (in
    # Counters), the softly mixed reference (in the checkpoint) and the masked loss all continue exactly.
    keys = ["objective=grpo", "trainer.ref_update_every=2", "trainer.ref_update_mix=0.5"]
    keys += ["trainer.entropy_target=10", "objective.top_entropy_frac=0.5", "trainer.plots=false"]
    full = train(_cfg(tiny_dir, tmp_path / "full", "trainer.total_steps=4", *keys), **QUIET)
    part = train(_cfg(tiny_dir, tmp_path / "part", "trainer.total_steps=2", *keys), **QUIET)
    with (part / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "reward/mean": 0.5}\n{"step": 4, "rew')
    resumed = train(_cfg(tiny_dir, part, "trainer.total_steps=4", *keys), resume_dir=str(part), **QUIET)
    a, b = _rows(full), _rows(resumed)
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4]
    assert [untimed(r) for r in a] == [untimed(r) for r in b]
    assert b[3]["policy/entropy_coef"] == pytest.approx(2e-4, abs=1e-15)  # 2 x Delta; c_0 = 0 would restart at 0
    for load in (_model, _reference):
        wa, wb = load(full, 4), load(resumed, 4)
        assert all(torch.equal(wa[k], wb[k]) for k in wa)


# ---------------------------------------------------------------- refused settings


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["trainer.ref_update_mix=0"], r"ref_update_mix: got 0.*\(0, 1\]"),
        (["trainer.ref_update_mix=1.5", "trainer.ref_update_every=2"], r"ref_update_mix: got 1.5"),
        (["trainer.ref_update_mix=0.5"], "no refresh is set; set trainer.ref_update_every"),
        (["model.lora={r: 4}", "trainer.ref_update_mix=0.5"], "cannot be mixed.*set trainer.ref_update_mix=1.0"),
        (["trainer.entropy_target=0"], "entropy_target: got 0.*positive entropy"),
        (["trainer.entropy_target=-1"], "entropy_target: got -1"),
        (["trainer.entropy_coef_step=0"], "step > 0"),
        (["trainer.entropy_coef_min=0.2", "trainer.entropy_coef_max=0.1"], "0 <= min <= max"),
        (["trainer.entropy_target=0.2", "rollout.top_p=0.9"], "entropy_target.*set rollout.top_p=1"),
        (["trainer.entropy_target=0.2", "objective.entropy_coef=0.01"], r"entropy_coef=0.01.*\[0.0, 0.005\]"),
        (["objective.top_entropy_frac=0"], r"top_entropy_frac: got 0.*\(0, 1\]"),
    ],
)
def test_refused_settings_name_the_fix(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [*overrides, f"output_dir={tmp_path / 'run'}"])


def test_the_new_keys_cannot_change_on_resume(tiny_dir, tmp_path):
    run = _run(tiny_dir, tmp_path / "run", "trainer.entropy_target=10")
    with pytest.raises(ConfigError, match="trainer.entropy_target"):
        train(_cfg(tiny_dir, run, "trainer.total_steps=4", "trainer.entropy_target=5"), resume_dir=str(run), **QUIET)
