"""Hand-computed numeric cases for each surrogate (the arithmetic in the comments)."""

import math

import pytest
import torch

from tether.core import etr as E
from tether.core import rpg
from tether.core import surrogates as S

D = torch.float64


def _grad(fn, lp0):
    lp = lp0.clone().requires_grad_()
    out = fn(lp)
    out.loss.sum().backward()
    return out, lp.grad


def test_ppo_clip_hand_cases():
    # lp_old = 0, so w = exp(lp). eps = 0.2, dual clip c = 3.
    w = torch.tensor([[1.5, 0.5, 0.5, 1.5, 4.0]], dtype=D)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0]], dtype=D)
    out, g = _grad(lambda lp: S.ppo_clip(lp, torch.zeros_like(lp), adv, 0.2, 0.2, dual_clip_c=3.0), w.log())
    # A>0, w=1.5: -min(1.5, 1.2) = -1.2, clipped (grad 0)
    # A>0, w=0.5: -min(0.5, 0.8) = -0.5, grad d/dlp = -A w = -0.5
    # A<0, w=0.5: -min(-0.5, -0.8) = 0.8, clipped (grad 0)
    # A<0, w=1.5: -min(-1.5, -1.2) = 1.5, grad -A w = 1.5
    # A<0, w=4:   -max(min(-4, -1.2), -3) = 3, dual-clipped (grad 0)
    torch.testing.assert_close(out.loss, torch.tensor([[-1.2, -0.5, 0.8, 1.5, 3.0]], dtype=D))
    torch.testing.assert_close(g, torch.tensor([[0.0, -0.5, 0.0, 1.5, 0.0]], dtype=D))
    assert out.clip_high.tolist() == [[True, False, False, False, False]]
    assert out.clip_low.tolist() == [[False, False, True, False, False]]
    assert out.clip_dual.tolist() == [[False, False, False, False, True]]


def test_ppo_clip_accepts_per_token_bounds():
    # Same ratio 1.5 and A = 1 everywhere; eps_high per token 0.1, 0.6: losses -1.1 (clipped), -1.5.
    lp = torch.log(torch.tensor([[1.5, 1.5]], dtype=D))
    eps_high = torch.tensor([[0.1, 0.6]], dtype=D)
    out, g = _grad(lambda x: S.ppo_clip(x, torch.zeros_like(x), torch.ones(1, dtype=D), 0.2, eps_high), lp)
    torch.testing.assert_close(out.loss, torch.tensor([[-1.1, -1.5]], dtype=D))
    torch.testing.assert_close(g, torch.tensor([[0.0, -1.5]], dtype=D))


def test_cispo_hand_case():
    # lp_old = log 0.4, lp = log 0.6: w = 1.5, truncated to 1 + 0.28 = 1.28.
    # loss = -1.28 * A * lp = -1.28 * 2 * log(0.6) = 1.30770...; d/dlp = -1.28 * 2 = -2.56 (gradient kept).
    lp_old = torch.log(torch.tensor([[0.4]], dtype=D))
    out, g = _grad(
        lambda lp: S.cispo(lp, lp_old, torch.tensor([2.0], dtype=D), 1.0, 0.28),
        torch.log(torch.tensor([[0.6]], dtype=D)),
    )
    assert out.loss.item() == pytest.approx(-1.28 * 2 * math.log(0.6), rel=1e-12)
    assert g.item() == pytest.approx(-2.56, rel=1e-12)
    assert out.clip_high.item()


def test_gspo_hand_case():
    # Token log-ratios 0.1 and -0.3: sequence ratio w = exp(-0.1) = 0.904837; A = 1 and
    # eps 3e-4: w < 1 - eps but A > 0 binds only the upper side, so the token loss is -w
    # and each token's gradient is -w (sum over the 2 tokens; seq-mean divides by 2 later).
    lp_old = torch.tensor([[-1.0, -2.0]], dtype=D)
    lp0 = lp_old + torch.tensor([[0.1, -0.3]], dtype=D)
    mask = torch.ones(1, 2, dtype=D)
    out, g = _grad(lambda lp: S.gspo(lp, lp_old, torch.ones(1, dtype=D), mask), lp0)
    w = math.exp(-0.1)
    torch.testing.assert_close(out.loss, torch.full((1, 2), -w, dtype=D))
    torch.testing.assert_close(g, torch.full((1, 2), -w, dtype=D))
    # With A = -1 the lower bound binds: the whole sequence is clipped, gradient 0.
    out, g = _grad(lambda lp: S.gspo(lp, lp_old, -torch.ones(1, dtype=D), mask), lp0)
    assert out.clip_low.all() and (g == 0).all()
    torch.testing.assert_close(out.loss, torch.full((1, 2), 1 - 3e-4, dtype=D))


