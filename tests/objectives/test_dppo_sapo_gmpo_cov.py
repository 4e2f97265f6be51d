"""DPPO, SAPO, GMPO, Clip-Cov, KL-Cov and the REINFORCE++ estimator (issue 18, item 1) compute the
objective and gradient they are meant to, on CPU in float64:

1. hand-computed values and gradients (arithmetic in the comments);
3. gradients: gradcheck, and each surrogate's gradient against the gradient it is meant to have
   (DPPO with a ratio measure = ATR-GRPO's divergence clip; on-policy SAPO/KL-Cov = the plain policy gradient);
4. invariants: the random Clip-Cov choice is a uniform k-subset of the candidates, seeded draws reproduce;
6. end to end: `tether train objective=NAME` runs two steps for each of these presets.
Exactness against verl 0.9.1 is in tests/integrations/test_verl_plugin.py (VERL_OWN).
"""

import json
import math
from pathlib import Path

import pytest
import torch

from tether import objectives
from tether.core import advantages as A
from tether.core import covariance as C
from tether.core import divergences as Dv
from tether.core import dppo as P
from tether.core import gmpo as Gm
from tether.core import sapo as S

from conftest import slow_after_first

D = torch.float64
NEW_PRESETS = ["dppo_tv", "dppo_kl", "sapo", "gmpo", "clip_cov", "kl_cov", "reinforce_pp"]


def _run(spec, lp, old, adv, mask=None):
    lp = lp.clone().requires_grad_()
    mask = torch.ones_like(lp, dtype=torch.bool) if mask is None else mask
    out = objectives.build(spec)(objectives.TokenBatch(logprobs=lp, old_logprobs=old, advantages=adv, loss_mask=mask))
    out.loss.backward()
    return out, lp.grad


def _t(*rows):
    return torch.tensor(rows, dtype=D)


# ---------------------------------------------------------------- 1. hand-computed


@pytest.mark.parametrize("measure,delta", [("binary_tv", 0.15), ("binary_kl", 0.05), ("binary_kl_max", 0.05)])
def test_dppo_hand_computed(measure, delta):
    # One sequence, A = (+1, +1, -1), p_old = (0.5, 0.1, 0.5), p = (0.7, 0.2, 0.3), token-mean over 3.
    #   binary_tv: |p - p_old| = 0.2, 0.1, 0.2: token 1 (A > 0, moved up 0.2 > 0.15) and token 3 (A < 0, moved
    #   down 0.2) leave the region; token 2 stays.  binary_kl: KL(Ber(.5)||Ber(.7)) = .5 ln(.5/.7) + .5 ln(.5/.3)
    #   = 0.08718 > 0.05 (token 3 the same by symmetry); KL(Ber(.1)||Ber(.2)) = .1 ln .5 + .9 ln(.9/.8) = 0.03669.
    #   binary_kl_max (KPop's, both ways): token 2's reverse KL(Ber(.2)||Ber(.1)) = .2 ln 2 + .8 ln(.8/.9) = 0.04440,
    #   max 0.04440 <= 0.05: the same decisions (tokens 1 and 3 are out at 0.08718 either way).
    # Token 2: w = 2, l = -A w ln 0.2 = 3.21888; loss = 3.21888 / 3 = 1.07296; d loss / d lp_2 = -A w / 3 = -2/3.
    p_old, p = _t([0.5, 0.1, 0.5]), _t([0.7, 0.2, 0.3])
    adv = _t([1.0, 1.0, -1.0])
    spec = {"name": "dppo", "measure": measure, "delta_low": delta, "delta_high": delta, "truncation_c": None}
    out, g = _run(spec, p.log(), p_old.log(), adv)
    assert out.loss.item() == pytest.approx(-2 * math.log(0.2) / 3, rel=1e-12)
    torch.testing.assert_close(g, _t([0.0, -2 / 3, 0.0]), rtol=0, atol=1e-15)
    assert out.metrics["policy/clipfrac_high"].item() == pytest.approx(1 / 3)
    assert out.metrics["policy/clipfrac_low"].item() == pytest.approx(1 / 3)
    # TIS cap c = 1.5 < w = 2: weight 1.5, loss -1.5 ln 0.2 / 3 = 0.80472, gradient -0.5.
    out, g = _run({**spec, "truncation_c": 1.5}, p.log(), p_old.log(), adv)
    assert out.loss.item() == pytest.approx(-1.5 * math.log(0.2) / 3, rel=1e-12)
    torch.testing.assert_close(g, _t([0.0, -0.5, 0.0]), rtol=0, atol=1e-15)
    assert out.metrics["dppo/truncfrac"].item() == pytest.approx(1 / 3)


