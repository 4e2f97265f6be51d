"""BAPO (arXiv 2510.18927) computes what the paper and the authors' verl recipe compute, on CPU in float64:

(a) it equals the authors' recipe, transcribed below, in the bounds chosen, the per-token loss, the loss and its
    gradient, on random batches whose ratios fall on both sides of the bounds; and its paper order equals the
    paper's Algorithm 1, transcribed below;
(b) hand-computed values on a five-token batch (arithmetic in the comments);
(c) by enumeration of a small softmax policy: the chosen bounds satisfy Eq. 8 as an expectation, the expected
    surrogate gradient is the gradient of the expected advantage over the unclipped actions, and on-policy it is
    the plain policy gradient; gradcheck;
(d) invariants: an all-masked batch, extreme ratios, NaN padding, per-shard sums that add up;
(e) the preset builds with the paper's values.

The objective registers when its module is imported, which tether/objectives/__init__.py does not do yet.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import tether.objectives.bapo  # noqa: F401  registers "bapo"
from tether import objectives
from tether.core import bapo as B
from tether.schema import ConfigError

D = torch.float64
TOL = dict(rtol=0, atol=1e-12)  # tighter than the 1e-10 asked of the comparison with the authors' code


def _t(*rows):
    return torch.tensor(rows, dtype=D)


def _run(spec, lp, old, adv, mask=None):
    lp = lp.clone().requires_grad_()
    mask = torch.ones_like(lp, dtype=torch.bool) if mask is None else mask
    obj = objectives.build(spec)
    out = obj(objectives.TokenBatch(logprobs=lp, old_logprobs=old, advantages=adv, loss_mask=mask))
    out.loss.backward()
    return out, lp.grad


def _random(seed, shift, N=6, T=5, spread=0.5):
    """A batch with ratios spread well past any bound ([0.2, 5] or so) and rows of 2 to 5 counted tokens; the
    advantages are N(shift, 1)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(N, T, generator=g, dtype=D) * 2 - 0.05
    lp = old + spread * torch.randn(N, T, generator=g, dtype=D)
    adv = torch.randn(N, generator=g, dtype=D) + shift
    lengths = torch.randint(2, T + 1, (N,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return lp, old, adv, mask


# ---------------------------------------------------------------- (a) the authors' recipe, transcribed
#
# Transcribed from github.com/WooooDyy/BAPO, recipe/bapo/policy_loss.py at commit
# 7287044444d5d578529ea464b45f090a36e8da3a (`compute_policy_loss_bapo`, `_compute_effective_advantage`; the file
# was last changed in 3b8389c), with verl's `agg_loss` and `masked_mean` as bundled in that repository (verl
# 0.7.0.dev, verl/trainer/ppo/core_algos.py and verl/utils/torch_functional.py). The recipe needs its verl fork
# and Ray, so its semantics are rewritten here as an independent reference: explicit ratio bounds, c_low raised
# first, the ratio P / (M + eps) compared with `adv_ratio_target` after every step and read with `.item()`, the
# running sum `min(c + step, max)`, verl's dual clip at clip_ratio_c. Not used by tether's code.


def _recipe_pos_neg_ratio(ratio, adv, mask, clip_low, clip_high, eps):
    effective = torch.where(adv >= 0, torch.minimum(ratio, ratio.new_tensor(clip_high)), ratio.clamp(min=clip_low))
    contribution = effective * adv * mask
    pos = contribution.clamp(min=0).sum()
    neg = (-contribution.clamp(max=0)).sum()
    return math.inf if neg.item() <= 0 else (pos / (neg + eps)).item()


def _verl_agg_loss(loss, mask, mode):
    if mode == "token-mean":  # verl_F.masked_mean: sum(loss * mask) / (sum(mask) + 1e-8)
        return (loss * mask).sum() / (mask.sum() + 1e-8)
    assert mode == "seq-mean-token-mean"
    return ((loss * mask).sum(-1) / mask.sum(-1)).mean()


def _recipe_bapo_loss(old, lp, adv, mask, pl, clip_ratio_c=3.0, mode="token-mean"):
    """(loss, per-token loss (N, T), (c_low, c_high)) as the recipe computes them; adv is token-level (N, T)."""
    ratio = torch.exp(torch.clamp(lp - old, min=-20.0, max=20.0))
    mask = mask.to(ratio.dtype)
    low, high = pl.ratio_lower_start, pl.ratio_upper_start
    target = max(pl.adv_ratio_target, 0.0)
    low_step, high_step = max(pl.ratio_lower_step, 0.0), max(pl.ratio_upper_step, 0.0)
    r = _recipe_pos_neg_ratio(ratio, adv, mask, low, high, pl.eps)
    while r < target and low < pl.ratio_lower_max and low_step > 0:  # the lower bound first
        low = min(low + low_step, pl.ratio_lower_max)
        r = _recipe_pos_neg_ratio(ratio, adv, mask, low, high, pl.eps)
    while r < target and high < pl.ratio_upper_max and high_step > 0:  # then the upper bound
        high = min(high + high_step, pl.ratio_upper_max)
        r = _recipe_pos_neg_ratio(ratio, adv, mask, low, high, pl.eps)
    unclipped, clipped = -adv * ratio, -adv * torch.clamp(ratio, low, high)
    ppo = torch.maximum(unclipped, clipped)
    per_token = torch.where(adv < 0, torch.minimum(-adv * clip_ratio_c, ppo), ppo)
    return _verl_agg_loss(per_token, mask, mode), per_token, (low, high), r


RECIPE_SETTINGS = {  # adv_ratio_target t, then (start, max, step) of the lower and the upper bound
    "recipe_yaml": (1.0, (0.6, 0.8, 0.05), (1.2, 2.0, 0.05)),  # recipe/bapo/config/bapo_trainer.yaml
    "recipe_script": (0.5, (0.8, 0.95, 0.05), (1.2, 2.0, 0.1)),  # recipe/bapo/run_bapo_example.sh
    "readme_ranges": (0.5, (0.6, 0.9, 0.02), (1.2, 3.0, 0.05)),  # README's ranges, the paper's steps
}
CASES = [(seed, shift) for seed in range(5) for shift in (-0.8, -0.4, -0.1, 0.3, 1.5)]


def _stopping_on_the_way(seed, target_ratio, low, high):
    """A batch whose positive advantages are scaled so that P / M misses `target_ratio` at the start bounds and
    meets it at the end of the path (when P / M is larger there): the walk stops on the way. Random batches
    rarely do, since the lower steps, taken first or last, only add to M."""
    lp, old, adv, mask = _random(seed, 0.0)
    w, a = torch.exp(lp - old), adv[:, None] * mask

    def pos_over_neg(c_low, c_high):
        return (a.clamp(min=0) * w.clamp(max=c_high)).sum() / ((-a).clamp(min=0) * w.clamp(min=c_low)).sum()

    scale = target_ratio / torch.sqrt(pos_over_neg(low[0], high[0]) * pos_over_neg(low[1], high[1]))
    return lp, old, torch.where(adv > 0, adv * scale, adv), mask


def _recipe_config(t, low, high):
    return SimpleNamespace(
        adv_ratio_target=t,
        ratio_lower_start=low[0],
        ratio_lower_max=low[1],
        ratio_lower_step=low[2],
        ratio_upper_start=high[0],
        ratio_upper_max=high[1],
        ratio_upper_step=high[2],
        eps=1e-8,
    )


def _spec(target, low, high, order, dual_clip_c=None, aggregation="token-mean"):
    return {
        "name": "bapo",
        "target": target,
        "low_start": low[0],
        "low_max": low[1],
        "low_step": low[2],
        "high_start": high[0],
        "high_max": high[1],
        "high_step": high[2],
        "order": order,
        "dual_clip_c": dual_clip_c,
        "aggregation": aggregation,
    }


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("setting", list(RECIPE_SETTINGS))
def test_bapo_low_first_equals_the_authors_recipe(setting, mode):
    t, low, high = RECIPE_SETTINGS[setting]
    pl = _recipe_config(t, low, high)
    # The recipe's ratio target t is the paper's share rho_0 = t / (1 + t) (tether.core.bapo, departure 1).
    spec = _spec(t / (1 + t), low, high, "low_first", dual_clip_c=3.0, aggregation=mode)
    outcomes, sides = set(), {"low": 0, "high": 0, "dual": 0}
    batches = [_random(seed, shift) for seed, shift in CASES]
    batches += [_stopping_on_the_way(seed, t, low, high) for seed in range(5)]
    for lp, old, adv, mask in batches:
        lp_ref = lp.clone().requires_grad_()
        loss_ref, per_token_ref, (c_low, c_high), r = _recipe_bapo_loss(
            old, lp_ref, adv[:, None].expand_as(lp), mask, pl, mode=mode
        )
        loss_ref.backward()
        out, grad = _run(spec, lp, old, adv, mask)
        assert out.metrics["bapo/clip_low"].item() == pytest.approx(c_low, abs=1e-12)
        assert out.metrics["bapo/clip_high"].item() == pytest.approx(c_high, abs=1e-12)
        assert out.metrics["bapo/target_met"].item() == float(r >= t)
        terms = objectives.build(spec).terms(
            objectives.TokenBatch(logprobs=lp, old_logprobs=old, advantages=adv, loss_mask=mask)
        )
        torch.testing.assert_close(terms.tokens.loss[mask], per_token_ref.detach()[mask], **TOL)
        # verl's token-mean divides by (number of tokens + 1e-8); its seq-mean-token-mean has no such term.
        scale = mask.sum().item() / (mask.sum().item() + 1e-8) if mode == "token-mean" else 1.0
        torch.testing.assert_close(out.loss * scale, loss_ref.detach(), **TOL)
        torch.testing.assert_close(grad * scale, lp_ref.grad, **TOL)
        # The outcome: the start bounds, stopped on the upper segment, or the path ran out. Raising c_low only adds
        # negative contribution, so once the start misses the target the recipe always takes c_low to its maximum.
        if (c_low, c_high) == (low[0], high[0]):
            outcomes.add("start")
        else:
            assert c_low == low[1]
            outcomes.add("upper segment" if r >= t else "ran out")
        sides["low"] += int(out.metrics["policy/clipfrac_low"].item() > 0)
        sides["high"] += int(out.metrics["policy/clipfrac_high"].item() > 0)
        sides["dual"] += int(out.metrics["policy/clipfrac_dual"].item() > 0)
    assert outcomes == {"start", "upper segment", "ran out"}, outcomes
    assert min(sides.values()) > 0, sides  # ratios below c_low, above c_high and above the dual clip's c


# The paper's Algorithm 1 (arXiv 2510.18927, as the authors' repository held it at commit 602d517, paper.pdf),
# transcribed: c_high first while it has room, then c_low, the loop asking for room on the lower side; Eq. 8 with
# the sum of |min(w A, clip(w, c_low, c_high) A)| as its denominator (tether.core.bapo, departure 1). The 1e-9
# lets 0.6 + 15 x 0.02 count as <= 0.9 despite the running sum's rounding.


def _eq8(ratio, adv, mask, c_low, c_high):
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, c_low, c_high) * adv) * mask
    return (surrogate * (adv > 0)).sum().abs().item() / surrogate.abs().sum().item()


