"""ASPO and PSPO compute what their references compute, and the objectives those define, on CPU in float64.

References, transcribed below (`_released_*`, `_authors_*`): ours, written to reproduce their semantics, not copies.
- ASPO [arXiv 2510.06062]: wizard-III/Archer2.0 at b08d963d5d65909ef1f24dba2f382006d0be33e1 (MIT licence):
  `compute_policy_loss_archer` and `agg_loss` in verl/trainer/ppo/core_algos.py, and the entropy quantile in
  `DataParallelPPOActor.update_policy` (verl/workers/actor/dp_actor.py) that picks each token's clip range. The
  released call hard-codes (0.2, 0.4, 0.2, 0.4) and c = 3.0; `_released_aspo` takes them as arguments so that the
  paper's single range (eps 0.2) is the same function with 0.2 everywhere.
- PSPO [arXiv 2509.21282]: the authors' TRL patch, MCDwyer/GR-PSPO at 16d89d531f586ff50edbff7edad6124cce390b4f
  (grpotrainer.patch, MIT licence) on TRL 0.25.1's `GRPOTrainer._compute_loss` (1cf8d56c06ce095aeaa92d0853fca68e5834a928),
  whose loss types aggregate; TRL PR #4548's head 9d490c313e6dbaf5bf1f6c0ca36e40f89d3e2f1f has the same branch on
  TRL main (`coef_2 = (1 - smoothing_alpha) * coef_1 + smoothing_alpha`, `per_token_loss = -(coef_2 * advantages)`).

What is proved, by section:
(a) loss, per-token losses and gradient equal the reference's (every branch hit, asserted), metrics equal its metrics;
(b) hand-computed values, arithmetic in the comments;
(c) exactness by enumeration over a softmax policy: ASPO's expected gradient is the gradient of the objective its
    three steps define (tether.core.aspo), the policy gradient on-policy; PSPO's expected loss IS the smoothed
    policy's expected advantage, off-policy too;
(d) invariants: all-masked batches, extreme ratios, padding values, zero advantages, gradcheck, config errors;
(e) the presets build. The objectives register on import (tether/objectives/__init__.py does not import them yet).
"""

import math

import pytest
import torch

import tether.objectives.aspo  # noqa: F401  registers "aspo"
import tether.objectives.pspo  # noqa: F401  registers "pspo"
from tether import objectives
from tether.core import aspo as AS
from tether.core import pspo as PS
from tether.core import surrogates as S
from tether.schema import ConfigError

D = torch.float64
TOL = dict(rtol=1e-12, atol=1e-14)  # tighter than the 1e-10 asked for: the two compute the same float64 operations
RELEASED_SPLIT = dict(high_entropy_eps_low=0.4, high_entropy_eps_high=0.4, high_entropy_quantile=0.8)


def _t(*rows):
    return torch.tensor(rows, dtype=D)


def _run(spec, lp, old, adv, mask=None, **fields):
    """(output, d loss / d lp) of a built objective on one batch."""
    lp = lp.detach().clone().requires_grad_()
    mask = torch.ones_like(lp) if mask is None else mask
    batch = objectives.TokenBatch(logprobs=lp, old_logprobs=old, advantages=adv, loss_mask=mask, **fields)
    out = objectives.build(spec)(batch)
    (grad,) = torch.autograd.grad(out.loss, lp)
    return out, grad


def _grad(loss, x):
    return torch.autograd.grad(loss, x)[0]


def _agg(loss_mat, mask, mode, max_len=None):
    """verl's `agg_loss` (core_algos.py at that commit); its `masked_mean` adds 1e-8 to the token count, a relative
    change of 1e-8 / n that tether's token mean does not make, so it is left out here."""
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum()
    seq = (loss_mat * mask).sum(-1)
    if mode == "seq-mean-token-sum":
        return seq.mean()
    if mode == "seq-mean-token-mean":
        return (seq / mask.sum(-1)).mean()
    return seq.sum() / (max_len or mask.shape[-1])  # seq-mean-token-sum-norm


# ---------------------------------------------------------------- (a) ASPO equals the released code


def _released_low_entropy_mask(entropy, response_mask, quantile=0.8):
    """dp_actor.py: `high_entropy_mask = (masked_entropy <= q80) & response_mask`, which (as its comment says) is True
    for the LOW-entropy tokens: those get the first clip range of each pair below."""
    masked_entropy = torch.where(response_mask.bool(), entropy.detach(), torch.nan)
    q80 = torch.nanquantile(masked_entropy, q=quantile, dim=-1, keepdim=True)
    return (masked_entropy <= q80) & response_mask.bool()


