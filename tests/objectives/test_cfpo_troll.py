"""CFPO and TROLL compute the objective and gradient they are meant to, on CPU in float64.

CFPO (arXiv 2601.22801, tether.core.cfpo, objective and preset `cfpo`):
1. hand-computed values and gradients (arithmetic in the comments);
2. equal, in loss and gradient, to the authors' own pull requests, transcribed below (they cannot be installed:
   each is an unmerged branch of a whole framework):
   - OpenRLHF #1184, head 8eb43dac6acbcea89b34a8131313e780428b1b8b, `openrlhf/models/loss.py`
     `PolicyLoss.forward` with policy_loss_type="cfpo": eps = clip_eps_low, no log-ratio clamp, `masked_mean`
     over tokens (token_level_loss=True) or per sequence then over sequences (False);
   - verl #5252, head 18bd5cde9ed769b91b6b2537e6c4ffb80e0dd0b1, `verl/trainer/ppo/core_algos.py`
     `compute_policy_loss_cfpo`: eps = clip_ratio, log-ratio clamped to [-20, 20], verl's `agg_loss`;
   - TRL #5027, head afa266b563c97e180b96d0f767a53eaba3af9ffd, `trl/trainer/grpo_trainer.py` loss_type "cfpo":
     eps = epsilon_high, aggregated as its "grpo" loss (per-sequence token mean, then the mean);
   the three compute the same per-token loss, so one transcription with the eps each reads covers them;
3. exactness by enumeration: the expected gradient over every action of a small softmax policy is the gradient
   of the paper's objective E_old[w A - |A| (w - 1)^2 / (2 eps)], written in probabilities;
4. invariants: on-policy it is the policy gradient, the gradient vanishes at PPO's clip boundary, all-masked
   batches, extreme ratios, no NaN; the preset builds.

TROLL (arXiv 2510.03817, tether.core.troll; the objective `troll`: test_troll_objective.py, with the same reference):
the authors' code (github.com/niklasfreymuth/troll, github.com/pbecker93/discrete_trpl) was not available here, so
the reference is an independent implementation of the paper's equations in plain Python floats (`_ref_position`):
the dual variable eta found by bisection on log eta (tether bisects on a = 1 / (1 + eta)), and the gradient through
the projection from a closed-form implicit derivative with explicit Jacobians (tether uses autograd and an implicit
function step). Tested: hand-computed projections, equality with the reference to 1e-10, exact expected gradients
by enumeration, optimality of the projection, on-policy = policy gradient, the sparse supports, invariants.
"""

from __future__ import annotations

import math

import pytest
import torch

import tether.objectives.cfpo  # noqa: F401  registers "cfpo" until tether/objectives/__init__.py imports it
from tether import objectives
from tether.core import cfpo as C
from tether.core import troll as R
from tether.schema import ConfigError

D = torch.float64
TOL = dict(rtol=1e-10, atol=1e-12)


def _t(*rows):
    return torch.tensor(rows, dtype=D)


def _run(spec, lp, old, adv, mask=None):
    lp = lp.clone().requires_grad_()
    mask = torch.ones_like(lp, dtype=torch.bool) if mask is None else mask
    out = objectives.build(spec)(objectives.TokenBatch(logprobs=lp, old_logprobs=old, advantages=adv, loss_mask=mask))
    out.loss.backward()
    return out, lp.grad


# ================================================================ CFPO
# ---------------------------------------------------------------- 1. hand-computed