def _algorithm_1(ratio, adv, mask, rho_0, low, high):
    (a_minus, b_minus, delta_2), (a_plus, b_plus, delta_1) = low, high
    c_low, c_high = a_minus, a_plus
    while _eq8(ratio, adv, mask, c_low, c_high) < rho_0 and c_low + delta_2 <= b_minus + 1e-9:
        if c_high + delta_1 <= b_plus + 1e-9:
            c_high += delta_1
        else:
            c_low += delta_2
    return c_low, c_high


def test_bapo_high_first_equals_the_papers_algorithm_1():
    rho_0, low, high = 0.4, (0.6, 0.9, 0.02), (1.2, 3.0, 0.05)  # the paper's section 5 values
    assert objectives.build("bapo").config.search == B.BoundSearch(rho_0, *low, *high, order="high_first")
    outcomes = set()
    # rho_0 = 0.4 is P / M = 2/3 (departure 1)
    batches = [_random(seed, shift) for seed, shift in CASES]
    batches += [_stopping_on_the_way(seed, 2 / 3, low, high) for seed in range(5)]
    for lp, old, adv, mask in batches:
        ratio = torch.exp(lp - old)
        c_low, c_high = _algorithm_1(ratio, adv[:, None], mask.to(D), rho_0, low, high)
        out, grad = _run("bapo", lp, old, adv, mask)
        assert out.metrics["bapo/clip_low"].item() == pytest.approx(c_low, abs=1e-12)
        assert out.metrics["bapo/clip_high"].item() == pytest.approx(c_high, abs=1e-12)
        # The loss is PPO's clip at those bounds, token-mean, no dual clip.
        lp_ref = lp.clone().requires_grad_()
        w = torch.exp(lp_ref - old)
        a = adv[:, None]
        ppo = -torch.minimum(w * a, torch.clamp(w, c_low, c_high) * a)
        loss_ref = (ppo * mask).sum() / mask.sum()
        loss_ref.backward()
        torch.testing.assert_close(out.loss, loss_ref.detach(), **TOL)
        torch.testing.assert_close(grad, lp_ref.grad, **TOL)
        if (c_low, c_high) == (low[0], high[0]):
            outcomes.add("start")
        elif c_low == low[0]:
            outcomes.add("upper segment")
        else:  # the upper bound could not do it alone: c_high at its maximum, then c_low all the way
            assert c_high == pytest.approx(high[1]) and c_low == pytest.approx(low[1])
            outcomes.add("ran out")
    assert outcomes == {"start", "upper segment", "ran out"}, outcomes