def _released_aspo(old, lp, adv, response_mask, low_entropy, ranges=(0.2, 0.4, 0.2, 0.4), c=(3.0, 3.0)):
    """`compute_policy_loss_archer` semantics: (per-token losses, metrics). `ranges` = (negative low-entropy,
    negative high-entropy, positive low-entropy, positive high-entropy) clip ranges; c = (negative, positive)."""
    neg_lo, neg_hi, pos_lo, pos_hi = ranges
    advantages = adv[:, None].expand_as(lp)  # verl passes token-level advantages
    m = response_mask.bool()
    ratio = torch.exp(torch.clamp(lp - old, min=-20.0, max=20.0))
    negative_clip_ratio = torch.where(
        low_entropy, torch.clamp(ratio, min=1 - neg_lo, max=None), torch.clamp(ratio, min=1 - neg_hi, max=None)
    )
    positive_clip_ratio = torch.where(
        low_entropy, torch.clamp(ratio, min=None, max=1 + pos_lo), torch.clamp(ratio, min=None, max=1 + pos_hi)
    )
    clip_ratio = torch.where(advantages < 0, negative_clip_ratio, positive_clip_ratio)
    frac = lambda x, among: (x.double() * among).sum() / among.sum()  # noqa: E731  (masked_mean without its 1e-8)
    metrics = {
        "pg_clipfrac_upper": frac(torch.gt(ratio, clip_ratio), m),
        "pg_clipfrac_lower": frac(torch.lt(ratio, clip_ratio), m),
        "upper_at_zero_advantage": frac(torch.gt(ratio, clip_ratio) & (advantages == 0), m),
    }
    negative_pg_losses_clip = -advantages * negative_clip_ratio
    positive_pg_losses_clip = (
        -advantages * (positive_clip_ratio / positive_clip_ratio.detach()) / positive_clip_ratio.detach()
    )
    negative_dual_clip_ratio = torch.clamp(negative_clip_ratio, min=None, max=c[0])
    negative_clipped_mask = torch.gt(negative_clip_ratio, negative_dual_clip_ratio)
    metrics["negative_pg_clipfrac_dual"] = frac(negative_clipped_mask, m & (advantages < 0))
    negative_pg_losses_dual = -advantages * negative_dual_clip_ratio.detach() * lp
    negative_pg_losses = torch.where(negative_clipped_mask, negative_pg_losses_dual, negative_pg_losses_clip)
    positive_dual_clip_ratio = torch.clamp(1 / positive_clip_ratio, min=None, max=c[1])
    positive_clipped_mask = torch.gt(1 / positive_clip_ratio, positive_dual_clip_ratio)
    metrics["positive_pg_clipfrac_dual"] = frac(positive_clipped_mask, m & (advantages > 0))
    positive_pg_losses_dual = -advantages * positive_dual_clip_ratio.detach() * lp
    positive_pg_losses = torch.where(positive_clipped_mask, positive_pg_losses_dual, positive_pg_losses_clip)
    return torch.where(advantages < 0, negative_pg_losses, positive_pg_losses), metrics


def _aspo_batch(seed=0, n=8, t=8):
    """log w uniform on [-2, 2] (w in [0.14, 7.4]: both sides of 1 -/+ eps and of c = 3, 1 / c), a ragged mask,
    advantages of both signs and one exact 0, random entropies; two tokens forced into the band where only the
    released code's wider high-entropy range keeps the gradient."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=g, dtype=D) * 3 - 0.05
    lp = old + torch.rand(n, t, generator=g, dtype=D) * 4 - 2
    adv = _t(1.0, -1.0, 0.5, -0.25, 0.0, 2.0, -0.7, 1.3)[:n]
    mask = torch.ones(n, t, dtype=D)
    mask[1, 6:] = 0
    mask[3, 3:] = 0
    entropy = torch.rand(n, t, generator=g, dtype=D) * 2
    lp[0, 0], entropy[0, 0] = old[0, 0] + math.log(1.3), 5.0  # A > 0, w = 1.3: masked at 0.2, kept at 0.4
    lp[6, 1], entropy[6, 1] = old[6, 1] + math.log(0.7), 5.0  # A < 0, w = 0.7: masked at 0.2, kept at 0.4
    # A tie: row 1's six entropies put the 0.8 quantile (rank 0.8 * 5 = 4) exactly on token 4, which is not above it
    # and keeps the 0.2 range (w = 0.7, A < 0: masked); only token 5 is high-entropy.
    entropy[1, :6] = _t(0.1, 0.2, 0.3, 0.4, 0.5, 0.6)
    lp[1, 4] = old[1, 4] + math.log(0.7)
    return lp, old, adv, mask, entropy


def _branches(lp, old, adv, mask, c=3.0):
    """How many counted tokens each of ASPO's seven branches holds (at eps 0.2)."""
    w, a, m = (lp - old).exp(), adv[:, None].expand_as(lp), mask.bool()
    pos, neg = m & (a > 0), m & (a < 0)
    return {
        "pos masked": pos & (w > 1.2),
        "pos flipped": pos & (w <= 1.2) & (w >= 1 / c),
        "pos dual": pos & (w < 1 / c),
        "neg masked": neg & (w < 0.8),
        "neg ratio": neg & (w >= 0.8) & (w <= c),
        "neg dual": neg & (w > c),
        "zero advantage": m & (a == 0),
    }


