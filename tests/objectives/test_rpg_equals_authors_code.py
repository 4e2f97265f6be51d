"""RPG equals the authors' released code (complex-reasoning/RPG), float64, to rounding.

The reference is the RPG authors' verl fork, `verl/trainer/ppo/core_algos.py` at commit
620920672c6d85280f8a78b7b1598332e6450a16 (MIT licence): `compute_policy_loss_reinforce` with
`kl_type="rpg_rf_<kl>_clip_ppo"` (RPG-REINFORCE with RPG-Style Clip, the README's "rf_clip_ppo" runs) and,
for Algorithm 1 as released, verl's dual-clip `compute_policy_loss` plus `kl_loss_coef *
agg(kl_penalty(lp, ref_lp, "rpg_<kl>"))` (the README's "rpg_<kl>1e-4" runs). That package cannot be installed
(it is a fork of verl 0.3 named `verl`), so `_released_*` below transcribe those functions' semantics, quirks
included; they are ours, not copies.

What is compared, and why only that:
- The released code takes pi_old as the anchor inside the REINFORCE loss, and a separate reference model in
  the differentiable form's KL loss, without an importance weight. tether's `anchor: old` is the former; for
  the latter the test sets ref = old, where both agree (with a reference that is not pi_old, tether's
  `anchor: ref` multiplies by w = pi_theta / pi_old so that the gradient stays exact off-policy, a documented
  departure: docs/algorithms/rpg.md).
- RPG-Style Clip: the released code branches on `advantages > 0`, tether's `branch_on: advantage`. Its dropped
  tokens carry a detached constant loss, tether's a 0 (docs/algorithms/rpg.md, departure 2): gradients are
  compared on every token, loss values on the kept ones.
- `kl_type="..._clip_ppo_v3"` branches on `A' * lp > 0`, that is `A' < 0` wherever lp < 0: the opposite of
  Algorithm 2's `psi = A' * (-lp)`; no README run uses it and tether does not reproduce it
  (`test_the_released_v3_branch_is_the_opposite_of_algorithm_2` records that reading).
"""

from __future__ import annotations

import pytest
import torch

from tether import objectives

D = torch.float64

KLS = ["fkl", "ufkl", "rkl", "urkl"]
EPS_LOW, EPS_HIGH, C, BETA = 0.2, 0.28, 3.0, 0.05  # beta large enough that the KL term is visible


def _agg(loss, mask, mode):
    """verl's `agg_loss` of that commit (token-mean, seq-mean-token-sum, seq-mean-token-mean)."""
    if mode == "token-mean":
        return (loss * mask).sum() / mask.sum()
    seq = (loss * mask).sum(-1)
    return seq.mean() if mode == "seq-mean-token-sum" else (seq / mask.sum(-1)).mean()


def _released_c_kl(kl, w_clipped, beta):
    """The released REINFORCE `kl_term`, at the clamped weight w_ = clamp(w, 1 - low, 1 + high)."""
    log_wc = torch.log(w_clipped)
    return {
        "fkl": beta * torch.ones_like(w_clipped),
        "rkl": -beta * w_clipped * (log_wc + 1),
        "ufkl": beta * (1 - w_clipped),
        "urkl": -beta * w_clipped * log_wc,
    }[kl]


def _released_reinforce_clip_ppo(kl, lp, old, adv, mask, mode, v3=False):
    """`compute_policy_loss_reinforce(kl_type=f"rpg_rf_{kl}_clip_ppo")` semantics: (loss, per-token losses)."""
    adv = adv[:, None]  # the released code takes token-level advantages (N, T)
    log_w = lp - old
    w = torch.exp(log_w)
    ckl = _released_c_kl(kl, torch.clamp(w, 1 - EPS_LOW, 1 + EPS_HIGH), BETA).detach()
    a_lp = adv * lp + ckl * torch.exp(-log_w).detach() * lp  # A' * lp, gradient through lp
    kept = a_lp * w.detach()  # (A w + C_KL) lp
    lpd = lp.detach()
    high = adv * lpd * (1 + EPS_HIGH) - ckl * lpd  # detached constants for the dropped tokens
    low = adv * lpd * (1 - EPS_LOW) - ckl * lpd
    dual = adv * lpd * C + ckl * lpd
    pos = torch.where(w < 1 + EPS_HIGH, kept, high)
    neg = torch.where(w < C, torch.where(w < 1 - EPS_LOW, low, kept), dual)
    per_token = torch.where((a_lp > 0) if v3 else (adv > 0), -pos, -neg)
    return _agg(per_token, mask, mode), per_token


def _released_kl_penalty(kl, lp, ref):
    """The released `kl_penalty(lp, ref, "rpg_<kl>")`: fkl unclamped, the others clamped to [-10, 10]."""
    log_w = lp - ref
    w = torch.exp(log_w)
    if kl == "fkl":
        return -lp + ref
    term = {"rkl": w * log_w, "ufkl": w - log_w - 1, "urkl": w * (log_w - 1) + 1}[kl]
    return torch.clamp(term, -10, 10)


def _released_algorithm_1(kl, lp, old, adv, mask, mode):
    """verl's dual-clip PPO loss on A plus `BETA * agg(kl_penalty)`, with ref = old."""
    adv = adv[:, None]
    ratio = torch.exp(lp - old)
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH)
    clipped = torch.maximum(loss1, loss2)
    pg = torch.where(adv < 0, torch.minimum(-adv * C, clipped), clipped)
    return _agg(pg, mask, mode) + BETA * _agg(_released_kl_penalty(kl, lp, old.detach()), mask, mode)


