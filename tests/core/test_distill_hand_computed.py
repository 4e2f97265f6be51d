"""On-policy distillation's math (`tether.core.distill`, `tether.objectives.distill`), on CPU in float64:

1. hand-computed numbers, the arithmetic in the comments: the discounted sum to go, the reverse-KL advantage with
   its clamp and the task mix, the objective's loss and gradient on it (REINFORCE) and on the k3 loss term, the
   top-k forward KL (truncated, clamped, with a tail bucket) and its gradient;
2. exactness by enumeration: every sequence of a two-token autoregressive softmax policy, weighted by its
   probability. The reverse-KL advantage summed to go (discount 1) is the policy gradient of KL(student || teacher)
   over whole sequences, to 1e-12; the k3 loss term's expected gradient is the FORWARD KL's, as tether.core.kl says;
3. gradients: `torch.autograd.gradcheck` of the top-k forward KL, with and without the tail;
4. invariants: an environment's or padding's token (mask 0, holding NaN or -inf) moves no advantage, loss or
   metric; an all-masked batch is finite and 0; the config refuses what it cannot mean, naming the fix.
"""

import math

import pytest
import torch

from tether import objectives
from tether.core import distill as D_
from tether.core.distill import DISTILL_SIGNALS, discounted_to_go, reverse_kl_advantage, topk_forward_kl, with_tail
from tether.schema import ConfigError

D = torch.float64


def _t(*rows):
    return torch.tensor(rows, dtype=D)


# ---------------------------------------------------------------- 1. hand-computed


def test_discounted_sum_to_go():
    # x = (1, 2, 3), gamma 0.5: (1 + 0.5 * 2 + 0.25 * 3, 2 + 0.5 * 3, 3) = (2.75, 3.5, 3); gamma 0 is x itself.
    x = _t([1.0, 2.0, 3.0])
    torch.testing.assert_close(discounted_to_go(x, 0.5), _t([2.75, 3.5, 3.0]), rtol=0, atol=1e-15)
    assert discounted_to_go(x, 0.0) is x
    torch.testing.assert_close(discounted_to_go(x, 1.0), _t([6.0, 5.0, 3.0]), rtol=0, atol=0)


def test_reverse_kl_advantage_by_hand():
    # lp_old = (-1, -2, -0.5), lp_teacher = (-1.5, -1, -0.5) -> k1 cost c = lp_old - lp_teacher = (0.5, -1, 0);
    # mask (1, 1, 0), coef 2: A = -2 c m = (-1, 2, 0).
    cost, m = _t([0.5, -1.0, 0.0]), _t([1.0, 1.0, 0.0])
    torch.testing.assert_close(reverse_kl_advantage(cost, m, 2.0), _t([-1.0, 2.0, 0.0]), rtol=0, atol=0)
    # discount 0.5: (-1 + 0.5 * 2, 2, 0) = (0, 2, 0).
    torch.testing.assert_close(reverse_kl_advantage(cost, m, 2.0, 0.5), _t([0.0, 2.0, 0.0]), rtol=0, atol=0)
    # clamp 0.75: c = (0.5, -0.75, 0) -> (-1, 1.5, 0).
    torch.testing.assert_close(reverse_kl_advantage(cost, m, 2.0, 0.0, 0.75), _t([-1.0, 1.5, 0.0]), rtol=0, atol=0)
    # the task mix: A = (0.5) per sequence, task_coef 0.25 -> 0.125 + (-1, 2, 0).
    mixed = D_.mixed_advantage(_t(0.5), _t([-1.0, 2.0, 0.0]), 0.25)
    torch.testing.assert_close(mixed, _t([-0.875, 2.125, 0.125]), rtol=0, atol=0)