ASPO_SETTINGS = {
    "paper (one range, eps 0.2)": ({}, (0.2, 0.2, 0.2, 0.2), (3.0, 3.0)),
    "released (0.4 above the 0.8 entropy quantile)": (RELEASED_SPLIT, (0.2, 0.4, 0.2, 0.4), (3.0, 3.0)),
    "asymmetric, c 2.5": (
        {"eps_low": 0.15, "eps_high": 0.28, "dual_clip_c": 2.5},
        (0.15, 0.15, 0.28, 0.28),
        (2.5, 2.5),
    ),
}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("setting", list(ASPO_SETTINGS))
def test_aspo_equals_the_released_loss(setting, mode):
    spec, ranges, c = ASPO_SETTINGS[setting]
    lp, old, adv, mask, entropy = _aspo_batch()
    for name, where in _branches(lp, old, adv, mask).items():
        assert where.any(), f"the batch must hold a token in branch {name!r}"
    x = lp.clone().requires_grad_()
    split = _released_low_entropy_mask(entropy, mask) if "high_entropy_eps_low" in spec else mask.bool()
    ref_tokens, ref_metrics = _released_aspo(old, x, adv, mask, split, ranges, c)
    ref_loss = _agg(ref_tokens, mask, mode)
    out, g = _run({"name": "aspo", "aggregation": mode, **spec}, lp, old, adv, mask, entropy=entropy)
    torch.testing.assert_close(out.loss.detach(), ref_loss.detach(), **TOL)
    torch.testing.assert_close(g, _grad(ref_loss, x), **TOL)
    # Per token, before aggregation (padding excluded: neither side defines it).
    y = lp.clone().requires_grad_()
    obj = objectives.build({"name": "aspo", "aggregation": mode, **spec})
    terms = obj.terms(
        objectives.TokenBatch(logprobs=y, old_logprobs=old, advantages=adv, loss_mask=mask, entropy=entropy)
    )
    m = mask.bool()
    torch.testing.assert_close(terms.tokens.loss[m].detach(), ref_tokens[m].detach(), **TOL)
    # Metrics: the released dual-clip fractions (among A < 0, A > 0 tokens) and clip fractions; the upper one also
    # counts A = 0 tokens above 1 + eps, which tether's flag leaves out (tether.core.aspo, departure 4).
    assert ref_metrics["upper_at_zero_advantage"] > 0
    expected = {
        "aspo/dual_frac_neg": ref_metrics["negative_pg_clipfrac_dual"],
        "aspo/dual_frac_pos": ref_metrics["positive_pg_clipfrac_dual"],
        "policy/clipfrac_low": ref_metrics["pg_clipfrac_lower"],
        "policy/clipfrac_high": ref_metrics["pg_clipfrac_upper"] - ref_metrics["upper_at_zero_advantage"],
    }
    for key, value in expected.items():
        torch.testing.assert_close(out.metrics[key], value, rtol=1e-14, atol=1e-15, msg=key)


def test_the_released_entropy_split_changes_the_loss_only_where_the_wider_range_acts():
    # The two forced tokens (w = 1.3 with A > 0, w = 0.7 with A < 0, both at their sequence's top entropy) keep their
    # gradient only with the released 0.4 range; the split must not be a no-op on this batch.
    lp, old, adv, mask, entropy = _aspo_batch()
    _, g_paper = _run({"name": "aspo"}, lp, old, adv, mask, entropy=entropy)
    out, g_split = _run({"name": "aspo", **RELEASED_SPLIT}, lp, old, adv, mask, entropy=entropy)
    assert g_paper[0, 0] == 0 and g_paper[6, 1] == 0
    assert g_split[0, 0] != 0 and g_split[6, 1] != 0
    high = AS.high_entropy_tokens(entropy, mask)
    assert high[0, 0] and high[6, 1] and not high[~mask.bool()].any()
    assert high[1, 5] and not high[1, 4] and g_split[1, 4] == 0  # the tie with the quantile keeps the 0.2 range
    torch.testing.assert_close(out.metrics["aspo/high_entropy_frac"], high.sum().double() / mask.sum(), **TOL)


