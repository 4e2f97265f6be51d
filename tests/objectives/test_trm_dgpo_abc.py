"""TRM, DGPO and ABC-GRPO compute the objective and gradient their papers define, on CPU in float64.

1. hand-computed values and gradients (arithmetic in the comments);
2. against public code, to 1e-10:
   - TRM: verl 0.9.1's own `compute_rollout_rejection_mask` and `bypass_mode` loss (the code of
     verl-project/verl#4544, merged as 97eac90487a0c6f7ef38e38d305e8f3fad7c4f0b: `seq_max_k2`, `seq_max_k3`,
     `seq_mean_k3`, `seq_mean_k2` and chains of them), called, not transcribed (skipped without verl); and the
     paper's Algorithm 1 written out (arXiv 2512.23075);
   - DGPO: the authors' code transcribed, VenomRose-Juri/DGPO-RL at cc225d44a66bacaaf952cff04ec578114d8179ff,
     verl/trainer/ppo/core_algos.py, `compute_policy_loss` (`ratio_mode == "dgpo"`) and `agg_loss`;
   - ABC-GRPO: no public loss code could be read (the README points at the `abc-grpo` branch of chi2liu/trl, which
     the stored snapshot of chi2liu/trl does not hold: only `main` and five unrelated branches); the paper's
     Algorithm 1 and Eq. 6 (chi2liu/ABC-GRPO at c40bbafd9ef1a0983b562527f6e813ca13188f1f, 2601.03895v1.pdf) are
     written out independently instead, with GRPO as the special case the paper names;
   and exactness by enumeration: on small softmax policies, the expected gradient of each per-token loss under the
   sampling policy equals the gradient the paper's objective defines (DGPO's probability-gradient weight W with its
   constants C_left, C_right; ABC-GRPO's unclipped objective; TRM's masked surrogate over every 2-token sequence);
3. gradients: gradcheck where the loss is a plain function of log pi (TRM, ABC-GRPO), and on-policy all three are
   the plain policy gradient;
4. invariants: all-masked batches, extreme ratios, NaN in the padding, A = 0, micro-batch splits, no NaN;
and the presets build with the papers' settings.

The objectives register on import; tether/objectives/__init__.py does not import these families yet.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import tether.objectives.abc_grpo  # noqa: F401  (registers abc_grpo)
import tether.objectives.dgpo  # noqa: F401  (registers dgpo)
import tether.objectives.trm  # noqa: F401  (registers trm)
from tether import objectives
from tether.core import abc_grpo as AB
from tether.core import dgpo as DG
from tether.core import trm as TR
from tether.schema import ConfigError

D = torch.float64
TOL = dict(rtol=1e-10, atol=1e-12)
e = math.exp


def _t(*rows):
    return torch.tensor(rows, dtype=D)


def _run(spec, lp, old, adv, mask=None, **kw):
    """(ObjectiveOutput, d loss / d lp) of `spec` on one batch."""
    lp = lp.clone().requires_grad_()
    mask = torch.ones_like(lp, dtype=torch.bool) if mask is None else mask
    out = objectives.build(spec)(
        objectives.TokenBatch(logprobs=lp, old_logprobs=old, advantages=adv, loss_mask=mask, **kw)
    )
    out.loss.backward()
    return out, lp.grad


def _batch(seed, n=6, t=7, spread=0.5, ragged=True):
    """Random old log-probs in [-3.05, -0.05], log-ratios of sd `spread`, advantages of both signs with one exact
    zero, and a ragged mask with one empty row when `ragged`."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=g, dtype=D) * 3 - 0.05
    lp = old + spread * torch.randn(n, t, generator=g, dtype=D)
    adv = torch.randn(n, generator=g, dtype=D)
    adv[1] = 0.0
    mask = torch.ones(n, t, dtype=torch.bool)
    if ragged:
        lengths = torch.randint(1, t + 1, (n,), generator=g)
        mask = torch.arange(t)[None, :] < lengths[:, None]
        mask[-1] = False  # a row with no counted token
    return lp, old, adv, mask


# ---------------------------------------------------------------- 1. hand-computed


def _trm_case():
    # Three sequences of two tokens, d = log rho:
    #   s0: d = (0.1, -0.2), A = +1     k2 = (0.005, 0.02)            k3 = (0.0051709, 0.0187308)
    #   s1: d = (0.4,  0.0), A = -1     k2 = (0.08, 0)                k3 = (0.0918247, 0)
    #   s2: d = (-0.33, 0.05), A = 0.5  k2 = (0.05445, 0.00125)       k3 = (0.0489237, 0.0012711)
    old = torch.full((3, 2), -1.0, dtype=D)
    return old + _t([0.1, -0.2], [0.4, 0.0], [-0.33, 0.05]), old, _t(1.0, -1.0, 0.5)


def test_trm_hand_computed():
    # max_t k2 <= 0.05 (the paper's TRM-Max): s0 (0.02) kept; s1 (0.08) and s2 (0.05445) masked.
    # seq-mean-token-sum over all 3 sequences (Algorithm 1's 1 / N): loss = -(e^0.1 + e^-0.2) / 3
    #   = -(1.1051709 + 0.8187308) / 3 = -0.6413006; d loss / d lp on s0 = -A rho / 3 = (-0.3683903, -0.2729103).
    lp, old, adv = _trm_case()
    out, g = _run("trm", lp, old, adv)
    assert out.loss.item() == pytest.approx(-(e(0.1) + e(-0.2)) / 3, rel=1e-12)
    assert out.loss.item() == pytest.approx(-0.6413006, abs=1e-7)
    torch.testing.assert_close(g, _t([-e(0.1) / 3, -e(-0.2) / 3], [0, 0], [0, 0]), rtol=1e-12, atol=0)
    # masked tokens: s1's two (A < 0) and s2's two (A > 0) of 6
    assert out.metrics["trm/seq_masked_frac"].item() == pytest.approx(2 / 3)
    assert out.metrics["trm/masked_frac"].item() == pytest.approx(4 / 6)
    assert out.metrics["policy/clipfrac_low"].item() == pytest.approx(2 / 6)
    assert out.metrics["policy/clipfrac_high"].item() == pytest.approx(2 / 6)
    assert out.metrics["trm/max_stat_mean"].item() == pytest.approx((0.02 + 0.08 + 0.05445) / 3, rel=1e-12)
    # k3 as the max detector (verl's seq_max_k3) is asymmetric: k3(e^-0.33) = 0.0489237 <= 0.05 keeps s2.
    #   loss = (-(e^0.1 + e^-0.2) - 0.5 (e^-0.33 + e^0.05)) / 3 = (-1.9239017 - 0.8850974) / 3 = -0.9363330
    out, g = _run({"preset": "trm", "max_estimator": "k3"}, lp, old, adv)
    assert out.loss.item() == pytest.approx((-(e(0.1) + e(-0.2)) - 0.5 * (e(-0.33) + e(0.05))) / 3, rel=1e-12)
    assert out.loss.item() == pytest.approx(-0.9363330, abs=1e-7)
    torch.testing.assert_close(g[2], -0.5 * _t(e(-0.33), e(0.05)) / 3, rtol=1e-12, atol=0)