def test_the_objective_trains_on_the_reverse_kl_advantage():
    # REINFORCE, token-mean, pure distillation (task_coef 0): l_t = -A_t lp_t with A_t = -(lp_old - lp_teacher).
    # lp = lp_old = (-1, -2 | -0.5, pad), lp_teacher = (-1.5, -1 | -0.25, pad): A = (-0.5, 1 | 0.25, 0).
    # loss = -(-0.5 * -1 + 1 * -2 + 0.25 * -0.5) / 3 = -(0.5 - 2 - 0.125) / 3 = 1.625 / 3; d loss / d lp = -A / 3.
    lp = _t([-1.0, -2.0], [-0.5, 0.0]).requires_grad_()
    mask = _t([1.0, 1.0], [1.0, 0.0])
    teacher = _t([-1.5, -1.0], [-0.25, float("nan")])  # padding may hold anything
    obj = objectives.build({"name": "reinforce", "distill": {"signal": "reverse_kl", "task_coef": 0.0}})
    b = objectives.TokenBatch(lp, lp.detach(), _t(3.0, -3.0), mask, teacher_logprobs=teacher)
    out = obj(b)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(1.625 / 3, rel=1e-14)
    torch.testing.assert_close(lp.grad, _t([-0.5, 1.0], [0.25, 0.0]) / -3, rtol=1e-14, atol=0)
    # distill/reverse_kl = mean_m(lp - lp_teacher) = (0.5 - 1 - 0.25) / 3; k3 with log r = (-0.5, 1, 0.25).
    assert out.metrics["distill/reverse_kl"].item() == pytest.approx(-0.75 / 3, rel=1e-14)
    k3 = sum(math.expm1(x) - x for x in (-0.5, 1.0, 0.25)) / 3
    assert out.metrics["distill/k3"].item() == pytest.approx(k3, rel=1e-14)
    assert out.metrics["distill/advantage_mean"].item() == pytest.approx(0.75 / 3, rel=1e-14)


def test_the_k3_loss_term_by_hand():
    # kl_loss (k3), coef 0.5, pure distillation (task_coef 0: the policy term is 0): log r = lp_teacher - lp =
    # (-1.5 + 1, -1 + 2) = (-0.5, 1); k3 = e^x - 1 - x = (e^-0.5 - 0.5, e - 2); token-mean over 2 tokens (pad out).
    # d k3 / d lp = 1 - e^x = (1 - e^-0.5, 1 - e), times coef / 2.
    lp = _t([-1.0, -2.0, 0.0]).requires_grad_()
    mask = _t([1.0, 1.0, 0.0])
    teacher = _t([-1.5, -1.0, float("-inf")])
    obj = objectives.build({"name": "reinforce", "distill": {"signal": "kl_loss", "coef": 0.5, "task_coef": 0.0}})
    out = obj(objectives.TokenBatch(lp, lp.detach(), _t(1.0), mask, teacher_logprobs=teacher))  # (1, 3)
    out.loss.backward()
    k3 = (math.exp(-0.5) - 0.5 + math.e - 2) / 2
    assert out.metrics["loss/distill"].item() == pytest.approx(k3, rel=1e-14)
    assert out.loss.item() == pytest.approx(0.5 * k3, rel=1e-14)
    want = _t([1 - math.exp(-0.5), 1 - math.e, 0.0]) * 0.5 / 2
    torch.testing.assert_close(lp.grad, want, rtol=1e-14, atol=0)