def _batch(seed=0, n=6, t=7):
    """Log-ratios spread over [-0.9, 0.9] (w in [0.41, 2.46]: every clip branch is hit, C = 3 is not), a
    ragged mask, per-sequence advantages of both signs and one exact zero."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=g, dtype=D) * 4 - 0.05
    lp = (old + (torch.rand(n, t, generator=g, dtype=D) * 1.8 - 0.9)).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.25, 0.0, 2.0], dtype=D)[:n]
    mask = torch.ones(n, t, dtype=D)
    mask[1, 5:] = 0
    mask[3, 2:] = 0
    return lp, old, adv, mask


def _tether(spec, lp, old, adv, mask, mode):
    obj = objectives.build(
        {
            **spec,
            "aggregation": mode,
            "beta": BETA,
            "eps_low": EPS_LOW,
            "eps_high": EPS_HIGH,
            "dual_clip_c": C,
            "anchor": "old",
        }
    )
    return obj(objectives.TokenBatch(logprobs=lp, old_logprobs=old, advantages=adv, loss_mask=mask)).loss


def _grad(loss, lp):
    return torch.autograd.grad(loss, lp)[0]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("kl", KLS)
def test_rpg_style_clip_equals_the_released_reinforce_clip_ppo(kl, mode):
    lp, old, adv, mask = _batch()
    ref_loss, ref_tokens = _released_reinforce_clip_ppo(kl, lp, old, adv, mask, mode)
    spec = {"name": "rpg", "kl": kl, "form": "reinforce", "clip": "rpg", "branch_on": "advantage"}
    ours = _tether(spec, lp, old, adv, mask, mode)
    torch.testing.assert_close(_grad(ours, lp), _grad(ref_loss, lp), rtol=1e-12, atol=1e-14)
    # Loss values agree on the kept tokens: with the dropped ones zeroed on the reference side too.
    w = torch.exp(lp - old).detach()
    pos = adv[:, None] > 0
    kept = torch.where(pos, w < 1 + EPS_HIGH, (w >= 1 - EPS_LOW) & (w < C)).to(lp.dtype)
    assert 0 < (kept * mask).sum() < mask.sum(), "the batch must exercise both kept and dropped tokens"
    torch.testing.assert_close(ours.detach(), _agg(ref_tokens * kept, mask, mode).detach(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("kl", KLS)
def test_clipped_differentiable_form_equals_the_released_algorithm_1(kl, mode):
    lp, old, adv, mask = _batch(seed=1)
    ref_loss = _released_algorithm_1(kl, lp, old, adv, mask, mode)
    ours = _tether({"name": "rpg", "kl": kl, "form": "differentiable", "clip": "rpg"}, lp, old, adv, mask, mode)
    torch.testing.assert_close(ours, ref_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(_grad(ours, lp), _grad(ref_loss, lp), rtol=1e-12, atol=1e-14)


def test_the_released_clamp_of_the_kl_term_is_reproduced_at_large_ratios():
    # rkl at w = e^2: w log w = 14.78 > 10, so the released term is clamped to 10 and gives no KL gradient;
    # tether's clipped differentiable form must clamp identically (PPO part: A = 0, no gradient).
    old = torch.tensor([[-3.0, -3.0]], dtype=D)
    lp = torch.tensor([[-1.0, -2.9]], dtype=D, requires_grad=True)  # log w = 2 (clamped), 0.1 (not)
    adv, mask = torch.tensor([0.0], dtype=D), torch.ones(1, 2, dtype=D)
    ref = _released_algorithm_1("rkl", lp, old, adv, mask, "token-mean")
    ours = _tether(
        {"name": "rpg", "kl": "rkl", "form": "differentiable", "clip": "rpg"}, lp, old, adv, mask, "token-mean"
    )
    g_ours, g_ref = _grad(ours, lp), _grad(ref, lp)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-12, atol=1e-14)
    # d/dlp of beta/2 * w log w at log w = 0.1: beta/2 * w (log w + 1) = 0.025 * 1.10517 * 1.1 = 0.0303922
    assert g_ours[0, 0] == 0.0 and g_ours[0, 1].item() == pytest.approx(0.025 * 1.1051709180756477 * 1.1, rel=1e-12)


def test_the_released_v3_branch_is_the_opposite_of_algorithm_2():
    # Algorithm 2 branches on psi = A' * l with l = -lp > 0, i.e. on the sign of A' (tether's
    # `regularized_advantage`). The released v3 variant branches on A' * lp > 0, i.e. on A' < 0: on a batch
    # where A' has both signs, the two disagree on every token whose branch matters, so tether does not offer it.
    lp, old, adv, mask = _batch(seed=2)
    _, v3_tokens = _released_reinforce_clip_ppo("urkl", lp, old, adv, mask, "token-mean", v3=True)
    spec = {"name": "rpg", "kl": "urkl", "form": "reinforce", "clip": "rpg", "branch_on": "regularized_advantage"}
    ours = objectives.build(
        {**spec, "aggregation": "token-mean", "beta": BETA, "eps_low": EPS_LOW, "eps_high": EPS_HIGH, "dual_clip_c": C}
    )
    terms = ours.terms(objectives.TokenBatch(logprobs=lp, old_logprobs=old, advantages=adv, loss_mask=mask))
    differs = (terms.tokens.loss.detach() - v3_tokens.detach()).abs() > 1e-9
    assert differs[mask.bool()].any()