def test_trm_average_and_combined_criteria_hand_computed():
    # mean_t k3: s0 (0.0051709 + 0.0187308) / 2 = 0.0119508; s1 0.0918247 / 2 = 0.0459123;
    #            s2 (0.0489237 + 0.0012711) / 2 = 0.0250974.
    # avg_delta 0.03 alone (TRM-Avg): s0 and s2 kept, s1 masked: the loss of the k3-max case above, -0.9363330.
    lp, old, adv = _trm_case()
    out, _ = _run({"preset": "trm", "max_delta": None, "avg_delta": 0.03}, lp, old, adv)
    assert out.loss.item() == pytest.approx(-0.9363330, abs=1e-7)
    assert out.metrics["trm/avg_stat_mean"].item() == pytest.approx(
        ((e(0.1) - 1.1 + e(-0.2) - 0.8) / 2 + (e(0.4) - 1.4) / 2 + (e(-0.33) - 0.67 + e(0.05) - 1.05) / 2) / 3,
        rel=1e-12,
    )
    # combined (max k2 <= 0.05 and mean k3 <= 0.03): s2 fails the max, so only s0 is left: -0.6413006.
    out, _ = _run({"preset": "trm", "max_delta": 0.05, "avg_delta": 0.03}, lp, old, adv)
    assert out.loss.item() == pytest.approx(-0.6413006, abs=1e-7)
    # avg_delta 0.011 < 0.0119508: every sequence masked, loss and gradient exactly 0 (the normaliser still 3).
    out, g = _run({"preset": "trm", "max_delta": None, "avg_delta": 0.011}, lp, old, adv)
    assert out.loss.item() == 0.0 and not g.any()


def test_trm_clip_on_kept_sequences_hand_computed():
    # eps 0.05: s0's rho = e^0.1 = 1.1052 > 1.05 with A > 0 is clipped (value -1.05, no gradient); e^-0.2 is not.
    #   loss = (-1.05 - 0.8187308) / 3 = -0.6229103
    lp, old, adv = _trm_case()
    out, g = _run({"preset": "trm", "eps_low": 0.05}, lp, old, adv)
    assert out.loss.item() == pytest.approx((-1.05 - e(-0.2)) / 3, rel=1e-12)
    torch.testing.assert_close(g, _t([0, -e(-0.2) / 3], [0, 0], [0, 0]), rtol=1e-12, atol=0)
    assert out.metrics["policy/clipfrac_high"].item() == pytest.approx(3 / 6)  # s2's two masked + s0's clipped one


def test_dgpo_hand_computed():
    # One sequence, eps 0.2 / 0.2, n = 1, m = 2, token-mean over 4:
    #   t0 A = -1, w = 0.5  (LN): decay (0.5 / 0.8)^1 = 0.625; l = 0.5 * 0.625 = 0.3125 = w^2 / 0.8; grad 0.3125
    #   t1 A = +1, w = 1.44 (HP): decay (1.2 / 1.44)^(1/2) = 0.9128709; l = -sqrt(1.2 * 1.44) = -1.3145341; same grad
    #   t2 A = +1, w = 0.5: no decay (the lower bound is not DGPO's for A > 0): l = -0.5, grad -0.5
    #   t3 A = -1, w = 1.25: no decay: l = 1.25, grad 1.25
    #   loss = (0.3125 - 1.3145341 - 0.5 + 1.25) / 4 = -0.0630085
    old = torch.full((1, 4), -1.0, dtype=D)
    w = _t(0.5, 1.44, 0.5, 1.25)
    adv = _t([-1.0, 1.0, 1.0, -1.0])
    out, g = _run("dgpo", old + w.log()[None], old, adv)
    per_token = _t([0.3125, -math.sqrt(1.728), -0.5, 1.25])
    assert out.loss.item() == pytest.approx(per_token.sum().item() / 4, rel=1e-12)
    assert out.loss.item() == pytest.approx(-0.0630085, abs=1e-7)
    torch.testing.assert_close(g, per_token / 4, rtol=1e-12, atol=0)  # d(-A w decay) / d lp = -A w decay = l
    assert out.metrics["policy/clipfrac_low"].item() == 0.25 and out.metrics["policy/clipfrac_high"].item() == 0.25
    assert out.metrics["dgpo/decay_mean"].item() == pytest.approx((0.625 + math.sqrt(1.2 / 1.44) + 2) / 4)