# ---------------------------------------------------------------- (a) PSPO equals the authors' TRL patch


def _authors_pspo(lp, old, adv, mask, alpha, loss_type, max_completion_length=None, num_items_in_batch=None):
    """The patch's pspo branch of TRL 0.25.1's `_compute_loss` (token-level ratios, beta 0, no entropy mask, one
    process, one accumulation step), with that version's loss types."""
    log_ratio = lp - old
    coef_1 = torch.exp(log_ratio)
    coef_2 = (1.0 - alpha) * coef_1 + alpha
    per_token_loss = -(coef_2 * adv.unsqueeze(1))
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
    return (per_token_loss * mask).sum() / num_items_in_batch  # dapo


def _pspo_batch(seed=1, n=6, t=7, spread=1.5):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=g, dtype=D) * 3 - 0.05
    lp = old + spread * torch.randn(n, t, generator=g, dtype=D)
    mask = torch.ones(n, t, dtype=D)
    mask[2, 4:] = 0
    mask[5, 1:] = 0
    return lp, old, torch.randn(n, generator=g, dtype=D), mask


TRL_LOSS_TYPES = {  # TRL loss_type -> tether aggregation
    "dapo": "token-mean",
    "bnpo": "token-mean",
    "grpo": "seq-mean-token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
}


@pytest.mark.parametrize("loss_type", list(TRL_LOSS_TYPES))
@pytest.mark.parametrize("alpha", [0.1, 0.0, 0.6])
def test_pspo_equals_the_authors_trl_patch(alpha, loss_type):
    lp, old, adv, mask = _pspo_batch()
    x = lp.clone().requires_grad_()
    ref = _authors_pspo(x, old, adv, mask, alpha, loss_type, max_completion_length=12, num_items_in_batch=mask.sum())
    spec = {"name": "pspo", "alpha": alpha, "aggregation": TRL_LOSS_TYPES[loss_type], "max_len": 12}
    out, g = _run(spec, lp, old, adv, mask)
    torch.testing.assert_close(out.loss.detach(), ref.detach(), **TOL)
    torch.testing.assert_close(g, _grad(ref, x), **TOL)
    w = (lp - old).exp()
    assert (w > 3).any() and (w < 0.3).any()  # far off-policy on both sides: nothing is clipped, by design


def test_pspo_micro_batches_equal_trls_dapo_normaliser():
    # TRL's dapo divides each micro-batch's sum by the accumulated batch's token count (num_items_in_batch):
    # tether's token-mean with loss_norm = the mini-batch normaliser, summed over the micro-batches.
    lp, old, adv, mask = _pspo_batch(seed=2)
    x = lp.clone().requires_grad_()
    ref = _authors_pspo(x, old, adv, mask, 0.1, "dapo", num_items_in_batch=mask.sum())
    obj = objectives.build("pspo")
    norm = obj.normalizer(mask)
    y = lp.clone().requires_grad_()
    total = sum(
        obj(
            objectives.TokenBatch(
                logprobs=y[rows], old_logprobs=old[rows], advantages=adv[rows], loss_mask=mask[rows], loss_norm=norm
            )
        ).loss
        for rows in (slice(0, 2), slice(2, 6))
    )
    torch.testing.assert_close(total.detach(), ref.detach(), **TOL)
    torch.testing.assert_close(_grad(total, y), _grad(ref, x), **TOL)


# ---------------------------------------------------------------- (b) hand-computed