# ---------------------------------------------------------------- (b) hand-computed


def _five_tokens():
    # One sequence, token-level A = (+1, +1, -1, -1, -1), w = (2, 0.5, 0.5, 1, 0.4).
    old = _t(-1.0, -2.0, -1.5, -0.5, -1.0)
    lp = old + torch.log(_t(2.0, 0.5, 0.5, 1.0, 0.4))
    return lp, old, _t(1.0, 1.0, -1.0, -1.0, -1.0)


SMALL = dict(target=0.46, low=(0.6, 0.8, 0.1), high=(1.2, 1.6, 0.2))


def test_hand_computed_paper_order():
    # P(c_high) = min(2, c_high) + min(0.5, c_high):  P(1.2) = 1.7, P(1.4) = 1.9, P(1.6) = 2.1.
    # M(c_low) = max(0.5, c_low) + max(1, c_low) + max(0.4, c_low):  M(0.6) = 2.2, M(0.7) = 2.4, M(0.8) = 2.6.
    # high_first path: (0.6, 1.2) rho = 1.7 / 3.9 = 0.43590 < 0.46;  (0.6, 1.4) rho = 1.9 / 4.1 = 0.46341 >= 0.46: stop.
    # Per-token loss at [0.6, 1.4]: -1.4 (clipped above), -0.5, +0.6 (clipped below), +1.0, +0.6 (clipped below);
    # token-mean = 0.3 / 5 = 0.06. Gradient of -A w: token 2 -0.5 / 5 = -0.1, token 4 +1.0 / 5 = 0.2, clipped ones 0.
    lp, old, adv = _five_tokens()
    out, g = _run(_spec(SMALL["target"], SMALL["low"], SMALL["high"], "high_first"), lp[None], old[None], adv[None])
    m = {k: v.item() for k, v in out.metrics.items()}
    assert (m["bapo/clip_low"], m["bapo/clip_high"]) == pytest.approx((0.6, 1.4), abs=1e-15)
    assert m["bapo/positive_share"] == pytest.approx(1.9 / 4.1, rel=1e-14)
    assert (m["bapo/target_met"], m["bapo/steps"]) == (1.0, 1.0)
    assert out.loss.item() == pytest.approx(0.06, abs=1e-15)
    torch.testing.assert_close(g, _t([0.0, -0.1, 0.0, 0.2, 0.0]), rtol=0, atol=1e-15)
    assert (m["policy/clipfrac_high"], m["policy/clipfrac_low"]) == (0.2, 0.4)


