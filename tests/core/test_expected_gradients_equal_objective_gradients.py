"""Exactness by enumeration (SPEC section 6): expected losses are sums weighted by pi_old over
every action of a small softmax policy, never Monte Carlo, so gradients must match the
intended objective's gradient to float64 rounding."""

import itertools

import pytest
import torch

from tether.core import kl as K
from tether.core import rpg
from tether.core import surrogates as S

TOL = dict(rtol=1e-10, atol=1e-12)
KLS = ["fkl", "ufkl", "rkl", "urkl"]
NUM_ACTIONS = 6
BETA = 0.3  # large enough that a wrong KL weight is visible next to the reward term


def _bandit(seed=0):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(NUM_ACTIONS, generator=g, dtype=torch.float64)
    theta_old = theta + 0.5 * torch.randn(NUM_ACTIONS, generator=g, dtype=torch.float64)  # off-policy
    theta_ref = theta + 0.7 * torch.randn(NUM_ACTIONS, generator=g, dtype=torch.float64)
    reward = torch.randint(0, 2, (NUM_ACTIONS,), generator=g).double()
    return theta, theta_old, theta_ref, reward


def _div(kl, lp, lp_a):
    """Div(pi_theta, pi_a) in closed form (sums over all actions; policies may be unnormalised)."""
    p, pa = lp.exp(), lp_a.exp()
    return {
        "fkl": (pa * (lp_a - lp)).sum(),
        "ufkl": (pa * (lp_a - lp) - pa + p).sum(),
        "rkl": (p * (lp - lp_a)).sum(),
        "urkl": (p * (lp - lp_a) - p + pa).sum(),
    }[kl]


def _expected_loss_grad(token_loss_fn, theta, lp_old_of, normalise=True):
    """grad_theta of sum_a pi_old(a) l(a), with l computed per action as an (N=K, T=1) batch."""
    th = theta.clone().requires_grad_()
    lp = (torch.log_softmax(th, -1) if normalise else th)[:, None]  # (K, 1)
    loss = token_loss_fn(lp)  # (K, 1)
    expected = (lp_old_of.exp()[:, None] * loss).sum()
    (grad,) = torch.autograd.grad(expected, th)
    return grad


def _objective_grad(kl, theta, lp_anchor_of, reward, normalise=True):
    """grad_theta of -J, J = sum_a pi_theta(a) R(a) - beta Div(pi_theta, pi_a)."""
    th = theta.clone().requires_grad_()
    lp = torch.log_softmax(th, -1) if normalise else th
    J = (lp.exp() * reward).sum() - BETA * _div(kl, lp, lp_anchor_of)
    (grad,) = torch.autograd.grad(-J, th)
    return grad