def test_aspo_hand_computed():
    # pi_old = 0.2 for every token, eps 0.2, c 3, token-mean over 6.
    # A = +1: w = 1.5 (p 0.3) > 1.2: masked, l = -1 / 1.2 = -0.8333333, no gradient;
    #         w = 0.8 (p 0.16): flipped, l = -1 / 0.8 = -1.25, d l / d lp = -1 / w = -1.25;
    #         w = 0.25 (p 0.05): 1 / w = 4 > 3: dual, l = -3 ln 0.05 = 8.9871968, d l / d lp = -3.
    # A = -1: w = 0.5 (p 0.1) < 0.8: masked, l = 0.8, no gradient;
    #         w = 1.25 (p 0.25): l = w = 1.25, d l / d lp = w = 1.25;
    #         w = 4 (p 0.8) > 3: dual, l = 3 ln 0.8 = -0.6694307, d l / d lp = 3.
    # loss = (-0.8333333 - 1.25 + 8.9871968 + 0.8 + 1.25 - 0.6694307) / 6 = 8.2844328 / 6 = 1.3807388.
    p = _t([0.3, 0.16, 0.05], [0.1, 0.25, 0.8])
    old = torch.full_like(p, 0.2).log()
    out, g = _run({"name": "aspo"}, p.log(), old, _t(1.0, -1.0))
    expected = (-1 / 1.2 - 1.25 - 3 * math.log(0.05) + 0.8 + 1.25 + 3 * math.log(0.8)) / 6
    assert expected == pytest.approx(1.3807388, abs=1e-7)
    assert out.metrics["loss/policy"].item() == pytest.approx(expected, rel=1e-12)
    torch.testing.assert_close(g, _t([0.0, -1.25, -3.0], [0.0, 1.25, 3.0]) / 6, rtol=1e-12, atol=1e-15)
    # One token of six in each clip flag, two dual-clipped; mean weight (0 + 1.25 + 3) / 3 = 1.4166667 on each side.
    for key, value in {
        "policy/clipfrac_high": 1 / 6,
        "policy/clipfrac_low": 1 / 6,
        "policy/clipfrac_dual": 2 / 6,
        "aspo/dual_frac_pos": 1 / 3,
        "aspo/dual_frac_neg": 1 / 3,
        "aspo/weight_pos_mean": 4.25 / 3,
        "aspo/weight_neg_mean": 4.25 / 3,
    }.items():
        assert out.metrics[key].item() == pytest.approx(value, rel=1e-12), key


def test_aspo_flipped_weight_is_eq_12():
    # Eq. 12: a positive token's gradient is (pi_old / pi_theta) grad log pi_theta. One token, A = 2, pi_old = 0.5,
    # pi_theta = 0.35 (w = 0.7, inside [1/3, 1.2]): d l / d lp = -2 / 0.7 = -2.8571429; GRPO's is -2 w = -1.4.
    _, g = _run({"name": "aspo"}, _t([math.log(0.35)]), _t([math.log(0.5)]), _t(2.0))
    assert g.item() == pytest.approx(-2 / 0.7, rel=1e-14)
    _, g_grpo = _run({"preset": "grpo", "kl_penalty": None}, _t([math.log(0.35)]), _t([math.log(0.5)]), _t(2.0))
    assert g_grpo.item() == pytest.approx(-1.4, rel=1e-14)


def test_pspo_hand_computed():
    # alpha 0.1, token-mean over 2. A = +1, w = 2: w~ = 0.9 * 2 + 0.1 = 1.9, l = -1.9, d l / d lp = -0.9 * 2 = -1.8.
    # A = -1, w = 0.5: w~ = 0.55, l = 0.55, d l / d lp = 0.9 * 0.5 = 0.45. loss = (-1.9 + 0.55) / 2 = -0.675.
    # k3(x) = x - 1 - ln x: k3(1.9) = 0.9 - 0.6418539 = 0.2581461, k3(0.55) = -0.45 + 0.5978370 = 0.1478370,
    # mean 0.2029916; smoothed ratio mean (1.9 + 0.55) / 2 = 1.225.
    old = _t([math.log(0.3)], [math.log(0.4)])
    lp = old + _t([math.log(2.0)], [math.log(0.5)])
    out, g = _run("pspo", lp, old, _t(1.0, -1.0))
    assert out.loss.item() == pytest.approx(-0.675, rel=1e-12)
    torch.testing.assert_close(g, _t([-1.8], [0.45]) / 2, rtol=1e-12, atol=1e-15)
    assert out.metrics["pspo/smoothed_ratio_mean"].item() == pytest.approx(1.225, rel=1e-12)
    assert out.metrics["pspo/smoothed_kl_old"].item() == pytest.approx(0.2029916, abs=1e-7)
    assert out.metrics["policy/clipfrac_high"].item() == 0 and out.metrics["policy/clipfrac_low"].item() == 0


# ---------------------------------------------------------------- (c) exactness by enumeration

NUM_ACTIONS = 8
ENUM_TOL = dict(rtol=1e-10, atol=1e-12)


def _expected_grad(token_loss, theta, lp_old):
    """grad_theta of sum_a pi_old(a) l(a), each action a one-token sequence (an (K, 1) batch)."""
    th = theta.clone().requires_grad_()
    lp = torch.log_softmax(th, -1)[:, None]
    return _grad((lp_old.exp()[:, None] * token_loss(lp)).sum(), th)