def test_abc_grpo_hand_computed():
    # One sequence, eps1..eps4 = 0.2, seq-mean-token-mean over 4:
    #   t0 A = +1, w = 1.5 (Q1): clip 1.2, l = -1.2, no gradient
    #   t1 A = +1, w = 0.5 (Q2): clip 0.8, l = -0.8, no gradient   (GRPO: min(0.5, 0.8) = 0.5, gradient -0.5)
    #   t2 A = -1, w = 1.5 (Q4): clip 1.2, l = 1.2, no gradient    (GRPO: -max(-1.5, -1.2) = 1.5, gradient 1.5)
    #   t3 A = -1, w = 0.9: inside, l = 0.9, gradient 0.9
    #   loss = (-1.2 - 0.8 + 1.2 + 0.9) / 4 = 0.025;  GRPO's: (-1.2 - 0.5 + 1.5 + 0.9) / 4 = 0.175
    old = torch.full((1, 4), -1.0, dtype=D)
    lp = old + _t(1.5, 0.5, 1.5, 0.9).log()[None]
    adv = _t([1.0, 1.0, -1.0, -1.0])
    out, g = _run("abc_grpo", lp, old, adv)
    assert out.loss.item() == pytest.approx(0.025, rel=1e-12)
    torch.testing.assert_close(g, _t([0, 0, 0, 0.9 / 4]), rtol=1e-12, atol=0)
    assert [out.metrics[f"abc_grpo/clipfrac_q{q}"].item() for q in range(1, 5)] == [0.25, 0.25, 0.0, 0.25]
    assert out.metrics["policy/clipfrac_low"].item() == 0.25 and out.metrics["policy/clipfrac_high"].item() == 0.5
    grpo, g_grpo = _run({"preset": "grpo", "kl_penalty": None}, lp, old, adv)
    assert grpo.loss.item() == pytest.approx(0.175, rel=1e-12)
    torch.testing.assert_close(g_grpo, _t([0, -0.5, 1.5, 0.9]) / 4, rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", ["trm", "dgpo", "abc_grpo"])
def test_a_zero_advantage_is_never_flagged(name):
    # A = 0 has no gradient to remove or decay: no clip flag, no quadrant, whatever the ratio (w = 1.5 and 0.5 here:
    # outside every interval; TRM masks the sequence, k2 = 0.082 > 0.05, and still flags nothing).
    old = torch.full((1, 2), -1.0, dtype=D)
    out, g = _run(name, old + _t([math.log(1.5), math.log(0.5)]), old, _t(0.0))
    assert not g.any()
    flagged = [v.item() for k, v in out.metrics.items() if "clipfrac" in k]
    assert flagged and all(f == 0.0 for f in flagged)


# ---------------------------------------------------------------- 2. TRM against verl 0.9.1 (#4544) and Algorithm 1

VERL_RS = [  # (verl rollout_rs, its threshold, tether's criteria)
    ("seq_max_k2", 0.05, dict(max_delta=0.05, max_estimator="k2", avg_delta=None)),
    ("seq_max_k3", 0.05, dict(max_delta=0.05, max_estimator="k3", avg_delta=None)),
    ("seq_mean_k3", 0.03, dict(max_delta=None, avg_delta=0.03, avg_estimator="k3")),
    ("seq_mean_k2", 0.03, dict(max_delta=None, avg_delta=0.03, avg_estimator="k2")),
    ("seq_max_k2,seq_mean_k3", "0.1,0.03", dict(max_delta=0.1, avg_delta=0.03)),
]


@pytest.mark.parametrize("rs,threshold,criteria", VERL_RS, ids=[c[0] for c in VERL_RS])
@pytest.mark.parametrize("seed", range(3))
def test_trm_mask_equals_verls_rejection_mask(rs, threshold, criteria, seed):
    rch = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
    lp, old, _, mask = _batch(seed, n=8, t=9, spread=0.25)
    d = lp - old
    verl_mask, _ = rch.compute_rollout_rejection_mask(d, mask.to(D), rollout_rs=rs, rollout_rs_threshold=threshold)
    keep = TR.trm_keep(d, mask, **criteria)
    assert torch.equal(verl_mask.bool(), mask & keep[:, None])
    rows = mask.any(-1)
    assert keep[rows].any() and (~keep[rows]).any()  # both kinds: a case that tests nothing is a defect


def _verl_bypass(lp, old, adv, mask, rs, threshold, agg, loss_type, eps=None, global_info=True):
    """(loss, d loss / d lp) of verl 0.9.1's own `bypass_mode` loss (old = the rollout policy's log-probs)."""
    pytest.importorskip("verl")
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo import core_algos
    from verl.workers.config import FSDPActorConfig, PolicyLossConfig

    rc = RolloutCorrectionConfig(
        rollout_is="token" if loss_type == "reinforce" else None,
        rollout_is_threshold=1e6,  # no truncation: the weight is rho itself, as in Algorithm 1
        rollout_rs=rs,
        rollout_rs_threshold=threshold,
        bypass_mode=True,
        loss_type=loss_type,
    )
    clip = {} if eps is None else dict(clip_ratio=eps, clip_ratio_low=eps, clip_ratio_high=eps)
    if loss_type == "ppo_clip" and eps is None:
        clip = dict(clip_ratio=1e6, clip_ratio_low=1e6, clip_ratio_high=1e6)  # a clip that never binds
    config = FSDPActorConfig(
        strategy="fsdp",
        rollout_n=4,
        ppo_micro_batch_size_per_gpu=2,
        policy_loss=PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=rc),
        loss_agg_mode=agg,
        clip_ratio_c=1e9,  # no dual clip (TRM has none)
        **clip,
    )
    if global_info:  # the batch's own counts, as verl's engine workers pass them (taken before the rejection)
        config.global_batch_info.update(
            {"dp_size": 1, "batch_num_tokens": mask.sum(), "global_batch_size": mask.any(-1).sum()}
        )
    x = lp.clone().requires_grad_()
    fn = core_algos.get_policy_loss_fn("bypass_mode")
    adv_tok = adv[:, None].expand_as(lp)
    loss, _ = fn(
        old_log_prob=old, log_prob=x, advantages=adv_tok, response_mask=mask.to(D), loss_agg_mode=agg, config=config
    )
    loss.backward()
    return loss.detach(), x.grad


VERL_AGG = ("token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")  # verl's seq-mean-token-mean adds 1e-8


@pytest.mark.parametrize("agg", VERL_AGG)
@pytest.mark.parametrize("rs,threshold,criteria", [VERL_RS[0], VERL_RS[4]], ids=["seq_max_k2", "combined"])
def test_trm_equals_verls_bypass_mode(agg, rs, threshold, criteria):
    # Bypass mode (pi_old = pi_rollout, tether's against: old): verl measures log(pi_theta / pi_rollout) inside the
    # loss, masks, and runs PPO-clip (value -A rho when the clip never binds) or REINFORCE with token IS weights
    # (value -A rho lp: the same gradient -A rho grad lp, another value). With the batch's own counts as verl's
    # global_batch_info, the normaliser counts the masked sequences (the paper's 1 / N) and the losses are equal.
    lp, old, adv, mask = _batch(4, n=8, t=9, spread=0.25)
    spec = {"preset": "trm", "aggregation": agg, **criteria}
    ours, g = _run(spec, lp, old, adv, mask)
    v_loss, v_grad = _verl_bypass(lp, old, adv, mask, rs, threshold, agg, "ppo_clip")
    torch.testing.assert_close(ours.loss.detach(), v_loss, **TOL)
    torch.testing.assert_close(g, v_grad, **TOL)
    _, v_grad = _verl_bypass(lp, old, adv, mask, rs, threshold, agg, "reinforce")
    torch.testing.assert_close(g, v_grad, **TOL)
    # with a binding clip on the kept sequences (tether's eps_low / eps_high)
    ours, g = _run({**spec, "eps_low": 0.1, "eps_high": 0.1}, lp, old, adv, mask)
    v_loss, v_grad = _verl_bypass(lp, old, adv, mask, rs, threshold, agg, "ppo_clip", eps=0.1)
    torch.testing.assert_close(ours.loss.detach(), v_loss, **TOL)
    torch.testing.assert_close(g, v_grad, **TOL)
    assert 0 < ours.metrics["trm/seq_masked_frac"] < 1 and ours.metrics["policy/clipfrac_high"] > 0


