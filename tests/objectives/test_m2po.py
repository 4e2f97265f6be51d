"""M2PO's second-moment mask and DeepSeek-V3.2's off-policy sequence mask (issue 26, item 3), on CPU in float64.

1. hand-computed masks, losses and gradients (arithmetic in the comments);
2. exactness: `m2_keep` equals AReaL's `m2_threshold` rule written out as a loop, on random batches; the loss and
   gradient with `normaliser: kept_tokens` and `eps_low` equal AReaL's M2 mask + `ppo_actor_loss_fn` (transcribed),
   and the paper's `all_tokens` normaliser is that times kept / counted (issue 30: 0.0033839 vs 0.0039479);
   the off-policy mask treats a NaN sampler log-prob as TRL's `get_off_policy_mask` does;
4. invariants: no suffix below tau keeps one token, padding never counts, micro-batch split is the batch's;
6. end to end: `tether train objective=m2po` runs two steps (as tests/objectives/test_dppo_sapo_gmpo_cov.py does).
"""

import math

import torch
import pytest

from tether import objectives
from tether.core import correction as C
from tether.core import m2po as M

from conftest import slow_after_first

D = torch.float64


def _t(*rows):
    return torch.tensor(rows, dtype=D)


def _areal_rule(d: torch.Tensor, mask: torch.Tensor, tau: float) -> torch.Tensor:
    """AReaL's `_apply_m2po_masking` + `_get_m2po_loss_mask` (areal/trainer/ppo/actor.py), written out:
    d^2 of the counted tokens sorted descending; mask the first k, k the first index whose suffix mean is < tau,
    or all but the last when there is none."""
    flat_m = mask.bool().reshape(-1)
    sq = (d.reshape(-1) ** 2)[flat_m].tolist()
    order = sorted(range(len(sq)), key=lambda i: -sq[i])
    vals = [sq[i] for i in order]
    n_drop = len(vals) - 1
    for k in range(len(vals)):
        if sum(vals[k:]) / (len(vals) - k) < tau:
            n_drop = k
            break
    kept_counted = [True] * len(sq)
    for i in order[:n_drop]:
        kept_counted[i] = False
    out = torch.zeros_like(flat_m)
    out[flat_m] = torch.tensor(kept_counted)
    return out.reshape(mask.shape)


# ---------------------------------------------------------------- 1. hand-computed


def test_m2_keep_hand_computed():
    # counted d^2: 0.25, 0.01, 0.00 | 0.09, 0.04 (the last token of row 2 is padding, its 9.0 never counts)
    # sorted: 0.25, 0.09, 0.04, 0.01, 0.00; suffix means 0.39/5 = 0.078, 0.14/4 = 0.035 < 0.04: drop one, the 0.25
    d = _t([0.5, 0.1, 0.0], [0.3, -0.2, 3.0])
    m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    keep = M.m2_keep(d, m, 0.04)
    assert keep.tolist() == [[False, True, True], [True, True, False]]
    assert M.second_moment(d, m).item() == pytest.approx(0.39 / 5)
    assert M.second_moment(d, keep).item() == pytest.approx(0.14 / 4)
    # tau 0.03: 0.035 is not < 0.03; next suffix 0.05/3 = 0.0167 < 0.03: drop two (0.25 and 0.09)
    assert M.m2_keep(d, m, 0.03).tolist() == [[False, True, True], [False, True, False]]
    # tau 0.1: 0.078 < 0.1 already: nothing dropped
    assert M.m2_keep(d, m, 0.1).tolist() == [[True, True, True], [True, True, False]]


def test_no_suffix_below_tau_keeps_only_the_smallest():
    # d^2 = 1, 4, 0.25: every suffix mean >= 0.25 >= tau 0.1: keep only the token with d^2 = 0.25 (AReaL's rule)
    d = _t([1.0, -2.0, 0.5])
    keep = M.m2_keep(d, torch.ones(1, 3), 0.1)
    assert keep.tolist() == [[False, False, True]]