def _off_policy_bandit():
    """pi_theta = pi_old w with chosen ratios w (sum_a pi_old w = 1 fixes the last) and advantage signs that put at
    least one action in each of ASPO's six branches at eps 0.2, c 3."""
    theta_old = 0.3 * torch.randn(NUM_ACTIONS, generator=torch.Generator().manual_seed(0), dtype=D)
    p_old = torch.softmax(theta_old, -1)
    w = _t(0.15, 0.25, 0.5, 0.9, 1.1, 1.5, 3.5, 0.0)
    w[-1] = (1 - (p_old[:-1] * w[:-1]).sum()) / p_old[-1]  # 0.372
    adv = _t(0.7, -1.2, 0.4, -0.9, 1.1, 0.8, -1.3, -0.5)
    # branches: pos dual, neg masked, pos flipped, neg ratio, pos flipped, pos masked, neg dual, neg masked
    return theta_old + w.log(), theta_old, adv


def _aspo_objective_grad(theta, theta_old, adv, eps=0.2, c=3.0):
    """grad_theta of -J for the objective ASPO's three steps define, in probabilities (regions frozen at theta):
    A < 0 kept: A pi; A > 0 kept: -A pi_old^2 / pi (weight flipped); dual-clipped: c A pi_old log pi (CISPO's
    truncated weight, gradient kept); masked: 0."""
    th = theta.clone().requires_grad_()
    p, p_old = torch.softmax(th, -1), torch.softmax(theta_old, -1)
    w = (p / p_old).detach()
    terms = torch.where(
        adv > 0,
        torch.where(w > 1 + eps, 0 * p, torch.where(1 / w > c, c * adv * p_old * p.log(), -adv * p_old**2 / p)),
        torch.where(w < 1 - eps, 0 * p, torch.where(w > c, c * adv * p_old * p.log(), adv * p)),
    )
    return _grad(-terms.sum(), th)


def test_aspo_expected_gradient_is_the_gradient_of_its_objective():
    theta, theta_old, adv = _off_policy_bandit()
    lp_old = torch.log_softmax(theta_old, -1)
    w = (torch.log_softmax(theta, -1) - lp_old).exp()
    assert (w - _t(0.15, 0.25, 0.5, 0.9, 1.1, 1.5, 3.5, 0.372056587822)).abs().max() < 1e-9
    got = _expected_grad(lambda lp: AS.aspo(lp, lp_old[:, None], adv).tokens.loss, theta, lp_old)
    torch.testing.assert_close(got, _aspo_objective_grad(theta, theta_old, adv), **ENUM_TOL)
    # The flip matters: GRPO's clipped surrogate (the same mask, weight w for A > 0) has another expected gradient.
    grpo = _expected_grad(lambda lp: S.ppo_clip(lp, lp_old[:, None], adv, 0.2, 0.2).loss, theta, lp_old)
    assert (grpo - got).abs().max() > 1e-2


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_on_policy_aspo_and_pspo_expected_gradients_are_the_policy_gradient(seed):
    # At theta = theta_old every weight is 1: ASPO's expected gradient is -grad E_pi[R]; PSPO's is (1 - alpha) of it.
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(NUM_ACTIONS, generator=g, dtype=D)
    reward = torch.randint(0, 2, (NUM_ACTIONS,), generator=g).double()
    adv = reward - 0.37  # a constant baseline adds nothing in expectation
    lp_old = torch.log_softmax(theta, -1)
    th = theta.clone().requires_grad_()
    pg = _grad(-(torch.softmax(th, -1) * reward).sum(), th)
    got = _expected_grad(lambda lp: AS.aspo(lp, lp_old[:, None], adv).tokens.loss, theta, lp_old)
    torch.testing.assert_close(got, pg, **ENUM_TOL)
    got = _expected_grad(lambda lp: PS.pspo(lp, lp_old[:, None], adv, 0.1)[0].loss, theta, lp_old)
    torch.testing.assert_close(got, 0.9 * pg, **ENUM_TOL)