def test_verls_own_normaliser_divides_by_the_kept_tokens():
    # Without global_batch_info verl's agg_loss divides by the rejection-modified mask: its token-mean is tether's
    # (the paper's, every counted token in the normaliser) times counted / kept.
    lp, old, adv, mask = _batch(5, n=8, t=9, spread=0.25)
    ours, g = _run({"preset": "trm", "aggregation": "token-mean"}, lp, old, adv, mask)
    v_loss, v_grad = _verl_bypass(lp, old, adv, mask, "seq_max_k2", 0.05, "token-mean", "ppo_clip", global_info=False)
    keep = TR.trm_keep(lp - old, mask, 0.05, None)
    scale = mask.sum() / (mask & keep[:, None]).sum()
    assert scale > 1
    torch.testing.assert_close(ours.loss.detach() * scale, v_loss, **TOL)
    torch.testing.assert_close(g * scale, v_grad, **TOL)


def test_trm_against_sampler_is_verls_decoupled_mask():
    # Decoupled mode: verl rejects on log(pi_old / pi_sampler) once per rollout batch; tether's against: sampler.
    rch = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
    lp, old, adv, mask = _batch(7, n=8, t=9, spread=0.2)
    sampler = old - 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(60), dtype=D)
    verl_mask, _ = rch.compute_rollout_rejection_mask(old - sampler, mask.to(D), "seq_max_k2", 0.05)
    spec = {"preset": "trm", "against": "sampler", "aggregation": "token-mean"}
    out, g = _run(spec, lp, old, adv, mask, sampler_logprobs=sampler)
    kept = verl_mask.bool()
    assert kept.any() and (mask & ~kept).any()
    for other in (lp - sampler, lp - old):  # the case tells pi_old / pi_sampler from the other two log-ratios
        assert not torch.equal(mask & TR.trm_keep(other, mask, 0.05, None)[:, None], kept)
    expected = torch.where(kept, -adv[:, None] * torch.exp(lp - old), torch.zeros_like(lp)) / mask.sum()
    torch.testing.assert_close(g, expected, **TOL)


def test_trm_keeps_a_sequence_at_the_threshold():
    # The paper's and verl's <=: d = 0.5 gives k2 = 0.125 exactly (in binary too); delta 0.125 keeps it, a d of
    # 0.5 + 1e-9 (k2 = 0.125 + 5e-10) is masked.
    old = torch.zeros(2, 2, dtype=D)
    lp = _t([0.5, 0.1], [0.5 + 1e-9, 0.1])
    keep = TR.trm_keep(lp - old, torch.ones(2, 2, dtype=torch.bool), 0.125, None)
    assert keep.tolist() == [True, False]
    rch = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
    verl_mask, _ = rch.compute_rollout_rejection_mask(lp - old, torch.ones(2, 2, dtype=D), "seq_max_k2", 0.125)
    assert verl_mask.bool().all(-1).tolist() == [True, False]


def test_trm_avg_in_decoupled_mode_is_tethers_sequence_kl3_rejection():
    # TRM-Avg on log(pi_old / pi_sampler) is the rollout correction {level: sequence, mode: mask, measure: kl3} that
    # tether already has (verl's seq_mean_k3): the same tokens leave the loss, the normaliser keeps them, so the two
    # configs give the same loss and gradient (and the max criterion on a kl2 sequence maximum has no such twin).
    lp, old, adv, mask = _batch(7, n=8, t=9, spread=0.2)
    sampler = old - 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(61), dtype=D)
    trm_avg, g = _run(
        {"preset": "trm", "against": "sampler", "max_delta": None, "avg_delta": 0.03},
        lp,
        old,
        adv,
        mask,
        sampler_logprobs=sampler,
    )
    rc = {"level": "sequence", "mode": "mask", "measure": "kl3", "delta": 0.03}
    via_rc, g_rc = _run(
        {"preset": "trm", "max_delta": 1e9, "rollout_correction": rc}, lp, old, adv, mask, sampler_logprobs=sampler
    )
    assert 0 < trm_avg.metrics["trm/seq_masked_frac"] < 1
    assert via_rc.metrics["rollout_correction/masked_frac"] == trm_avg.metrics["trm/masked_frac"]
    torch.testing.assert_close(trm_avg.loss, via_rc.loss, **TOL)
    torch.testing.assert_close(g, g_rc, **TOL)


def _algorithm_1(lp, old, adv, mask, delta):
    """arXiv 2512.23075, Algorithm 1 with the paper's sample-based max detector, written out per sequence:
    M_i = 1[max_t (log rho_t)^2 / 2 <= delta];  grad = (1 / N) sum_i M_i A_i sum_t rho_t grad log pi_t."""
    n = int(mask.any(-1).sum())
    grad = torch.zeros_like(lp)
    for i in range(lp.shape[0]):
        idx = mask[i].nonzero().flatten()
        if len(idx) == 0:
            continue
        log_rho = lp[i, idx] - old[i, idx]
        if max(float(x) ** 2 / 2 for x in log_rho) <= delta:
            grad[i, idx] = -adv[i] * torch.exp(log_rho) / n  # of the loss -L_masked
    return grad


@pytest.mark.parametrize("seed", range(4))
def test_trm_gradient_is_algorithm_1(seed):
    lp, old, adv, mask = _batch(seed, n=8, t=9, spread=0.25)
    _, g = _run("trm", lp, old, adv, mask)
    torch.testing.assert_close(g, _algorithm_1(lp, old, adv, mask, 0.05), **TOL)


# ---------------------------------------------------------------- 2. DGPO against the authors' code