def test_equal_values_are_dropped_in_position_order():
    # d^2 = 0.09 three times and 0: suffix means 0.27/4 = 0.0675, 0.18/3 = 0.06, 0.09/2 = 0.045, 0 -> drop 3 for
    # tau 0.04; with tau 0.05 drop 2: the first two in row-major order (a stable sort, departure 1)
    d = _t([0.3, 0.0], [-0.3, 0.3])
    m = torch.ones(2, 2)
    assert M.m2_keep(d, m, 0.05).tolist() == [[False, True], [False, True]]
    assert M.m2_keep(d, m, 0.04).tolist() == [[False, True], [False, False]]


def test_m2po_loss_and_gradient_hand_computed():
    # token-mean over 4 tokens of -A w M; log w = 0.5, 0.1, -0.1, 0.0 -> d^2 0.25, 0.01, 0.01, 0: suffix means
    # 0.27/4 = 0.0675, 0.02/3 = 0.0067 < 0.04: the first token is dropped.
    # kept: w = e^0.1 (A = 1), e^-0.1 (A = -1), 1 (A = -1)
    # loss = (-(1)(e^0.1) - (-1)(e^-0.1) - (-1)(1)) / 4 ; grad_t = -A_t w_t M_t / 4
    old = _t([-1.0, -1.0], [-1.0, -1.0])
    lp = (old + _t([0.5, 0.1], [-0.1, 0.0])).requires_grad_()
    adv = _t(1.0, -1.0)
    out = objectives.build("m2po")(objectives.TokenBatch(lp, old, adv, torch.ones(2, 2)))
    out.loss.backward()
    e = math.exp(0.1)
    assert out.loss.item() == pytest.approx((-e + 1 / e + 1) / 4, rel=1e-12)
    torch.testing.assert_close(lp.grad, _t([0.0, -e / 4], [1 / e / 4, 0.25]), rtol=1e-12, atol=0)
    assert out.metrics["m2po/masked_frac"].item() == pytest.approx(0.25)
    assert out.metrics["policy/clipfrac_high"].item() == pytest.approx(0.25)  # the dropped token has A > 0
    assert out.metrics["m2po/m2"].item() == pytest.approx(0.27 / 4)


def test_against_sampler_measures_old_against_the_sampler():
    # d = old - sampler = 0.5, 0.1, 0, 0: drop the first (0.26/4 = 0.065 >= 0.04; 0.01/3 < 0.04); on-policy w = 1,
    # so the gradient is -A / 4 on the three kept tokens whatever pi_theta is
    old = _t([-1.0, -1.0], [-1.0, -1.0])
    sampler = old - _t([0.5, 0.1], [0.0, 0.0])
    lp = old.clone().requires_grad_()
    spec = {"preset": "m2po", "against": "sampler"}
    out = objectives.build(spec)(
        objectives.TokenBatch(lp, old, _t(1.0, -1.0), torch.ones(2, 2), sampler_logprobs=sampler)
    )
    out.loss.backward()
    torch.testing.assert_close(lp.grad, _t([0.0, -0.25], [0.25, 0.25]), rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="sampler_logprobs"):
        objectives.build(spec)(objectives.TokenBatch(lp, old, _t(1.0, -1.0), torch.ones(2, 2)))


# ---------------------------------------------------------------- 2. exactness against AReaL's rule


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("tau", [0.001, 0.04, 0.3])
def test_m2_keep_equals_areals_rule(seed, tau):
    g = torch.Generator().manual_seed(seed)
    d = 0.4 * torch.randn(6, 9, generator=g, dtype=D)  # continuous: no ties, so the sort order is AReaL's too
    lengths = torch.randint(0, 10, (6,), generator=g)
    m = (torch.arange(9)[None, :] < lengths[:, None]).to(D)
    keep = M.m2_keep(d, m, tau)
    assert torch.equal(keep, _areal_rule(d, m, tau))
    if m.sum() > 0:
        assert M.second_moment(d, keep).item() < tau or keep.sum() == 1
        assert keep.sum() > 0