def test_dppo_default_has_no_cap_and_verls_default_cap_is_3():
    # Issue 22, item 5: one token, p_old = e^-5 = 0.00674, w = e^2 (p = e^-3 = 0.0498, |p - p_old| = 0.0431 < 0.15:
    # valid), A = 1. No cap (tether's default, the authors'): d loss / d lp = -A w = -e^2 = -7.389. verl's default
    # clip_ratio_c = 3.0: -A min(w, 3) = -3.
    obj = objectives.build("dppo")
    assert obj.config.truncation_c is None
    assert all(objectives.build(p).config.truncation_c is None for p in ("dppo_tv", "dppo_kl"))
    old, lp = _t([-5.0]), _t([-3.0])
    _, g = _run({"name": "dppo"}, lp, old, _t([1.0]))
    torch.testing.assert_close(g, _t([-math.exp(2.0)]), rtol=1e-15, atol=0)
    out, g = _run({"name": "dppo", "truncation_c": 3.0}, lp, old, _t([1.0]))
    torch.testing.assert_close(g, _t([-3.0]), rtol=1e-15, atol=0)
    assert out.metrics["dppo/truncfrac"].item() == 1.0


def test_sapo_hand_computed():
    # Tokens: (A = +1, w = 1.5, tau 1), (A = -1, w = 0.5, tau 1.05); seq-mean-token-mean over one sequence.
    #   f = (4 / tau) sigmoid(tau (w - 1)): sigmoid(0.5) = 0.6224593 -> f1 = 2.4898373;
    #   sigmoid(-0.525) = 0.3716838 -> f2 = 1.4159383.  loss = (-f1 + f2) / 2 = -0.5369495.
    #   d l / d lp = -A 4 s (1 - s) w:  token 1: -4 (.6224593)(.3775407)(1.5) = -1.4100223;
    #   token 2: +4 (.3716838)(.6283162)(0.5) = 0.4670699; each / 2.
    lp_old = _t([-1.0, -1.0])
    lp = lp_old + _t([math.log(1.5), math.log(0.5)])
    out, g = _run("sapo", lp, lp_old, _t([1.0, -1.0]))
    s1, s2 = 1 / (1 + math.exp(-0.5)), 1 / (1 + math.exp(0.525))
    assert out.loss.item() == pytest.approx((-4 * s1 + 4 / 1.05 * s2) / 2, rel=1e-12)
    assert (-4 * s1 + 4 / 1.05 * s2) / 2 == pytest.approx(-0.5369495, abs=1e-7)
    torch.testing.assert_close(g, _t([-4 * s1 * (1 - s1) * 1.5, 4 * s2 * (1 - s2) * 0.5]) / 2, rtol=1e-12, atol=0)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_gmpo_hand_computed(sign):
    # One sequence, log w = (0.5, -0.1), eps 0.4 / 0.4.
    #   A = +1: token 1 is clipped to 0.4 (no gradient), token 2 keeps -0.1; mean 0.15; loss = -e^0.15 = -1.1618342;
    #           d loss / d lp = (0, -e^0.15 / 2) = (0, -0.5809171).
    #   A = -1: the clip binds only below: log w stays (0.5, -0.1); mean 0.2; loss = e^0.2 = 1.2214028;
    #           d loss / d lp = (e^0.2 / 2, e^0.2 / 2) = 0.6107014 each.
    lp_old = _t([-1.0, -2.0])
    lp = lp_old + _t([0.5, -0.1])
    out, g = _run("gmpo", lp, lp_old, _t(sign))
    if sign > 0:
        assert out.loss.item() == pytest.approx(-math.exp(0.15), rel=1e-12)
        torch.testing.assert_close(g, _t([0.0, -math.exp(0.15) / 2]), rtol=1e-12, atol=0)
        assert out.metrics["policy/clipfrac_high"].item() == 0.5
    else:
        assert out.loss.item() == pytest.approx(math.exp(0.2), rel=1e-12)
        torch.testing.assert_close(g, _t([math.exp(0.2) / 2] * 2), rtol=1e-12, atol=0)