def _authors_dgpo(old_log_prob, log_prob, advantages, response_mask, cliprange_low, cliprange_high, n, m, agg):
    """VenomRose-Juri/DGPO-RL @ cc225d44a66bacaaf952cff04ec578114d8179ff, verl/trainer/ppo/core_algos.py:
    `compute_policy_loss` with policy_loss.ratio_clip.ratio_mode == "dgpo" (dgpo_n = n, dgpo_m = m), then that
    file's `agg_loss` (token-mean; seq-mean-token-sum over the local batch); transcribed, quirks included: the
    region tests use the clamped ratio, the decayed ratios the unclamped log-probs, and the dual clip is skipped."""
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0))
    lower_bound, upper_bound = 1 - cliprange_low, 1 + cliprange_high
    log_upper_bound = torch.log(torch.tensor(upper_bound, dtype=log_prob.dtype))
    negative_lower_bound_case = (ratio < lower_bound) & (advantages < 0)
    positive_upper_bound_case = (ratio > upper_bound) & (advantages > 0)
    ratio = torch.where(
        negative_lower_bound_case,
        torch.exp(log_prob + n * log_prob.detach() - (n + 1) * old_log_prob) / (lower_bound**n),
        ratio,
    )
    ratio = torch.where(
        positive_upper_bound_case,
        torch.exp(log_prob + (log_upper_bound / m) - old_log_prob * (m - 1) / m - log_prob.detach() / m),
        ratio,
    )
    pg_losses = -advantages * ratio
    masked = (pg_losses * response_mask).sum(-1)
    if agg == "token-mean":
        return masked.sum() / response_mask.sum()
    return masked.sum() / pg_losses.shape[0]  # seq-mean-token-sum: the local batch size


@pytest.mark.parametrize("eps_low,eps_high", [(0.2, 0.2), (0.2, 0.28), (0.1, 0.05)])
@pytest.mark.parametrize("n,m", [(1, 2), (2, 2), (2, 1), (3, 3)])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_dgpo_equals_the_authors_code(eps_low, eps_high, n, m, agg):
    lp, old, adv, mask = _batch(7, n=6, t=8, spread=0.5, ragged=False)
    mask[2, 5:] = False
    spec = {"preset": "dgpo", "eps_low": eps_low, "eps_high": eps_high, "n": n, "m": m, "aggregation": agg}
    out, g = _run(spec, lp, old, adv, mask)
    x = lp.clone().requires_grad_()
    adv_tok = adv[:, None].expand_as(lp)
    ref = _authors_dgpo(old, x, adv_tok, mask.to(D), eps_low, eps_high, n, m, agg)
    ref.backward()
    torch.testing.assert_close(out.loss.detach(), ref.detach(), **TOL)
    torch.testing.assert_close(g, x.grad, **TOL)
    # every branch acts: LN and HP decay, the two undecayed outer quadrants, the inside, A = 0
    w, a = torch.exp(lp - old)[mask], adv_tok[mask]
    assert ((a < 0) & (w < 1 - eps_low)).any() and ((a > 0) & (w > 1 + eps_high)).any()
    assert ((a > 0) & (w < 1 - eps_low)).any() and ((a < 0) & (w > 1 + eps_high)).any()
    assert ((w > 1 - eps_low) & (w < 1 + eps_high) & (a != 0)).any() and (a == 0).any()


# ---------------------------------------------------------------- 2. ABC-GRPO: the paper's Algorithm 1, GRPO as a case


def _abc_algorithm_1(lp, old, adv, mask, e1, e2, e3, e4):
    """arXiv 2601.03895 (v1) Algorithm 1, lines 7-9, aggregated as Eq. 6: (1 / G) sum_i (1 / |y_i|) sum_t l_t,
    l_t = -w~ A_i with w~ = clip(w, 1 - e2, 1 + e1) if A_i > 0 else clip(w, 1 - e4, 1 + e3); written out per
    sequence with torch.clamp."""
    losses = []
    for i in range(lp.shape[0]):
        idx = mask[i].nonzero().flatten()
        if len(idx) == 0:
            continue
        r = torch.exp(lp[i, idx] - old[i, idx])
        r_clip = torch.clamp(r, 1 - e2, 1 + e1) if adv[i] > 0 else torch.clamp(r, 1 - e4, 1 + e3)
        losses.append((-r_clip * adv[i]).mean())
    return torch.stack(losses).mean()


@pytest.mark.parametrize("eps", [(0.2, 0.2, 0.2, 0.2), (0.28, 0.2, 0.1, 0.3), (0.05, 0.4, 0.5, 0.05)])
@pytest.mark.parametrize("seed", range(3))
def test_abc_grpo_equals_the_papers_algorithm(eps, seed):
    lp, old, adv, mask = _batch(seed, n=8, t=10, spread=0.6)
    e1, e2, e3, e4 = eps
    spec = {"preset": "abc_grpo", "eps_pos_high": e1, "eps_pos_low": e2, "eps_neg_high": e3, "eps_neg_low": e4}
    out, g = _run(spec, lp, old, adv, mask)
    x = lp.clone().requires_grad_()
    ref = _abc_algorithm_1(x, old, adv, mask, e1, e2, e3, e4)
    ref.backward()
    torch.testing.assert_close(out.loss.detach(), ref.detach(), **TOL)
    torch.testing.assert_close(g, x.grad, **TOL)
    # every quadrant's bound acts somewhere (Eq. 13: those tokens have no gradient)
    assert all(out.metrics[f"abc_grpo/clipfrac_q{q}"].item() > 0 for q in range(1, 5))


@pytest.mark.parametrize("seed", range(3))
def test_abc_grpo_contains_grpo(seed):
    # The paper: GRPO is eps3 -> inf; with eps2 >= 1 (lower bound <= 0, never binding) the A > 0 side is min(w, 1 + e1).
    lp, old, adv, mask = _batch(seed, spread=0.6)
    spec = {"preset": "abc_grpo", "eps_pos_low": 1.0, "eps_neg_high": None}
    out, g = _run(spec, lp, old, adv, mask)
    grpo, g_grpo = _run({"preset": "grpo", "kl_penalty": None}, lp, old, adv, mask)
    torch.testing.assert_close(out.loss, grpo.loss, **TOL)
    torch.testing.assert_close(g, g_grpo, **TOL)
    # and the default differs from GRPO exactly on the Q2 and Q4 tokens
    out, g = _run("abc_grpo", lp, old, adv, mask)
    w, a = torch.exp(lp - old), adv[:, None].expand_as(lp)
    new = mask & (((a > 0) & (w < 0.8)) | ((a < 0) & (w > 1.2)))
    assert new.any()
    torch.testing.assert_close(g[~new], g_grpo[~new], **TOL)
    assert (g[new] == 0).all() and (g_grpo[new] != 0).all()