def test_gspo_gradient_is_the_sequence_objective_gradient():
    # With seq-mean-token-mean, sum_t l_t / |o| has the gradient of -w_i A_i, w_i = exp(mean_t log ratio).
    N, T = 3, 5
    lp_old = -torch.rand(N, T, dtype=D)
    lp0 = lp_old + 1e-5 * torch.randn(N, T, dtype=D)  # inside the tiny GSPO range
    mask = torch.ones(N, T, dtype=D)
    mask[1, 3:] = 0
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=D)
    lp = lp0.clone().requires_grad_()
    loss = (S.gspo(lp, lp_old, adv, mask, 1.0, 1.0).loss * mask).sum(-1) / mask.sum(-1)
    g1 = torch.autograd.grad(loss.sum(), lp)[0]
    lp = lp0.clone().requires_grad_()
    w = torch.exp(((lp - lp_old) * mask).sum(-1) / mask.sum(-1))
    g2 = torch.autograd.grad(-(w * adv).sum(), lp)[0]
    torch.testing.assert_close(g1 * mask, g2, rtol=1e-12, atol=1e-14)


def test_reinforce_hand_case():
    # -A lp = -(-0.5)(-2) = -1 ; d/dlp = -A = 0.5. With importance weight w = e^0.5: loss -e^0.5.
    lp0, lp_old, adv = torch.tensor([[-2.0]], dtype=D), torch.tensor([[-2.5]], dtype=D), torch.tensor([-0.5], dtype=D)
    out, g = _grad(lambda lp: S.reinforce(lp, lp_old, adv), lp0)
    assert out.loss.item() == pytest.approx(-1.0) and g.item() == pytest.approx(0.5)
    out, g = _grad(lambda lp: S.reinforce(lp, lp_old, adv, importance_weight=True), lp0)
    assert out.loss.item() == pytest.approx(-math.exp(0.5), rel=1e-12)
    assert g.item() == pytest.approx(0.5 * math.exp(0.5), rel=1e-12)


def test_rpg_hand_cases():
    # urkl, anchor old (q = 1), log w = 0.2, beta = 0.1, A = 1, lp = -1:
    # C_KL = -beta w log w = -0.1 * e^0.2 * 0.2 = -0.02 e^0.2
    # REINFORCE: loss = -(w A + C_KL) lp = -(0.98 e^0.2)(-1) = 0.98 e^0.2, d/dlp = -0.98 e^0.2
    # differentiable: loss = -w A + beta (1 - w + w log w) = -e^0.2 + 0.1 (1 - e^0.2 + 0.2 e^0.2)
    lp0, lp_old = torch.tensor([[-1.0]], dtype=D), torch.tensor([[-1.2]], dtype=D)
    adv, log_q, w = torch.ones(1, dtype=D), torch.zeros(1, 1, dtype=D), math.exp(0.2)
    out, g = _grad(lambda lp: rpg.rpg_reinforce("urkl", lp, lp_old, adv, 0.1, log_q), lp0)
    assert out.loss.item() == pytest.approx(0.98 * w, rel=1e-12)
    assert g.item() == pytest.approx(-0.98 * w, rel=1e-12)
    out, g = _grad(lambda lp: rpg.rpg_differentiable("urkl", lp, lp_old, adv, 0.1, log_q), lp0)
    assert out.loss.item() == pytest.approx(-w + 0.1 * (1 - w + 0.2 * w), rel=1e-12)
    assert g.item() == pytest.approx(-0.98 * w, rel=1e-12)  # same gradient, Prop. 4.1
    # fkl: C_KL = beta q = 0.1, so the REINFORCE weight is w + 0.1.
    out, g = _grad(lambda lp: rpg.rpg_reinforce("fkl", lp, lp_old, adv, 0.1, log_q), lp0)
    assert g.item() == pytest.approx(-(w + 0.1), rel=1e-12)


def test_clipped_differentiable_form_clamps_the_kl_term():
    # rkl term w log rho with log w = 5, log q = -10: w log rho = e^5 * 15 = 2226 -> clamped to 10.
    lp_old = torch.tensor([[-6.0]], dtype=D)
    lp0 = lp_old + 5.0
    log_q = torch.full((1, 1), -10.0, dtype=D)
    out, g = _grad(
        lambda lp: rpg.rpg_clipped_differentiable("rkl", lp, lp_old, torch.ones(1, dtype=D), 0.5, log_q), lp0
    )
    # PPO part: A > 0 and w = e^5 > 1.28 -> -1.28 (no gradient); KL part 0.5 * 10 (clamped, no gradient).
    assert out.loss.item() == pytest.approx(-1.28 + 5.0)
    assert g.item() == 0.0


