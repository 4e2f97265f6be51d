"""Train-inference mismatch correction (issue 18, item 2): weights pi_old / pi_sampler, truncated or
masked, per token or per sequence; the identity when the two agree; hand-computed cases; in
tether's trainer with a bf16 decode; in the TRL adapter with sampler log-probs injected."""

import math

import pytest
import torch

from tether import objectives
from tether.core.correction import rollout_correction
from tether.divergences import interval

D = torch.float64


def _batch(seed=0, N=6, T=5):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(N, T, generator=g, dtype=D) - 0.1
    lp = (old + 0.3 * torch.randn(N, T, generator=g, dtype=D)).requires_grad_()
    mask = torch.ones(N, T, dtype=D)
    mask[0, 3:] = 0
    adv = torch.randn(N, generator=g, dtype=D)
    return lp, old, adv, mask


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("preset", ["dapo", "rpg_urkl", "atr_grpo", "sapo"])
def test_equal_logprobs_make_the_correction_the_identity(level, mode, preset):
    lp, old, adv, mask = _batch()
    plain = objectives.build(preset)
    corrected = objectives.build({"preset": preset, "rollout_correction": {"level": level, "mode": mode}})
    out_a = plain(objectives.TokenBatch(lp, old, adv, mask))
    (g_a,) = torch.autograd.grad(out_a.loss, lp)
    out_b = corrected(objectives.TokenBatch(lp, old, adv, mask, sampler_logprobs=old.clone()))
    (g_b,) = torch.autograd.grad(out_b.loss, lp)
    torch.testing.assert_close(out_b.loss, out_a.loss, rtol=0, atol=0)
    torch.testing.assert_close(g_b, g_a, rtol=0, atol=0)
    assert out_b.metrics["rollout_correction/mismatch_k3"] == 0 and out_b.metrics["rollout_correction/weight_mean"] == 1


def test_hand_computed_weights():
    # Token level: log r = old - sampler = (0.5, -0.1, 1.0); r = (e^0.5, e^-0.1, e^1) = (1.649, 0.905, 2.718).
    old = torch.tensor([[-1.0, -1.0, -1.0]], dtype=D)
    sampler = torch.tensor([[-1.5, -0.9, -2.0]], dtype=D)
    mask = torch.ones(1, 3, dtype=torch.bool)
    c = rollout_correction(old, sampler, mask, "token", "truncate", 0.0, 2.0)
    torch.testing.assert_close(c.weights, torch.tensor([[math.exp(0.5), math.exp(-0.1), 2.0]], dtype=D))
    assert c.truncated.tolist() == [[False, False, True]] and not c.masked.any()
    c = rollout_correction(old, sampler, mask, "token", "mask", 0.95, 2.0)  # 0.905 < 0.95 and 2.718 > 2: out
    torch.testing.assert_close(c.weights, torch.tensor([[math.exp(0.5), 0.0, 0.0]], dtype=D))
    assert c.masked.tolist() == [[False, True, True]]
    # Sequence level: the geometric mean, exp(mean(0.5, -0.1, 1.0)) = exp(0.4667), on every token.
    c = rollout_correction(old, sampler, mask, "sequence", "truncate", 0.0, 2.0)
    torch.testing.assert_close(c.weights, torch.full((1, 3), math.exp(1.4 / 3), dtype=D))
    # Padding: no weight, not counted; a NaN sampler log-prob (not reported) means no correction.
    pad = torch.tensor([[True, True, False]])
    sampler_nan = torch.tensor([[-1.5, float("nan"), -2.0]], dtype=D)
    c = rollout_correction(old, sampler_nan, pad, "token", "truncate", 0.0, 2.0)
    torch.testing.assert_close(c.weights, torch.tensor([[math.exp(0.5), 1.0, 0.0]], dtype=D))


def test_bounds_from_a_divergence_measure_and_the_loss_is_scaled_per_token():
    rc = objectives.RolloutCorrectionConfig(mode="mask", measure="kl3", delta=0.05)
    assert (rc.low, rc.high) == pytest.approx(interval("kl3", 0.05))  # a k3 rejection band
    # REINFORCE: l_t = -A lp_t; corrected l_t = -c_t A lp_t with c_t = r_t inside the band.
    obj = objectives.build({"name": "reinforce", "rollout_correction": {"mode": "truncate", "high": 1.2},
                            "aggregation": "seq-mean-token-sum"})
    lp = torch.tensor([[-1.0, -2.0]], dtype=D, requires_grad=True)
    sampler = torch.tensor([[-1.1, -2.5]], dtype=D)  # r = e^0.1 = 1.105, e^0.5 = 1.649 -> 1.2
    out = obj(objectives.TokenBatch(lp, lp.detach(), torch.tensor([2.0], dtype=D), torch.ones(1, 2, dtype=D),
                                    sampler_logprobs=sampler))
    out.loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-2.0 * math.exp(0.1), -2.0 * 1.2]], dtype=D))
    assert out.metrics["rollout_correction/truncated_frac"] == pytest.approx(0.5)
    # mismatch k1 = mean(sampler - old) = (-0.1 - 0.5) / 2; k3 = mean(r - 1 - log r).
    assert out.metrics["rollout_correction/mismatch_k1"].item() == pytest.approx(-0.3)
    k3 = ((math.exp(0.1) - 1 - 0.1) + (math.exp(0.5) - 1 - 0.5)) / 2
    assert out.metrics["rollout_correction/mismatch_k3"].item() == pytest.approx(k3)


def test_a_missing_sampler_logprob_names_the_fix():
    lp, old, adv, mask = _batch()
    obj = objectives.build({"preset": "dapo", "rollout_correction": {}})
    with pytest.raises(ValueError, match="sampler_logprobs.*rollout_correction"):
        obj(objectives.TokenBatch(lp, old, adv, mask))


def test_the_trainer_corrects_a_bf16_decode(tiny_dir, tmp_path):
    # bf16 autocast in the engine's decode and in the recompute differ (different batch shapes and
    # KV-cache paths): a real, small mismatch that the correction measures and weighs.
    import json

    from tether.config import load_config
    from tether.train import train

    from conftest import DIGIT_REWARD

    cfg = load_config(None, [
        f"model.name_or_path={tiny_dir}", f"output_dir={tmp_path / 'run'}", "warm_start.enabled=false",
        f"reward.name={DIGIT_REWARD}", "rollout.prompts_per_step=4", "rollout.group_size=4",
        "rollout.max_new_tokens=6", "trainer.total_steps=2", "data.eval_size=8", "trainer.progress=false",
        "trainer.plots=false", "trainer.autocast=bf16", "trainer.threads=1",
        "objective={preset: dapo, rollout_correction: {level: token, mode: truncate, high: 1.5}}",
    ])
    run = train(cfg, log=lambda *_: None)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][1:]
    for r in rows:
        assert r["rollout_correction/mismatch_k3"] > 0 and math.isfinite(r["loss/total"])
        assert 0 < r["rollout_correction/weight_mean"] <= 1.5