def _areal_m2po_loss(lp, prox, behave, adv, mask, tau, eps_clip, eps_clip_higher=None):
    """AReaL's M2PO loss on one micro-batch, transcribed (areal 1.0.4 from PyPI, the same at areal-project/AReaL
    cbff54d): `grpo_loss_fn` (areal/trainer/ppo/actor.py) replaces loss_mask by `_apply_m2po_masking(old_logp,
    prox_logp, ...)`, on d = behave - prox, then `ppo_actor_loss_fn` (areal/utils/functional/functional.py, no
    rejection_sampling) takes max(-A r, -A clamp(r, 1 - eps, 1 + eps_h)) with r = exp(lp - prox), zero outside the
    mask, summed and divided by the mask's count_nonzero() (the KEPT tokens: the count is taken after the M2 mask)."""
    m = _areal_rule(behave - prox, mask, tau)
    count = m.count_nonzero() or 1
    ratio = torch.where(m, torch.exp(lp - prox), torch.zeros_like(lp))
    a = adv[:, None]
    clipped = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + (eps_clip if eps_clip_higher is None else eps_clip_higher))
    loss = torch.maximum(-a * ratio, -a * clipped)
    return torch.where(m, loss, torch.zeros_like(loss)).sum() / count


def _issue30_case():
    # issue 30's case: d^2 = [.25, .01, .01, pad | .09, 0, .04, .01], tau .04, A = [1, -0.5]. The same d is both
    # log(pi_theta / pi_old) and log(pi_old / pi_sampler), so against old and against sampler mask alike.
    d = _t([0.5, -0.1, 0.1, 0.0], [-0.3, 0.0, 0.2, 0.1])
    m = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]).bool()
    prox = torch.full((2, 4), -1.0, dtype=D)
    return prox + d, prox, prox - d, _t(1.0, -0.5), m


@pytest.mark.parametrize("against", ["old", "sampler"])
def test_issue30_normalisers_hand_computed(against):
    # sorted d^2 .25, .09, .04, .01, .01, .01, 0: mean .41/7 = .0586 >= .04; drop .25: .16/6 = .0267 < .04.
    # kept: -(1)(e^-.1 + e^.1) - (-.5)(e^-.3 + 1 + e^.2 + e^.1) = -2.0100083 + 2.0337956 = 0.0236873 (no clip)
    #   all_tokens (the paper, 1 / sum |o_i| = 1/7): 0.0033839;  kept_tokens (AReaL, 1/6): 0.0039479
    lp, prox, behave, adv, m = _issue30_case()
    kept_sum = -(math.exp(-0.1) + math.exp(0.1)) + 0.5 * (math.exp(-0.3) + 1 + math.exp(0.2) + math.exp(0.1))
    spec = {"preset": "m2po", "against": against}
    for normaliser, n, value in (("all_tokens", 7, 0.0033839), ("kept_tokens", 6, 0.0039479)):
        batch = objectives.TokenBatch(lp, prox, adv, m.to(D), sampler_logprobs=behave)
        out = objectives.build({**spec, "normaliser": normaliser})(batch)
        assert out.loss.item() == pytest.approx(kept_sum / n, rel=1e-12)
        assert out.loss.item() == pytest.approx(value, abs=5e-8)
        assert out.metrics["m2po/masked_frac"].item() == pytest.approx(1 / 7)