def test_topk_forward_kl_by_hand():
    # p_T = (0.5, 0.25), p_S = (0.25, 0.5) on the teacher's top 2: 0.5 log 2 + 0.25 log(1/2) = 0.25 log 2, and
    # d/d log p_S = -p_T = (-0.5, -0.25).
    s = torch.log(_t([0.25, 0.5])).requires_grad_()
    t = torch.log(_t([0.5, 0.25]))
    out = topk_forward_kl(s, t)
    assert out.loss.item() == pytest.approx(0.25 * math.log(2), rel=1e-14)
    assert out.student_mass.item() == pytest.approx(0.75, rel=1e-15)
    torch.testing.assert_close(torch.autograd.grad(out.loss.sum(), s)[0], _t([-0.5, -0.25]), rtol=1e-15, atol=0)
    # clamp 0.1: the value is 0.1 and no gradient is left.
    clamped = topk_forward_kl(s, t, clamp=0.1)
    assert clamped.loss.item() == pytest.approx(0.1, rel=1e-15)
    assert not torch.autograd.grad(clamped.loss.sum(), s)[0].any()
    # A truncated sum can be negative: p_T = 0.1, p_S = 0.5 -> 0.1 log 0.2 < 0, clamped to 0 (verl's clamp_min).
    neg = topk_forward_kl(torch.log(_t([0.5])).requires_grad_(), torch.log(_t([0.1])))
    assert neg.loss.item() == 0.0
    # log_prob_min -2: log 0.05 = -3.0 -> -2 for both sides; p_T = e^-2 then, 0 where they are equal.
    low = topk_forward_kl(torch.log(_t([0.01])), torch.log(_t([0.05])), log_prob_min=-2.0)
    assert low.loss.item() == 0.0 and low.teacher_mass.item() == pytest.approx(0.05, rel=1e-15)


def test_topk_forward_kl_with_a_tail_bucket_by_hand():
    # p_T = (0.6, 0.3 | tail 0.1), p_S = (0.3, 0.3 | tail 0.4): 0.6 log 2 + 0 + 0.1 log(1/4) = 0.4 log 2.
    # d/d log p_S(j) = -p_T(j) + p_T(tail) p_S(j) / p_S(tail): -0.6 + 0.1 * 0.3 / 0.4 = -0.525, -0.3 + 0.075 = -0.225.
    s = torch.log(_t([0.3, 0.3])).requires_grad_()
    t = torch.log(_t([0.6, 0.3]))
    torch.testing.assert_close(with_tail(t).exp(), _t([0.6, 0.3, 0.1]), rtol=1e-14, atol=0)
    out = topk_forward_kl(s, t, tail=True)
    assert out.loss.item() == pytest.approx(0.4 * math.log(2), rel=1e-14)
    torch.testing.assert_close(torch.autograd.grad(out.loss.sum(), s)[0], _t([-0.525, -0.225]), rtol=1e-13, atol=0)
    # The set holding all the mass: the tail is capped at log(1 - e^-1e-7), not log 0 (TRL's guard).
    full = with_tail(torch.log(_t([0.5, 0.5])))
    assert full[0, 2].item() == pytest.approx(math.log(-math.expm1(-1e-7)), rel=1e-12)


# ---------------------------------------------------------------- 2. exact by enumeration

V = 3


def _policy(theta):
    """Two tokens from a V-way softmax: y1 ~ softmax(theta[0]), y2 | y1 ~ softmax(theta[1 + y1]). Returns the
    (V * V, 2) log-probs of every sequence's tokens, row y1 * V + y2."""
    first = torch.log_softmax(theta[0], -1)  # (V,)
    second = torch.log_softmax(theta[1:], -1)  # (V, V): row y1
    ys = torch.cartesian_prod(torch.arange(V), torch.arange(V))
    return torch.stack([first[ys[:, 0]], second[ys[:, 0], ys[:, 1]]], 1)


def _thetas(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1 + V, V, generator=g, dtype=D)).requires_grad_(), torch.randn(1 + V, V, generator=g, dtype=D)


