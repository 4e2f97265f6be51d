"""VESPO, LUSPO and DRO (issue 30) compute the objective and gradient they are meant to, on CPU in float64:

1. hand-computed values and gradients (arithmetic in the comments);
2. exactness against the references: TRL 1.16's own `GRPOTrainer._compute_loss` for `vespo` (with its vLLM
   importance-sampling ratio folded in) and `luspo`, called on a stand-in trainer; the VESPO authors' verl recipe
   (transcribed below); verl 0.9.1's `dro` is in tests/integrations/test_verl_plugin.py (VERL_OWN);
3. gradients: on-policy VESPO is REINFORCE, gradcheck;
4. invariants and refusals: padding, masked rollout-correction tokens, configs that would undo the method;
6. end to end: `tether train` runs two steps of each (and of the sampler KL on dapo).
"""

import math

import pytest
import torch

from tether import objectives
from tether.core import dro as Dr
from tether.core import vespo as V
from tether.schema import ConfigError

from conftest import trl_compute_loss

D = torch.float64


def _t(*rows):
    return torch.tensor(rows, dtype=D)


def _run(spec, lp, old, adv, mask=None, **fields):
    lp = lp.clone().requires_grad_()
    mask = torch.ones_like(lp, dtype=torch.bool) if mask is None else mask
    out = objectives.build(spec)(
        objectives.TokenBatch(logprobs=lp, old_logprobs=old, advantages=adv, loss_mask=mask, **fields)
    )
    out.loss.backward()
    return out, lp.grad