@pytest.mark.parametrize("alpha", [0.1, 0.5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pspo_expected_loss_is_the_smoothed_policys_expected_advantage(seed, alpha):
    # E_old[-w~ A] = -sum_a pi~(a) A(a), pi~ = (1 - alpha) pi_theta + alpha pi_old, in value and gradient, however far
    # pi_theta is from pi_old (here ratios from ~0.02 to ~20).
    g = torch.Generator().manual_seed(seed)
    theta_old = torch.randn(NUM_ACTIONS, generator=g, dtype=D)
    theta = theta_old + 2.0 * torch.randn(NUM_ACTIONS, generator=g, dtype=D)
    adv = torch.randn(NUM_ACTIONS, generator=g, dtype=D)
    lp_old = torch.log_softmax(theta_old, -1)
    th = theta.clone().requires_grad_()
    lp = torch.log_softmax(th, -1)[:, None]
    expected = (lp_old.exp()[:, None] * PS.pspo(lp, lp_old[:, None], adv, alpha)[0].loss).sum()
    th2 = theta.clone().requires_grad_()
    smoothed = (1 - alpha) * torch.softmax(th2, -1) + alpha * lp_old.exp()
    objective = -(smoothed * adv).sum()
    torch.testing.assert_close(expected, objective, **ENUM_TOL)
    torch.testing.assert_close(_grad(expected, th), _grad(objective, th2), **ENUM_TOL)


def test_pspo_gradient_is_the_unclipped_importance_weighted_gradient_times_one_minus_alpha():
    # What the smoothing does to the update, on a batch: d l / d lp = -(1 - alpha) w A, reinforce with SG(w)'s times
    # the constant 1 - alpha, far off-policy included (docs/algorithms/pspo.md).
    lp, old, adv, mask = _pspo_batch(seed=3)
    _, g = _run({"name": "pspo", "alpha": 0.25}, lp, old, adv, mask)
    _, g_is = _run({"name": "reinforce", "importance_weight": True, "aggregation": "token-mean"}, lp, old, adv, mask)
    torch.testing.assert_close(g, 0.75 * g_is, **TOL)


# ---------------------------------------------------------------- (d) invariants


@pytest.mark.parametrize(
    "spec", [{"preset": "aspo"}, {"name": "aspo", **RELEASED_SPLIT}, {"name": "aspo", "dual_clip_c": None}, "pspo"]
)
def test_all_masked_batch_gives_zero_and_no_nan(spec):
    lp, old, adv, _, entropy = _aspo_batch()
    mask = torch.zeros_like(lp)
    out, g = _run(spec, lp, old, adv, mask, entropy=entropy, ref_logprobs=old - 0.1)
    assert out.loss.item() == 0.0 and torch.equal(g, torch.zeros_like(g))
    assert all(torch.isfinite(v).all() for v in out.metrics.values())


@pytest.mark.parametrize("spec", [{"name": "aspo"}, {"name": "aspo", "dual_clip_c": None}, {"name": "pspo"}])
def test_extreme_ratios_give_finite_losses_and_gradients(spec):
    # log w = +-50 (clamped to +-20), +-30, +-5 with both signs of A: no inf, no NaN anywhere.
    old = torch.full((4, 3), -3.0, dtype=D)
    lp = old + _t([50.0, -50.0, 5.0], [-30.0, 30.0, -5.0], [50.0, -50.0, 0.0], [-30.0, 30.0, 0.0])
    out, g = _run(spec, lp, old, _t(1.0, 1.0, -1.0, -1.0))
    assert torch.isfinite(out.loss) and torch.isfinite(g).all()
    assert all(torch.isfinite(v).all() for v in out.metrics.values())
    if spec == {"name": "aspo"}:
        # A > 0 at w = e^-20 (p = e^-53 ~ 0): dual-clipped, gradient weight c = 3 (/ 12 tokens), not 1 / w = e^20.
        assert g[0, 1].item() == pytest.approx(-3 / 12, rel=1e-12)


@pytest.mark.parametrize("spec", [{"name": "aspo", **RELEASED_SPLIT}, {"name": "pspo"}])
def test_padding_values_change_nothing(spec):
    lp, old, adv, mask, entropy = _aspo_batch()
    out, g = _run(spec, lp, old, adv, mask, entropy=entropy)
    pad = ~mask.bool()
    junk = lambda x, v: torch.where(pad, torch.full_like(x, v), x)  # noqa: E731
    out2, g2 = _run(spec, junk(lp, float("nan")), junk(old, float("inf")), adv, mask, entropy=junk(entropy, 1e9))
    torch.testing.assert_close(out2.loss, out.loss, rtol=0, atol=0)
    torch.testing.assert_close(g2[~pad], g[~pad], rtol=0, atol=0)
    assert torch.equal(g2[pad], torch.zeros_like(g2[pad]))


def test_zero_advantages_give_zero_gradient():
    lp, old, _, mask, entropy = _aspo_batch()
    for spec in ({"name": "aspo", **RELEASED_SPLIT}, {"name": "pspo"}):
        _, g = _run(spec, lp, old, torch.zeros(lp.shape[0], dtype=D), mask, entropy=entropy)
        assert torch.equal(g, torch.zeros_like(g))


def test_gradcheck_and_where_the_aspo_value_is_no_antiderivative():
    g = torch.Generator().manual_seed(5)
    old = -torch.rand(3, 4, generator=g, dtype=D) - 0.2
    lp = old + 0.1 * torch.randn(3, 4, generator=g, dtype=D)  # |log w| < 0.18: away from every clip boundary
    adv = _t(1.0, -0.5, 0.3)
    torch.autograd.gradcheck(lambda x: PS.pspo(x, old, adv, 0.1)[0].loss, (lp.clone().requires_grad_(),))
    neg = adv < 0  # A < 0: the loss is -A w, a true function of lp
    torch.autograd.gradcheck(lambda x: AS.aspo(x, old[neg], adv[neg]).tokens.loss, (lp[neg].clone().requires_grad_(),))
    # A > 0: Eq. 3's value is 1 / w but its gradient (1 / w) grad lp is not d(1 / w) = -(1 / w) grad lp: the loss
    # value rises as the update raises pi_theta (so loss/policy is no progress measure for positive tokens), while
    # autograd's gradient is the intended -A / w. One token, A = 1, w = 0.9: value -1 / 0.9, slope +1 / 0.9.
    x = (old[:1, :1] + math.log(0.9)).requires_grad_()
    l = AS.aspo(x, old[:1, :1], _t(1.0)).tokens.loss.sum()
    assert _grad(l, x).item() == pytest.approx(-1 / 0.9, rel=1e-12)
    h = 1e-6
    slope = (AS.aspo(x.detach() + h, old[:1, :1], _t(1.0)).tokens.loss - l.detach()).item() / h
    assert slope == pytest.approx(1 / 0.9, rel=1e-5)


def test_metrics_merge_exactly_over_micro_batches():
    lp, old, adv, mask, entropy = _aspo_batch()
    spec = {"name": "aspo", **RELEASED_SPLIT}
    full, _ = _run(spec, lp, old, adv, mask, entropy=entropy)
    merger = objectives.MetricMerger()
    for rows in (slice(0, 3), slice(3, 8)):
        part, _ = _run(spec, lp[rows], old[rows], adv[rows], mask[rows], entropy=entropy[rows])
        merger.add(part)
    merged = merger.result()
    for key in ("aspo/dual_frac_pos", "aspo/dual_frac_neg", "aspo/weight_pos_mean", "aspo/weight_neg_mean"):
        torch.testing.assert_close(merged[key], full.metrics[key].double(), **TOL, msg=key)


def test_capabilities_and_config_errors_name_the_fix():
    assert objectives.build("aspo").has_trust_region()
    assert not objectives.build("pspo").has_trust_region()  # no factor of its gradient depends on w - 1
    assert "entropy" in objectives.build({"name": "aspo", **RELEASED_SPLIT}).config.needs()
    assert "entropy" not in objectives.build("aspo").config.needs()
    lp, old, adv, mask, _ = _aspo_batch()
    with pytest.raises(ValueError, match="needs TokenBatch.entropy"):
        _run({"name": "aspo", **RELEASED_SPLIT}, lp, old, adv, mask)
    for bad, key in (
        ({"name": "pspo", "alpha": 1.0}, "alpha"),
        ({"name": "pspo", "alpha": -0.1}, "alpha"),
        ({"name": "aspo", "dual_clip_c": 1.0}, "dual_clip_c"),
        ({"name": "aspo", "high_entropy_eps_low": 0.4}, "high_entropy_eps_low/high"),
        ({"name": "aspo", **RELEASED_SPLIT, "high_entropy_quantile": 1.0}, "high_entropy_quantile"),
        ({"name": "aspo", "alpha": 0.1}, "alpha"),
    ):
        with pytest.raises(ConfigError, match=key):
            objectives.build(bad)


# ---------------------------------------------------------------- (e) presets


def test_presets_build_with_the_papers_settings():
    aspo = objectives.build({"preset": "aspo"})
    assert aspo.name == "aspo" and aspo.label == "aspo"
    c = aspo.config
    assert (c.eps_low, c.eps_high, c.dual_clip_c, c.aggregation, c.advantage) == (0.2, 0.2, 3.0, "token-mean", "grpo")
    assert (c.kl_penalty.estimator, c.kl_penalty.coef) == ("k3_clamped", 0.001)
    assert c.high_entropy_eps_low is None and aspo.uses_reference()
    pspo = objectives.build({"preset": "pspo"})
    assert pspo.name == "pspo" and (pspo.config.alpha, pspo.config.aggregation) == (0.1, "token-mean")
    assert pspo.config.kl_penalty is None and not pspo.uses_reference()
    # Overrides go through the one spec path; the presets run on a batch.
    assert objectives.build({"preset": "aspo", **RELEASED_SPLIT}).config.high_entropy_eps_high == 0.4
    lp, old, adv, mask, entropy = _aspo_batch()
    for spec in ({"preset": "aspo"}, {"preset": "pspo"}):
        out, g = _run(spec, lp, old, adv, mask, ref_logprobs=old - 0.1)
        assert torch.isfinite(out.loss) and torch.isfinite(g).all() and g.abs().sum() > 0