# ---------------------------------------------------------------- 2. exactness by enumeration


def _softmax_bandit(seed, k=8, spread=0.8):
    g = torch.Generator().manual_seed(seed)
    theta_old = torch.randn(k, generator=g, dtype=D)
    theta = theta_old + spread * torch.randn(k, generator=g, dtype=D)
    reward = torch.randn(k, generator=g, dtype=D)
    return theta, theta_old, reward - reward.mean()


def _expected_token_loss_grad(spec, theta, lp_old, adv):
    """grad_theta of sum_a pi_old(a) l(a), each action a one 1-token sequence with advantage adv[a]."""
    th = theta.clone().requires_grad_()
    lp = torch.log_softmax(th, -1)[:, None]  # (K, 1)
    batch = objectives.TokenBatch(lp, lp_old[:, None], adv, torch.ones_like(lp, dtype=torch.bool))
    loss = objectives.build(spec).terms(batch).tokens.loss[:, 0]  # (K,)
    (grad,) = torch.autograd.grad((lp_old.exp() * loss).sum(), th)
    return grad


@pytest.mark.parametrize("n,m", [(1, 2), (2, 2), (3, 1)])
@pytest.mark.parametrize("seed", [0, 3])
def test_dgpo_expected_gradient_is_the_papers_probability_gradient(n, m, seed):
    # The paper's J = sum_a pi_old(a) W(a) A(a) pi_theta(a) with W = 1 / pi_old inside, C_left SG(pi^n) on LN and
    # C_right SG(pi^(-1/m)) on HP, C_left = (1 - eps)^-n pi_old^-(n+1), C_right = (1 + eps)^(1/m) pi_old^(1/m - 1):
    # the expected gradient of tether's per-token loss under pi_old is -grad J.
    eps_low, eps_high = 0.2, 0.2
    theta, theta_old, adv = _softmax_bandit(seed)
    lp_old = torch.log_softmax(theta_old, -1)
    spec = {"preset": "dgpo", "n": n, "m": m}
    got = _expected_token_loss_grad(spec, theta, lp_old, adv)
    th = theta.clone().requires_grad_()
    pi, pi_old = torch.softmax(th, -1), lp_old.exp()
    p, w = pi.detach(), (pi / pi_old).detach()
    c_left = (1 - eps_low) ** -n * pi_old ** -(n + 1)
    c_right = (1 + eps_high) ** (1 / m) * pi_old ** (1 / m - 1)
    ln, hp = (adv < 0) & (w < 1 - eps_low), (adv > 0) & (w > 1 + eps_high)
    weight = torch.where(ln, c_left * p**n, torch.where(hp, c_right * p ** (-1 / m), 1 / pi_old))
    (want,) = torch.autograd.grad(-(pi_old * weight * adv * pi).sum(), th)
    assert ln.any() and hp.any()
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("seed", [0, 2, 5, 6])
def test_abc_grpo_expected_gradient_is_the_unclipped_objectives_gradient(seed):
    # E_old[grad l] = -sum_{a unclipped} A(a) grad pi_theta(a): the gradient of the true objective sum_a pi(a) A(a)
    # restricted to the actions whose ratio is inside its sign's interval (Eq. 12-13), in every quadrant.
    theta, theta_old, adv = _softmax_bandit(seed, k=10, spread=0.5)
    lp_old = torch.log_softmax(theta_old, -1)
    got = _expected_token_loss_grad("abc_grpo", theta, lp_old, adv)
    th = theta.clone().requires_grad_()
    pi = torch.softmax(th, -1)
    w = (pi / lp_old.exp()).detach()
    inside = (w >= 0.8) & (w <= 1.2)  # eps1..eps4 = 0.2: the same interval for both signs
    (want,) = torch.autograd.grad(-(pi * adv * inside).sum(), th)
    pos, neg = adv > 0, adv < 0
    assert inside.any() and all(q.any() for q in (pos & (w > 1.2), pos & (w < 0.8), neg & (w < 0.8), neg & (w > 1.2)))
    torch.testing.assert_close(got, want, **TOL)


def _two_token_policy(seed, k=3, spread=0.35):
    """Logits of a 2-token autoregressive policy over a k-token vocabulary: (first (k,), second (k, k) by y1)."""
    g = torch.Generator().manual_seed(seed)
    roll = (torch.randn(k, generator=g, dtype=D), torch.randn(k, k, generator=g, dtype=D))
    theta = (
        roll[0] + spread * torch.randn(k, generator=g, dtype=D),
        roll[1] + spread * torch.randn(k, k, generator=g, dtype=D),
    )
    return theta, roll


def _sequence_logprobs(first, second, seqs):
    """(N, 2) log pi(y1), log pi(y2 | y1) for the sequences `seqs` (N, 2)."""
    lp1 = torch.log_softmax(first, -1)[seqs[:, 0]]
    lp2 = torch.log_softmax(second, -1)[seqs[:, 0], seqs[:, 1]]
    return torch.stack([lp1, lp2], -1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_trm_expected_gradient_is_the_masked_surrogates_gradient(seed):
    # Every sequence of a 2-token policy over 3 tokens (9): sum_y P_roll(y) sum_t l_t(y) has the gradient of the
    # paper's L_masked = E_roll[M(y) A(y) sum_t rho_t] (Eq. masked-surrogate), M held at its value, up to the sign.
    k = 3
    seqs = torch.tensor(list(itertools.product(range(k), repeat=2)))  # (9, 2)
    theta, roll = _two_token_policy(seed)
    lp_roll = _sequence_logprobs(*roll, seqs)  # (9, 2)
    p_roll = lp_roll.sum(-1).exp()  # (9,)
    adv = torch.randn(len(seqs), generator=torch.Generator().manual_seed(10 + seed), dtype=D)
    params = [x.clone().requires_grad_() for x in theta]
    lp = _sequence_logprobs(*params, seqs)
    batch = objectives.TokenBatch(lp, lp_roll, adv, torch.ones_like(lp, dtype=torch.bool))
    tokens = objectives.build({"preset": "trm", "max_delta": 0.05}).terms(batch).tokens.loss  # (9, 2)
    got = torch.autograd.grad((p_roll * tokens.sum(-1)).sum(), params)
    # the paper's side, from the probabilities: rho_t, M(y) = 1[max_t (log rho_t)^2 / 2 <= 0.05]
    params = [x.clone().requires_grad_() for x in theta]
    rho = _sequence_logprobs(*params, seqs).exp() / lp_roll.exp()  # (9, 2)
    keep = (rho.detach().log() ** 2 / 2).max(-1).values <= 0.05
    l_masked = (p_roll * keep * adv * rho.sum(-1)).sum()
    want = torch.autograd.grad(-l_masked, params)
    assert keep.any() and (~keep).any()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)