def test_hand_computed_recipe_order_runs_out():
    # low_first path: (0.6, 1.2) 1.7 / 3.9 = 0.43590;  (0.7, 1.2) 1.7 / 4.1 = 0.41463;  (0.8, 1.2) 1.7 / 4.3 = 0.39535;
    # (0.8, 1.4) 1.9 / 4.5 = 0.42222;  (0.8, 1.6) 2.1 / 4.7 = 0.44681: none reaches 0.46, the walk ends at (0.8, 1.6),
    # step 4. Per-token loss: -1.6, -0.5, +0.8, +1.0, +0.8; token-mean 0.5 / 5 = 0.1; the same tokens keep their
    # gradient as in the paper order (token 4's w = 1 sits inside [0.8, 1.6]).
    lp, old, adv = _five_tokens()
    out, g = _run(_spec(SMALL["target"], SMALL["low"], SMALL["high"], "low_first"), lp[None], old[None], adv[None])
    m = {k: v.item() for k, v in out.metrics.items()}
    assert (m["bapo/clip_low"], m["bapo/clip_high"]) == pytest.approx((0.8, 1.6), abs=1e-15)
    assert m["bapo/positive_share"] == pytest.approx(2.1 / 4.7, rel=1e-14)
    assert (m["bapo/target_met"], m["bapo/steps"]) == (0.0, 4.0)
    assert out.loss.item() == pytest.approx(0.1, abs=1e-15)
    torch.testing.assert_close(g, _t([0.0, -0.1, 0.0, 0.2, 0.0]), rtol=0, atol=1e-15)
    # With rho_0 = 0.4 the start already qualifies (0.43590 >= 0.4): [0.6, 1.2], loss (-1.2 - 0.5 + 0.6 + 1 + 0.6) / 5.
    out, _ = _run(_spec(0.4, SMALL["low"], SMALL["high"], "low_first"), lp[None], old[None], adv[None])
    assert (out.metrics["bapo/clip_low"].item(), out.metrics["bapo/clip_high"].item()) == (0.6, 1.2)
    assert out.loss.item() == pytest.approx(0.5 / 5, abs=1e-15) and out.metrics["bapo/steps"].item() == 0.0