def test_cfpo_hand_computed():
    # One sequence, per-token A = (+1, -1, +1), w = (1.5, 0.5, 1.1), eps 0.2, token-mean over 3 tokens.
    #   l = -(w A - |A| (w - 1)^2 / 0.4):  token 1: -(1.5 - 0.25 / 0.4) = -(1.5 - 0.625) = -0.875
    #                                       token 2: -(-0.5 - 0.625) = 1.125
    #                                       token 3: -(1.1 - 0.01 / 0.4) = -(1.1 - 0.025) = -1.075
    #   loss = (-0.875 + 1.125 - 1.075) / 3 = -0.825 / 3 = -0.275
    #   d l / d lp = -(A - |A| (w - 1) / 0.2) w:  token 1: -(1 - 2.5) 1.5 = 2.25 (past w* = 1.2: pulled back)
    #                                             token 2: -(-1 + 2.5) 0.5 = -0.75 (past w* = 0.8: pulled back)
    #                                             token 3: -(1 - 0.5) 1.1 = -0.55 (inside: pushed up)
    #   each / 3 = (0.75, -0.25, -0.183333); penalties (0.625, 0.625, 0.025), mean 0.425; 2 of 3 past w*.
    old = _t([-1.0, -2.0, -0.5])
    lp = old + torch.log(_t([1.5, 0.5, 1.1]))
    out, g = _run("cfpo", lp, old, _t([1.0, -1.0, 1.0]))
    assert out.loss.item() == pytest.approx(-0.275, rel=1e-12)
    torch.testing.assert_close(g, _t([2.25, -0.75, -0.55]) / 3, rtol=1e-12, atol=0)
    assert out.metrics["cfpo/penalty_mean"].item() == pytest.approx(0.425, rel=1e-12)
    assert out.metrics["cfpo/past_optimum_frac"].item() == pytest.approx(2 / 3, rel=1e-12)
    assert out.metrics["policy/clipfrac_high"].item() == 0.0  # nothing is clipped


@pytest.mark.parametrize("eps", [0.1, 0.2, 0.28])
def test_cfpo_gradient_vanishes_exactly_at_ppos_clip_boundary(eps):
    # The surrogate w A - |A| (w - 1)^2 / (2 eps) peaks at w* = 1 + eps sign(A): there d l / d w = -(A - |A| (w* - 1)
    # / eps) = -(A - |A| sign(A)) = 0; here A = 2 at w = 1 + eps and A = -0.5 at w = 1 - eps, one sequence.
    old = _t([-1.0, -0.7])
    lp = (old + torch.log(_t([1 + eps, 1 - eps]))).requires_grad_()
    adv = _t([2.0, -0.5])
    l = C.cfpo(lp, old, adv, eps)[0].loss
    (g,) = torch.autograd.grad(l.sum(), lp)
    assert g.abs().max().item() < 1e-14
    # and there l = -(w* A - |A| eps / 2) = -A (1 + sign(A) eps / 2): -2 (1 + eps / 2) and 0.5 (1 - eps / 2).
    torch.testing.assert_close(l.detach(), _t([-2 * (1 + eps / 2), 0.5 * (1 - eps / 2)]), **TOL)


# ---------------------------------------------------------------- 2. the authors' pull requests


def _released_cfpo(lp, old, adv, mask, eps, token_level):
    """The OpenRLHF PR's PolicyLoss.forward for "cfpo" (verl's and TRL's compute the same per-token loss)."""
    ratio = (lp - old).exp()
    adv = adv[:, None]  # token-level advantages, as those trainers pass them
    loss = -(adv * ratio - torch.abs(adv) * torch.pow(ratio - 1, 2) / (2 * eps))
    m = mask.to(lp.dtype)
    if token_level:  # masked_mean(loss, mask, dim=None); verl's token-mean
        return (loss * m).sum() / m.sum()
    return ((loss * m).sum(-1) / m.sum(-1)).mean()  # masked_mean(dim=-1).mean(); TRL's "grpo" branch


