"""Train-inference mismatch correction (issue 18, item 2; issue 22, items 1-3): weights pi_old / pi_sampler,
truncated or masked, per token, per sequence (the product of the token ratios, as verl and TRL) or as their
geometric mean; 0/1 rejection by a divergence (verl's token_k3 / seq_mean_k3); a masked token leaves the loss
of every objective, sequence-level ones included; the identity when the two agree; hand-computed cases and
the references' formulas written out; in tether's trainer with a bf16 decode."""

import math

import pytest
import torch

from tether import objectives
from tether.core.correction import rollout_correction
from tether.schema import ConfigError

D = torch.float64


def _batch(seed=0, N=6, T=5):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(N, T, generator=g, dtype=D) - 0.1
    lp = (old + 0.3 * torch.randn(N, T, generator=g, dtype=D)).requires_grad_()
    mask = torch.ones(N, T, dtype=D)
    mask[0, 3:] = 0
    adv = torch.randn(N, generator=g, dtype=D)
    return lp, old, adv, mask


@pytest.mark.parametrize("level", ["token", "sequence", "sequence_geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask", "kl3"])
@pytest.mark.parametrize("preset", ["dapo", "rpg_urkl", "atr_grpo", "sapo", "gmpo", "gspo"])
def test_equal_logprobs_make_the_correction_the_identity(level, mode, preset):
    lp, old, adv, mask = _batch()
    plain = objectives.build(preset)
    rc = (
        {"level": level, "mode": "mask", "measure": "kl3", "delta": 0.01}
        if mode == "kl3"
        else {"level": level, "mode": mode}
    )
    corrected = objectives.build({"preset": preset, "rollout_correction": rc})
    out_a = plain(objectives.TokenBatch(lp, old, adv, mask))
    (g_a,) = torch.autograd.grad(out_a.loss, lp)
    out_b = corrected(objectives.TokenBatch(lp, old, adv, mask, sampler_logprobs=old.clone()))
    (g_b,) = torch.autograd.grad(out_b.loss, lp)
    torch.testing.assert_close(out_b.loss, out_a.loss, rtol=0, atol=0)
    torch.testing.assert_close(g_b, g_a, rtol=0, atol=0)
    assert out_b.metrics["rollout_correction/mismatch_k3"] == 0 and out_b.metrics["rollout_correction/weight_mean"] == 1


def test_hand_computed_weights():
    # Token level: log r = old - sampler = (0.5, -0.1, 1.0); r = (e^0.5, e^-0.1, e^1) = (1.649, 0.905, 2.718).
    old = torch.tensor([[-1.0, -1.0, -1.0]], dtype=D)
    sampler = torch.tensor([[-1.5, -0.9, -2.0]], dtype=D)
    mask = torch.ones(1, 3, dtype=torch.bool)
    c = rollout_correction(old, sampler, mask, "token", "truncate", 0.0, 2.0)
    torch.testing.assert_close(c.weights, torch.tensor([[math.exp(0.5), math.exp(-0.1), 2.0]], dtype=D))
    assert c.truncated.tolist() == [[False, False, True]] and not c.masked.any()
    c = rollout_correction(old, sampler, mask, "token", "mask", 0.95, 2.0)  # 0.905 < 0.95 and 2.718 > 2: out
    torch.testing.assert_close(c.weights, torch.tensor([[math.exp(0.5), 0.0, 0.0]], dtype=D))
    assert c.masked.tolist() == [[False, True, True]]
    # Sequence level: the product, exp(0.5 - 0.1 + 1.0) = e^1.4 = 4.055 -> 2, on every token.
    c = rollout_correction(old, sampler, mask, "sequence", "truncate", 0.0, 2.0)
    torch.testing.assert_close(c.weights, torch.full((1, 3), 2.0, dtype=D))
    assert c.truncated.all()
    c = rollout_correction(old, sampler, mask, "sequence", "truncate", 0.0, 5.0)
    torch.testing.assert_close(c.weights, torch.full((1, 3), math.exp(1.4), dtype=D))
    # sequence_geometric: the geometric mean, exp(1.4 / 3) = 1.594, on every token.
    c = rollout_correction(old, sampler, mask, "sequence_geometric", "truncate", 0.0, 2.0)
    torch.testing.assert_close(c.weights, torch.full((1, 3), math.exp(1.4 / 3), dtype=D))
    # Padding: no weight, not counted; a NaN sampler log-prob (not reported) means no correction.
    pad = torch.tensor([[True, True, False]])
    sampler_nan = torch.tensor([[-1.5, float("nan"), -2.0]], dtype=D)
    c = rollout_correction(old, sampler_nan, pad, "token", "truncate", 0.0, 2.0)
    torch.testing.assert_close(c.weights, torch.tensor([[math.exp(0.5), 1.0, 0.0]], dtype=D))