def test_the_advantage_summed_to_go_is_the_policy_gradient_of_the_sequence_reverse_kl():
    # E_{y ~ pi}[sum_t A_t grad log pi(y_t | y_<t)], A_t = -sum_{k >= t} (log pi - log q)(y_k) (discount 1), is
    # -grad KL(pi || q) over whole sequences: the objective's per-token loss weighted by each sequence's probability
    # has the gradient of KL(pi || q).
    theta, teacher_theta = _thetas(0)
    lp, lq = _policy(theta), _policy(teacher_theta)  # (9, 2)
    prob = lp.sum(1).exp().detach()
    obj = objectives.build({"name": "reinforce", "distill": {"signal": "reverse_kl", "task_coef": 0.0, "discount": 1}})
    mask = torch.ones(V * V, 2, dtype=D)
    terms = obj.terms(objectives.TokenBatch(lp, lp.detach(), torch.zeros(V * V, dtype=D), mask, teacher_logprobs=lq))
    (g_ours,) = torch.autograd.grad((prob[:, None] * terms.tokens.loss).sum(), theta, retain_graph=True)
    kl = (lp.sum(1).exp() * (lp.sum(1) - lq.sum(1))).sum()
    (g_kl,) = torch.autograd.grad(kl, theta)
    torch.testing.assert_close(g_ours, g_kl, rtol=1e-12, atol=1e-14)