def test_the_paths_are_the_documented_walks():
    search = B.BoundSearch(0.46, 0.6, 0.8, 0.1, 1.2, 1.6, 0.2, order="high_first")
    low, high = search.path()
    assert low == pytest.approx([0.6, 0.6, 0.6, 0.7, 0.8]) and high == pytest.approx([1.2, 1.4, 1.6, 1.6, 1.6])
    low, high = B.BoundSearch(0.46, 0.6, 0.8, 0.1, 1.2, 1.6, 0.2, order="low_first").path()
    assert low == pytest.approx([0.6, 0.7, 0.8, 0.8, 0.8]) and high == pytest.approx([1.2, 1.2, 1.2, 1.4, 1.6])
    # The paper's: 1 + 36 upper steps + 15 lower steps, ending exactly at (0.9, 3.0); a step of 0 freezes a side;
    # an off-grid range ends on its maximum (0.6 -> 0.75 by 0.1: 0.7, then 0.75).
    low, high = objectives.build("bapo").config.search.path()
    assert len(low) == 52 and (low[-1], high[-1]) == (0.9, 3.0) and (low[36], high[36]) == (0.6, 3.0)
    assert B.BoundSearch(0.4, 0.6, 0.9, 0.0, 1.2, 1.4, 0.1).path() == ([0.6] * 3, [1.2, 1.3, 1.4])
    assert B.BoundSearch(0.4, 0.6, 0.75, 0.1, 1.2, 1.2, 0.1).path()[0] == pytest.approx([0.6, 0.7, 0.75])


# ---------------------------------------------------------------- (c) exactness by enumeration, gradients

NUM_ACTIONS = 6
ENUM_SEARCH = B.BoundSearch(0.5, 0.6, 0.9, 0.1, 1.1, 2.0, 0.1, order="high_first")


def _bandit(seed, spread):
    g = torch.Generator().manual_seed(seed)
    theta_old = torch.randn(NUM_ACTIONS, generator=g, dtype=D)
    theta = theta_old + spread * torch.randn(NUM_ACTIONS, generator=g, dtype=D)
    adv = torch.randint(0, 2, (NUM_ACTIONS,), generator=g).to(D) - 0.45  # any baseline; both signs occur
    return theta, theta_old, adv


def _expected(theta, theta_old, adv, search=ENUM_SEARCH):
    """The core on the batch of every action (N = K, T = 1) weighted by pi_old: (sum_a pi_old(a) l(a), its
    gradient in theta, the Choice)."""
    th = theta.clone().requires_grad_()
    lp = torch.log_softmax(th, -1)[:, None]  # (K, 1)
    lp_old = torch.log_softmax(theta_old, -1)[:, None]
    p_old = lp_old.exp()
    tokens, choice = B.bapo(lp, lp_old, adv, p_old, search)  # Eq. 8's pi_rollout(y_t) weights
    expected = (p_old * tokens.loss).sum()
    (grad,) = torch.autograd.grad(expected, th)
    return expected, grad, choice