@pytest.mark.parametrize("eps", [None, 0.2, 0.05])
@pytest.mark.parametrize("seed", range(4))
def test_m2po_equals_areals_loss_and_gradient(seed, eps):
    # tether against=sampler (d = log(pi_old / pi_sampler) with pi_old AReaL's proximal policy) with
    # normaliser kept_tokens and eps_low = eps is AReaL's loss exactly; the paper's all_tokens normaliser is it
    # times kept / counted. eps None: a clip that never binds on AReaL's side (eps_clip 1e3), none on tether's.
    g = torch.Generator().manual_seed(seed)
    n, t = 5, 7
    prox = -torch.rand(n, t, generator=g, dtype=D) * 3 - 0.05
    behave = prox + 0.3 * torch.randn(n, t, generator=g, dtype=D)
    lp0 = prox + 0.25 * torch.randn(n, t, generator=g, dtype=D)
    adv = torch.randn(n, generator=g, dtype=D)
    m = torch.arange(t)[None, :] < torch.randint(1, t + 1, (n,), generator=g)[:, None]
    lp_a, lp_t = lp0.clone().requires_grad_(), lp0.clone().requires_grad_()
    ref = _areal_m2po_loss(lp_a, prox, behave, adv, m, 0.04, 1e3 if eps is None else eps)
    ref.backward()
    spec = {"preset": "m2po", "against": "sampler", "normaliser": "kept_tokens", "eps_low": eps}
    out = objectives.build(spec)(objectives.TokenBatch(lp_t, prox, adv, m.to(D), sampler_logprobs=behave))
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(lp_t.grad, lp_a.grad, rtol=1e-12, atol=1e-14)
    kept = _areal_rule(behave - prox, m, 0.04).sum().item()
    paper = objectives.build({**spec, "normaliser": "all_tokens"})(
        objectives.TokenBatch(lp0, prox, adv, m.to(D), sampler_logprobs=behave)
    )
    assert paper.loss.item() == pytest.approx(ref.item() * kept / m.sum().item(), rel=1e-12, abs=1e-15)


def test_kept_tokens_over_micro_batches_is_areals_weighting():
    # AReaL weights each micro-batch's kept-token mean by its counted tokens (loss_weight_fn = loss_mask's
    # count_nonzero, taken before the M2 mask) over the mini-batch's: tether's micro-batch losses with the
    # mini-batch's token-mean normaliser sum to exactly that.
    g = torch.Generator().manual_seed(3)
    prox = -torch.rand(6, 5, generator=g, dtype=D) - 0.1
    behave, lp = (
        prox + 0.3 * torch.randn(6, 5, generator=g, dtype=D),
        prox + 0.1 * torch.randn(6, 5, generator=g, dtype=D),
    )
    adv, m = torch.randn(6, generator=g, dtype=D), torch.ones(6, 5, dtype=torch.bool)
    m[1, 3:] = m[4, 1:] = False
    obj = objectives.build({"preset": "m2po", "against": "sampler", "normaliser": "kept_tokens", "eps_low": 0.2})
    total, areal = 0.0, 0.0
    for rows in (slice(0, 2), slice(2, 6)):
        b = objectives.TokenBatch(
            lp[rows],
            prox[rows],
            adv[rows],
            m[rows].to(D),
            sampler_logprobs=behave[rows],
            loss_norm=obj.normalizer(m.to(D)),
        )
        total += obj(b).loss.item()
        areal += (
            _areal_m2po_loss(lp[rows], prox[rows], behave[rows], adv[rows], m[rows], 0.04, 0.2).item()
            * m[rows].sum().item()
            / m.sum().item()
        )
    assert total == pytest.approx(areal, rel=1e-12)


def test_m2po_clip_hand_computed():
    # eps_low = eps_high = 0.2 on the issue's case (against old): the kept token of row 2 with log w = -.3 has
    # w = .7408 < .8 and A = -.5 < 0: the clip binds, its loss is -(-.5)(.8) = .4 instead of .3704, no gradient.
    lp, prox, behave, adv, m = _issue30_case()
    lp = lp.clone().requires_grad_()
    out = objectives.build({"preset": "m2po", "eps_low": 0.2, "eps_high": 0.2})(
        objectives.TokenBatch(lp, prox, adv, m.to(D))
    )
    out.loss.backward()
    kept_sum = -(math.exp(-0.1) + math.exp(0.1)) + 0.5 * (0.8 + 1 + math.exp(0.2) + math.exp(0.1))
    assert out.loss.item() == pytest.approx(kept_sum / 7, rel=1e-12)
    assert lp.grad[1, 0].item() == 0.0 and lp.grad[0, 0].item() == 0.0  # clipped, and dropped by the M2 mask
    assert lp.grad[1, 2].item() == pytest.approx(0.5 * math.exp(0.2) / 7, rel=1e-12)
    assert out.metrics["policy/clipfrac_low"].item() == pytest.approx(1 / 7)  # the clipped one (A < 0)


