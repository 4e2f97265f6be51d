"""The objective `troll` (tether.objectives.troll, arXiv 2510.03817) computes the paper's loss and gradient, in
float64 on CPU, through tether's objective runtime:

1. its loss and its gradient in each support log-prob equal the independent reference of the paper's equations
   (`_ref_position` in test_cfpo_troll.py: plain Python floats, eta bisected on log eta, the gradient from the
   closed-form implicit derivative with explicit Jacobians), aggregated by hand for three aggregation modes, with
   ragged supports, padding and an environment token in the mask, projected and unprojected tokens (1e-10);
2. it composes with tether's axes that act outside the per-token loss: a KL penalty to the reference, an entropy
   bonus and a truncating rollout correction give the reference's per-token loss times the correction's weight,
   plus the penalty and minus the bonus, by hand;
3. a batch without the support fields is refused naming each field and how the trainer feeds it; bad settings are
   refused naming the key and the paper's value.
The trainer's supports (the old pass's top-k, the update's union support, the fused head) are tested in
tests/trainer/test_troll_feed.py; the projection's own tests are in test_cfpo_troll.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_cfpo_troll import _ref_position

from tether import objectives
from tether.schema import ConfigError

D = torch.float64
TOL = dict(rtol=1e-10, atol=1e-12)
N, T, S = 3, 4, 5


def _batch(seed=0, spread=1.0):
    """Support scores of pi_theta (with gradient) and pi_old (N, T, S) on ragged supports, the sampled token's entry,
    advantages of both signs; row 0 has an environment token at t = 1 and row 2 padding after t = 1."""
    g = torch.Generator().manual_seed(seed)
    z_old = torch.randn(N, T, S, generator=g, dtype=D)
    z_new = (z_old + spread * torch.randn(N, T, S, generator=g, dtype=D)).requires_grad_()
    support = torch.ones(N, T, S, dtype=torch.bool)
    support[0, 0, 2:] = False
    support[1, 2, 3:] = False
    token = torch.randint(0, 2, (N, T), generator=g)
    mask = torch.ones(N, T, dtype=D)
    mask[0, 1] = 0.0  # an environment's token
    mask[2, 2:] = 0.0  # padding
    lp = z_new.log_softmax(-1).gather(-1, token[..., None])[..., 0]  # the sampled token's, for policy/* metrics
    old = z_old.log_softmax(-1).gather(-1, token[..., None])[..., 0]
    return objectives.TokenBatch(
        logprobs=lp,
        old_logprobs=old,
        advantages=torch.tensor([1.0, -0.7, 0.4], dtype=D),
        loss_mask=mask,
        support_logprobs=z_new,
        old_support_logprobs=z_old,
        support_mask=support,
        support_token_index=token,
    )


def _reference(b, eps, alpha):
    """Per-token loss (N, T) and d loss_t / d scores (N, T, S) of the paper's equations at the counted tokens."""
    loss, grad = torch.zeros(N, T, dtype=D), torch.zeros(N, T, S, dtype=D)
    for i in range(N):
        for t in range(T):
            if b.loss_mask[i, t] == 0:
                continue
            keep = b.support_mask[i, t]
            value, g = _ref_position(
                b.support_logprobs[i, t][keep].tolist(),
                b.old_support_logprobs[i, t][keep].tolist(),
                int(b.support_token_index[i, t]),
                float(b.advantages[i]),
                eps,
                alpha,
            )
            loss[i, t] = value
            grad[i, t, keep] = torch.tensor(g, dtype=D)
    return loss, grad


