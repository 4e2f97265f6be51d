"""GPPO and CE-GPPO compute the loss and gradient of the authors' released code, on CPU in float64.

The references below are our transcriptions of the authors' loss functions (their semantics, written here; the
repositories are Apache-2.0 forks of verl that cannot be installed as packages):
- GPPO as used for the paper: `compute_gppo_loss` in `verl/trainer/ppo/core_algos.py` of Kwai-Klear/KlearReasoner
  at commit e0f7bb1141ae258dd86ee23ebb622a406fdca183 (PPO's clamp whose bounds are (1 -/+ eps) w / SG(w)). At the
  newest commit (3422f6d36a8251cb1c86a7b943c7c815850864fd) that function tests an undefined name `only_higher`
  (its argument is `only_high`), so its default path raises NameError; the older version is the one that ran.
- CE-GPPO (and GPPO with beta 1 / 1): `compute_gppo_loss_general_beta` in the same file at 3422f6d3..., identical
  in Kwai-Klear/CE-GPPO at commit 10558fe017ac776773fd7f29753d8353a11c0813 (and in that repository's README).
Both end in verl's dual clip (clip_ratio_c, always on there) and verl's `agg_loss`. verl's token-mean divides by
(number of tokens + 1e-8); the reference aggregation leaves the 1e-8 out (a relative 2.4e-10 on 41 tokens here; it
belongs to verl's aggregation, a separate tether axis, not to GPPO), so that loss values can be compared to 1e-10.

What is proved, by section (STYLE.md's numbering):
1. hand-computed values: GPPO's forward value is PPO-clip's while a clipped token's gradient is -(1 -/+ eps) A
   (Klear-Reasoner Eq. 12), CE-GPPO's is -beta (1 -/+ eps) A (Eq. 18); the gradient is not the value's derivative;
3. loss and gradient equal the authors' code to 1e-10 on random batches with ratios on both sides of both bounds,
   both advantage signs, A = 0 and the dual clip binding; on-policy both are the plain policy gradient;
4. invariants: all-masked batches, extreme ratios (where the authors' w / SG(w) gives NaN), NaN padding;
and the presets build and bad configs name the problem.
"""

from __future__ import annotations

import math

import pytest
import torch

import tether.objectives.gppo  # noqa: F401  registers gppo and ce_gppo until tether/objectives/__init__.py does
from tether import objectives
from tether.core import gppo as G
from tether.schema import ConfigError

D = torch.float64
TOL = dict(rtol=1e-10, atol=1e-10)
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
NO_DUAL = 1e12  # the released code always dual-clips; a c this large never binds, which is tether's dual_clip_c=None


# ---------------------------------------------------------------- the released code, transcribed


def _verl_agg(loss, mask, mode):
    """verl's `agg_loss` of both commits (token-mean without the +1e-8 of its masked_mean: see the module doc)."""
    if mode == "token-mean":
        return (loss * mask).sum() / mask.sum()
    seq = (loss * mask).sum(-1)
    return seq.mean() if mode == "seq-mean-token-sum" else (seq / mask.sum(-1)).mean()


def _verl_dual_clip(pg, adv, c):
    """The released functions' last step: for A < 0, min(-A c, loss)."""
    return torch.where(adv < 0, torch.min(-adv * c, pg), pg)


def _released_gppo(lp, old, adv, mask, mode, eps_low, eps_high, c):
    """KlearReasoner@e0f7bb1 `compute_gppo_loss`: (aggregated loss, per-token loss)."""
    adv = (adv[:, None] if adv.dim() == 1 else adv).expand_as(lp).contiguous()  # the released code takes (bs, T)
    ratio = torch.exp(lp - old)
    sg = ratio.detach()
    unclipped = -adv * ratio
    bounded = -adv * torch.clamp(ratio, (1 - eps_low) / sg * ratio, (1 + eps_high) / sg * ratio)
    tokens = _verl_dual_clip(torch.maximum(unclipped, bounded), adv, c)
    return _verl_agg(tokens, mask, mode), tokens