def _cov_case():
    # N = 2, T = 2, A = (+1, -1) per sequence: A - mean A = (1, 1, -1, -1).
    # lp = (-0.4, -3.5, -3.5, -0.5): mean -1.975, lp - mean = (1.575, -1.525, -1.525, 1.475)
    #   cov = (1.575, -1.525, 1.525, -1.475).  log w = (0.2, 0, -0.3, 0.1).
    lp = _t([-0.4, -3.5], [-3.5, -0.5])
    log_w = _t([0.2, 0.0], [-0.3, 0.1])
    return lp, lp - log_w, _t(1.0, -1.0)


def test_kl_cov_hand_computed():
    # k = max(floor(0.25 * 4), 1) = 1: the top covariance token is (0, 0) (1.575).
    # l = -A w (+ |log w| there): (0,0) -e^0.2 + 0.2 = -1.0214028; (0,1) -1; (1,0) e^-0.3 = 0.7408182;
    # (1,1) e^0.1 = 1.1051709. token-mean = -0.1754137 / 4 = -0.0438534.
    # d/d lp (0,0) = (-e^0.2 + 1) / 4 = -0.0553507; others -A w / 4.
    lp, old, adv = _cov_case()
    out, g = _run({"name": "kl_cov", "select_frac": 0.25, "kl_coef": 1.0}, lp, old, adv)
    expected = (-math.exp(0.2) + 0.2 - 1 + math.exp(-0.3) + math.exp(0.1)) / 4
    assert expected == pytest.approx(-0.0438534, abs=1e-7)
    assert out.loss.item() == pytest.approx(expected, rel=1e-12)
    torch.testing.assert_close(
        g, _t([-math.exp(0.2) + 1, -1.0], [math.exp(-0.3), math.exp(0.1)]) / 4, rtol=1e-12, atol=0
    )
    assert out.metrics["cov/selected_frac"].item() == 0.25


def test_clip_cov_hand_computed():
    # Covariances as in _cov_case, eps 0.2 / 0.28: ratios e^0.2 = 1.221 (A > 0, not above 1.28), 1, e^-0.3 = 0.741
    # (A < 0, below 0.8: clipped, no candidate), e^0.1. Candidates cov in (1, 5): (0, 0) only (1.575; (1, 0) has
    # 1.525 but is clipped). k = max(floor(0.5 * 4), 1) = 2 >= 1 candidate: (0, 0) loses its gradient.
    # token-mean loss = (0 - 1 + 0.8 + e^0.1) / 4 with (1, 0) clipped at 0.8: (-1 + 0.8 + 1.1051709) / 4 = 0.2262927.
    lp, old, adv = _cov_case()
    out, g = _run({"name": "clip_cov", "eps_low": 0.2, "eps_high": 0.28, "select_frac": 0.5}, lp, old, adv)
    assert out.loss.item() == pytest.approx((-1 + 0.8 + math.exp(0.1)) / 4, rel=1e-12)
    torch.testing.assert_close(g, _t([0.0, -1.0], [0.0, math.exp(0.1)]) / 4, rtol=1e-12, atol=0)
    assert out.metrics["cov/selected_frac"].item() == 0.25 and out.metrics["policy/clipfrac_low"].item() == 0.25


def test_reinforce_pp_hand_computed():
    # R = (1, 0 | 0, 0), groups of 2: a = R - mean_g = (0.5, -0.5, 0, 0); batch mean 0;
    # Bessel variance (0.25 + 0.25) / 3 = 1/6; A = a / sqrt(1/6 + 1e-8) = (1.2247449, -1.2247449, 0, 0).
    r, g = _t(1.0, 0.0, 0.0, 0.0), torch.tensor([0, 0, 1, 1])
    s = 1 / math.sqrt(1 / 6 + 1e-8)
    torch.testing.assert_close(
        A.compute_advantages("reinforce_pp", r, g), _t(0.5 * s, -0.5 * s, 0, 0), rtol=1e-14, atol=0
    )
    # Weights (2, 1, 1, 1) (token counts): mean (2 * 0.5 - 0.5) / 5 = 0.1;
    # var = (2 * 0.4^2 + 0.6^2 + 2 * 0.1^2) / 5 * 5/4 = 0.7 / 4 = 0.175; the flat group stays exactly 0.
    s = 1 / math.sqrt(0.175 + 1e-8)
    adv = A.compute_advantages("reinforce_pp", r, g, weights=_t(2.0, 1.0, 1.0, 1.0))
    torch.testing.assert_close(adv, _t(0.4 * s, -0.6 * s, 0, 0), rtol=1e-13, atol=0)
    # Other estimators ignore weights.
    torch.testing.assert_close(A.compute_advantages("grpo", r, g, weights=_t(2.0, 1.0, 1.0, 1.0)), A.grpo(r, g))