def _weights(aggregation, mask, max_len):
    """d loss / d loss_t of each aggregation, by hand (tether.core.aggregation's table)."""
    if aggregation == "token-mean":
        return mask / mask.sum()
    if aggregation == "seq-mean-token-mean":
        rows = mask.sum(1, keepdim=True)
        return mask / rows / (rows > 0).sum()
    return mask / (mask.shape[0] * max_len)  # seq-mean-token-sum-norm


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("eps, alpha, seed", [(0.05, 1.0, 0), (0.2, 0.5, 1)])
def test_the_objective_equals_the_papers_equations(aggregation, eps, alpha, seed):
    b = _batch(seed)
    obj = objectives.build({"preset": "troll", "eps": eps, "alpha": alpha, "aggregation": aggregation, "max_len": 6})
    out = obj(b)
    (grad,) = torch.autograd.grad(out.loss, b.support_logprobs)
    ref_loss, ref_grad = _reference(b, eps, alpha)
    w = _weights(aggregation, b.loss_mask, 6)
    assert out.loss.item() == pytest.approx((ref_loss * w).sum().item(), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(grad, ref_grad * w[..., None], **TOL)
    assert (grad[b.loss_mask == 0] == 0).all() and (grad[~b.support_mask] == 0).all()
    m = b.loss_mask.bool()
    assert 0 < out.metrics["troll/projected_frac"].item() < 1  # both branches among the counted tokens
    assert out.metrics["troll/support_size"].item() == pytest.approx(b.support_mask[m].sum(-1).double().mean())


def test_it_composes_with_the_kl_penalty_the_entropy_bonus_and_rollout_correction():
    b = _batch(seed=2)
    g = torch.Generator().manual_seed(3)
    ref = b.logprobs.detach() + 0.3 * torch.randn(N, T, generator=g, dtype=D)
    sampler = b.old_logprobs + 0.5 * torch.randn(N, T, generator=g, dtype=D)
    entropy = torch.rand(N, T, generator=g, dtype=D).requires_grad_()
    b = dataclasses.replace(b, ref_logprobs=ref, sampler_logprobs=sampler, entropy=entropy)
    spec = {
        "preset": "troll",
        "kl_penalty": {"estimator": "k3", "coef": 0.1},
        "entropy_coef": 0.01,
        "rollout_correction": {"level": "token", "mode": "truncate", "high": 1.5},
    }
    out = objectives.build(spec)(b)
    ref_loss, _ = _reference(b, 0.05, 1.0)
    m = b.loss_mask
    c = (b.old_logprobs - sampler).exp().clamp(max=1.5)  # TIS: pi_old / pi_sampler truncated at 1.5
    k3 = (ref - b.logprobs).exp() - (ref - b.logprobs) - 1
    want = ((ref_loss * c + 0.1 * k3 - 0.01 * entropy) * m).sum() / m.sum()
    assert out.loss.item() == pytest.approx(want.item(), rel=1e-10, abs=1e-12)
    assert (c[m.bool()] < 1.5).any() and (c[m.bool()] == 1.5).any()  # truncated and not


def test_a_batch_without_supports_is_refused_naming_the_feed():
    b = _batch()
    plain = objectives.TokenBatch(
        logprobs=b.logprobs, old_logprobs=b.old_logprobs, advantages=b.advantages, loss_mask=b.loss_mask
    )
    with pytest.raises(ValueError, match="needs TokenBatch.support_logprobs.*trainer.old_logprobs=recompute"):
        objectives.build("troll")(plain)
    with pytest.raises(ValueError, match=r"support_mask has shape \(3, 4, 4\), expected \(N, T, S\) = \(3, 4, 5\)"):
        objectives.build("troll")(dataclasses.replace(b, support_mask=b.support_mask[..., :4]))


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("eps", 0.0, "eps"),
        ("alpha", -1.0, "alpha.*the paper's 1"),
        ("top_k", 0, "top_k.*the paper's 64"),
        ("delta", 1.0, "delta.*the paper's 1e-5"),
    ],
)
def test_bad_settings_are_refused_naming_the_papers_value(key, value, message):
    with pytest.raises(ConfigError, match=message):
        objectives.build({"preset": "troll", key: value})


def test_the_preset_is_the_papers_settings():
    cfg = objectives.build("troll").config
    assert (cfg.eps, cfg.alpha, cfg.top_k, cfg.delta) == (0.05, 1.0, 64, 1e-5)
    assert cfg.sparse_support() == objectives.SupportSize(64, 1.0 - 1e-5) and cfg.has_trust_region()


def test_distilling_to_the_teachers_top_k_is_refused_and_the_sampled_token_signals_compose():
    # The update's forward for TROLL gives pi_theta on its own sparse support; a forward_kl_topk distill signal would
    # need the policy's log-probs on the teacher's top-k too, which that forward does not compute: refused, naming
    # the signals that do compose.
    with pytest.raises(ConfigError, match="distill.*reverse_kl or kl_loss.*teacher's top-k"):
        objectives.build({"preset": "troll", "distill": {"signal": "forward_kl_topk"}})
    for signal in ("reverse_kl", "kl_loss"):
        assert objectives.build({"preset": "troll", "distill": {"signal": signal}}).config.distill.signal == signal