RPG_KLS = ("fkl", "ufkl", "rkl", "urkl")
RPG_FORMS = (  # (form, clip) -> the surrogate function with its trust region off or on
    ("differentiable", "none"),
    ("differentiable", "rpg"),
    ("reinforce", "none"),
    ("reinforce", "rpg"),
)


def _rpg_surrogate(form, clip):
    return {
        ("differentiable", "none"): rpg.rpg_differentiable,
        ("differentiable", "rpg"): rpg.rpg_clipped_differentiable,
        ("reinforce", "none"): rpg.rpg_reinforce,
        ("reinforce", "rpg"): rpg.rpg_style_clip,
    }[(form, clip)]


@pytest.mark.parametrize("kl", RPG_KLS)
@pytest.mark.parametrize("form,clip", RPG_FORMS)
@pytest.mark.parametrize("anchor", ["old", "ref"])
def test_no_clamp_changes_a_gradient_the_objective_defines(kl, form, clip, anchor):
    # Log-probs far below -10 with every ratio inside the trust region (0.8, 1.28) and every
    # |term| small: each token's gradient must be the objective's, d l / d lp = -(w A + C_KL(w))
    # (Prop. 4.1 token by token), whatever the size of lp itself (issue 13, item 1).
    g = torch.Generator().manual_seed(1)
    N, T = 4, 6
    lp_old = -11.0 - 20.0 * torch.rand(N, T, generator=g, dtype=D)  # log pi_old in (-31, -11)
    lp0 = lp_old + 0.3 * (torch.rand(N, T, generator=g, dtype=D) - 0.5)  # w in (0.86, 1.16)
    adv = torch.randn(N, generator=g, dtype=D)
    log_q = torch.zeros(N, T, dtype=D) if anchor == "old" else 0.1 * torch.randn(N, T, generator=g, dtype=D)
    beta = 0.7
    out, grad = _grad(lambda lp: _rpg_surrogate(form, clip)(kl, lp, lp_old, adv, beta, log_q), lp0)
    log_w = lp0 - lp_old
    want = -(torch.exp(log_w) * adv[:, None] + rpg.c_kl(kl, beta, log_w, log_q))
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-12)


def test_fkl_clipped_differentiable_gradient_is_minus_beta_q_over_n_even_at_very_low_logprobs():
    # The case: A = 0, on-policy (w = 1, q = 1), beta = 1, token-mean over 5 tokens: the
    # gradient of each token is -beta q / 5 = -0.2, also for log pi = -12 and -15 (was 0 there,
    # when the clamp acted on -q lp instead of -q log rho).
    from tether import objectives

    obj = objectives.build({"name": "rpg", "kl": "fkl", "form": "differentiable", "clip": "rpg", "beta": 1.0})
    lp = torch.tensor([[-0.5, -3.0, -9.0, -12.0, -15.0]], dtype=D, requires_grad=True)
    out = obj(
        objectives.TokenBatch(
            logprobs=lp,
            old_logprobs=lp.detach(),
            advantages=torch.zeros(1, dtype=D),
            loss_mask=torch.ones(1, 5, dtype=D),
        )
    )
    out.loss.backward()
    torch.testing.assert_close(lp.grad, torch.full((1, 5), -0.2, dtype=D), rtol=1e-12, atol=1e-12)
    assert out.loss.item() == pytest.approx(0.0, abs=1e-15)  # -q log rho = 0 on-policy


def test_rpg_style_clip_branch_on_advantage_sends_a_zero_advantage_to_the_negative_branch():
    # branch_on="advantage" follows the released code, torch.where(A > 0, ...): A = 0 (a zero-
    # variance group) takes the negative branch, whose mask is 1 - eps_low < w < c. urkl, beta
    # 0.1, q = 1; weights w = 1.5, 0.7, 1.1:
    #   w = 1.5 > 1.28: kept (negative branch), gradient -C_KL(w_bar = 1.28) = 0.1 * 1.28 log 1.28
    #   w = 0.7 < 0.8: dropped, gradient 0 (the positive branch, A >= 0, would have kept it)
    #   w = 1.1: kept, gradient -C_KL(1.1) = 0.1 * 1.1 log 1.1
    lp_old = torch.full((1, 3), -1.0, dtype=D)
    w = torch.tensor([[1.5, 0.7, 1.1]], dtype=D)
    out, g = _grad(
        lambda lp: rpg.rpg_style_clip(
            "urkl", lp, lp_old, torch.zeros(1, dtype=D), 0.1, torch.zeros(1, 3, dtype=D), branch_on="advantage"
        ),
        lp_old + w.log(),
    )
    want = torch.tensor([[0.1 * 1.28 * math.log(1.28), 0.0, 0.1 * 1.1 * math.log(1.1)]], dtype=D)
    torch.testing.assert_close(g, want, rtol=1e-12, atol=1e-15)
    assert out.clip_low.tolist() == [[False, True, False]] and not out.clip_high.any()