def test_trm_on_policy_gradient_is_the_gradient_of_the_kept_sequences_objective():
    # against: sampler with pi_theta = pi_old (the first update of a decoupled run): the mask comes from
    # log(pi_old / pi_sampler), rho = 1, and E_old[grad l] = -grad sum_y P_theta(y) M(y) A(y), M fixed.
    k = 3
    seqs = torch.tensor(list(itertools.product(range(k), repeat=2)))
    theta, sampler = _two_token_policy(4, spread=0.4)
    lp_sampler = _sequence_logprobs(*sampler, seqs)
    params = [x.clone().requires_grad_() for x in theta]
    lp = _sequence_logprobs(*params, seqs)
    old = lp.detach()
    adv = torch.randn(len(seqs), generator=torch.Generator().manual_seed(14), dtype=D)
    batch = objectives.TokenBatch(lp, old, adv, torch.ones_like(lp, dtype=torch.bool), sampler_logprobs=lp_sampler)
    tokens = objectives.build({"preset": "trm", "against": "sampler"}).terms(batch).tokens.loss
    got = torch.autograd.grad((old.sum(-1).exp() * tokens.sum(-1)).sum(), params)
    keep = ((old - lp_sampler) ** 2 / 2).max(-1).values <= 0.05
    params = [x.clone().requires_grad_() for x in theta]
    p_theta = _sequence_logprobs(*params, seqs).sum(-1).exp()
    want = torch.autograd.grad(-(p_theta * keep * adv).sum(), params)
    assert keep.any() and (~keep).any()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)


# ---------------------------------------------------------------- 3. gradients


def test_gradcheck_trm_and_abc_grpo():
    # Both are plain functions of log pi away from their boundaries (DGPO is not: its decay is stop-gradient by
    # design, so the gradient of its value is not its gradient; the enumeration test above checks DGPO instead).
    lp, old, adv, _ = _batch(8, n=3, t=4, spread=0.3, ragged=False)
    log_w = lp - old
    assert ((log_w.exp() - 0.8).abs().min() > 1e-4) and ((log_w.exp() - 1.2).abs().min() > 1e-4)
    mask = torch.ones_like(lp, dtype=torch.bool)
    keep = TR.trm_keep(log_w, mask, 0.1, None)
    seq_max, _ = TR.statistics(log_w, mask)
    assert (seq_max - 0.1).abs().min() > 1e-4 and keep.any() and (~keep).any()
    torch.autograd.gradcheck(lambda x: TR.trm(x, old, adv, keep).loss, (lp.clone().requires_grad_(),))
    torch.autograd.gradcheck(lambda x: AB.abc_grpo(x, old, adv)[0].loss, (lp.clone().requires_grad_(),))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_on_policy_all_three_are_the_policy_gradient(agg):
    # w = 1: every k = 0 (TRM keeps all), DGPO's decay is 1, ABC-GRPO's interval contains 1.
    _, old, adv, mask = _batch(9)
    _, g_pg = _run({"name": "reinforce", "aggregation": agg}, old, old, adv, mask)
    for name in ("trm", "dgpo", "abc_grpo"):
        _, g = _run({"preset": name, "aggregation": agg}, old, old, adv, mask)
        torch.testing.assert_close(g, g_pg, **TOL)


def test_dgpo_inside_the_bounds_is_grpo_and_decays_continuously():
    # Inside [0.8, 1.2] (and on the undecayed outer quadrants) DGPO's gradient is PPO's -A w; at the bounds the
    # decayed weight meets the plain one: the paper's continuity (C_left, C_right).
    lp, old, adv, mask = _batch(10, spread=0.4)
    _, g = _run("dgpo", lp, old, adv, mask)
    _, g_ppo = _run({"name": "ppo_clip", "aggregation": "token-mean"}, lp, old, adv, mask)
    w, a = torch.exp(lp - old), adv[:, None].expand_as(lp)
    decayed = ((a < 0) & (w < 0.8)) | ((a > 0) & (w > 1.2))
    assert decayed.any()
    torch.testing.assert_close(g[~decayed], g_ppo[~decayed], **TOL)
    for w0, a0 in ((0.8, -1.0), (1.2, 1.0)):
        for side in (1 - 1e-9, 1 + 1e-9):
            lp1 = torch.tensor([[math.log(w0 * side)]], dtype=D)
            out, decay = DG.dgpo(lp1, torch.zeros(1, 1, dtype=D), _t(a0))
            assert decay.item() == pytest.approx(1.0, abs=1e-8)
            assert out.loss.item() == pytest.approx(-a0 * w0, abs=1e-8)


# ---------------------------------------------------------------- 4. invariants


SPECS = [
    "trm",
    {"preset": "trm", "avg_delta": 0.01, "eps_low": 0.2},
    {"preset": "trm", "against": "sampler"},
    "dgpo",
    "abc_grpo",
]


@pytest.mark.parametrize("spec", SPECS, ids=["trm", "trm_combined_clip", "trm_sampler", "dgpo", "abc_grpo"])
def test_all_masked_extreme_ratios_and_nan_padding_stay_finite(spec):
    lp, old, adv, mask = _batch(11, n=4, t=6, spread=0.3)
    sampler = old + 0.1
    # all masked: loss 0, gradient 0, every metric finite
    out, g = _run(spec, lp, old, adv, torch.zeros_like(mask), sampler_logprobs=sampler)
    assert out.loss.item() == 0.0 and not g.any()
    assert all(torch.isfinite(v).all() for v in out.metrics.values())
    # extreme ratios, both signs of A: log w = +-60 (beyond the clamp), +-25, +-3
    ext = old.clone()
    ext[0, :6] += _t(60.0, -60.0, 25.0, -25.0, 3.0, -3.0)
    ext[1, :6] += _t(60.0, -60.0, 25.0, -25.0, 3.0, -3.0)
    adv2 = _t(1.0, -1.0, 0.5, -0.5)
    full = torch.ones_like(mask)
    out, g = _run(spec, ext, old, adv2, full, sampler_logprobs=sampler)
    assert torch.isfinite(out.loss) and torch.isfinite(g).all()
    assert all(torch.isfinite(v).all() for v in out.metrics.values())
    # NaN / inf in the padding of every input changes nothing
    out_ref, g_ref = _run(spec, lp, old, adv, mask, sampler_logprobs=sampler)
    junk = torch.where(mask, torch.zeros_like(lp), torch.full_like(lp, float("nan")))
    out, g = _run(spec, lp + junk, old - junk.nan_to_num(nan=float("inf")), adv, mask, sampler_logprobs=sampler + junk)
    torch.testing.assert_close(out.loss, out_ref.loss, **TOL)
    torch.testing.assert_close(g, g_ref, **TOL)
    # A = 0 everywhere: no gradient
    _, g = _run(spec, lp, old, torch.zeros_like(adv), mask, sampler_logprobs=sampler)
    assert not g.any()