def _batch(seed=0, n=6, t=7):
    """Log-ratios in [-0.9, 0.9] (w in [0.41, 2.46]: both sides of both boundaries), a ragged mask, advantages of
    both signs and one exact zero."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=g, dtype=D) * 4 - 0.05
    lp = (old + (torch.rand(n, t, generator=g, dtype=D) * 1.8 - 0.9)).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.25, 0.0, 2.0], dtype=D)[:n]
    mask = torch.ones(n, t, dtype=D)
    mask[1, 5:] = 0
    mask[3, 2:] = 0
    return lp, old, adv, mask


@pytest.mark.parametrize("aggregation,token_level", [("token-mean", True), ("seq-mean-token-mean", False)])
@pytest.mark.parametrize("eps", [0.2, 0.28])
def test_cfpo_equals_the_authors_pull_requests(aggregation, token_level, eps):
    lp, old, adv, mask = _batch()
    ref = _released_cfpo(lp, old, adv, mask, eps, token_level)
    obj = objectives.build({"preset": "cfpo", "eps": eps, "aggregation": aggregation})
    out = obj(objectives.TokenBatch(logprobs=lp, old_logprobs=old, advantages=adv, loss_mask=mask))
    torch.testing.assert_close(out.loss, ref, rtol=1e-12, atol=1e-14)
    (g_ours,) = torch.autograd.grad(out.loss, lp)
    (g_ref,) = torch.autograd.grad(ref, lp)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-12, atol=1e-14)
    w = torch.exp(lp - old).detach()
    assert ((w > 1 + eps) & (adv[:, None] > 0) & mask.bool()).any()  # the batch reaches past both optima
    assert ((w < 1 - eps) & (adv[:, None] < 0) & mask.bool()).any()


# ---------------------------------------------------------------- 3. exactness by enumeration


def _bandit(seed, num_actions=6, spread=0.6):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(num_actions, generator=g, dtype=D)
    theta_old = theta + spread * torch.randn(num_actions, generator=g, dtype=D)
    reward = torch.randint(0, 2, (num_actions,), generator=g).to(D)
    return theta, theta_old, reward - 0.37  # any sample-independent baseline


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cfpo_expected_gradient_is_the_objective_gradient(seed):
    # sum_a pi_old(a) l(a), with l computed per sampled action as an (N = 6, T = 1) batch, has the gradient of
    # -J, J = sum_a pi(a) A(a) - sum_a |A(a)| (pi(a) - pi_old(a))^2 / (2 eps pi_old(a)).
    theta, theta_old, adv = _bandit(seed)
    lp_old = torch.log_softmax(theta_old, -1)
    th = theta.clone().requires_grad_()
    lp = torch.log_softmax(th, -1)
    expected = (lp_old.exp() * C.cfpo(lp[:, None], lp_old[:, None], adv, 0.2)[0].loss[:, 0]).sum()
    (got,) = torch.autograd.grad(expected, th)
    th2 = theta.clone().requires_grad_()
    p, q = torch.softmax(th2, -1), lp_old.exp()
    J = (p * adv).sum() - (adv.abs() * (p - q) ** 2 / (2 * 0.2 * q)).sum()
    (want,) = torch.autograd.grad(-J, th2)
    torch.testing.assert_close(got, want, **TOL)
    w = (lp - lp_old).exp().detach()
    assert ((w > 1.2) | (w < 0.8)).any()  # off-policy enough for the penalty to reverse some gradients


# ---------------------------------------------------------------- 4. invariants


def test_cfpo_on_policy_is_the_policy_gradient():
    lp, old, adv, mask = _batch(seed=3)
    old = lp.detach().clone()
    _, g = _run("cfpo", lp.detach(), old, adv, mask)
    _, g_pg = _run({"name": "reinforce"}, lp.detach(), old, adv, mask)
    torch.testing.assert_close(g, g_pg, rtol=1e-12, atol=1e-15)


def test_cfpo_all_masked_and_extreme_ratios_stay_finite():
    old = _t([-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0])
    lp = old + _t([30.0, -30.0, 0.5], [-50.0, 50.0, 0.0])  # beyond the [-20, 20] clamp on both sides
    out, g = _run("cfpo", lp, old, _t(1.0, -1.0))
    assert torch.isfinite(out.loss) and torch.isfinite(g).all()
    assert g[0, 0] == 0 and g[0, 1] == 0 and g[1, 0] == 0 and g[1, 1] == 0  # clamped: no gradient (departure 1)
    assert g[0, 2] != 0
    out, g = _run("cfpo", lp, old, _t(1.0, -1.0), mask=torch.zeros(2, 3, dtype=torch.bool))
    assert out.loss.item() == 0.0 and (g == 0).all()
    assert all(torch.isfinite(v).all() for v in out.metrics.values())
    out, g = _run("cfpo", lp, old, _t(0.0, 0.0))  # A = 0: loss and gradient 0 (departure 2)
    assert out.loss.item() == 0.0 and (g == 0).all()


def test_cfpo_preset_builds_and_config_errors_name_the_fix():
    obj = objectives.build("cfpo")
    assert obj.name == "cfpo" and obj.config.eps == 0.2 and obj.config.aggregation == "token-mean"
    assert obj.config.advantage == "grpo" and obj.has_trust_region()
    with pytest.raises(ConfigError, match="eps"):
        objectives.build({"name": "cfpo", "eps": 0.0})
    with pytest.raises(ConfigError, match="Did you mean 'eps'"):
        objectives.build({"name": "cfpo", "epsilon": 0.2})


# ================================================================ TROLL
# ---------------------------------------------------------------- the independent reference


def _lse(xs):
    m = max(xs)
    return m + math.log(math.fsum(math.exp(x - m) for x in xs))


def _ref_position(z_new, z_old, tok, adv, bound, alpha):
    """Loss and d loss / d z_new at one position, support = every entry of z_new (Python floats).

    The paper's projection: log pi*(a) = (log pi~(a) + eta log pi_old(a)) / (1 + eta) - log Z, eta = 0 inside the
    region, else KL(pi* || pi_old) = bound, found by bisection on log eta. Gradient: with c = 1 / (1 + eta),
    u = log pi~ - log pi_old and J[b][j] = d log pi~(b) / d z_j = [b = j] - pi~(j),
        d log pi*(a) / d z_j = c (J[a][j] - E_pi* J[.][j]) + dc_j (u(a) - E_pi* u),
        dc_j = -c Cov_pi*(u, J[.][j]) / Var_pi*(u)    (differentiating KL(pi* || pi_old) = bound).
    """
    k = len(z_new)
    lpn = [z - _lse(z_new) for z in z_new]
    lpo = [z - _lse(z_old) for z in z_old]

    def interp(eta):
        x = [(a + eta * b) / (1 + eta) for a, b in zip(lpn, lpo)]
        return [v - _lse(x) for v in x]

    def kl(p, q):
        return math.fsum(math.exp(a) * (a - b) for a, b in zip(p, q))

    J = [[(1.0 if b == j else 0.0) - math.exp(lpn[j]) for j in range(k)] for b in range(k)]
    if kl(lpn, lpo) <= bound:
        lps, dlps = lpn, J
    else:
        lo, hi = -40.0, 40.0
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if kl(interp(math.exp(mid)), lpo) > bound else (lo, mid)
        eta = math.exp(0.5 * (lo + hi))
        c, lps = 1 / (1 + eta), interp(eta)
        ps = [math.exp(v) for v in lps]
        u = [a - b for a, b in zip(lpn, lpo)]
        eu = math.fsum(p * x for p, x in zip(ps, u))
        var = math.fsum(p * (x - eu) ** 2 for p, x in zip(ps, u))
        eJ = [math.fsum(ps[b] * J[b][j] for b in range(k)) for j in range(k)]
        dc = [-c * math.fsum(ps[b] * (u[b] - eu) * J[b][j] for b in range(k)) / var for j in range(k)]
        dlps = [[c * (J[a][j] - eJ[j]) + dc[j] * (u[a] - eu) for j in range(k)] for a in range(k)]
    r = math.exp(lps[tok] - lpo[tok])
    reg = kl(lpn, lps)
    loss = -r * adv + alpha * reg
    grad = [
        -adv * r * dlps[tok][j] + alpha * math.fsum(math.exp(lpn[a]) * (lpn[a] - lps[a]) * J[a][j] for a in range(k))
        for j in range(k)
    ]
    return loss, grad


def _troll_case(seed, n=3, t=4, k=5, spread=1.5):
    """Random logits on ragged supports (row (0, 0) has 2 entries, (1, 2) has 3), sampled tokens in the support,
    advantages of both signs and 0; pi~ far enough from pi_old that most positions are projected."""
    g = torch.Generator().manual_seed(seed)
    z_old = torch.randn(n, t, k, generator=g, dtype=D)
    z_new = z_old + spread * torch.randn(n, t, k, generator=g, dtype=D)
    mask = torch.ones(n, t, k, dtype=torch.bool)
    mask[0, 0, 2:] = False
    mask[1, 2, 3:] = False
    tok = torch.randint(0, 2, (n, t), generator=g)
    adv = torch.tensor([1.0, -0.7, 0.0], dtype=D)[:n]
    return z_new, z_old, mask, tok, adv


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("bound,alpha", [(0.05, 1.0), (0.2, 0.5)])
def test_troll_equals_the_papers_equations(seed, bound, alpha):
    z_new, z_old, mask, tok, adv = _troll_case(seed)
    zn = z_new.clone().requires_grad_()
    out, stats = R.troll(zn, z_old, mask, tok, adv, bound, alpha)
    (g,) = torch.autograd.grad(out.loss.sum(), zn)
    assert stats.projected.any() and (~stats.projected).any()  # both branches
    for i, j in ((i, j) for i in range(z_new.shape[0]) for j in range(z_new.shape[1])):
        keep = mask[i, j]
        loss, grad = _ref_position(
            z_new[i, j][keep].tolist(), z_old[i, j][keep].tolist(), int(tok[i, j]), float(adv[i]), bound, alpha
        )
        assert out.loss[i, j].item() == pytest.approx(loss, rel=1e-10, abs=1e-12)
        torch.testing.assert_close(g[i, j][keep], torch.tensor(grad, dtype=D), **TOL)
        assert (g[i, j][~keep] == 0).all()


def test_troll_hand_computed_two_token_support():
    # pi~ = (0.8, 0.2), pi_old = (0.5, 0.5), sampled token 0, A = +1, alpha 1.
    # KL(pi~ || pi_old) = 0.8 ln 1.6 + 0.2 ln 0.4 = 0.3760029 - 0.1832581 = 0.1927448.
    # With pi_old uniform, pi_a = normalise(pi~^a): pi_a(0) = 0.8^a / (0.8^a + 0.2^a) = 1 / (1 + 4^-a); at a = 1/2,
    # pi = (2/3, 1/3) and KL(pi || pi_old) = ln 2 + (2/3) ln(2/3) + (1/3) ln(1/3) = (5/3) ln 2 - ln 3 = 0.0566330.
    # So with eps = (5/3) ln 2 - ln 3: a* = 1/2, eta* = 1, pi* = (2/3, 1/3).
    #   ratio = (2/3) / (1/2) = 4/3; KL(pi~ || pi*) = 0.8 ln 1.2 + 0.2 ln 0.6 = 0.1458573 - 0.1021651 = 0.0436921;
    #   l = -4/3 + 0.0436921 = -1.2896412.
    # On two tokens the boundary is one point, whatever pi~ outside it: the ratio term has no gradient, and the
    # regression term's is pi~0 pi~1 ((ln pi~0 - ln pi*0) - (ln pi~1 - ln pi*1)) = 0.16 (ln 1.2 - ln 0.6)
    #   = 0.16 ln 2 = 0.1109035 for logit 0, its negative for logit 1.
    eps = 5 / 3 * math.log(2) - math.log(3)
    z = torch.log(_t([[0.8, 0.2]])).requires_grad_()
    z_old = torch.log(_t([[0.5, 0.5]]))
    mask = torch.ones(1, 1, 2, dtype=torch.bool)
    out, stats = R.troll(z, z_old, mask, torch.tensor([[0]]), _t(1.0), eps, 1.0)
    assert stats.kl_before.item() == pytest.approx(0.8 * math.log(1.6) + 0.2 * math.log(0.4), rel=1e-14)
    assert stats.eta.item() == pytest.approx(1.0, rel=1e-12) and stats.kl_after.item() == pytest.approx(eps, rel=1e-12)
    reg = 0.8 * math.log(1.2) + 0.2 * math.log(0.6)
    assert out.loss.item() == pytest.approx(-4 / 3 + reg, rel=1e-12)
    assert -4 / 3 + reg == pytest.approx(-1.2896412, abs=1e-7)
    (g,) = torch.autograd.grad(out.loss.sum(), z)
    torch.testing.assert_close(g[0], _t([0.16 * math.log(2), -0.16 * math.log(2)]), rtol=1e-10, atol=1e-12)
    # Inside the region: pi~ = (0.55, 0.45), KL = 0.55 ln 1.1 + 0.45 ln 0.9 = 0.0524206 - 0.0474122 = 0.0050084 <
    # 0.05: pi* = pi~, l = -1.1 A, d l / d z = -A w (e_0 - pi~) = -1.1 (0.45, -0.45) = (-0.495, 0.495).
    z = torch.log(_t([[0.55, 0.45]])).requires_grad_()
    out, stats = R.troll(z, z_old, mask, torch.tensor([[0]]), _t(1.0), 0.05, 1.0)
    assert not stats.projected.any() and stats.eta.item() == 0.0
    assert out.loss.item() == pytest.approx(-1.1, rel=1e-12)
    (g,) = torch.autograd.grad(out.loss.sum(), z)
    torch.testing.assert_close(g[0], _t([-0.495, 0.495]), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("spread", [0.3, 1.2])
def test_troll_expected_gradient_is_the_projected_objective_gradient(seed, spread):
    # sum_a pi_old(a) l(a), each sampled action a row of an (N = 6, T = 1, K = 6) batch on the full support, is
    # -(sum_a pi*(a) A(a)) + alpha KL(pi~ || SG(pi*)): its gradient must be the reference's for that objective.
    theta, theta_old, adv = _bandit(seed, spread=spread)
    k = theta.shape[0]
    th = theta.clone().requires_grad_()
    z_new = th.expand(k, 1, k)
    z_old = theta_old.expand(k, 1, k)
    mask = torch.ones(k, 1, k, dtype=torch.bool)
    out, stats = R.troll(z_new, z_old, mask, torch.arange(k)[:, None], adv[:, None], 0.05, 1.0)
    q = torch.softmax(theta_old, -1)
    (got,) = torch.autograd.grad((q * out.loss[:, 0]).sum(), th)
    # The reference's per-action gradients, weighted by pi_old: the expected per-token gradient.
    want = torch.zeros(k, dtype=D)
    for a in range(k):
        _, grad = _ref_position(theta.tolist(), theta_old.tolist(), a, float(adv[a]), 0.05, 1.0)
        want += q[a] * torch.tensor(grad, dtype=D)
    torch.testing.assert_close(got, want, **TOL)
    # ... which is the gradient of the distribution-level objective: sum_a pi_old(a) pi*(a) / pi_old(a) A(a) is
    # sum_a pi*(a) A(a), with pi* the projection that the loss differentiates through.
    proj = R.project(torch.log_softmax(th, -1), torch.log_softmax(theta_old, -1), mask[0, 0], 0.05)
    J = (proj.logp.exp() * adv).sum() - R.kl_on_support(torch.log_softmax(th, -1), proj.logp.detach(), mask[0, 0])
    (want_J,) = torch.autograd.grad(-J, th)
    torch.testing.assert_close(got, want_J, **TOL)
    assert bool(stats.projected[0, 0]) == (spread > 1)


def test_troll_projection_is_the_kl_minimiser_in_the_region():
    # Against 4000 random distributions inside KL(pi || pi_old) <= eps: none is closer to pi~ in KL(pi || pi~).
    g = torch.Generator().manual_seed(7)
    lpn = torch.log_softmax(2.0 * torch.randn(3, generator=g, dtype=D), -1)
    lpo = torch.log_softmax(torch.randn(3, generator=g, dtype=D), -1)
    mask = torch.ones(3, dtype=torch.bool)
    proj = R.project(lpn, lpo, mask, 0.05)
    assert proj.projected and proj.kl_after.item() == pytest.approx(0.05, rel=1e-12)
    flat = -torch.log(torch.rand(200000, 3, generator=g, dtype=D))  # uniform on the simplex, once normalised
    near = lpo + 0.3 * torch.randn(200000, 3, generator=g, dtype=D)  # and many near pi_old
    cand = torch.cat([flat.log(), near]).log_softmax(-1)
    inside = R.kl_on_support(cand, lpo.expand_as(cand), mask.expand_as(cand)) <= 0.05
    assert inside.sum() > 4000
    best = R.kl_on_support(proj.logp, lpn, mask)
    assert (R.kl_on_support(cand[inside], lpn.expand_as(cand[inside]), mask.expand_as(cand[inside])) >= best).all()


def test_troll_on_policy_is_the_policy_gradient():
    # pi~ = pi_old: nothing is projected (eta 0), the regression term is 0 with gradient 0, and
    # d l / d z_j = -A d pi~(y) / pi~(y) / d z_j = -A ([y = j] - pi~(j)): the plain policy gradient.
    z_new, z_old, mask, tok, adv = _troll_case(0)
    zn = z_old.clone().requires_grad_()
    out, stats = R.troll(zn, z_old, mask, tok, adv)
    assert not stats.projected.any() and (stats.eta == 0).all()
    (g,) = torch.autograd.grad(out.loss.sum(), zn)
    p = torch.softmax(torch.where(mask, z_old, torch.full_like(z_old, float("-inf"))), -1)
    onehot = torch.nn.functional.one_hot(tok, z_old.shape[-1]).to(D)
    torch.testing.assert_close(g, -adv[:, None, None] * (onehot - p), rtol=1e-12, atol=1e-15)


def test_troll_invariants_empty_supports_extreme_logits_float32():
    z_new, z_old, mask, tok, adv = _troll_case(1)
    mask[2, 1] = False  # a padding position: no support at all
    z_new = z_new.clone()
    z_new[0, 1, 0] += 40.0  # pi~ almost a point mass far from pi_old
    zn = z_new.clone().requires_grad_()
    out, stats = R.troll(zn, z_old, mask, tok, adv)
    (g,) = torch.autograd.grad(out.loss.sum(), zn)
    assert torch.isfinite(out.loss).all() and torch.isfinite(g).all()
    assert not stats.projected[2, 1] and (g[2, 1] == 0).all()
    assert stats.kl_after[0, 1].item() == pytest.approx(0.05, rel=1e-10)  # projected back onto the boundary
    assert (stats.kl_after[stats.projected] - 0.05).abs().max() < 1e-12
    assert (stats.kl_after <= 0.05 + 1e-12).all()
    out32, _ = R.troll(z_new.float().requires_grad_(), z_old.float(), mask, tok, adv.float())
    assert torch.isfinite(out32.loss).all()
    torch.testing.assert_close(out32.loss.double(), out.loss.detach(), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- sparse supports


def test_sparse_support_hand_computed():
    # V = 6. pi_old = (0.5, 0.3, 0.1, 0.05, 0.03, 0.02), pi~ = (0.05, 0.9, 0.02, 0.01, 0.01, 0.01); top_k 3,
    # mass 0.85: pi_old keeps token 0 (mass before 0), 1 (before 0.5), 2 (before 0.8 < 0.85); pi~ keeps
    # token 1 (before 0), not 0 (before 0.9 >= 0.85). The sampled token 5 joins: support {0, 1, 2, 5}.
    lo = torch.log(_t([0.5, 0.3, 0.1, 0.05, 0.03, 0.02]))
    ln = torch.log(_t([0.05, 0.9, 0.02, 0.01, 0.01, 0.01]))
    s = R.sparse_support(lo, ln, torch.tensor([5]), top_k=3, mass=0.85)
    assert s.index.shape == (1, 7)  # width 2 * 3 + 1
    assert s.index[0][s.mask[0]].tolist() == [0, 1, 2, 5] and s.mask[0].sum() == 4
    assert s.index[0, s.token_index[0]].item() == 5
    # pi_old stored sparsely as its kept set {0: 0.5, 1: 0.3, 2: 0.1}: token 5 gets the leftover 0.1 spread over the
    # 6 - 3 = 3 tokens outside it, log(0.1 / 3); the others their own log-probs.
    ids, keep = R.top_mass(lo, 3, 0.85)
    got = R.old_on_support(s, ids, lo.gather(-1, ids), keep, vocab=6)
    want = torch.log(_t([0.5, 0.3, 0.1, 0.1 / 3]))
    torch.testing.assert_close(got[s.mask], want[0], rtol=1e-14, atol=0)


def test_troll_on_a_full_support_equals_the_dense_projection():
    # mass 1 and top_k = V: the support is the whole vocabulary (in id order), and gathering the full log-probs
    # there gives the dense loss.
    z_new, z_old, _, tok, adv = _troll_case(2, k=6)
    lpn, lpo = z_new.log_softmax(-1), z_old.log_softmax(-1)
    s = R.sparse_support(lpo, lpn, tok, top_k=6, mass=2.0)
    assert s.mask.sum(-1).eq(6).all() and (s.index[..., :6] == torch.arange(6)).all()
    sparse, _ = R.troll(lpn.gather(-1, s.index), lpo.gather(-1, s.index), s.mask, s.token_index, adv)
    dense, _ = R.troll(z_new, z_old, torch.ones_like(lpn, dtype=torch.bool), tok, adv)
    torch.testing.assert_close(sparse.loss, dense.loss, **TOL)


def test_troll_from_a_stored_old_set_equals_the_full_old_log_probs_where_the_set_covers_them():
    # The trainer's path (docs/algorithms/troll.md): pi_old kept as its top_mass set, the support the union of that
    # set, pi~'s set and the sampled token (`union_support`), pi_old's log-probs there from the set
    # (`old_on_support`). With a set that is the whole vocabulary it is the full-log-prob path exactly; with a
    # sparse set, every support token inside it keeps its true log-prob.
    z_new, z_old, _, tok, adv = _troll_case(3, k=8, spread=2.0)
    lpn, lpo = z_new.log_softmax(-1), z_old.log_softmax(-1)
    for top_k, mass in ((8, 2.0), (3, 0.9)):
        ids_o, keep_o = R.top_mass(lpo, top_k, mass)
        ids_n, keep_n = R.top_mass(lpn, top_k, mass)
        s = R.union_support(torch.cat([ids_o, ids_n], -1), torch.cat([keep_o, keep_n], -1), tok, 8)
        old_s = R.old_on_support(s, ids_o, lpo.gather(-1, ids_o), keep_o, vocab=8)
        in_set = (s.index[..., :, None] == torch.where(keep_o, ids_o, -1)[..., None, :]).any(-1) & s.mask
        torch.testing.assert_close(old_s[in_set], lpo.gather(-1, s.index)[in_set], rtol=0, atol=0)
        if top_k == 8:
            assert in_set.sum() == s.mask.sum()
            full = R.sparse_support(lpo, lpn, tok, top_k=8, mass=2.0)
            a, _ = R.troll(lpn.gather(-1, s.index), old_s, s.mask, s.token_index, adv)
            b, _ = R.troll(lpn.gather(-1, full.index), lpo.gather(-1, full.index), full.mask, full.token_index, adv)
            torch.testing.assert_close(a.loss, b.loss, **TOL)
        else:
            assert (s.mask & ~in_set).any()  # some support tokens come from pi~'s set only: filled