def test_truncation_scales_the_loss_per_token():
    # REINFORCE: l_t = -A lp_t; corrected l_t = -c_t A lp_t with c_t = clamp(r_t, 0, 1.2).
    obj = objectives.build(
        {
            "name": "reinforce",
            "rollout_correction": {"mode": "truncate", "high": 1.2},
            "aggregation": "seq-mean-token-sum",
        }
    )
    lp = torch.tensor([[-1.0, -2.0]], dtype=D, requires_grad=True)
    sampler = torch.tensor([[-1.1, -2.5]], dtype=D)  # r = e^0.1 = 1.105, e^0.5 = 1.649 -> 1.2
    out = obj(
        objectives.TokenBatch(
            lp, lp.detach(), torch.tensor([2.0], dtype=D), torch.ones(1, 2, dtype=D), sampler_logprobs=sampler
        )
    )
    out.loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-2.0 * math.exp(0.1), -2.0 * 1.2]], dtype=D))
    assert out.metrics["rollout_correction/truncated_frac"] == pytest.approx(0.5)
    # mismatch k1 = mean(sampler - old) = (-0.1 - 0.5) / 2; k3 = mean(r - 1 - log r).
    assert out.metrics["rollout_correction/mismatch_k1"].item() == pytest.approx(-0.3)
    k3 = ((math.exp(0.1) - 1 - 0.1) + (math.exp(0.5) - 1 - 0.5)) / 2
    assert out.metrics["rollout_correction/mismatch_k3"].item() == pytest.approx(k3)


# ---------------------------------------------------------------- issue 22, item 1: the sequence ratio is the product