# ---------------------------------------------------------------- 3. gradients


def _random(N=6, T=5, seed=0, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(N, T, generator=g, dtype=D) * 2 - 0.05
    lp = old + spread * torch.randn(N, T, generator=g, dtype=D)
    return lp, old, torch.randn(N, generator=g, dtype=D)


@pytest.mark.parametrize("measure", ["kl3", "chi2", "hellinger", "ratio", "user"])
def test_dppo_with_a_ratio_measure_has_the_divergence_clips_gradient(measure):
    # Same tokens dropped as ATR-GRPO's clip with that measure ([ATR] Thm 4.1) and, without a TIS cap, the same
    # gradient -A w grad lp elsewhere: DPPO with a ratio measure is the divergence clip up to its loss value.
    m = (lambda w: (w - 1.0) ** 2 / (1.0 + w)) if measure == "user" else measure
    lp, old, adv = _random()
    for dl, dh in ((0.02, 0.02), (0.0231, 0.05)):
        _, g_dppo = _run(
            {"name": "dppo", "measure": m, "delta_low": dl, "delta_high": dh, "truncation_c": None}, lp, old, adv
        )
        lo, hi = Dv.interval(m, dl)[0], Dv.interval(m, dh)[1]
        ratio = torch.exp(lp - old)
        _, g_ppo = _run({"name": "ppo_clip", "eps_low": 1 - lo, "eps_high": hi - 1}, lp, old, adv)
        assert ((ratio > hi) | (ratio < lo)).any()  # the region binds somewhere
        torch.testing.assert_close(g_dppo, g_ppo, rtol=1e-12, atol=1e-15)
        if dl == dh:
            _, g_div = _run({"name": "divergence_clip", "measure": m, "delta": dl}, lp, old, adv)
            torch.testing.assert_close(g_dppo, g_div, rtol=1e-12, atol=1e-15)


def test_binary_tv_is_a_per_token_ratio_interval():
    # |p - p_old| <= delta  <=>  w in [1 - delta / p_old, 1 + delta / p_old]: wide for rare tokens.
    lp, old, adv = _random(N=40, T=8, seed=1, spread=1.0)
    valid = P.binary_valid("binary_tv", lp, old, adv, 0.1, 0.1)
    w, p_old = torch.exp(lp - old), torch.exp(old)
    a = adv[:, None].expand_as(w)
    expected = torch.where(a > 0, w <= 1 + 0.1 / p_old, w >= 1 - 0.1 / p_old)
    near = ((w - 1).abs() * p_old - 0.1).abs() < 1e-12  # boundary ties, none expected
    assert not near.any() and valid.any() and (~valid).any()
    assert torch.equal(valid, expected)


def test_gmpo_and_sapo_gradcheck():
    lp, old, adv = _random(N=3, T=4, seed=2, spread=0.2)
    mask = torch.ones_like(lp)
    # Away from the clip boundaries (gradcheck needs a smooth neighbourhood).
    assert ((lp - old).abs() - 0.3).abs().min() > 1e-4
    torch.autograd.gradcheck(lambda x: Gm.gmpo(x, old, adv, mask, 0.3, 0.3)[0].loss, (lp.clone().requires_grad_(),))
    torch.autograd.gradcheck(lambda x: S.sapo(x, old, adv, 1.0, 1.05)[0].loss, (lp.clone().requires_grad_(),))


def test_on_policy_sapo_kl_cov_and_dppo_are_the_policy_gradient():
    # At w = 1: SAPO's gate slope is 1, |log w| has zero gradient, every token is inside DPPO's region;
    # all three give reinforce's gradient -A grad lp (aggregated alike).
    _, old, adv = _random(seed=3)
    _, g_pg = _run({"name": "reinforce", "aggregation": "seq-mean-token-mean"}, old, old, adv)
    for spec in (
        {"name": "sapo"},
        {"name": "kl_cov", "select_frac": 0.5, "aggregation": "seq-mean-token-mean"},
        {"preset": "dppo_tv", "aggregation": "seq-mean-token-mean"},
    ):
        _, g = _run(spec, old, old, adv)
        torch.testing.assert_close(g, g_pg, rtol=1e-12, atol=1e-15)


def test_gmpo_on_policy_is_grpo_with_sequence_means():
    # w = 1: d/d lp of -A exp(mean_t log w) = -A / |o| per token: the seq-mean-token-mean policy gradient.
    _, old, adv = _random(seed=4)
    _, g = _run("gmpo", old, old, adv)
    _, g_pg = _run({"name": "reinforce", "aggregation": "seq-mean-token-mean"}, old, old, adv)
    torch.testing.assert_close(g, g_pg, rtol=1e-12, atol=1e-15)


# ---------------------------------------------------------------- 4. the random choice


def test_clip_cov_random_choice_is_a_uniform_k_subset_and_seeded():
    # Three copies of _cov_case's batch, on-policy (nothing clipped): the batch means are unchanged, so the
    # candidates (cov in (1, 5)) are the 3 copies of (0, 0) and of (1, 0); k = max(floor(12 / 6), 1) = 2.
    lp, _, adv = _cov_case()
    lp, adv = torch.cat([lp] * 3), torch.cat([adv] * 3)
    old = lp.clone()
    mask = torch.ones_like(lp, dtype=torch.bool)
    counts = torch.zeros_like(lp)
    draws = 3000
    gen = torch.Generator().manual_seed(0)
    for _ in range(draws):
        out = C.clip_cov(lp, old, adv, mask, select_frac=1 / 6, cov_lb=1.0, generator=gen)
        assert out.selected.sum() == 2 and not (out.selected & ~out.candidates).any()
        counts += out.selected
    assert int(out.candidates.sum()) == 6
    share = counts[out.candidates] / draws  # each candidate: 2/6 in expectation, sd sqrt(p(1-p)/n) = 0.0086
    assert (share - 1 / 3).abs().max() < 0.04
    a = C.clip_cov(lp, old, adv, mask, select_frac=1 / 6, generator=torch.Generator().manual_seed(7)).selected
    b = C.clip_cov(lp, old, adv, mask, select_frac=1 / 6, generator=torch.Generator().manual_seed(7)).selected
    assert torch.equal(a, b)


def test_config_errors_name_the_fix():
    from tether.schema import ConfigError

    with pytest.raises(ConfigError, match="Did you mean 'binary_kl'"):
        objectives.build({"name": "dppo", "measure": "binary_k"})
    with pytest.raises(ConfigError, match="tau_neg"):
        objectives.build({"name": "sapo", "tau_neg": 0})
    with pytest.raises(ConfigError, match="select_frac"):
        objectives.build({"name": "kl_cov", "select_frac": 0})
    with pytest.raises(ConfigError, match="cov_ub"):
        objectives.build({"name": "clip_cov", "cov_lb": 5.0, "cov_ub": 1.0})
    assert all(objectives.build(p).has_trust_region() for p in NEW_PRESETS)
    assert not objectives.build("reinforce").has_trust_region()
    assert not objectives.build({"preset": "rpg_urkl", "clip": "none"}).has_trust_region()


# ---------------------------------------------------------------- 6. end to end


@pytest.mark.parametrize("preset", slow_after_first(NEW_PRESETS))
def test_train_runs_two_steps(tiny_dir, tmp_path, preset):
    from conftest import train_config as _cfg

    from tether.trainer.loop import train

    run = train(_cfg(tiny_dir, tmp_path / "run", "trainer.total_steps=2", f"objective={preset}"), log=lambda *_: None)
    rows = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(math.isfinite(r["loss/total"]) and math.isfinite(r["optim/grad_norm"]) for r in rows[1:])
    key = {
        "dppo_tv": "dppo/truncfrac",
        "dppo_kl": "dppo/truncfrac",
        "sapo": "sapo/gate_slope_mean",
        "gmpo": "gmpo/seq_ratio_mean",
        "clip_cov": "cov/selected_frac",
        "kl_cov": "cov/kl_abs_mean",
    }.get(preset)
    if key:
        assert all(key in r for r in rows[1:]), key