def _data(N=6, T=5, seed=0, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    lengths[0] = T
    mask = torch.arange(T)[None, :] < lengths[:, None]
    old = -torch.rand(N, T, generator=g, dtype=D) - 0.1
    lp = old + scale * torch.randn(N, T, generator=g, dtype=D)
    sampler = old + 0.4 * torch.randn(N, T, generator=g, dtype=D)
    lp, old, sampler = (torch.where(mask, x, torch.zeros_like(x)) for x in (lp, old, sampler))
    adv = torch.randn(N, generator=g, dtype=D)
    adv[1] = 0.0  # A = 0 takes the A >= 0 branch
    return lp, old, sampler, adv, mask


# ---------------------------------------------------------------- 1. hand-computed


def test_vespo_hand_computed():
    # Sequence 1: log r = (0.1, 0.2), A = +1: log w = 0.3, w = e^0.3 = 1.3498588; (k, lambda) = (2, 3):
    #   log phi = 3 + 2 (0.3) - 3 (1.3498588) = -0.4495764, phi = 0.6378983 (below 1: w is past the peak k/lambda).
    # Sequence 2: log r = (-0.5, pad), A = -1: w = e^-0.5 = 0.6065307; (3, 2): log phi = 2 - 1.5 - 1.2130613
    #   = -0.7130613, phi = 0.4901414.
    # token-mean over 3 tokens: loss = sum -phi A lp / 3, d loss / d lp_t = -phi_i A_i / 3.
    old = _t([-1.0, -2.0], [-0.7, 0.0])
    lp = old + _t([0.1, 0.2], [-0.5, 0.0])
    mask = torch.tensor([[True, True], [True, False]])
    phi1 = math.exp(3 + 2 * 0.3 - 3 * math.exp(0.3))
    phi2 = math.exp(2 + 3 * -0.5 - 2 * math.exp(-0.5))
    assert phi1 == pytest.approx(0.6378983, abs=1e-7) and phi2 == pytest.approx(0.4901414, abs=1e-7)
    out, g = _run("vespo", lp, old, _t(1.0, -1.0), mask)
    loss = (-phi1 * (lp[0, 0] + lp[0, 1]) + phi2 * lp[1, 0]) / 3
    assert out.loss.item() == pytest.approx(loss.item(), rel=1e-13)
    torch.testing.assert_close(g, _t([-phi1 / 3, -phi1 / 3], [phi2 / 3, 0.0]), rtol=1e-13, atol=0)
    assert out.metrics["vespo/phi_mean"].item() == pytest.approx((phi1 + phi2) / 2, rel=1e-13)
    assert out.metrics["vespo/log_w_mean"].item() == pytest.approx((0.3 - 0.5) / 2, rel=1e-13)


def test_vespo_folds_the_rollout_correction_into_w():
    # One sequence, A = +1, on-policy (log r = 0), log(pi_old / pi_sampler) = (log 1.5, log 3).
    # TIS truncate at 2: rho = (1.5, 2), log w = log 3, phi = e^(3 + 2 log 3 - 9) = 9 e^-6 = 0.0223088;
    # the loss is NOT multiplied by rho: d loss / d lp_t = -phi / 2 on both tokens.
    old, lp = _t([-1.0, -2.0]), _t([-1.0, -2.0])
    sampler = old - _t([math.log(1.5), math.log(3.0)])
    spec = {"preset": "vespo", "rollout_correction": {"mode": "truncate", "high": 2.0}}
    out, g = _run(spec, lp, old, _t(1.0), sampler_logprobs=sampler)
    phi = 9 * math.exp(-6.0)
    torch.testing.assert_close(g, _t([-phi / 2, -phi / 2]), rtol=1e-12, atol=0)
    assert out.metrics["rollout_correction/truncated_frac"].item() == 0.5
    # MIS mask at [0.5, 2]: rho = (1.5, 0); log 0 is clamped to log 1e-8: log w = log 1.5 + log 1e-8 and the
    # token stays in the loss (VESPO's weight carries the mask): phi = e^(3 + 2 log w - 3 w) ~ 4.5e-15.
    spec = {"preset": "vespo", "rollout_correction": {"mode": "mask", "low": 0.5, "high": 2.0}}
    out, g = _run(spec, lp, old, _t(1.0), sampler_logprobs=sampler)
    w = 1.5e-8
    phi = math.exp(3 + 2 * math.log(w) - 3 * w)
    torch.testing.assert_close(g, _t([-phi / 2, -phi / 2]), rtol=1e-10, atol=0)
    assert out.metrics["rollout_correction/masked_frac"].item() == 0.5
    assert out.metrics["policy/ratio_mean"].item() == 1.0  # both tokens counted, not one


def test_luspo_hand_computed():
    # On-policy (s_i = 1, nothing clipped), A = (1, -0.5), lengths (1, 3): GSPO's sequence terms l_i = -A_i;
    # LUSPO: mean_i |y_i| l_i = (1 (-1) + 3 (0.5)) / 2 = 0.25. GSPO (seq-mean-token-mean): (-1 + 0.5) / 2 = -0.25.
    # Gradient: every token of sequence i gets -A_i s_i / 2 under LUSPO (its |y_i| cancels GSPO's 1/|y_i|).
    old = _t([-1.0, 0.0, 0.0], [-0.5, -0.6, -0.7])
    mask = torch.tensor([[True, False, False], [True, True, True]])
    adv = _t(1.0, -0.5)
    out, g = _run("luspo", old, old, adv, mask)
    assert out.loss.item() == pytest.approx(0.25, rel=1e-14)
    torch.testing.assert_close(g, _t([-0.5, 0, 0], [0.25, 0.25, 0.25]), rtol=1e-14, atol=0)
    gspo, g_gspo = _run("gspo", old, old, adv, mask)
    assert gspo.loss.item() == pytest.approx(-0.25, rel=1e-14)
    torch.testing.assert_close(g_gspo, _t([-0.5, 0, 0], [0.25 / 3, 0.25 / 3, 0.25 / 3]), rtol=1e-14, atol=0)


def test_dro_hand_computed():
    # beta = 0.1. Token 1: lp = -1, lp_old = -1.2, A = 0.5: log r = 0.2, l = -(0.5 (-1) - 0.05 (0.04)) = 0.502,
    # d l / d lp = -(A - beta log r) = -(0.5 - 0.02) = -0.48. Token 2: lp = -0.5, lp_old = -0.3, A = 0 (another
    # sequence): log r = -0.2, the penalty alone, l = 0.05 (0.04) = 0.002, d l / d lp = 0.1 (-0.2) = -0.02.
    # token-mean over 2 halves both gradients.
    lp, old = _t([-1.0], [-0.5]), _t([-1.2], [-0.3])
    out, g = _run({"name": "dro", "beta": 0.1}, lp, old, _t(0.5, 0.0))
    assert out.loss.item() == pytest.approx((0.502 + 0.002) / 2, rel=1e-13)
    torch.testing.assert_close(g, _t([-0.24], [-0.01]), rtol=1e-13, atol=0)
    # log r is not clamped (departure 3): at log r = 30 the penalty still pulls back with force beta 30 = 3.
    loss = Dr.dro(_t([29.0]).requires_grad_(), _t([-1.0]), _t(0.0), 0.1).loss
    loss.sum().backward()
    assert loss.item() == pytest.approx(45.0, rel=1e-14)


# ---------------------------------------------------------------- 2. against TRL 1.16 and the authors' recipe


def _trl_vllm_is_ratio(old, sampler, mask, mode, clip_min, clip_max):
    """TRL 1.16's importance_sampling_ratio for token_truncate / token_mask (GRPOTrainer._generate_and_score_
    completions, trl/trainer/grpo_trainer.py at v1.16.0): exp((old - sampler) m), clamped or masked to 0."""
    r = torch.exp(torch.nan_to_num((old - sampler) * mask, nan=0.0))
    if mode == "truncate":
        return torch.clamp(r, min=clip_min, max=clip_max)
    return r.masked_fill((r < clip_min) | (r > clip_max), 0.0)


@pytest.mark.parametrize("correction", [None, "truncate", "mask"])
def test_vespo_equals_trls_compute_loss(correction):
    pytest.importorskip("trl")
    lp, old, sampler, adv, mask = _data(seed=1)
    fields, spec, is_ratio = {}, {"preset": "vespo"}, None
    if correction is not None:
        low, high = (0.0, 1.5) if correction == "truncate" else (0.6, 1.5)
        is_ratio = _trl_vllm_is_ratio(old, sampler, mask, correction, low, high)
        spec["rollout_correction"] = {"mode": correction, "low": low, "high": high}
        fields["sampler_logprobs"] = sampler
        assert ((is_ratio == 0) & mask).any() == (correction == "mask")  # the case masks a token
    v_loss, v_grad, v_metrics = trl_compute_loss("vespo", lp, old, adv[:, None], mask, is_ratio=is_ratio)
    out, t_grad = _run(spec, lp, old, adv, mask, **fields)
    assert v_grad.abs().sum() > 1e-3  # a case that tests nothing is a defect
    torch.testing.assert_close(out.loss.detach(), v_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(t_grad, v_grad, rtol=1e-12, atol=1e-14)
    # TRL's vespo/phi_seq_mean is the mean of phi over sequences; tether's vespo/phi_mean the same.
    assert out.metrics["vespo/phi_mean"].item() == pytest.approx(v_metrics["vespo/phi_seq_mean"][0], rel=1e-12)


def _authors_vespo(old, lp, adv, mask, rollout_is_weights=None, k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0):
    """The VESPO authors' verl loss, transcribed independently (FloyedShen/VESPO, recipe/vespo/code/core_algos.py,
    `compute_policy_loss_vespo`, commit 3fd2c7fd05dd361974829daff6e083efee111b8a), with verl's token-mean agg_loss
    (no global batch info): the sum is clamped to [-20, 20] and then log max(w, 1e-8) is taken (departure 2)."""
    log_ratio = torch.clamp(lp - old, -20.0, 20.0)
    seq = (log_ratio * mask).sum(-1)
    if rollout_is_weights is not None:
        log_tis = torch.clamp(torch.log(rollout_is_weights.clamp(min=1e-8)), -20.0, 20.0)
        seq = seq + (log_tis * mask).sum(-1)
    w = torch.exp(torch.clamp(seq, -20.0, 20.0).detach())
    seq_adv = adv[:, 0]
    pos = (seq_adv >= 0).to(D)
    k = pos * k_pos + (1 - pos) * k_neg
    lam = torch.clamp(pos * lambda_pos + (1 - pos) * lambda_neg, min=1e-4)
    phi = torch.exp(lam + k * torch.log(w.clamp(min=1e-8)) - lam * w).detach()
    phi = torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)
    loss_mat = -phi[:, None] * adv * lp
    return (loss_mat * mask).sum() / mask.sum()


def test_vespo_equals_the_authors_verl_recipe_with_rollout_weights():
    lp, old, sampler, adv, mask = _data(seed=2)
    g = torch.Generator().manual_seed(5)
    rho = torch.where(mask, 0.5 + torch.rand(mask.shape, generator=g, dtype=D), torch.ones_like(lp))  # verl's weights
    adv_tok = adv[:, None] * mask
    for weights in (None, rho):
        lp_ref = lp.clone().requires_grad_()
        expected = _authors_vespo(old, lp_ref, adv_tok, mask, weights)
        expected.backward()
        out, t_grad = _run("vespo", lp, old, adv_tok, mask, rollout_weights=weights)
        torch.testing.assert_close(out.loss.detach(), expected.detach(), rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(t_grad, lp_ref.grad, rtol=1e-12, atol=1e-14)
    assert rho[mask].min() < 1 < rho[mask].max()


def test_luspo_equals_trls_compute_loss_at_the_sequence_level():
    pytest.importorskip("trl")
    lp, old, _, adv, mask = _data(seed=3, scale=0.01)  # ratios near 1, so GSPO's small clip acts on some
    eps = (3e-4, 4e-4)  # the preset's
    spec = "luspo"
    v_loss, v_grad, _ = trl_compute_loss("luspo", lp, old, adv[:, None], mask, level="sequence", eps=eps)
    out, t_grad = _run(spec, lp, old, adv, mask)
    assert v_grad.abs().sum() > 1e-3
    torch.testing.assert_close(out.loss.detach(), v_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(t_grad, v_grad, rtol=1e-12, atol=1e-14)
    clipped = out.metrics["policy/clipfrac_low"] + out.metrics["policy/clipfrac_high"]
    assert 0 < clipped < 1  # some sequences clipped, some not


# ---------------------------------------------------------------- 3. gradients


def test_on_policy_vespo_is_reinforce():
    # w = 1: phi = e^(lambda + 0 - lambda) = 1 whatever (k, lambda): the plain policy gradient -A grad lp.
    _, old, _, adv, mask = _data(seed=4)
    _, g = _run("vespo", old, old, adv, mask)
    _, g_pg = _run({"name": "reinforce", "aggregation": "token-mean"}, old, old, adv, mask)
    torch.testing.assert_close(g, g_pg, rtol=1e-14, atol=0)


def test_gradcheck():
    lp, old, _, adv, mask = _data(N=3, T=3, seed=5)
    for spec in ("dro", "luspo"):
        obj = objectives.build(spec)

        def f(x):
            return obj(objectives.TokenBatch(logprobs=x, old_logprobs=old, advantages=adv, loss_mask=mask)).loss

        assert torch.autograd.gradcheck(f, (lp.clone().requires_grad_(),))
    # VESPO's phi is detached: the loss is linear in lp, its gradient -phi A / n exactly.
    loss, phi, _ = V.vespo(lp.clone().requires_grad_(), old, adv, mask)
    assert not phi.requires_grad


# ---------------------------------------------------------------- 4. invariants and refusals


def test_padding_and_empty_rows_change_nothing():
    lp, old, sampler, adv, mask = _data(seed=6)
    garbage = torch.where(mask, lp, torch.full_like(lp, 50.0))
    extra = torch.zeros(1, lp.shape[1], dtype=torch.bool)
    for spec in ("vespo", "luspo", "dro"):
        base, g = _run(spec, lp, old, adv, mask)
        padded, g_padded = _run(
            spec,
            torch.cat([garbage, garbage[:1]]),
            torch.cat([old, old[:1] - 9.0]),
            torch.cat([adv, adv[:1]]),
            torch.cat([mask, extra]),
        )
        torch.testing.assert_close(padded.loss, base.loss, rtol=1e-14, atol=1e-15)
        torch.testing.assert_close(g_padded[:-1], torch.where(mask, g, torch.zeros_like(g)), rtol=1e-14, atol=0)
        assert g_padded[-1].abs().sum() == 0


def test_refusals_name_the_fix():
    with pytest.raises(ConfigError, match="seq-mean-token-mean.*plain GSPO"):
        objectives.build({"preset": "luspo", "aggregation": "seq-mean-token-mean"})
    with pytest.raises(ConfigError, match="rollout_correction.level.*token"):
        objectives.build({"preset": "vespo", "rollout_correction": {"level": "sequence"}})
    with pytest.raises(ConfigError, match="beta"):
        objectives.build({"name": "dro", "beta": 0.0})
    with pytest.raises(ConfigError, match="k_pos"):
        objectives.build({"name": "vespo", "k_pos": -1.0})
    lp, old, _, adv, mask = _data(seed=7)
    with pytest.raises(ValueError, match="does not fold"):
        _run("dapo", lp, old, adv, mask, rollout_weights=torch.ones_like(lp))
    with pytest.raises(ValueError, match="drop one"):
        _run(
            {"preset": "vespo", "rollout_correction": {"high": 2.0}},
            lp,
            old,
            adv,
            mask,
            sampler_logprobs=old,
            rollout_weights=torch.ones_like(lp),
        )


def test_presets_and_trust_regions():
    vespo, luspo, dro = (objectives.build(p) for p in ("vespo", "luspo", "dro"))
    assert (vespo.config.k_pos, vespo.config.lambda_pos, vespo.config.k_neg, vespo.config.lambda_neg) == (2, 3, 3, 2)
    assert (luspo.name, luspo.config.eps_low, luspo.config.eps_high, luspo.config.aggregation) == (
        "luspo",
        3e-4,
        4e-4,
        "seq-mean-token-sum",
    )
    assert (dro.config.beta, dro.config.aggregation) == (0.05, "token-mean")
    assert all(o.has_trust_region() for o in (vespo, luspo, dro))
    assert vespo.config.folds_rollout_correction() and not luspo.config.folds_rollout_correction()


# ---------------------------------------------------------------- 6. end to end

END_TO_END = [
    ("dapo", ["objective.sampler_kl_coef=0.01"], "loss/sampler_kl"),
    ("vespo", ["objective.rollout_correction.high=2.0"], "vespo/phi_mean"),
    ("luspo", [], "policy/clipfrac_high"),
    ("dro", [], "loss/policy"),
]


@pytest.mark.parametrize(
    "preset,overrides,key",
    [  # the first in the fast subset, the others in the full suite
        pytest.param(*case, id=case[0], marks=() if i == 0 else pytest.mark.slow) for i, case in enumerate(END_TO_END)
    ],
)
def test_train_runs_two_steps(tiny_dir, tmp_path, preset, overrides, key):
    # tether's trainer hands every objective the sampler's log-probs: the sampler KL and VESPO's folded rollout
    # correction run in `tether train` as they do on a TokenBatch.
    import json
    from pathlib import Path

    from conftest import train_config as _cfg

    from tether.trainer.loop import train

    cfg = _cfg(tiny_dir, tmp_path / "run", "trainer.total_steps=2", f"objective={preset}", *overrides)
    run = train(cfg, log=lambda *_: None)
    rows = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(math.isfinite(r["loss/total"]) and math.isfinite(r["optim/grad_norm"]) for r in rows[1:])
    assert all(key in r for r in rows[1:]), key
    if preset == "dapo":
        assert all(r["loss/sampler_kl"] >= 0 for r in rows[1:])