@pytest.mark.parametrize("kl", KLS)
@pytest.mark.parametrize("form", ["differentiable", "reinforce"])
@pytest.mark.parametrize("anchor", ["old", "ref"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rpg_expected_gradient_is_the_objective_gradient(kl, form, anchor, seed):
    theta, theta_old, theta_ref, reward = _bandit(seed)
    lp_old = torch.log_softmax(theta_old, -1)
    lp_a = lp_old if anchor == "old" else torch.log_softmax(theta_ref, -1)
    log_q = rpg.anchor_log_q(lp_old[:, None], None if anchor == "old" else lp_a[:, None])
    adv = reward - 0.37  # any sample-independent baseline adds zero in expectation
    fn = rpg.rpg_differentiable if form == "differentiable" else rpg.rpg_reinforce
    got = _expected_loss_grad(lambda lp: fn(kl, lp, lp_old[:, None], adv, BETA, log_q).loss, theta, lp_old)
    want = _objective_grad(kl, theta, lp_a, reward)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("kl", ["ufkl", "urkl"])
@pytest.mark.parametrize("form", ["differentiable", "reinforce"])
def test_unnormalised_variants_are_exact_for_unnormalised_measures(kl, form):
    # pi_theta = exp(theta) without normalisation: UKL's extra terms now matter, and the
    # unnormalised variants must still give grad of -J exactly (baseline 0: with an
    # unnormalised policy a constant baseline no longer adds zero).
    theta, theta_old, theta_ref, reward = _bandit(3)
    lp_old = torch.log_softmax(theta_old, -1)
    lp_a = torch.log_softmax(theta_ref, -1)
    log_q = (lp_a - lp_old)[:, None]
    fn = rpg.rpg_differentiable if form == "differentiable" else rpg.rpg_reinforce
    got = _expected_loss_grad(
        lambda lp: fn(kl, lp, lp_old[:, None], reward, BETA, log_q).loss, theta, lp_old, normalise=False
    )
    want = _objective_grad(kl, theta, lp_a, reward, normalise=False)
    torch.testing.assert_close(got, want, **TOL)
    # ... whereas the normalised variant's weights describe a different objective there.
    other = {"ufkl": "fkl", "urkl": "rkl"}[kl]
    wrong = _expected_loss_grad(
        lambda lp: fn(other, lp, lp_old[:, None], reward, BETA, log_q).loss, theta, lp_old, normalise=False
    )
    assert (wrong - want).abs().max() > 1e-3


@pytest.mark.parametrize("pair", [("fkl", "ufkl"), ("rkl", "urkl")])
def test_normalised_and_unnormalised_variants_share_the_expected_gradient(pair):
    theta, theta_old, theta_ref, reward = _bandit(4)
    lp_old = torch.log_softmax(theta_old, -1)
    log_q = (torch.log_softmax(theta_ref, -1) - lp_old)[:, None]
    grads = [
        _expected_loss_grad(
            lambda lp: rpg.rpg_reinforce(k, lp, lp_old[:, None], reward, BETA, log_q).loss, theta, lp_old
        )
        for k in pair
    ]
    torch.testing.assert_close(grads[0], grads[1], **TOL)


def test_k3_of_the_ratio_estimates_ukl_old_to_theta():
    # E_old[k3(pi_theta / pi_old)] = UKL(pi_old || pi_theta), for normalised and unnormalised pi_theta.
    theta, theta_old, _, _ = _bandit(5)
    lp_old = torch.log_softmax(theta_old, -1)
    for lp in (torch.log_softmax(theta, -1), theta):
        lhs = (lp_old.exp() * K.k3_of_log(lp - lp_old)).sum()
        p, po = lp.exp(), lp_old.exp()
        rhs = (po * (lp_old - lp) - po + p).sum()
        torch.testing.assert_close(lhs, rhs, **TOL)


def test_k3_is_nonnegative_and_zero_only_at_one():
    y = torch.logspace(-6, 6, 101, dtype=torch.float64)
    k = K.k3_of_log(torch.log(y))
    assert (k >= 0).all() and K.k3_of_log(torch.zeros(1, dtype=torch.float64)).item() == 0.0


def _penalty_grad(estimator, theta, lp_old, lp_ref):
    return _expected_loss_grad(lambda lp: getattr(K, estimator)(lp, lp_ref[:, None], lp_old[:, None]), theta, lp_old)


def _kl_grad(theta, lp_ref, direction):
    th = theta.clone().requires_grad_()
    lp = torch.log_softmax(th, -1)
    p, pr = lp.exp(), lp_ref.exp()
    kl = (pr * (lp_ref - lp)).sum() if direction == "forward" else (p * (lp - lp_ref)).sum()
    return torch.autograd.grad(kl, th)[0]


def test_grpo_k3_term_on_policy_has_the_forward_kl_gradient():
    theta, _, theta_ref, _ = _bandit(6)
    lp_on = torch.log_softmax(theta, -1)  # samples from pi_theta itself
    lp_ref = torch.log_softmax(theta_ref, -1)
    got = _penalty_grad("k3", theta, lp_on, lp_ref)
    torch.testing.assert_close(got, _kl_grad(theta, lp_ref, "forward"), **TOL)
    assert (got - _kl_grad(theta, lp_ref, "reverse")).abs().max() > 1e-3  # not the KL it is written as


def test_corrected_k3_iw_term_has_the_reverse_ukl_gradient_off_policy():
    theta, theta_old, theta_ref, _ = _bandit(7)
    lp_old, lp_ref = torch.log_softmax(theta_old, -1), torch.log_softmax(theta_ref, -1)
    got = _penalty_grad("k3_iw", theta, lp_old, lp_ref)
    torch.testing.assert_close(got, _kl_grad(theta, lp_ref, "reverse"), **TOL)
    # The uncorrected term off-policy is neither KL's gradient.
    k3_off = _penalty_grad("k3", theta, lp_old, lp_ref)
    for direction in ("forward", "reverse"):
        assert (k3_off - _kl_grad(theta, lp_ref, direction)).abs().max() > 1e-3


def test_k3_iw_is_urkl_with_the_reference_as_anchor():
    theta, theta_old, theta_ref, _ = _bandit(8)
    lp = torch.log_softmax(theta, -1)[:, None]
    lp_old, lp_ref = torch.log_softmax(theta_old, -1)[:, None], torch.log_softmax(theta_ref, -1)[:, None]
    torch.testing.assert_close(K.k3_iw(lp, lp_ref, lp_old), rpg.kl_term("urkl", lp, lp_old, lp_ref - lp_old), **TOL)


def test_k2_on_policy_gives_reverse_kl_and_k1_gives_nothing():
    theta, _, theta_ref, _ = _bandit(9)
    lp_on, lp_ref = torch.log_softmax(theta, -1), torch.log_softmax(theta_ref, -1)
    torch.testing.assert_close(_penalty_grad("k2", theta, lp_on, lp_ref), _kl_grad(theta, lp_ref, "reverse"), **TOL)
    torch.testing.assert_close(
        _penalty_grad("k1", theta, lp_on, lp_ref), torch.zeros(NUM_ACTIONS, dtype=torch.float64), **TOL
    )


# ---------------------------------------------------------------- RPG-Style Clip


def _token_grads(fn, lp0):
    lp = lp0.clone().requires_grad_()
    fn(lp).loss.sum().backward()
    return lp.grad


@pytest.mark.parametrize("kl", KLS)
@pytest.mark.parametrize("anchor", ["old", "ref"])
def test_rpg_style_clip_gradient_is_dual_clip_ppo_plus_masked_kl_weight(kl, anchor):
    N, T = 8, 16
    lp_old = -torch.rand(N, T, dtype=torch.float64) - 0.2
    lp0 = lp_old + 0.5 * torch.randn(N, T, dtype=torch.float64)  # ratios on both sides of every bound
    lp0[0, :4] = lp_old[0, :4] + 2.5  # w ~ 12 > c: the dual clip acts
    adv = torch.randn(N, dtype=torch.float64)
    log_q = torch.zeros_like(lp_old) if anchor == "old" else 0.3 * torch.randn(N, T, dtype=torch.float64)
    beta, el, eh, c = 0.05, 0.2, 0.28, 10.0
    g_rpg = _token_grads(
        lambda lp: rpg.rpg_style_clip(kl, lp, lp_old, adv, beta, log_q, el, eh, c, branch_on="advantage"), lp0
    )
    g_ppo = _token_grads(lambda lp: S.ppo_clip(lp, lp_old, adv, el, eh, c), lp0)
    w = (lp0 - lp_old).exp()
    a = adv[:, None].expand(N, T)
    mask = torch.where(a > 0, w < 1 + eh, (w > 1 - el) & (w < c)).double()  # released code: A > 0
    c_kl = rpg.c_kl(kl, beta, torch.log(w.clamp(1 - el, 1 + eh)), log_q)
    torch.testing.assert_close(g_rpg, g_ppo - mask * c_kl, **TOL)
    assert 0 < mask.mean() < 1  # both kept and dropped tokens were exercised


def test_rpg_style_clip_branches_on_the_kl_adjusted_advantage():
    # A = 0.01 > 0 but C_KL / w = -0.1 * 1.5 * log 1.28 / 1.5 = -0.0247 makes A' < 0; w = 1.5
    # is above 1 + eps_high, so branching on A drops the token while branching on A' keeps it
    # (1 - eps_low < w < c) with weight A w + C_KL(w_bar) = 0.015 - 0.1 * 1.28 * log(1.28).
    lp_old = torch.full((1, 1), -1.0, dtype=torch.float64)
    lp0 = lp_old + torch.log(torch.tensor(1.5, dtype=torch.float64))
    adv, log_q = torch.tensor([0.01], dtype=torch.float64), torch.zeros(1, 1, dtype=torch.float64)
    g_adv = _token_grads(lambda lp: rpg.rpg_style_clip("urkl", lp, lp_old, adv, 0.1, log_q, branch_on="advantage"), lp0)
    g_reg = _token_grads(lambda lp: rpg.rpg_style_clip("urkl", lp, lp_old, adv, 0.1, log_q), lp0)
    assert g_adv.item() == 0.0
    want = -(0.01 * 1.5 - 0.1 * 1.28 * torch.log(torch.tensor(1.28, dtype=torch.float64)))
    torch.testing.assert_close(g_reg, want.reshape(1, 1), **TOL)


@pytest.mark.parametrize("kl", KLS)
def test_rpg_style_clip_inside_the_trust_region_is_the_exact_reinforce_form(kl):
    theta, _, theta_ref, reward = _bandit(10)
    theta_old = theta + 0.05 * torch.randn(NUM_ACTIONS, dtype=torch.float64)  # every w within (0.8, 1.28)
    lp_old = torch.log_softmax(theta_old, -1)
    log_q = (torch.log_softmax(theta_ref, -1) - lp_old)[:, None]
    clip = _expected_loss_grad(
        lambda lp: rpg.rpg_style_clip(kl, lp, lp_old[:, None], reward - 0.5, BETA, log_q).loss, theta, lp_old
    )
    plain = _expected_loss_grad(
        lambda lp: rpg.rpg_reinforce(kl, lp, lp_old[:, None], reward - 0.5, BETA, log_q).loss, theta, lp_old
    )
    torch.testing.assert_close(clip, plain, **TOL)


# ---------------------------------------------------------------- sequences of tokens


def test_token_level_clip_on_policy_gives_the_sequence_policy_gradient():
    # Two-token sequences over a vocabulary of 3, policy pi(o1) pi(o2 | o1) from logits; at
    # theta = theta_old every ratio is 1, so sum_t of the per-token PPO loss, weighted by
    # pi_old(sequence), must have gradient -grad E[R] exactly (policy gradient theorem).
    V = 3
    g = torch.Generator().manual_seed(11)
    theta = torch.randn(1 + V, V, generator=g, dtype=torch.float64)  # row 0: first token; row 1+o1: second
    seqs = list(itertools.product(range(V), repeat=2))
    reward = torch.randint(0, 2, (len(seqs),), generator=g).double()

    def token_logprobs(th):
        logp = torch.log_softmax(th, -1)
        return torch.stack([torch.stack([logp[0, a], logp[1 + a, b]]) for a, b in seqs])  # (N, 2)

    th = theta.clone().requires_grad_()
    lp = token_logprobs(th)
    lp_old = lp.detach()
    seq_p = lp_old.sum(-1).exp()
    loss = S.ppo_clip(lp, lp_old, reward - 0.4, 0.2, 0.28).loss.sum(-1)  # (N,)
    got = torch.autograd.grad((seq_p * loss).sum(), th)[0]
    th2 = theta.clone().requires_grad_()
    J = (token_logprobs(th2).sum(-1).exp() * reward).sum()
    want = torch.autograd.grad(-J, th2)[0]
    torch.testing.assert_close(got, want, **TOL)