# ---------------------------------------------------------------- DeepSeek-V3.2 off-policy sequence mask


def test_off_policy_sequence_mask_hand_computed():
    # mean over counted tokens of log(pi_sampler / pi_theta) = sampler - lp:
    #   row 0: (0.6 + 0.4) / 2 = 0.5, A < 0 -> 0.5 > 0.4: masked
    #   row 1: (0.6 + 0.4) / 2 = 0.5, A > 0 -> kept
    #   row 2: (0.3 + 0.3 + 0.3) / 3 = 0.3 <= 0.4, A < 0 -> kept
    #   row 3: 0.5 over its one counted token (the padding's 9.0 does not count), A < 0 -> masked
    lp = torch.full((4, 3), -1.0, dtype=D)
    sampler = lp + _t([0.6, 0.4, 0.0], [0.6, 0.4, 0.0], [0.3, 0.3, 0.3], [0.5, 9.0, 9.0])
    m = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0]])
    adv = _t(-1.0, 1.0, -0.5, -2.0)
    masked = C.off_policy_sequence_mask(lp, sampler, adv, m, 0.4)
    assert masked.tolist() == [[True, True, False], [False] * 3, [False] * 3, [True, False, False]]
    # exactly at delta: kept (TRL's <=)
    assert not C.off_policy_sequence_mask(lp, sampler, adv, m, 0.5)[0].any()


def test_off_policy_mask_removes_the_sequences_gradient_and_keeps_the_normaliser():
    # GRPO-style ppo_clip, token-mean over 4 tokens; row 0 (A = -1, drift 0.5 > 0.4) leaves the loss: its gradient is 0,
    # row 1 keeps -A w / 4 = -1 * 1 / 4 per token (on-policy w = 1), and the normaliser stays 4 (TRL's)
    old = torch.full((2, 2), -1.0, dtype=D)
    lp = old.clone().requires_grad_()
    sampler = old + _t([0.5, 0.5], [0.5, 0.5])
    batch = objectives.TokenBatch(lp, old, _t(-1.0, 1.0), torch.ones(2, 2), sampler_logprobs=sampler)
    out = objectives.build({"name": "ppo_clip", "aggregation": "token-mean", "off_policy_mask": 0.4})(batch)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, _t([0.0, 0.0], [-0.25, -0.25]), rtol=1e-12, atol=0)
    assert out.loss.item() == pytest.approx(-0.5)
    assert out.metrics["policy/off_policy_masked_frac"].item() == pytest.approx(0.5)
    # without sampler log-probs the mask reads pi_old (TRL's fallback): on-policy, nothing is masked
    plain = objectives.TokenBatch(old.clone().requires_grad_(), old, _t(-1.0, 1.0), torch.ones(2, 2))
    out = objectives.build({"name": "ppo_clip", "off_policy_mask": 0.4})(plain)
    assert out.metrics["policy/off_policy_masked_frac"].item() == 0.0