@pytest.mark.parametrize("seed", range(4))
def test_expected_surrogate_gradient_is_the_clipped_policy_gradient(seed):
    theta, theta_old, adv = _bandit(seed, spread=0.8)
    _, grad, choice = _expected(theta, theta_old, adv)
    c_low, c_high = choice.clip_low.item(), choice.clip_high.item()
    p, p_old = torch.softmax(theta, -1), torch.softmax(theta_old, -1)
    w = p / p_old
    # Eq. 8 as an expectation under pi_old: the chosen point qualifies and every earlier one does not.
    low, high = ENUM_SEARCH.path()
    shares = [(p_old * adv.clamp(min=0) * torch.minimum(w, torch.tensor(h, dtype=D))).sum() for h in high]
    negs = [(p_old * (-adv).clamp(min=0) * torch.maximum(w, torch.tensor(lo, dtype=D))).sum() for lo in low]
    rho = [(s / (s + n)).item() for s, n in zip(shares, negs)]
    k = int(choice.steps)
    assert all(r < ENUM_SEARCH.target for r in rho[:k])
    assert rho[k] >= ENUM_SEARCH.target or k == len(rho) - 1
    assert choice.positive_share.item() == pytest.approx(rho[k], rel=1e-13)
    # The intended objective: J(theta) = sum over the unclipped actions U of pi_theta(a) A(a), so that
    # E_old[grad l] = -sum_{a in U} pi_old(a) w(a) A(a) grad log pi_theta(a) = -grad J, U fixed at theta.
    unclipped = ~(((adv > 0) & (w > c_high)) | ((adv < 0) & (w < c_low)))
    th = theta.clone().requires_grad_()
    J = (torch.softmax(th, -1) * adv * unclipped).sum()
    (want,) = torch.autograd.grad(-J, th)
    torch.testing.assert_close(grad, want, rtol=1e-10, atol=1e-12)


def test_some_enumerated_case_clips_on_each_side():
    # Keeps the previous test able to fail: across its seeds the clip acts on both sides somewhere.
    seen = set()
    for seed in range(4):
        theta, theta_old, adv = _bandit(seed, spread=0.8)
        _, _, choice = _expected(theta, theta_old, adv)
        w = torch.softmax(theta, -1) / torch.softmax(theta_old, -1)
        if ((adv > 0) & (w > choice.clip_high)).any():
            seen.add("high")
        if ((adv < 0) & (w < choice.clip_low)).any():
            seen.add("low")
    assert seen == {"high", "low"}


@pytest.mark.parametrize("seed", range(3))
def test_on_policy_bapo_is_the_policy_gradient(seed):
    # w = 1 lies inside every [c_low, c_high] (c_low <= 1 <= c_high): nothing is clipped, whatever the search picks.
    _, theta_old, adv = _bandit(seed, spread=0.0)
    _, grad, _ = _expected(theta_old, theta_old, adv)
    th = theta_old.clone().requires_grad_()
    (want,) = torch.autograd.grad(-(torch.softmax(th, -1) * adv).sum(), th)
    torch.testing.assert_close(grad, want, rtol=1e-10, atol=1e-12)


def test_gradcheck():
    lp, old, adv, mask = _random(0, 0.0)
    search = objectives.build("bapo").config.search

    def f(x):
        return B.bapo(x, old, adv, mask, search, dual_clip_c=3.0)[0].loss.sum()

    assert torch.autograd.gradcheck(f, (lp.clone().requires_grad_(),), eps=1e-7, atol=1e-8)


# ---------------------------------------------------------------- (d) invariants


def test_all_masked_batch_gives_a_finite_zero_loss():
    lp, old, adv, _ = _random(1, 0.0)
    mask = torch.zeros_like(lp, dtype=torch.bool)
    out, g = _run("bapo", lp, old, adv, mask)
    assert out.loss.item() == 0.0 and torch.equal(g, torch.zeros_like(g))
    assert all(torch.isfinite(v).all() for v in out.metrics.values())
    # No contribution on either side: the target counts as met at the start, as the recipe's infinite ratio does.
    m = out.metrics
    assert (m["bapo/clip_low"].item(), m["bapo/clip_high"].item(), m["bapo/target_met"].item()) == (0.6, 1.2, 1.0)
    assert m["bapo/positive_share"].item() == 0.0