def _released_general_beta(lp, old, adv, mask, mode, eps_low, eps_high, c, beta1, beta2):
    """KlearReasoner@3422f6d / CE-GPPO@10558fe `compute_gppo_loss_general_beta`: (aggregated loss, per-token
    loss, the released clip fraction, whose masked mean divides by count + 1e-8)."""
    adv = (adv[:, None] if adv.dim() == 1 else adv).expand_as(lp).contiguous()
    ratio = torch.exp(lp - old)
    sg = ratio.detach()
    low = (ratio < 1 - eps_low) & (adv < 0)
    high = (ratio > 1 + eps_high) & (adv > 0)
    other = ~(low | high)
    tokens = torch.zeros_like(adv)
    tokens[low] = -beta1 * (1 - eps_low) / sg[low] * ratio[low] * adv[low]
    tokens[high] = -beta2 * (1 + eps_high) / sg[high] * ratio[high] * adv[high]
    tokens[other] = -ratio[other] * adv[other]
    clipfrac = ((low | high).to(D) * mask).sum() / (mask.sum() + 1e-8)
    tokens = _verl_dual_clip(tokens, adv, c)
    return _verl_agg(tokens, mask, mode), tokens, clipfrac


# ---------------------------------------------------------------- helpers


def _batch(seed=0, n=6, t=8):
    """log w uniform in [-1.2, 1.2] (w in [0.30, 3.32]: below 0.8, inside, above 1.28), two tokens of A < 0 rows
    pushed to w = 4.48 and 12.2 (past the dual clip at 3 and at 10), a ragged mask, advantages of both signs
    and an exact 0."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=g, dtype=D) * 4 - 0.05
    log_w = torch.rand(n, t, generator=g, dtype=D) * 2.4 - 1.2
    log_w[1, 0], log_w[5, 3] = 1.5, 2.5
    lp = (old + log_w).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.25, 0.0, -2.0], dtype=D)[:n]
    mask = torch.ones(n, t, dtype=D)
    mask[1, 6:] = 0
    mask[3, 3:] = 0
    return lp, old, adv, mask


def _tether(spec, lp, old, adv, mask):
    obj = objectives.build(spec)
    b = objectives.TokenBatch(logprobs=lp, old_logprobs=old, advantages=adv, loss_mask=mask)
    return obj(b), obj.terms(b).tokens


def _grad(loss, lp):
    return torch.autograd.grad(loss, lp, retain_graph=True)[0]


def _t(*rows):
    return torch.tensor(rows, dtype=D)  # one list gives a (1, T) batch


# ---------------------------------------------------------------- 3. equal to the authors' code


def test_the_batches_exercise_every_branch():
    lp, old, adv, mask = _batch()
    w, a, m = torch.exp(lp - old).detach(), adv[:, None].expand_as(lp), mask.bool()
    for region in (
        (a > 0) & (w > 1.28),  # clipped high: gradient kept
        (a > 0) & (w < 0.8),  # A > 0 below the lower bound: PPO keeps it unclipped
        (a < 0) & (w < 0.8),  # clipped low: gradient kept
        (a < 0) & (w > 1.28) & (w < 3),  # A < 0 above the upper bound: unclipped, under the dual clip
        (a < 0) & (w > 3) & (w < 10),  # past the dual clip at 3 only
        (a < 0) & (w > 10),  # past the dual clip at 10
        (a == 0),
        (w > 0.8) & (w < 1.2) & (a != 0),  # inside every clip range used here
    ):
        assert (region & m).any()


@pytest.mark.parametrize("c", [None, 3.0, 10.0])
@pytest.mark.parametrize("mode", MODES)
def test_gppo_equals_the_released_gppo_loss(mode, c):
    lp, old, adv, mask = _batch(seed=1)
    spec = {"name": "gppo", "eps_low": 0.2, "eps_high": 0.28, "dual_clip_c": c, "aggregation": mode}
    out, tokens = _tether(spec, lp, old, adv, mask)
    ref_c = NO_DUAL if c is None else c
    ref_loss, ref_tokens = _released_gppo(lp, old, adv, mask, mode, 0.2, 0.28, ref_c)
    ref2_loss, ref2_tokens, _ = _released_general_beta(lp, old, adv, mask, mode, 0.2, 0.28, ref_c, 1.0, 1.0)
    m = mask.bool()
    for loss, toks in ((ref_loss, ref_tokens), (ref2_loss, ref2_tokens)):
        torch.testing.assert_close(tokens.loss[m], toks[m], **TOL)
        torch.testing.assert_close(out.loss, loss, **TOL)
        torch.testing.assert_close(_grad(out.loss, lp), _grad(loss, lp), **TOL)


@pytest.mark.parametrize(
    "eps_low,eps_high,beta_low,beta_high",
    [(0.2, 0.2, 0.75, 1.0), (0.2, 0.2, 0.5, 1.0), (0.2, 0.28, 0.25, 0.6), (0.1, 0.3, 1.5, 0.0)],
)
@pytest.mark.parametrize("c", [None, 3.0, 10.0])
@pytest.mark.parametrize("mode", MODES)
def test_ce_gppo_equals_the_released_general_beta_loss(mode, c, eps_low, eps_high, beta_low, beta_high):
    # The last case has beta_low != beta_high on asymmetric bounds, so a swap of the two sides would show.
    lp, old, adv, mask = _batch(seed=2)
    spec = {
        "name": "ce_gppo",
        "eps_low": eps_low,
        "eps_high": eps_high,
        "beta_low": beta_low,
        "beta_high": beta_high,
        "dual_clip_c": c,
        "aggregation": mode,
    }
    out, tokens = _tether(spec, lp, old, adv, mask)
    ref_c = NO_DUAL if c is None else c
    ref_loss, ref_tokens, ref_clipfrac = _released_general_beta(
        lp, old, adv, mask, mode, eps_low, eps_high, ref_c, beta_low, beta_high
    )
    m = mask.bool()
    torch.testing.assert_close(tokens.loss[m], ref_tokens[m], **TOL)
    torch.testing.assert_close(out.loss, ref_loss, **TOL)
    torch.testing.assert_close(_grad(out.loss, lp), _grad(ref_loss, lp), **TOL)
    # The released clip fraction (low | high) is tether's clipfrac_low + clipfrac_high (up to verl's + 1e-8).
    ours = out.metrics["policy/clipfrac_low"] + out.metrics["policy/clipfrac_high"]
    torch.testing.assert_close(ours, ref_clipfrac, rtol=1e-8, atol=0)


# ---------------------------------------------------------------- 1. hand-computed


def _hand_batch():
    # One sequence of 4 tokens, token-mean over 4: (A, w) = (+1, 1.5), (-1, 0.5), (+1, 1.1), (-1, 1.5).
    old = _t([-1.0, -2.0, -0.5, -1.5])
    lp = (old + _t([math.log(1.5), math.log(0.5), math.log(1.1), math.log(1.5)])).requires_grad_()
    return lp, old, _t([1.0, -1.0, 1.0, -1.0]), torch.ones(1, 4, dtype=D)  # (1, 4) each, per-token A


def test_gppo_hand_computed_value_is_ppo_clips_and_clipped_gradients_are_kept():
    # eps 0.2 / 0.28: bounds [0.8, 1.28].
    #   token 1: A = +1, w = 1.5 > 1.28: clipped high. value -(1.28)(1) = -1.28; d l / d lp = -(1 + eps_high) A = -1.28
    #            (PPO-clip: the same value, gradient 0).
    #   token 2: A = -1, w = 0.5 < 0.8: clipped low. value -(0.8)(-1) = 0.8; d l / d lp = -(1 - eps_low) A = +0.8
    #            (PPO-clip: 0).
    #   token 3: A = +1, w = 1.1 inside: value -1.1; d l / d lp = -w A = -1.1 (as PPO).
    #   token 4: A = -1, w = 1.5 above 1.28 but A < 0: PPO keeps w A; value 1.5, d l / d lp = 1.5 (as PPO).
    # loss = (-1.28 + 0.8 - 1.1 + 1.5) / 4 = -0.08 / 4 = -0.02.
    # gradient = (-1.28, 0.8, -1.1, 1.5) / 4 = (-0.32, 0.2, -0.275, 0.375); PPO-clip's (0, 0, -0.275, 0.375).
    lp, old, adv, mask = _hand_batch()
    out, _ = _tether({"name": "gppo", "eps_low": 0.2, "eps_high": 0.28}, lp, old, adv, mask)
    ppo, _ = _tether({"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.28}, lp, old, adv, mask)
    assert out.loss.item() == pytest.approx(-0.02, rel=1e-12)
    assert out.loss.item() == pytest.approx(ppo.loss.item(), rel=1e-14)  # the forward value is PPO-clip's
    torch.testing.assert_close(_grad(out.loss, lp), _t([-0.32, 0.2, -0.275, 0.375]), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(_grad(ppo.loss, lp), _t([0.0, 0.0, -0.275, 0.375]), rtol=1e-12, atol=1e-15)
    assert out.metrics["policy/clipfrac_high"].item() == 0.25 and out.metrics["policy/clipfrac_low"].item() == 0.25


def test_ce_gppo_hand_computed_scales_each_side_by_its_beta():
    # Same batch, eps 0.2 / 0.28, beta_low 0.75, beta_high 0.5:
    #   token 1 (clipped high): value -(0.5)(1.28)(1) = -0.64, d l / d lp = -0.64
    #   token 2 (clipped low):  value -(0.75)(0.8)(-1) = 0.6,  d l / d lp = +0.6
    #   tokens 3, 4 as GPPO: -1.1 and 1.5.
    # loss = (-0.64 + 0.6 - 1.1 + 1.5) / 4 = 0.36 / 4 = 0.09; gradient (-0.64, 0.6, -1.1, 1.5) / 4
    #      = (-0.16, 0.15, -0.275, 0.375). With beta != 1 the clipped tokens' VALUE is beta times PPO-clip's.
    lp, old, adv, mask = _hand_batch()
    spec = {"name": "ce_gppo", "eps_low": 0.2, "eps_high": 0.28, "beta_low": 0.75, "beta_high": 0.5}
    out, _ = _tether(spec, lp, old, adv, mask)
    assert out.loss.item() == pytest.approx(0.09, rel=1e-12)
    torch.testing.assert_close(_grad(out.loss, lp), _t([-0.16, 0.15, -0.275, 0.375]), rtol=1e-12, atol=1e-15)
    # beta 1 / 1 is GPPO, token for token.
    one, _ = _tether({**spec, "beta_low": 1.0, "beta_high": 1.0}, lp, old, adv, mask)
    gppo, _ = _tether({"name": "gppo", "eps_low": 0.2, "eps_high": 0.28}, lp, old, adv, mask)
    assert one.loss.item() == gppo.loss.item()
    assert torch.equal(_grad(one.loss, lp), _grad(gppo.loss, lp))


def test_the_clipped_tokens_gradient_is_not_the_derivative_of_the_value():
    # Moving a clipped token's log-prob by +-1e-4 keeps it clipped: the value does not move (PPO-clip's flat
    # branch), yet autograd gives -(1 +- eps) A / n there. GPPO's gradient is a chosen direction, not d value.
    lp, old, adv, mask = _hand_batch()
    spec = {"name": "gppo", "eps_low": 0.2, "eps_high": 0.28}
    out, _ = _tether(spec, lp, old, adv, mask)
    g = _grad(out.loss, lp)
    for i in (0, 1):
        for h in (1e-4, -1e-4):
            moved = lp.detach().clone()
            moved[0, i] += h
            assert _tether(spec, moved, old, adv, mask)[0].loss.item() == pytest.approx(out.loss.item(), abs=1e-15)
        assert abs(g[0, i].item()) > 0.19


# ---------------------------------------------------------------- 3. on-policy


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("preset", ["gppo", "ce_gppo"])
def test_on_policy_is_the_plain_policy_gradient(preset, mode):
    # w = 1 lies inside [1 - eps_low, 1 + eps_high]: every token takes -w A, whose gradient at w = 1 is -A grad lp.
    _, old, adv, mask = _batch(seed=3)
    lp = old.clone().requires_grad_()
    out, _ = _tether({"preset": preset, "aggregation": mode}, lp, old, adv, mask)
    pg, _ = _tether({"name": "reinforce", "aggregation": mode}, lp, old, adv, mask)
    torch.testing.assert_close(_grad(out.loss, lp), _grad(pg.loss, lp), rtol=1e-12, atol=1e-15)
    assert out.metrics["policy/clipfrac_low"].item() == out.metrics["policy/clipfrac_high"].item() == 0.0


# ---------------------------------------------------------------- 4. invariants


@pytest.mark.parametrize("preset", ["gppo", "ce_gppo"])
def test_all_masked_batch_gives_zero_loss_and_gradient(preset):
    lp, old, adv, mask = _batch(seed=4)
    out, _ = _tether(preset, lp, old, adv, torch.zeros_like(mask))
    assert out.loss.item() == 0.0
    assert (_grad(out.loss, lp) == 0).all()
    assert all(torch.isfinite(v) for v in out.metrics.values())


def test_extreme_ratios_keep_the_clipped_gradient_and_give_no_nan():
    # log w = (+50, +800, -50, -50, -800, +50, 0, 0), A = (+, +, +, -, -, -, +, -), token-mean over 8, GPPO preset
    # (eps 0.2 / 0.28, dual clip 10):
    #   +50, +800 with A > 0: clipped high, gradient -1.28 / 8 whatever w is;
    #   -50 with A > 0: unclipped, w clamped at e^-20 (departure 1): gradient 0 (the released -A e^-50 / 8 ~ 2e-23);
    #   -50, -800 with A < 0: clipped low, gradient +0.8 / 8 (the released code: 0.8 / 8 at -50, NaN at -800:
    #   w underflows to 0 and w / SG(w) is 0 / 0);
    #   +50 with A < 0: unclipped, -A w >= 10 -A: the dual clip caps it, gradient 0;
    #   0, 0: on-policy, gradient -A / 8.
    old = torch.full((1, 8), -3.0, dtype=D)
    lp = (old + _t([50.0, 800.0, -50.0, -50.0, -800.0, 50.0, 0.0, 0.0])).requires_grad_()
    adv = _t([1.0, 1.0, 1.0, -1.0, -1.0, -1.0, 1.0, -1.0])  # (1, 8), per token
    mask = torch.ones(1, 8, dtype=D)
    out, _ = _tether("gppo", lp, old, adv, mask)
    g = _grad(out.loss, lp)
    assert torch.isfinite(out.loss) and torch.isfinite(g).all()
    torch.testing.assert_close(g, _t([-1.28, -1.28, 0.0, 0.8, 0.8, 0.0, -1.0, 1.0]) / 8, rtol=1e-12, atol=1e-15)
    assert out.metrics["policy/clipfrac_dual"].item() == 1 / 8
    _, ref_tokens, _ = _released_general_beta(lp, old, adv, mask, "token-mean", 0.2, 0.28, 10.0, 1.0, 1.0)
    assert torch.isnan(_grad(ref_tokens[0, 4], lp)[0, 4])  # the released code's 0 / 0 (departure 1)


def test_nan_in_padding_does_not_reach_the_loss():
    lp, old, adv, mask = _batch(seed=5)
    bad_lp = torch.where(mask.bool(), lp, torch.full_like(lp, float("nan")))
    bad_old = torch.where(mask.bool(), old, torch.full_like(old, float("-inf")))
    for preset in ("gppo", "ce_gppo"):
        out, _ = _tether(preset, bad_lp, bad_old, adv, mask)
        clean, _ = _tether(preset, lp, old, adv, mask)
        g = _grad(out.loss, lp)
        assert torch.isfinite(out.loss) and torch.isfinite(g).all() and (g[~mask.bool()] == 0).all()
        assert out.loss.item() == pytest.approx(clean.loss.item(), rel=1e-14)


def test_core_functions_without_the_runtime():
    # gppo is ce_gppo with beta 1 / 1; flags mark the replaced weights and the dual cap.
    lp, old, adv, _ = _batch(seed=6)
    a = G.gppo(lp, old, adv, 0.2, 0.28, 3.0)
    b = G.ce_gppo(lp, old, adv, 0.2, 0.28, 1.0, 1.0, 3.0)
    assert torch.equal(a.loss, b.loss)
    w, A = torch.exp(lp - old).detach(), adv[:, None].expand_as(lp)
    assert torch.equal(a.clip_high, (A > 0) & (w > 1.28)) and torch.equal(a.clip_low, (A < 0) & (w < 0.8))
    assert torch.equal(a.clip_dual, (A < 0) & (w > 3.0))


# ---------------------------------------------------------------- presets and configs


def test_presets_build_with_the_papers_settings():
    assert {"gppo", "ce_gppo"} <= set(objectives.names())
    g = objectives.build({"preset": "gppo"})
    assert g.name == "gppo" and isinstance(g.config, tether.objectives.gppo.GPPOConfig)
    assert (g.config.eps_low, g.config.eps_high, g.config.dual_clip_c) == (0.2, 0.28, 10.0)
    assert (g.config.aggregation, g.config.advantage, g.config.kl_penalty) == ("token-mean", "grpo", None)
    c = objectives.build({"preset": "ce_gppo"})
    assert c.name == "ce_gppo" and isinstance(c.config, tether.objectives.gppo.CEGPPOConfig)
    cfg = c.config
    assert (cfg.eps_low, cfg.eps_high, cfg.beta_low, cfg.beta_high, cfg.dual_clip_c) == (0.2, 0.2, 0.75, 1.0, 10.0)
    assert (cfg.aggregation, cfg.advantage, cfg.kl_penalty) == ("token-mean", "grpo", None)
    assert objectives.build({"preset": "ce_gppo", "beta_low": 0.5}).config.beta_low == 0.5
    # The config defaults are the papers' equations: no dual clip.
    assert all(objectives.build({"name": n}).config.dual_clip_c is None for n in ("gppo", "ce_gppo"))
    assert g.has_trust_region() and c.has_trust_region() and not g.uses_reference()


@pytest.mark.parametrize(
    "spec,match",
    [
        ({"name": "ce_gppo", "beta_low": -0.5}, "beta_low"),
        ({"name": "ce_gppo", "beta_high": -1.0}, "beta_high"),
        ({"name": "gppo", "dual_clip_c": 0.5}, "dual_clip_c"),
        ({"name": "gppo", "eps_low": -0.1}, "eps_low"),
        ({"name": "gppo", "beta_low": 0.5}, "beta_low"),
    ],
)
def test_bad_configs_name_the_problem(spec, match):
    with pytest.raises(ConfigError, match=match):
        objectives.build(spec)
