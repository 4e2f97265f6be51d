"""The squared log-ratio to the sampler (`sampler_kl_coef`, prime-rl's `kl_tau`, Kimi K2.5) on any objective,
on CPU in float64:

1. hand-computed value and gradient (arithmetic in the comments);
2. exactness against prime-rl's default loss (DPPO-Binary-TV + kl_tau), transcribed below;
4. invariants: it composes with every aggregation and objective, a missing (NaN) sampler log-prob gives no
   penalty and no NaN, a batch without sampler log-probs is refused naming the fix, and so is a run whose
   sampler log-probs are not the full softmax's (top_p < 1), before anything is written.
"""

import pytest
import torch

from tether import objectives
from tether.schema import ConfigError

D = torch.float64


def _t(*rows):
    return torch.tensor(rows, dtype=D)


def _run(spec, lp, old, adv, mask, sampler):
    lp = lp.clone().requires_grad_()
    out = objectives.build(spec)(
        objectives.TokenBatch(logprobs=lp, old_logprobs=old, advantages=adv, loss_mask=mask, sampler_logprobs=sampler)
    )
    out.loss.backward()
    return out, lp.grad


def test_hand_computed():
    # On-policy (lp = lp_old) REINFORCE with A = 0, so only the penalty acts. lp = (-1, -2 | -3, pad),
    # lp_sampler = (-1.5, -2 | -2.8, pad): s = (0.25, 0 | 0.04). token-mean over 3: 0.29 / 3 = 0.0966667;
    # with tau = 0.01 the loss is 0.000966667, d loss / d lp = tau 2 (lp - lp_sampler) / 3
    # = (0.0033333, 0 | -0.0013333).
    lp = _t([-1.0, -2.0], [-3.0, 0.0])
    sampler = _t([-1.5, -2.0], [-2.8, 5.0])  # the padding's value must not matter
    mask = torch.tensor([[True, True], [True, False]])
    spec = {"name": "reinforce", "sampler_kl_coef": 0.01}
    out, g = _run(spec, lp, lp, _t(0.0, 0.0), mask, sampler)
    assert out.metrics["loss/sampler_kl"].item() == pytest.approx(0.29 / 3, rel=1e-14)
    assert out.loss.item() == pytest.approx(0.0029 / 3, rel=1e-13)
    torch.testing.assert_close(g, _t([0.01 / 3, 0.0], [-0.004 / 3, 0.0]), rtol=1e-13, atol=1e-18)
    # seq-mean-token-mean: (0.25 / 2 + 0.04 / 1) / 2 = 0.0825.
    out, _ = _run({**spec, "aggregation": "seq-mean-token-mean"}, lp, lp, _t(0.0, 0.0), mask, sampler)
    assert out.metrics["loss/sampler_kl"].item() == pytest.approx(0.0825, rel=1e-14)


def _prime_rl_default_loss(trainer_lp, inference_lp, adv, mask, dppo_low=0.2, dppo_high=0.2, kl_tau=1e-3):
    """prime-rl's rl loss, transcribed independently: `default_loss_fn` (DPPO-Binary-TV mask + kl_tau times the
    squared log-ratio on every loss-mask token) summed over the packed samples and divided by the batch's rl token
    count (`compute_loss`'s rl_scale), PrimeIntellect-ai/prime-rl src/prime_rl/trainer/rl/loss.py at commit
    559b44772e471d1538537b8805cc77f3824a5e64 (kl_tau's default 1e-3: packages/prime-rl-configs/.../trainer.py).
    Returns (total loss, its KL part)."""
    log_r = trainer_lp - inference_lp
    ratio = torch.exp(log_r)
    diff = torch.exp(trainer_lp) - torch.exp(inference_lp)
    adv = adv[:, None].expand_as(trainer_lp)
    invalid = torch.where(adv > 0, diff > dppo_high, diff < -dppo_low)
    keep = mask & ~invalid
    pg = keep * adv * ratio
    kl = mask * log_r**2
    n = mask.sum()
    return (-pg + kl_tau * kl).sum() / n, (kl_tau * kl).sum() / n