def test_etr_bounds_hand_case():
    # Group 0 rewards (1,0,1,0): p = 1/2, nu = 4 p (1-p) = 1. Group 1 (1,0,0,0): p = 1/4, nu = 0.75.
    # mean nu = 0.875; eta = 0.5: macro_0 = 1 + 0.5 * 0.125 = 1.0625, macro_1 = 1 - 0.0625 = 0.9375.
    # A = 0.866 (say) in group 0: micro = 1 + 0.5 tanh(0.866); eps_high = 0.28 * micro * 1.0625.
    rewards = torch.tensor([1.0, 0, 1, 0, 1, 0, 0, 0], dtype=D)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv = torch.tensor([0.866, -0.866, 0.866, -0.866, 1.5, -0.5, -0.5, -0.5], dtype=D)
    stats = E.etr_group_stats(rewards, groups)
    b = E.etr_bounds(adv, stats, 0.2, 0.28, alpha=0.5, eta=0.5, eps_min=0.0, eps_max=10.0)
    torch.testing.assert_close(stats.nu, torch.tensor([1.0] * 4 + [0.75] * 4, dtype=D))
    torch.testing.assert_close(stats.nu_shift, torch.tensor([0.125] * 4 + [-0.125] * 4, dtype=D))
    assert b.eps_high[0].item() == pytest.approx(0.28 * (1 + 0.5 * math.tanh(0.866)) * 1.0625, rel=1e-12)
    assert b.eps_low[4].item() == pytest.approx(0.2 * (1 + 0.5 * math.tanh(1.5)) * 0.9375, rel=1e-12)
    torch.testing.assert_close(stats.pass_rate, torch.tensor([0.5] * 4 + [0.25] * 4, dtype=D))
    # The statistics of a subset of rows are the whole batch's, selected: group 1 alone keeps its
    # macro factor 0.9375 (a micro-batch holding only group 1 would have had nu_bar = nu_1, factor 1).
    sub = E.etr_bounds(
        adv[4:], stats.select(torch.arange(4, 8)), 0.2, 0.28, alpha=0.5, eta=0.5, eps_min=0.0, eps_max=10.0
    )
    torch.testing.assert_close(sub.eps_low, b.eps_low[4:], rtol=0, atol=0)
    # Every factor can be switched off: alpha = eta = 0 gives the base eps everywhere.
    flat = E.etr_bounds(adv, stats, 0.2, 0.28, alpha=0.0, eta=0.0, eps_min=0.0, eps_max=10.0)
    assert torch.all(flat.eps_high == 0.28) and torch.all(flat.eps_low == 0.2)
    # Clamping to [eps_min, eps_max].
    tight = E.etr_bounds(adv, stats, 0.2, 0.28, alpha=5.0, eta=0.5, eps_min=0.1, eps_max=0.3)
    assert tight.eps_high.max().item() == 0.3


def test_etr_implicit_mode_uses_unnormalised_deviation():
    # implicit: micro = 1 + alpha tanh(|R - mean_g|) and no macro factor: group 1 (mean 0.25)
    # gives |1 - 0.25| = 0.75 for its success, whatever advantage was passed.
    rewards = torch.tensor([1.0, 0, 1, 0, 1, 0, 0, 0], dtype=D)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv = torch.full((8,), 100.0, dtype=D)
    b = E.etr_bounds(
        adv,
        E.etr_group_stats(rewards, groups),
        0.2,
        0.28,
        alpha=0.5,
        eta=0.5,
        eps_min=0.0,
        eps_max=10.0,
        macro="implicit",
    )
    assert b.eps_high[4].item() == pytest.approx(0.28 * (1 + 0.5 * math.tanh(0.75)), rel=1e-12)
    assert b.eps_high[0].item() == pytest.approx(0.28 * (1 + 0.5 * math.tanh(0.5)), rel=1e-12)