def test_the_k3_loss_term_follows_the_forward_kl():
    # One position: E_{y ~ p}[grad k3(q(y) / p(y))] = -sum_y q(y) grad log p(y) = grad KL(q || p), the FORWARD KL.
    theta, teacher_theta = _thetas(1)
    lp_all, lq_all = torch.log_softmax(theta[0], -1), torch.log_softmax(teacher_theta[0], -1)
    obj = objectives.build({"name": "reinforce", "distill": {"signal": "kl_loss", "estimator": "k3"}})
    mask = torch.ones(V, 1, dtype=D)
    lp, zero = lp_all[:, None], torch.zeros(V, dtype=D)
    terms = obj.terms(objectives.TokenBatch(lp, lp.detach(), zero, mask, teacher_logprobs=lq_all[:, None]))
    (g_ours,) = torch.autograd.grad((lp_all.exp().detach() * terms.distill[:, 0]).sum(), theta, retain_graph=True)
    (g_fkl,) = torch.autograd.grad((lq_all.exp() * (lq_all - lp_all)).sum(), theta)
    torch.testing.assert_close(g_ours, g_fkl, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------- 3. gradients


@pytest.mark.parametrize("tail", [False, True])
def test_topk_forward_kl_gradcheck(tail):
    g = torch.Generator().manual_seed(2)
    full_s = torch.log_softmax(torch.randn(2, 3, 6, generator=g, dtype=D), -1)
    full_t = torch.log_softmax(2 * torch.randn(2, 3, 6, generator=g, dtype=D), -1)
    ids = full_t.topk(3, -1).indices
    t = full_t.gather(-1, ids)
    s = full_s.gather(-1, ids).requires_grad_()
    assert (topk_forward_kl(s, t, tail=tail).loss > 1e-3).all()  # away from the clamp at 0
    assert torch.autograd.gradcheck(lambda x: topk_forward_kl(x, t, tail=tail).loss, (s,))


# ---------------------------------------------------------------- 4. invariants


@pytest.mark.parametrize("signal", DISTILL_SIGNALS.names())
def test_masked_tokens_move_nothing_and_an_all_masked_batch_is_zero(signal):
    # Column 1 is an environment's token inside the completion (mask 0), column 3 padding: whatever the teacher's
    # and the student's values there, the loss, gradient and metrics are those of the batch without them.
    g = torch.Generator().manual_seed(3)
    n, t, k = 4, 4, 3
    old = -torch.rand(n, t, generator=g, dtype=D) - 0.1
    teacher = old - 0.5 * torch.rand(n, t, generator=g, dtype=D)
    topk_t = torch.log_softmax(torch.randn(n, t, 8, generator=g, dtype=D), -1)[..., :k]
    topk_s = torch.log_softmax(torch.randn(n, t, 8, generator=g, dtype=D), -1)[..., :k]
    mask = torch.ones(n, t, dtype=D)
    mask[:, 1] = mask[:, 3] = 0
    obj = objectives.build({"name": "ppo_clip", "distill": {"signal": signal, "discount": 0.0}})

    def run(noise, m):
        poke = lambda x: torch.where((mask == 0)[..., None] if x.dim() == 3 else mask == 0, noise, x)  # noqa: E731
        lp = poke(old + 0.1).clone().requires_grad_()
        s = poke(topk_s).clone().requires_grad_()
        b = objectives.TokenBatch(
            lp,
            poke(old),
            _t(1.0, -1.0, 0.5, 0.0),
            m,
            teacher_logprobs=poke(teacher),
            teacher_topk_logprobs=poke(topk_t),
            student_topk_logprobs=s,
        )
        out = obj(b)
        out.loss.backward()
        return out, lp.grad, s.grad

    clean, dirty = run(torch.tensor(0.0, dtype=D), mask), run(torch.tensor(float("nan"), dtype=D), mask)
    assert clean[0].loss.item() == dirty[0].loss.item()
    torch.testing.assert_close(dirty[1], clean[1], rtol=0, atol=0)
    assert torch.isfinite(dirty[1]).all() and not dirty[1][mask == 0].any()
    if signal == "forward_kl_topk":
        assert torch.isfinite(dirty[2]).all() and not dirty[2][mask == 0].any()
    assert {k: v.item() for k, v in clean[0].metrics.items()} == {k: v.item() for k, v in dirty[0].metrics.items()}
    empty, _, _ = run(torch.tensor(float("-inf"), dtype=D), torch.zeros_like(mask))
    assert empty.loss.item() == 0.0 and all(torch.isfinite(v) for v in empty.metrics.values())


@pytest.mark.parametrize(
    "distill, match",
    [
        ({"signal": "kl_los"}, "Did you mean 'kl_loss'"),
        ({"signal": "kl_loss", "estimator": "k1"}, "does not depend on the teacher.*use k3"),
        ({"signal": "kl_loss", "discount": 0.5}, "discount: got 0.5 with signal kl_loss"),
        ({"signal": "reverse_kl", "discount": 1.5}, "0 <= discount <= 1"),
        ({"signal": "reverse_kl", "tail": True}, "they belong to forward_kl_topk"),
        ({"signal": "forward_kl_topk", "estimator": "k3"}, "null with forward_kl_topk"),
        ({"signal": "forward_kl_topk", "tail": True, "log_prob_min": -10}, "log_prob_min null with tail"),
        ({"coef": 0}, "expected coef > 0"),
        ({"clamp": -1}, "clamp: got -1"),
        ({"estimator": "k9"}, "k1, k2, k3"),
    ],
)
def test_the_config_refuses_what_it_cannot_mean(distill, match):
    with pytest.raises(ConfigError, match=match):
        objectives.build({"name": "ppo_clip", "distill": distill})


def test_a_batch_without_the_teachers_log_probs_is_refused_naming_the_field():
    obj = objectives.build("opd")
    assert obj.uses_teacher() and not obj.config.uses_teacher_topk()
    lp = _t([-1.0, -2.0])
    with pytest.raises(ValueError, match="TokenBatch.teacher_logprobs"):
        obj(objectives.TokenBatch(lp, lp, _t(1.0), torch.ones(1, 2, dtype=D)))
    topk = objectives.build({"name": "ppo_clip", "distill": {"signal": "forward_kl_topk"}})
    assert {"teacher_topk_logprobs", "student_topk_logprobs"} <= set(topk.config.needs())
    with pytest.raises(ValueError, match=r"must both be \(N, T, K\)"):
        topk(
            objectives.TokenBatch(
                lp,
                lp,
                _t(1.0),
                torch.ones(1, 2, dtype=D),
                teacher_logprobs=lp,
                teacher_topk_logprobs=torch.zeros(1, 2, 3, dtype=D),
                student_topk_logprobs=torch.zeros(1, 2, 4, dtype=D),
            )
        )