def test_a_nan_sampler_logprob_counts_as_no_drift_as_trl():
    # issue 30's case: A = -1, per-token log(pi_sampler / pi_theta) = [NaN, 2, 0], delta .5. TRL zeroes the NaN:
    # mean (0 + 2 + 0) / 3 = .667 > .5, the sequence leaves the loss. Before, NaN propagated, NaN > .5 was False
    # and the sequence was kept. A second sequence, A = .1 over 10 tokens, on-policy (w = 1), token-mean over 13:
    #   TRL: (0 + 10 (-.1)) / 13 = -0.0769;  the old tether: (3 (1) + 10 (-.1)) / 13 = 0.1538
    trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    lp = torch.full((2, 10), -1.0, dtype=D)
    sampler = lp.clone()
    sampler[0, :3] = lp[0, :3] + _t(float("nan"), 2.0, 0.0)
    m = torch.zeros(2, 10)
    m[0, :3], m[1] = 1, 1
    adv = _t(-1.0, 0.1)
    masked = C.off_policy_sequence_mask(lp, sampler, adv, m, 0.5)
    assert masked[0, :3].all() and not masked[1].any()
    keep_trl = trl_grpo.GRPOTrainer.get_off_policy_mask(adv[:, None], lp, sampler, m.to(D), 0.5)  # (B, 1), 1 = keep
    assert torch.equal(~masked[:, 0], keep_trl[:, 0].bool())
    out = objectives.build({"name": "ppo_clip", "aggregation": "token-mean", "off_policy_mask": 0.5})(
        objectives.TokenBatch(lp.clone().requires_grad_(), lp, adv, m.to(D), sampler_logprobs=sampler)
    )
    assert out.loss.item() == pytest.approx(-1 / 13, rel=1e-12)  # -0.0769


def test_the_trainer_takes_a_nonfinite_sampler_logprob_out_of_the_loss_and_counts_it():
    from types import SimpleNamespace

    from tether.model.causal_lm import Tokens
    from tether.trainer.step import finite_sampler_tokens, sampler_logprobs

    lp = torch.tensor([[-1.0, float("nan"), -0.5], [float("-inf"), -2.0, float("nan")]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # row 1's NaN is padding: not counted, not masked twice
    ids = torch.zeros(2, 3, dtype=torch.long)
    tokens = Tokens(ids, torch.ones(2, 3), ids, ids, mask, 0)
    rollout = SimpleNamespace(sampler_logprobs=lp)
    kept, n = finite_sampler_tokens(rollout, tokens)
    assert n == 2.0 and kept.loss_mask.tolist() == [[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]
    assert tokens.loss_mask.tolist() == mask.tolist()  # the caller's tensor is not modified
    clean = sampler_logprobs(rollout, kept)
    assert torch.isfinite(clean).all() and clean.tolist() == [[-1.0, 0.0, -0.5], [0.0, -2.0, 0.0]]
    assert finite_sampler_tokens(SimpleNamespace(sampler_logprobs=torch.zeros(2, 3)), tokens) == (tokens, 0.0)


def test_bad_values_name_the_key():
    from tether.schema import ConfigError

    with pytest.raises(ConfigError, match="tau"):
        objectives.build({"preset": "m2po", "tau": 0})
    with pytest.raises(ConfigError, match="normaliser.*set aggregation: token-mean"):
        objectives.build({"preset": "m2po", "normaliser": "kept_tokens", "aggregation": "seq-mean-token-mean"})
    with pytest.raises(ConfigError, match="eps_high.*together with eps_low"):
        objectives.build({"preset": "m2po", "eps_high": 0.2})
    with pytest.raises(ConfigError, match="off_policy_mask"):
        objectives.build({"preset": "grpo", "off_policy_mask": -1})


# ---------------------------------------------------------------- 6. end to end


@pytest.mark.parametrize(
    "extra", slow_after_first([["objective=m2po"], ["objective=dapo", "objective.off_policy_mask=0.5"]])
)
def test_train_runs_two_steps(tiny_dir, tmp_path, extra):
    import json
    from pathlib import Path

    from conftest import train_config as _cfg

    from tether.trainer.loop import train

    run = train(_cfg(tiny_dir, tmp_path / "run", "trainer.total_steps=2", *extra), log=lambda *_: None)
    rows = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(math.isfinite(r["loss/total"]) for r in rows[1:])
    key = "m2po/masked_frac" if extra == ["objective=m2po"] else "policy/off_policy_masked_frac"
    assert all(key in r for r in rows[1:])
    assert all(r["rollout/nonfinite_sampler_logprobs"] == 0 for r in rows[1:])  # the hf engine scores every token