def test_extreme_ratios_behave_as_each_paper_says():
    old = torch.zeros(1, 4, dtype=D)
    lp = _t([-15.0, 15.0, -15.0, 15.0])  # inside the [-20, 20] clamp of log w
    adv = _t([-1.0, 1.0, 0.5, -2.0])
    # DGPO: the LN token's gradient vanishes with pi_theta (-A w^(n+1) / 0.8 = e^-30 / 0.8), where CISPO's would be
    # -A * 0.8 (its clipped weight, whatever pi_theta); the HP token's is -(1.2)^(1/2) w^(1/2) = -1.0954 e^7.5
    _, g = _run({"preset": "dgpo", "aggregation": "seq-mean-token-sum"}, lp, old, adv)
    assert g[0, 0].item() == pytest.approx(e(-30) / 0.8, rel=1e-12, abs=0)
    assert g[0, 1].item() == pytest.approx(-math.sqrt(1.2) * e(7.5), rel=1e-12, abs=0)
    # the other two quadrants keep PPO's -A w: -0.5 e^-15 and 2 e^15 (unbounded, as in the authors' code)
    assert g[0, 2].item() == pytest.approx(-0.5 * e(-15), rel=1e-12, abs=0)
    assert g[0, 3].item() == pytest.approx(2 * e(15), rel=1e-12, abs=0)
    # ABC-GRPO: every token is clipped, |l| <= (1 + 0.2) |A| per token, and no gradient at all:
    #   l = (0.8, -1.2, -0.8 * 0.5, 1.2 * 2) = (0.8, -1.2, -0.4, 2.4), sum 1.6
    out, g = _run({"preset": "abc_grpo", "aggregation": "seq-mean-token-sum"}, lp, old, adv)
    assert not g.any() and out.loss.item() == pytest.approx(1.6, rel=1e-12)
    # TRM: k2 = 15^2 / 2 = 112.5 > 0.05, the sequence is masked as a whole
    out, g = _run("trm", lp, old, adv)
    assert not g.any() and out.metrics["trm/seq_masked_frac"].item() == 1.0


@pytest.mark.parametrize("name", ["trm", "dgpo", "abc_grpo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batches_sum_to_the_mini_batch(name, agg):
    # TRM's statistic is per sequence, so the mask, and with the mini-batch normaliser the loss, split exactly.
    lp, old, adv, mask = _batch(12, n=6, t=7, spread=0.3)
    obj = objectives.build({"preset": name, "aggregation": agg})
    whole, g_whole = _run({"preset": name, "aggregation": agg}, lp, old, adv, mask)
    norm = obj.normalizer(mask)
    total, grads = 0.0, []
    for rows in (slice(0, 2), slice(2, 6)):
        x = lp[rows].clone().requires_grad_()
        out = obj(objectives.TokenBatch(x, old[rows], adv[rows], mask[rows], loss_norm=norm))
        out.loss.backward()
        total += out.loss.item()
        grads.append(x.grad)
    assert total == pytest.approx(whole.loss.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(torch.cat(grads), g_whole, **TOL)


# ---------------------------------------------------------------- presets and configs


def test_presets_build_with_the_papers_settings():
    trm = objectives.build("trm").config
    assert (trm.max_delta, trm.max_estimator, trm.avg_delta, trm.against, trm.eps_low) == (
        0.05,
        "k2",
        None,
        "old",
        None,
    )
    assert (trm.aggregation, trm.advantage) == ("seq-mean-token-sum", "grpo")
    dgpo = objectives.build("dgpo").config
    assert (dgpo.eps_low, dgpo.eps_high, dgpo.n, dgpo.m, dgpo.aggregation) == (0.2, 0.2, 1, 2, "token-mean")
    abc = objectives.build("abc_grpo").config
    assert (abc.eps_pos_high, abc.eps_pos_low, abc.eps_neg_high, abc.eps_neg_low) == (0.2, 0.2, 0.2, 0.2)
    assert abc.aggregation == "seq-mean-token-mean" and abc.advantage == "grpo"
    for name in ("trm", "dgpo", "abc_grpo"):
        assert name in objectives.names() and name in objectives.preset_names()
        assert objectives.build(name).config == objectives.build({"name": name}).config  # preset = the defaults
        assert objectives.build(name).has_trust_region()


def test_capabilities_and_config_errors_name_the_fix():
    cfg = objectives.build({"preset": "trm", "against": "sampler"}).config
    assert "sampler_logprobs" in cfg.needs() and "against" in cfg.vanishes_when_old_is_sampler()
    assert objectives.build("trm").config.vanishes_when_old_is_sampler() == {}
    with pytest.raises(ConfigError, match="at least one threshold"):
        objectives.build({"preset": "trm", "max_delta": None})
    with pytest.raises(ConfigError, match="max_estimator"):
        objectives.build({"preset": "trm", "max_estimator": "k1"})
    with pytest.raises(ConfigError, match="eps_high.*together with eps_low"):
        objectives.build({"preset": "trm", "eps_high": 0.2})
    with pytest.raises(ConfigError, match="eps_low.*\\[0, 1\\)"):
        objectives.build({"preset": "dgpo", "eps_low": 1.0})
    with pytest.raises(ConfigError, match="n: got 0"):
        objectives.build({"preset": "dgpo", "n": 0})
    with pytest.raises(ConfigError, match="eps_neg_high"):
        objectives.build({"preset": "abc_grpo", "eps_neg_high": -0.1})
    with pytest.raises(ValueError, match="sampler_logprobs"):
        lp, old, adv, mask = _batch(13)
        objectives.build({"preset": "trm", "against": "sampler"})(objectives.TokenBatch(lp, old, adv, mask))