@pytest.mark.parametrize("size", [30.0, 1e4])
def test_extreme_ratios_give_no_nan(size):
    lp, old, adv, mask = _random(2, -0.2)
    sign = torch.where(torch.rand(lp.shape, generator=torch.Generator().manual_seed(3)) < 0.5, -1.0, 1.0).to(D)
    lp = old + size * sign  # log w = +-size, far past the [-20, 20] clamp
    for spec in ("bapo", {"preset": "bapo", "order": "low_first", "dual_clip_c": 3.0}):
        out, g = _run(spec, lp, old, adv, mask)
        assert torch.isfinite(out.loss) and torch.isfinite(g).all()
        assert all(torch.isfinite(v).all() for v in out.metrics.values())


def test_nan_padding_changes_nothing():
    lp, old, adv, mask = _random(3, -0.3)
    dirty = torch.where(mask, lp, torch.full_like(lp, float("nan")))
    old_dirty = torch.where(mask, old, torch.full_like(old, float("inf")))
    out, g = _run("bapo", lp, old, adv, mask)
    out_d, g_d = _run("bapo", dirty, old_dirty, adv, mask)
    torch.testing.assert_close(out_d.loss, out.loss, rtol=0, atol=0)
    torch.testing.assert_close(g_d, g, rtol=0, atol=0)
    # The core alone ignores padding in its sums whatever the padding holds.
    ratio = torch.exp(lp - old)
    ratio_dirty = torch.where(mask, ratio, torch.full_like(ratio, float("inf")))
    low, high = (torch.tensor(x, dtype=D) for x in objectives.build("bapo").config.search.path())
    a = adv[:, None].expand_as(lp)
    for x, y in zip(B.contributions(ratio_dirty, a, mask, low, high), B.contributions(ratio, a, mask, low, high)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_shard_sums_add_up_to_the_whole_batch():
    # Departure 5: P and M are sums over tokens, so a data-parallel caller that all-reduces each shard's P and M
    # chooses the bounds of the whole batch.
    lp, old, adv, mask = _random(4, -0.2, N=8)
    ratio, a = torch.exp(lp - old), adv[:, None].expand_as(lp)
    low, high = (torch.tensor(x, dtype=D) for x in objectives.build("bapo").config.search.path())
    whole = B.contributions(ratio, a, mask, low, high)
    halves = [B.contributions(ratio[s], a[s], mask[s], low, high) for s in (slice(0, 4), slice(4, 8))]
    torch.testing.assert_close(halves[0][0] + halves[1][0], whole[0], rtol=1e-15, atol=0)
    torch.testing.assert_close(halves[0][1] + halves[1][1], whole[1], rtol=1e-15, atol=0)


@pytest.mark.parametrize(
    "override, match",
    [
        ({"target": 1.5}, "target"),
        ({"low_start": 0.9, "low_max": 0.8}, "low_start/low_max"),
        ({"low_max": 1.1}, "low_start/low_max"),
        ({"high_start": 0.95}, "high_start/high_max"),
        ({"high_step": -0.1}, "high_step"),
        ({"order": "both"}, "order"),
        ({"dual_clip_c": 0.5}, "dual_clip_c"),
    ],
)
def test_bad_settings_are_refused(override, match):
    with pytest.raises(ConfigError, match=match):
        objectives.build({"preset": "bapo", **override})


# ---------------------------------------------------------------- (e) the preset


def test_the_preset_builds_with_the_papers_values():
    obj = objectives.build({"preset": "bapo"})
    c = obj.config
    assert obj.name == "bapo" and "bapo" in objectives.names() and "bapo" in objectives.preset_names()
    assert (c.target, c.low_start, c.low_max, c.low_step) == (0.4, 0.6, 0.9, 0.02)
    assert (c.high_start, c.high_max, c.high_step, c.order) == (1.2, 3.0, 0.05, "high_first")
    assert (c.dual_clip_c, c.aggregation, c.advantage, c.kl_penalty) == (None, "token-mean", "grpo", None)
    assert objectives.build({"preset": "bapo", "order": "low_first"}).config.search.order == "low_first"