def _random_mismatch(seed, N=7, T=9, scale=0.4):
    """old, sampler, mask (N, T) float64; rows of every length, one empty, padding holding garbage."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(N, T, generator=g, dtype=D) * 3 - 0.05
    sampler = old - scale * torch.randn(N, T, generator=g, dtype=D)
    lengths = torch.tensor([T, 1, 0, 3, T - 2, 5, T])[:N]
    mask = torch.arange(T)[None, :] < lengths[:, None]
    garbage = torch.full_like(old, 123.0)
    return torch.where(mask, old, garbage), torch.where(mask, sampler, -garbage), mask


def _verl_is_weights(old, sampler, mask, level, lower, upper):
    """verl 0.9.1 `compute_rollout_correction_weights`, written out: log r = old - sampler (masked); sequence:
    the masked SUM over tokens; clamp to [-20, 20], exp, times the mask; a single threshold truncates from
    above (TIS), a "lower_upper" threshold zeroes r outside [lower, upper] (IcePop)."""
    m = mask.to(D)
    log_r = (old - sampler) * m  # verl's log_ratio arrives already 0 on padding
    if level == "sequence":
        log_r = (log_r * m).sum(-1, keepdim=True)
    r = torch.exp(log_r.clamp(-20.0, 20.0)).expand_as(m) * m
    if lower is None:
        return r.clamp(max=upper)
    return torch.where((r >= lower) & (r <= upper), r, torch.zeros_like(r))


def _trl_is_weights(old, sampler, mask, level, clip_min, clip_max, mode):
    """TRL 1.16 GRPOTrainer (`vllm_importance_sampling_mode`), written out: d = (old - sampler) * mask,
    NaN -> 0; sequence_*: d summed over the tokens; r = exp(d) (unclamped); *_truncate clamps r to
    [clip_min, clip_max], *_mask sets r to 0 outside; then the per-token loss is multiplied by r."""
    d = torch.nan_to_num((old - sampler) * mask.to(D), nan=0.0)
    if level == "sequence":
        d = d.sum(-1, keepdim=True)
    r = torch.exp(d)
    if mode == "truncate":
        r = torch.clamp(r, min=clip_min, max=clip_max)
    else:
        lo = clip_min if clip_min is not None else -math.inf
        r = r.masked_fill((r < lo) | (r > clip_max), 0.0)
    return r.expand_as(old) * mask.to(D)  # TRL's aggregation multiplies by the mask afterwards


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_weights_equal_verls_and_trls_formulas(level, seed):
    old, sampler, mask = _random_mismatch(seed)
    for low, high in ((0.0, 2.0), (0.0, 1.3), (0.5, 2.0), (0.8, 1.25)):
        for mode in ("truncate", "mask"):
            c = rollout_correction(old, sampler, mask, level, mode, low, high)
            # verl: TIS has no lower bound; IcePop takes "low_high".
            if mode == "mask" or low == 0.0:
                verl = _verl_is_weights(old, sampler, mask, level, low if mode == "mask" else None, high)
                torch.testing.assert_close(c.weights, verl, rtol=1e-15, atol=0)
            trl = _trl_is_weights(old, sampler, mask, level, low, high, mode)
            torch.testing.assert_close(c.weights, trl, rtol=1e-15, atol=0)
            kept = (c.weights > 0) & mask
            assert mode == "truncate" or (c.masked == (mask & ~kept)).all()
    # The inputs exercise both sides: some sequences masked, some kept, some truncated.
    c = rollout_correction(old, sampler, mask, level, "mask", 0.5, 2.0)
    assert c.masked.any() and ((c.weights > 0) & mask).any()


def test_the_audits_sequence_cases_and_the_geometric_mean_under_its_own_name():
    # 100 tokens, each pi_old / pi_sampler = e^0.01: the product is e^1 = 2.718.
    old = torch.full((1, 100), -1.0, dtype=D)
    sampler = old - 0.01
    mask = torch.ones(1, 100, dtype=torch.bool)
    c = rollout_correction(old, sampler, mask, "sequence", "truncate", 0.0, 2.0)
    torch.testing.assert_close(c.weights, torch.full((1, 100), 2.0, dtype=D), rtol=0, atol=0)  # min(e^1, 2)
    c = rollout_correction(old, sampler, mask, "sequence", "mask", 0.5, 2.0)
    assert c.masked.all() and (c.weights == 0).all()  # e^1 > 2: the sequence is dropped
    # The geometric mean e^0.01 = 1.01005 keeps it, weighted by 1.01005.
    c = rollout_correction(old, sampler, mask, "sequence_geometric", "mask", 0.5, 2.0)
    assert not c.masked.any()
    torch.testing.assert_close(c.weights, torch.full((1, 100), math.exp(0.01), dtype=D))


def test_the_product_is_computed_in_log_space_and_never_overflows():
    # 50 tokens at log r = +20 (and a row at -20): the sum 1000 would overflow exp in float64 (e^1000 = inf).
    old = torch.zeros(2, 50, dtype=D)
    sampler = torch.stack([torch.full((50,), -20.0, dtype=D), torch.full((50,), 20.0, dtype=D)])
    mask = torch.ones(2, 50, dtype=torch.bool)
    for dtype in (torch.float64, torch.float32):
        o, s = old.to(dtype), sampler.to(dtype)
        c = rollout_correction(o, s, mask, "sequence", "truncate", 0.0, 2.0)
        assert torch.isfinite(c.weights).all()
        assert (c.weights[0] == 2.0).all()  # min(e^1000 -> e^20, 2)
        torch.testing.assert_close(c.weights[1], torch.full((50,), math.exp(-20.0), dtype=dtype))  # verl's floor
        c = rollout_correction(o, s, mask, "sequence", "mask", 0.5, 2.0)
        assert c.masked.all() and (c.weights == 0).all()
        for level in ("sequence", "sequence_geometric", "token"):
            c = rollout_correction(o, s, mask, level, "mask", 0.0, 2.0, "kl3", 0.01)
            assert torch.isfinite(c.weights).all() and c.masked.all()


# ---------------------------------------------------------------- issue 22, item 2: rejection by a divergence


def _verl_rejection(old, sampler, mask, option, threshold):
    """verl 0.9.1 `compute_rollout_rejection_mask` for token_k3 / seq_mean_k3, written out: log r clamped to
    [-20, 20], k3 = exp(log r) - 1 - log r per token; seq_mean: the masked mean over the sequence's tokens;
    keep (1) where the statistic <= threshold, else 0; the kept tokens keep weight 1 (a mask, not r)."""
    m = mask.to(D)
    log_r = ((old - sampler) * m).clamp(-20.0, 20.0)
    k3 = torch.exp(log_r) - 1.0 - log_r
    if option == "seq_mean_k3":
        k3 = ((k3 * m).sum(-1) / m.sum(-1).clamp(min=1.0))[:, None].expand_as(m)
    return (k3 <= threshold).to(D) * m


def test_the_audits_k3_rejection_cases():
    # Sequence level: log r = +-0.3 alternating over 20 tokens; the mean k3 is
    # ((e^0.3 - 1 - 0.3) + (e^-0.3 - 1 + 0.3)) / 2 = (0.049859 + 0.040818) / 2 = 0.045338 > 0.01: all 20 rejected.
    old = torch.zeros(1, 20, dtype=D)
    sampler = -torch.tensor([0.3, -0.3] * 10, dtype=D)[None, :]
    mask = torch.ones(1, 20, dtype=torch.bool)
    c = rollout_correction(old, sampler, mask, "sequence", "mask", measure="kl3", delta=0.01)
    assert c.masked.all() and (c.weights == 0).all()
    assert ((math.exp(0.3) - 1.3) + (math.exp(-0.3) - 0.7)) / 2 == pytest.approx(0.045338, abs=1e-6)
    # Its geometric-mean ratio is exp(0) = 1, D = 0: sequence_geometric keeps all 20, weighted 1.
    c = rollout_correction(old, sampler, mask, "sequence_geometric", "mask", measure="kl3", delta=0.01)
    assert not c.masked.any() and (c.weights == 1).all()
    # Token level: log r = [0.1, -0.1, 0.5]: k3 = [0.005171, 0.004837, 0.148721] vs 0.01 -> weights [1, 1, 0],
    # not r: the kept tokens are not multiplied by e^0.1 = 1.105 and e^-0.1 = 0.905.
    old, sampler = torch.zeros(1, 3, dtype=D), -torch.tensor([[0.1, -0.1, 0.5]], dtype=D)
    c = rollout_correction(old, sampler, torch.ones(1, 3, dtype=torch.bool), "token", "mask", measure="kl3", delta=0.01)
    assert c.weights.tolist() == [[1.0, 1.0, 0.0]] and c.masked.tolist() == [[False, False, True]]
    # Through an objective: REINFORCE, l_t = -c_t A lp_t, gradient -A c_t with A = 2.
    obj = objectives.build(
        {
            "name": "reinforce",
            "aggregation": "seq-mean-token-sum",
            "rollout_correction": {"mode": "mask", "measure": "kl3", "delta": 0.01},
        }
    )
    lp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=D, requires_grad=True)
    out = obj(
        objectives.TokenBatch(
            lp,
            lp.detach(),
            torch.tensor([2.0], dtype=D),
            torch.ones(1, 3, dtype=D),
            sampler_logprobs=lp.detach() - torch.tensor([[0.1, -0.1, 0.5]], dtype=D),
        )
    )
    out.loss.backward()
    assert lp.grad.tolist() == [[-2.0, -2.0, 0.0]]
    assert out.metrics["rollout_correction/masked_frac"].item() == pytest.approx(1 / 3)
    assert out.metrics["rollout_correction/weight_mean"].item() == pytest.approx(2 / 3)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_k3_rejection_equals_verls_formula(seed):
    old, sampler, mask = _random_mismatch(seed, scale=0.15)
    for delta in (0.002, 0.01, 0.05):
        for level, option in (("token", "token_k3"), ("sequence", "seq_mean_k3")):
            c = rollout_correction(old, sampler, mask, level, "mask", measure="kl3", delta=delta)
            verl = _verl_rejection(old, sampler, mask, option, delta)
            torch.testing.assert_close(c.weights, verl, rtol=0, atol=0)
            assert (c.masked == (mask & (verl == 0))).all()
    c = rollout_correction(old, sampler, mask, "sequence", "mask", measure="kl3", delta=0.01)
    assert c.masked.any() and (c.weights == 1).any()  # both outcomes occur


@pytest.mark.parametrize("measure", ["kl2", "chi2", "hellinger", "log_ratio", "kl3_reverse"])
def test_rejection_by_any_measure_is_the_same_formula(measure):
    # D_t = D(r_t) at token level, mean_t D(r_t) at sequence level, D(exp(mean_t log r_t)) at sequence_geometric.
    from tether.divergences import value

    old, sampler, mask = _random_mismatch(3, scale=0.2)
    m = mask.to(D)
    r = torch.exp((old - sampler) * m)
    d_tok = value(measure, r) * m
    d_seq = (d_tok.sum(-1) / m.sum(-1).clamp(min=1.0))[:, None].expand_as(m)
    d_geo = value(measure, torch.exp(((old - sampler) * m).sum(-1) / m.sum(-1).clamp(min=1.0)))[:, None].expand_as(m)
    for level, stat in (("token", d_tok), ("sequence", d_seq), ("sequence_geometric", d_geo)):
        delta = float(stat[mask].median())  # about half of them rejected
        c = rollout_correction(old, sampler, mask, level, "mask", measure=measure, delta=delta)
        torch.testing.assert_close(c.weights, (stat <= delta).to(D) * m, rtol=0, atol=0)


def test_rejection_config_is_checked():
    rc = objectives.RolloutCorrectionConfig(mode="mask", measure="kl3", delta=0.05)
    assert (rc.measure, rc.delta, rc.mode) == ("kl3", 0.05, "mask")
    with pytest.raises(ConfigError, match=r"rollout_correction\.mode.*'mask' with measure"):
        objectives.build({"preset": "dapo", "rollout_correction": {"measure": "kl3", "delta": 0.05}})  # truncate
    with pytest.raises(ConfigError, match=r"rollout_correction\.delta.*null without measure"):
        objectives.build({"preset": "dapo", "rollout_correction": {"mode": "mask", "delta": 0.05}})
    with pytest.raises(ConfigError, match=r"rollout_correction\.measure.*kl3"):
        objectives.build({"preset": "dapo", "rollout_correction": {"mode": "mask", "measure": "kl4", "delta": 0.05}})
    with pytest.raises(ConfigError, match="sequence_geometric"):
        objectives.build({"preset": "dapo", "rollout_correction": {"level": "geometric"}})


# ---------------------------------------------------------------- issue 30: KPop, AReaL's binary-KL rejection


def _areal_binary_kl(log_p, log_q, eps=1e-8):
    """AReaL's `compute_binary_kl_divergence` (areal-project/AReaL cbff54d, areal/utils/functional/functional.py,
    added in PR 1405), transcribed: p, q clamped to [eps, 1 - eps], p log(p/q) + (1 - p) log((1 - p)/(1 - q))."""
    p = torch.clamp(torch.exp(log_p), eps, 1.0 - eps)
    q = torch.clamp(torch.exp(log_q), eps, 1.0 - eps)
    return p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))


def _areal_kpop_kept(prox, behave, mask, level, upper):
    """AReaL's `apply_rejection_sampling` with metric binary_kl, action mask, no lower bound, 2D padded input, agg
    mean (the same file and commit), transcribed: metric = max(KL(prox || behave), KL(behave || prox)) per token;
    at sequence level its mean over the counted tokens (count at least 1); kept iff metric <= upper, and counted."""
    metric = torch.maximum(_areal_binary_kl(prox, behave), _areal_binary_kl(behave, prox))
    if level == "sequence":
        masked = torch.where(mask, metric, torch.zeros_like(metric))
        metric = (masked.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)).expand_as(metric)
    return mask & (metric <= upper)


def test_binary_kl_max_hand_computed():
    # p = .5, q = .7: KL(.5 || .7) = .5 ln(.5/.7) + .5 ln(.5/.3) = .5 (-.3364722) + .5 (.5108256) = .0871767
    #                 KL(.7 || .5) = .7 ln(.7/.5) + .3 ln(.3/.5) = .2355306 - .1532477 = .0822829; max .0871767
    from tether.core.divergences import binary_kl, binary_kl_max

    a, b = torch.tensor([math.log(0.5)], dtype=D), torch.tensor([math.log(0.7)], dtype=D)
    fwd = 0.5 * math.log(0.5 / 0.7) + 0.5 * math.log(0.5 / 0.3)
    rev = 0.7 * math.log(0.7 / 0.5) + 0.3 * math.log(0.3 / 0.5)
    assert binary_kl(a, b).item() == pytest.approx(fwd, rel=1e-7)  # the 1e-8 guard moves the 8th digit at most
    assert binary_kl(b, a).item() == pytest.approx(rev, rel=1e-7)
    assert binary_kl_max(a, b).item() == binary_kl_max(b, a).item() == pytest.approx(max(fwd, rev), rel=1e-7)
    assert binary_kl_max(a, a).item() == 0.0


def test_kpop_rejection_hand_computed():
    # token level, delta .085: token 0 (p_old .5, p_sampler .7: .0871767 > .085) rejected; token 1 (.7 vs .5, the
    # same pair reversed: the max is symmetric) rejected; token 2 (.5 vs .55: KL .0050 both ways) kept.
    # sequence level, the row's mean (.0871767 + .0871767 + .0050) / 3 = .0598 <= .085: the sequence is kept.
    old = torch.log(torch.tensor([[0.5, 0.7, 0.5]], dtype=D))
    sampler = torch.log(torch.tensor([[0.7, 0.5, 0.55]], dtype=D))
    mask = torch.ones(1, 3, dtype=torch.bool)
    c = rollout_correction(old, sampler, mask, "token", "mask", measure="binary_kl_max", delta=0.085)
    assert c.weights.tolist() == [[0.0, 0.0, 1.0]] and c.masked.tolist() == [[True, True, False]]
    c = rollout_correction(old, sampler, mask, "sequence", "mask", measure="binary_kl_max", delta=0.085)
    assert c.weights.tolist() == [[1.0, 1.0, 1.0]]
    c = rollout_correction(old, sampler, mask, "sequence", "mask", measure="binary_kl_max", delta=0.05)
    assert c.weights.tolist() == [[0.0, 0.0, 0.0]]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kpop_rejection_equals_areals_rule(seed):
    # tether's binary_kl_max adds 1e-8 inside a log where AReaL clamps p and q to [1e-8, 1 - 1e-8]: the values
    # agree to 1e-6 (log-probs of 0 included, where the clamp moves p by 1e-8), and the decisions agree exactly
    # at every threshold (none falls within 1e-6 of a value).
    from tether.core.divergences import binary_kl_max

    old, sampler, mask = _random_mismatch(seed, scale=0.5)
    sampler = sampler.clamp(max=0.0)  # a log-prob; some are exactly 0 (p = 1)
    old, sampler = torch.where(mask, old, -1.0), torch.where(mask, sampler, -1.0)  # finite padding for the values
    assert (sampler == 0).any()
    tether = binary_kl_max(old, sampler)
    areal = torch.maximum(_areal_binary_kl(old, sampler), _areal_binary_kl(sampler, old))
    torch.testing.assert_close(tether, areal, rtol=0, atol=1e-6)
    for level in ("token", "sequence"):
        for upper in (0.001, 0.01, 0.05, 0.2):
            c = rollout_correction(old, sampler, mask, level, "mask", measure="binary_kl_max", delta=upper)
            kept = _areal_kpop_kept(old, sampler, mask, level, upper)
            assert torch.equal(mask & ~c.masked, kept), (level, upper)
            assert torch.equal(c.weights, kept.to(D))  # a kept token has weight 1, as AReaL's mask mode (no ratio)
    c = rollout_correction(old, sampler, mask, "token", "mask", measure="binary_kl_max", delta=0.01)
    assert c.masked.any() and (c.weights == 1).any()  # both outcomes occur


def test_kpop_in_an_objective_zeroes_the_rejected_tokens_gradient():
    old = torch.log(torch.tensor([[0.5, 0.7, 0.5]], dtype=D))
    sampler = torch.log(torch.tensor([[0.7, 0.5, 0.55]], dtype=D))
    lp = old.clone().requires_grad_()
    rc = {"mode": "mask", "measure": "binary_kl_max", "delta": 0.085}
    out = objectives.build({"preset": "dapo", "rollout_correction": rc})(
        objectives.TokenBatch(
            lp, old, torch.tensor([1.0], dtype=D), torch.ones(1, 3, dtype=D), sampler_logprobs=sampler
        )
    )
    out.loss.backward()
    # token-mean over 3 (the rejected tokens stay in the count), on-policy: -A / 3 on the kept token only
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.0, -1 / 3]], dtype=D), rtol=1e-12, atol=0)
    assert out.metrics["rollout_correction/masked_frac"].item() == pytest.approx(2 / 3)
    with pytest.raises(ConfigError, match=r"rollout_correction\.level.*token or sequence with the binary measure"):
        objectives.build({"preset": "dapo", "rollout_correction": {**rc, "level": "sequence_geometric"}})
    with pytest.raises(ConfigError, match=r"rollout_correction\.measure.*Did you mean 'binary_kl_max'"):
        objectives.build({"preset": "dapo", "rollout_correction": {**rc, "measure": "binary_kl_mx"}})
    with pytest.raises(ConfigError, match=r"rollout_correction\.mode.*'mask' with measure"):
        objectives.build({"preset": "dapo", "rollout_correction": {**rc, "mode": "truncate"}})


# ---------------------------------------------------------------- issue 22, item 3: a masked token leaves the loss


MASKED_CASES = [
    "gmpo",
    "gspo",
    "sapo",
    "ppo_clip",
    "dapo",
    "cispo",
    "rpg_urkl",
    "dppo_tv",
    "atr_grpo",
    "etr",
    "clip_cov",
    "kl_cov",
    "reinforce",
]


@pytest.mark.parametrize("spec", MASKED_CASES)
def test_a_masked_token_has_no_gradient_and_leaves_sequence_statistics(spec):
    # One 4-token sequence; the third token (index 2) has pi_old / pi_sampler = e^1 > 2 and is masked; the others
    # have r = 1. Its gradient must be exactly 0, and the loss must be the loss of the sequence without that
    # token: with the token count kept (4, departure 4 of tether.core.correction) every kept token's gradient
    # is 3/4 of its gradient when the token is padding (3 counted tokens) under a mean over tokens, and equal
    # to it under a token sum (seq-mean-token-sum[-norm]), for token- and sequence-level losses alike.
    old = torch.tensor([[-1.0, -0.7, -2.0, -1.2]], dtype=D)
    lp0 = old + torch.tensor([[0.1, -0.2, 0.3, 0.05]], dtype=D)
    sampler = old - torch.tensor([[0.0, 0.0, 1.0, 0.0]], dtype=D)
    adv = torch.tensor([1.0], dtype=D)
    obj = objectives.build(
        {**objectives.spec_mapping(spec), "rollout_correction": {"mode": "mask", "low": 0.5, "high": 2.0}}
    )
    plain = objectives.build(spec)
    extra = dict(rewards=torch.tensor([1.0], dtype=D), group_ids=torch.tensor([0]))

    lp = lp0.clone().requires_grad_()
    out = obj(objectives.TokenBatch(lp, old, adv, torch.ones(1, 4, dtype=D), sampler_logprobs=sampler, **extra))
    out.loss.backward()
    lp_pad = lp0.clone().requires_grad_()
    pad = torch.tensor([[1.0, 1.0, 0.0, 1.0]], dtype=D)
    ref = plain(objectives.TokenBatch(lp_pad, old, adv, pad, **extra))
    ref.loss.backward()
    assert lp.grad[0, 2] == 0.0
    assert lp_pad.grad.abs().sum() > 0  # a case that tests nothing is a defect
    f = 1.0 if obj.config.aggregation in ("seq-mean-token-sum", "seq-mean-token-sum-norm") else 0.75
    torch.testing.assert_close(lp.grad, f * lp_pad.grad, rtol=1e-14, atol=1e-16)
    torch.testing.assert_close(out.loss, f * ref.loss, rtol=1e-14, atol=1e-16)
    assert out.metrics["rollout_correction/masked_frac"].item() == 0.25


def test_gmpo_masked_token_hand_computed():
    # log w = lp - old = [0.1, -0.2, (masked), 0.05], A = 1, inside GMPO's clip (e^-0.4, e^0.4). The geometric mean
    # over the kept tokens is g = exp((0.1 - 0.2 + 0.05) / 3) = exp(-1/60) = 0.98347; each kept token carries
    # -A g, the masked one c = 0; seq-mean-token-mean over the 4 counted tokens: loss = 3 (-g) / 4 = -0.73760;
    # d loss / d lp_j = -(3/4) g (1/3) = -g / 4 = -0.24587 for a kept j, 0 for the masked token (it was -0.194
    # before issue 22, as if kept: its log-ratio stayed in the geometric mean).
    old = torch.tensor([[-1.0, -0.7, -2.0, -1.2]], dtype=D)
    lp = (old + torch.tensor([[0.1, -0.2, 0.3, 0.05]], dtype=D)).requires_grad_()
    obj = objectives.build({"name": "gmpo", "rollout_correction": {"mode": "mask", "low": 0.5, "high": 2.0}})
    out = obj(
        objectives.TokenBatch(
            lp,
            old,
            torch.tensor([1.0], dtype=D),
            torch.ones(1, 4, dtype=D),
            sampler_logprobs=old - torch.tensor([[0.0, 0.0, 1.0, 0.0]], dtype=D),
        )
    )
    out.loss.backward()
    g = math.exp(-1.0 / 60.0)
    assert out.loss.item() == pytest.approx(-0.75 * g, rel=1e-14)
    torch.testing.assert_close(lp.grad, torch.tensor([[-g / 4, -g / 4, 0.0, -g / 4]], dtype=D), rtol=1e-14, atol=0)
    assert out.metrics["gmpo/seq_ratio_mean"].item() == pytest.approx(g, rel=1e-14)


@pytest.mark.parametrize("spec", ["gmpo", "gspo", "ppo_clip"])
def test_a_masked_sequence_has_no_gradient(spec):
    # Sequence level, product: sequence 0 has r = e^(0.4 * 3) = 3.32 > 2 and leaves the loss entirely.
    lp, old, adv, mask = _batch(seed=4, N=3, T=3)
    mask = torch.ones_like(mask)
    sampler = old.clone()
    sampler[0] -= 0.4
    obj = objectives.build({"name": spec, "rollout_correction": {"level": "sequence", "mode": "mask", "high": 2.0}})
    out = obj(objectives.TokenBatch(lp, old, adv, mask, sampler_logprobs=sampler))
    (g,) = torch.autograd.grad(out.loss, lp)
    assert (g[0] == 0).all() and (g[1:] != 0).any()


def test_a_missing_sampler_logprob_names_the_fix():
    lp, old, adv, mask = _batch()
    obj = objectives.build({"preset": "dapo", "rollout_correction": {}})
    with pytest.raises(ValueError, match="sampler_logprobs.*rollout_correction"):
        obj(objectives.TokenBatch(lp, old, adv, mask))


def test_the_trainer_corrects_a_bf16_decode(tiny_dir, tmp_path):
    # bf16 autocast in the engine's decode and in the recompute differ (different batch shapes and
    # KV-cache paths): a real, small mismatch that the correction measures and weighs.
    import json

    from tether.config.loading import load_config
    from tether.trainer.loop import train

    from conftest import DIGIT_REWARD

    cfg = load_config(
        None,
        [
            f"model.name_or_path={tiny_dir}",
            f"output_dir={tmp_path / 'run'}",
            "warm_start.enabled=false",
            f"reward.name={DIGIT_REWARD}",
            "rollout.prompts_per_step=4",
            "rollout.group_size=4",
            "rollout.max_new_tokens=6",
            "trainer.total_steps=2",
            "data.eval_size=8",
            "trainer.progress=false",
            "trainer.plots=false",
            "trainer.autocast=bf16",
            "trainer.threads=1",
            "objective={preset: dapo, rollout_correction: {level: token, mode: truncate, high: 1.5}}",
        ],
    )
    run = train(cfg, log=lambda *_: None)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][1:]
    for r in rows:
        assert r["rollout_correction/mismatch_k3"] > 0 and math.isfinite(r["loss/total"])
        assert 0 < r["rollout_correction/weight_mean"] <= 1.5


@pytest.mark.parametrize("spec", ["gmpo", "gspo", "dapo", "etr", "sapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_masked_tokens_split_over_micro_batches_give_the_whole_batch(spec, level):
    # With tokens masked, micro-batches (loss_norm = the whole batch's normaliser) still sum to the whole batch's
    # loss and gradient, and their metrics merge to the whole batch's (the policy metrics over kept tokens).
    lp, old, adv, mask = _batch(seed=5, N=8, T=5)
    g = torch.Generator().manual_seed(6)
    sampler = old - 0.5 * torch.randn(old.shape, generator=g, dtype=D)
    rewards, groups = torch.tensor([1.0, 0, 1, 1, 0, 0, 1, 0], dtype=D), torch.arange(8) // 4
    obj = objectives.build(
        {"preset": spec, "rollout_correction": {"level": level, "mode": "mask", "low": 0.6, "high": 1.6}}
    )
    whole = obj(objectives.TokenBatch(lp, old, adv, mask, rewards=rewards, group_ids=groups, sampler_logprobs=sampler))
    (g_whole,) = torch.autograd.grad(whole.loss, lp)
    assert 0 < whole.metrics["rollout_correction/masked_frac"] < 1
    stats, norm = obj.group_stats(rewards, groups), obj.normalizer(mask)
    merger, total, g_sum = objectives.MetricMerger(), 0.0, torch.zeros_like(lp)
    for idx in (torch.arange(0, 3), torch.arange(3, 8)):
        x = lp.detach()[idx].clone().requires_grad_()
        out = obj(
            objectives.TokenBatch(
                x,
                old[idx],
                adv[idx],
                mask[idx],
                sampler_logprobs=sampler[idx],
                loss_norm=norm,
                group_stats=None if stats is None else stats.select(idx),
            )
        )
        total, g_sum[idx] = total + out.loss.detach(), torch.autograd.grad(out.loss, x)[0]
        merger.add(out)
    merger.end_mini_batch()
    torch.testing.assert_close(total, whole.loss.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g_sum, g_whole, rtol=1e-12, atol=1e-14)
    merged = merger.result()
    for k, v in whole.metrics.items():
        torch.testing.assert_close(merged[k], v.double(), rtol=1e-12, atol=1e-14, msg=k)


def test_tether_list_shows_the_binary_measures(capsys):
    from tether.cli import main

    assert main(["list"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("binary measures"))
    assert line.endswith("binary_tv, binary_kl, binary_kl_max") and "KPop" in line