def test_equals_prime_rls_default_loss():
    # prime-rl anchors on the sampler (no recomputed pi_old): tether's DPPO-Binary-TV with pi_old = pi_sampler
    # (trainer.old_logprobs=sampler), token-mean, no truncation. prime-rl differentiates through the ratio, tether's
    # dppo through SG(w) lp: the same gradient, another loss value, so the KL part is compared by value and the
    # total by gradient.
    g = torch.Generator().manual_seed(0)
    N, T = 6, 5
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    sampler = torch.log(0.05 + 0.9 * torch.rand(N, T, generator=g, dtype=D))
    lp = torch.where(mask, sampler + 0.4 * torch.randn(N, T, generator=g, dtype=D), torch.zeros_like(sampler))
    sampler = torch.where(mask, sampler, torch.zeros_like(sampler))
    adv = torch.randn(N, generator=g, dtype=D)
    lp_ref = lp.clone().requires_grad_()
    total, kl_part = _prime_rl_default_loss(lp_ref, sampler, adv, mask)
    total.backward()
    spec = {
        "name": "dppo",
        "measure": "binary_tv",
        "delta_low": 0.2,
        "delta_high": 0.2,
        "truncation_c": None,
        "aggregation": "token-mean",
        "sampler_kl_coef": 1e-3,
    }
    out, grad = _run(spec, lp, sampler, adv, mask, sampler)
    assert 0 < out.metrics["policy/clipfrac_high"] + out.metrics["policy/clipfrac_low"] < 1  # the mask acts
    assert (1e-3 * out.metrics["loss/sampler_kl"]).item() == pytest.approx(kl_part.item(), rel=1e-13)
    torch.testing.assert_close(grad, lp_ref.grad, rtol=1e-12, atol=1e-15)
    assert objectives.ObjectiveConfig().sampler_kl_coef == 0.0  # off unless asked for (prime-rl's default is 1e-3)


@pytest.mark.parametrize(
    "spec",
    ["dapo", "gspo", "vespo", "dro", "rpg_urkl", "etr", {"preset": "grpo", "aggregation": "seq-mean-token-sum-norm"}],
)
def test_composes_with_any_objective(spec):
    # The loss with the penalty minus the loss without it is tau times the penalty aggregated the objective's way.
    g = torch.Generator().manual_seed(1)
    N, T = 8, 4
    old = -torch.rand(N, T, generator=g, dtype=D) - 0.1
    lp = old + 0.2 * torch.randn(N, T, generator=g, dtype=D)
    sampler = old + 0.3 * torch.randn(N, T, generator=g, dtype=D)
    mask = torch.ones(N, T, dtype=torch.bool)
    mask[::3, -1] = False
    rewards = torch.randint(0, 2, (N,), generator=g).to(D)
    groups = torch.arange(N) // 4
    base = spec if isinstance(spec, dict) else objectives.spec_mapping(spec)
    outs = []
    for tau in (0.0, 0.02):
        obj = objectives.build({**base, "sampler_kl_coef": tau})
        batch = objectives.TokenBatch(
            logprobs=lp,
            old_logprobs=old,
            advantages=obj.advantages(rewards, groups),
            loss_mask=mask,
            ref_logprobs=old - 0.1,
            rewards=rewards,
            group_ids=groups,
            sampler_logprobs=sampler,
        )
        outs.append(obj(batch))
    from tether.core import aggregation

    penalty = aggregation.aggregate((lp - sampler) ** 2, mask, obj.config.aggregation, None, obj.config.max_len)
    assert outs[1].loss.item() - outs[0].loss.item() == pytest.approx(0.02 * penalty.item(), rel=1e-10)
    assert "loss/sampler_kl" not in outs[0].metrics


def test_a_missing_sampler_logprob_gives_no_penalty_and_no_nan():
    lp, sampler = _t([-1.0, -2.0]), _t([-1.5, float("nan")])
    out, g = _run(
        {"name": "reinforce", "sampler_kl_coef": 0.1}, lp, lp, _t(0.0), torch.ones(1, 2, dtype=torch.bool), sampler
    )
    # Only token 1 counts: 0.1 * 0.25 / 2 = 0.0125, gradient 0.1 * 2 * 0.5 / 2 = 0.05 and 0.
    assert out.loss.item() == pytest.approx(0.0125, rel=1e-14)
    torch.testing.assert_close(g, _t([0.05, 0.0]), rtol=1e-14, atol=0)


def test_refusals_name_the_fix(tmp_path):
    lp = _t([-1.0])
    with pytest.raises(ValueError, match="sampler_logprobs.*sampler_kl_coef=0"):
        objectives.build({"name": "reinforce", "sampler_kl_coef": 0.1})(
            objectives.TokenBatch(lp, lp, _t(1.0), torch.ones(1, 1, dtype=torch.bool))
        )
    with pytest.raises(ConfigError, match="sampler_kl_coef"):
        objectives.build({"name": "reinforce", "sampler_kl_coef": -1.0})
    from tether.config.loading import load_config

    with pytest.raises(ConfigError, match="sampler_kl_coef.*top_p=1"):
        load_config(None, ["objective.sampler_kl_coef=0.001", "rollout.top_p=0.9", f"output_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()
