"""The estimators and reward aggregation of issue 30 (float64, CPU): MaxRL (`maxrl`), GDPO
(`reward_aggregation: normalize_then_sum`, the `gdpo` preset), REINFORCE++ without a group baseline
(`reinforce_pp_no_baseline`) and GRPO with the batch's std (`grpo_batch_std`).

What these prove:
- hand-computed values of `maxrl` and of `normalize_then_sum`, with the arithmetic in comments;
- `maxrl` equals SkyRL's `compute_maxrl_advantage` and prime-rl's `MaxRLAlgorithm.score_group` (neither is
  installable in CI: each is transcribed below, with the commit it follows), and where the three differ
  (a group with mean <= 0, a group of one) tether does what its module header says;
- GDPO = `normalize_then_sum` + `reinforce_pp` equals verl's own `compute_gdpo_outcome_advantage` (called),
  and `normalize_then_sum` with TRL's eps equals TRL's per-function normalisation (test_trl_adapter.py
  calls TRL's trainer for it);
- `reinforce_pp_no_baseline` equals verl's `reinforce_plus_plus` (called) and `grpo_batch_std` TRL's
  `scale_rewards="batch"` rule (test_trl_adapter.py runs TRL's trainer) and AReaL's (transcribed), each up to
  the departures its module header lists;
- invariants: flat parts and groups of one give exactly 0, NaN scores take no part, the weighted sum
  (`sum`) is the default and changes nothing, and the trainer's reward parts are the reward's own;
- end to end: `tether train objective=gdpo` gives the estimator the weighted reward's parts (slow), and
  `tether list` shows what was added.
"""

from collections import defaultdict

import numpy as np
import pytest
import torch

from tether import objectives
from tether.core import advantages as A
from tether.core import multi_reward as M
from tether.core.multi_reward import RewardParts
from tether.rewards import get_reward, reward_parts, score_batch
from tether.schema import ConfigError
from tether.tasks import Example

D = torch.float64


# ---------------------------------------------------------------- MaxRL: hand values


def test_maxrl_hand_values():
    # Group 0, rewards (1, 0, 0, 0): mean 1/4, A = (R - 1/4) / (1/4 + 1e-6) = (3, -1, -1, -1) * 0.25 / 0.250001.
    # Group 1, rewards (1, 1, 1, 0): mean 3/4, A = (1/4, 1/4, 1/4, -3/4) / 0.750001 = (1/3, 1/3, 1/3, -1) * .75/.750001.
    # The hard prompt's one success weighs (.75 / .250001) / (.25 / .750001) = 3 * .750001 / .250001 ~ 9 times
    # an easy prompt's success (the paper's ~1/p: pass rates 1/4 and 3/4).
    r = torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 0], dtype=D)
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.25, 0.25, 0.25, -0.75], dtype=D)
    expected[:4] /= 0.25 + 1e-6
    expected[4:] /= 0.75 + 1e-6
    torch.testing.assert_close(A.maxrl(r, g), expected, rtol=1e-14, atol=0)
    torch.testing.assert_close(A.compute_advantages("maxrl", r, g), expected, rtol=1e-14, atol=0)
    assert A.maxrl(r, g)[0] / A.maxrl(r, g)[4] == pytest.approx(3 * 0.750001 / 0.250001, rel=1e-12)


def test_maxrl_edges_give_exactly_zero():
    # all-zero group (mean 0), flat group (mean 1), a group with a negative mean, a group of one, a zero-sum group
    r = torch.tensor([0.0, 0, 0, 1, 1, 1, -1, 0, 0.5, 1, -1], dtype=D)
    g = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 3, 4, 4])
    adv = A.maxrl(r, g)
    assert torch.isfinite(adv).all() and (adv == 0).all()  # each group has mean <= 0, no spread, or one sample
    # A non-binary group with a positive mean: rewards (2, 0, -0.5), mean 0.5, A = (1.5, -0.5, -1) / 0.500001.
    r2, g2 = torch.tensor([2.0, 0, -0.5], dtype=D), torch.zeros(3, dtype=torch.long)
    torch.testing.assert_close(
        A.maxrl(r2, g2), torch.tensor([1.5, -0.5, -1.0], dtype=D) / (0.5 + 1e-6), rtol=1e-14, atol=0
    )


# ---------------------------------------------------------------- MaxRL: the references


def skyrl_maxrl(scores: torch.Tensor, index: np.ndarray, epsilon: float = 1e-6) -> torch.Tensor:
    """SkyRL's `compute_maxrl_advantage` on outcome scores (N,), transcribed from NovaSky-AI/SkyRL
    skyrl/backends/skyrl_train/utils/ppo_utils.py at a9564572eb8e91076be43c1bd5e4615e3de17265 (the PyPI
    skyrl-train 0.3.1 predates it and needs Python 3.12): a group of one keeps R - 0; otherwise
    (R - mean) / (mean + epsilon), with no guard on the mean's sign."""
    scores = scores.clone()
    id2score, id2mean = defaultdict(list), {}
    for i in range(len(scores)):
        id2score[index[i]].append(scores[i])
    for idx, vals in id2score.items():
        id2mean[idx] = torch.tensor(0.0, dtype=scores.dtype) if len(vals) == 1 else torch.mean(torch.stack(vals))
    for i in range(len(scores)):
        if len(id2score[index[i]]) > 1:
            scores[i] = (scores[i] - id2mean[index[i]]) / (id2mean[index[i]] + epsilon)
        else:
            scores[i] = scores[i] - id2mean[index[i]]
    return scores


def prime_rl_max_rl(group_rewards: torch.Tensor) -> torch.Tensor:
    """prime-rl's `MaxRLAlgorithm.score_group` on one group's rewards, transcribed from
    PrimeIntellect-ai/prime-rl src/prime_rl/orchestrator/algo/max_rl.py at
    559b44772e471d1538537b8805cc77f3824a5e64: zeros when the mean is <= 0, else (R - mean) / mean."""
    mean = group_rewards.mean()
    return torch.zeros_like(group_rewards) if mean <= 0 else (group_rewards - mean) / mean


def _binary_groups(seed: int, n_groups: int = 6, size: int = 8):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(n_groups, 1, generator=g, dtype=D)
    r = (torch.rand(n_groups, size, generator=g, dtype=D) < p).to(D).flatten()
    r[:size] = 0.0  # one group with no success
    r[size : 2 * size] = 1.0  # one group all correct
    return r, torch.arange(n_groups).repeat_interleave(size)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_maxrl_equals_skyrl_and_prime_rl(seed):
    r, g = _binary_groups(seed)
    ours = A.maxrl(r, g)
    # SkyRL: equal on every group with >= 2 samples and a mean >= 0 (an all-zero group is 0 / 1e-6 = 0 there).
    torch.testing.assert_close(ours, skyrl_maxrl(r, g.numpy()), rtol=1e-14, atol=1e-15)
    # prime-rl divides by the mean itself: tether's value is prime-rl's times mean / (mean + 1e-6).
    for k in g.unique():
        rows = g == k
        mean = r[rows].mean()
        scale = mean / (mean + 1e-6) if mean > 0 else 1.0
        torch.testing.assert_close(ours[rows], prime_rl_max_rl(r[rows]) * scale, rtol=1e-14, atol=1e-15)
    assert (ours[:16] == 0).all() and (ours[16:] != 0).any()


def test_maxrl_departs_from_skyrl_where_its_header_says():
    # Negative mean: SkyRL divides by (-0.5 + 1e-6) and flips the signs; tether (and prime-rl) give 0.
    r, g = torch.tensor([0.0, -1.0], dtype=D), torch.zeros(2, dtype=torch.long)
    torch.testing.assert_close(skyrl_maxrl(r, g.numpy()), torch.tensor([0.5, -0.5], dtype=D) / (-0.5 + 1e-6))
    assert (A.maxrl(r, g) == 0).all() and (prime_rl_max_rl(r) == 0).all()
    # A group of one: SkyRL gives R (baseline 0), tether 0.
    r1, g1 = torch.tensor([1.0, 1.0, 0.0], dtype=D), torch.tensor([0, 1, 1])
    assert skyrl_maxrl(r1, g1.numpy())[0] == 1.0 and A.maxrl(r1, g1)[0] == 0.0


# ---------------------------------------------------------------- GDPO: hand values


def test_normalize_then_sum_hand_values():
    # One group of 4, parts r1 = (1, 0, 0, 0) (correct), r2 = (0, 2, 0, 0) (a format bonus), w = (1, 0.5).
    # Each part: mean 1/4 resp. 1/2, sample std sqrt(3/16 * 4/3) = 1/2 resp. sqrt(3 * 4/3) / 2 = 1.
    # n1 = (3/4, -1/4, -1/4, -1/4) / (1/2 + 1e-6) = (1.5, -.5, -.5, -.5) * s1, s1 = .5 / .500001
    # n2 = (-1/2, 3/2, -1/2, -1/2) / (1 + 1e-6)   = (-.5, 1.5, -.5, -.5) * s2, s2 = 1 / 1.000001
    # R = n1 + 0.5 n2. The plain weighted sum is (1, 1, 0, 0): the first two samples tie there.
    scores = torch.tensor([[1.0, 0], [0, 2], [0, 0], [0, 0]], dtype=D)
    parts = RewardParts(scores, torch.tensor([1.0, 0.5], dtype=D))
    g = torch.zeros(4, dtype=torch.long)
    s1, s2 = 0.5 / (0.5 + 1e-6), 1 / (1 + 1e-6)
    n1 = torch.tensor([1.5, -0.5, -0.5, -0.5], dtype=D) * s1
    n2 = torch.tensor([-0.5, 1.5, -0.5, -0.5], dtype=D) * s2
    torch.testing.assert_close(M.normalize_then_sum(parts, g), n1 + 0.5 * n2, rtol=1e-14, atol=0)
    torch.testing.assert_close(M.weighted_sum(parts, g), torch.tensor([1.0, 1, 0, 0], dtype=D), rtol=0, atol=0)
    # The gdpo preset whitens the sum over the batch (reinforce_pp, one weight per sequence here):
    # R ~ (2.5, 0.5, -1.5, -1.5), mean 0, Bessel variance (6.25 + .25 + 2.25 + 2.25) / 3 = 11 / 3.
    R = n1 + 0.5 * n2
    var = ((R - R.mean()) ** 2).sum() / 3
    expected = (R - R.mean()) / torch.sqrt(var + 1e-8)
    gdpo = objectives.build("gdpo")
    torch.testing.assert_close(gdpo.advantages(scores.sum(1), g, None, parts), expected, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(
        expected, torch.tensor([2.5, 0.5, -1.5, -1.5], dtype=D) / (11 / 3) ** 0.5, rtol=5e-6, atol=0
    )  # the 1e-6 guards move it by a few parts in 1e6


def test_flat_parts_groups_of_one_and_nan_scores():
    # Group 0: part 1 flat (1, 1) -> 0 there; part 2 (0, 1): mean .5, std sqrt(.5), n = (-.5, .5) / (sqrt(.5) + 1e-6).
    # Group 1: one sample -> 0. Group 2: part 1 (1, 0, NaN): the NaN row leaves the mean (.5) and std (sqrt .5)
    # and gets 0; part 2 flat -> 0.
    nan = float("nan")
    scores = torch.tensor([[1.0, 0], [1, 1], [5, 5], [1, 2], [0, 2], [nan, 2]], dtype=D)
    g = torch.tensor([0, 0, 1, 2, 2, 2])
    out = M.normalize_then_sum(RewardParts(scores, torch.tensor([1.0, 2.0], dtype=D)), g)
    h = 0.5 / (0.5**0.5 + 1e-6)
    torch.testing.assert_close(out, torch.tensor([-2 * h, 2 * h, 0, h, -h, 0], dtype=D), rtol=1e-14, atol=0)
    assert out[2] == 0 and out[5] == 0


def test_sum_is_the_default_and_reads_no_parts():
    obj = objectives.build("dapo")
    assert obj.config.reward_aggregation == "sum" and not obj.needs_reward_parts()
    r, g = torch.tensor([1.0, 0, 1, 1], dtype=D), torch.tensor([0, 0, 1, 1])
    junk = RewardParts(torch.full((4, 2), 7.0, dtype=D), torch.ones(2, dtype=D))
    torch.testing.assert_close(obj.advantages(r, g, None, junk), obj.advantages(r, g), rtol=0, atol=0)


def test_gdpo_without_parts_and_unknown_names_are_refused():
    gdpo = objectives.build("gdpo")
    with pytest.raises(ValueError, match="needs the reward's parts"):
        gdpo.advantages(torch.ones(2, dtype=D), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ConfigError, match="reward_aggregation.*normalize_then_sum"):
        objectives.build({"preset": "dapo", "reward_aggregation": "normalise_then_sum"})
    with pytest.raises(ValueError, match=r"scores \(N, K\) with weights \(K,\)"):
        M.aggregate_rewards("sum", RewardParts(torch.ones(3, 2), torch.ones(3)), torch.zeros(3))


def test_reward_parts_are_the_weighted_rewards_own():
    reward = get_reward({"exact_match": 1.0, "format": 0.25})
    examples = [Example("a", "1+1=", "2")] * 3
    results = score_batch(reward, ["2", "\\boxed{2}", "3"], examples)
    parts = reward_parts(reward, results)
    torch.testing.assert_close(parts.scores, torch.tensor([[1.0, 0], [0, 1], [0, 0]], dtype=D), rtol=0, atol=0)
    torch.testing.assert_close(parts.weights, torch.tensor([1.0, 0.25], dtype=D), rtol=0, atol=0)
    # The weighted sum of the parts is the reward's score.
    torch.testing.assert_close(
        M.weighted_sum(parts, torch.zeros(3)), torch.tensor([r.score for r in results], dtype=D), rtol=0, atol=0
    )
    single = reward_parts(get_reward("exact_match"), results[:1])
    assert single.scores.shape == (1, 1) and single.weights.tolist() == [1.0]


# ---------------------------------------------------------------- GDPO: verl's own estimator


def test_gdpo_equals_verls_gdpo_estimator():
    pytest.importorskip("verl")
    from verl.trainer.ppo import core_algos

    gen = torch.Generator().manual_seed(5)
    N, T, P, Gs = 16, 6, 3, 4
    lengths = torch.randint(1, T + 1, (N,), generator=gen)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float32)
    # parts on a float32 grid (verl reads them as float32): correctness 0/1, a format score in quarters
    correct = torch.randint(0, 2, (N,), generator=gen).float()
    fmt = torch.randint(0, 5, (N,), generator=gen).float() / 4
    correct[:Gs], fmt[:Gs] = 1.0, 0.5  # group 0: every part flat
    correct[Gs : 2 * Gs] = 0.0  # group 1: correctness flat, format live
    weights = [1.0, 0.5]
    groups = torch.arange(N) // Gs
    index = np.array([f"uid-{int(k)}" for k in groups], dtype=object)
    total = correct * weights[0] + fmt * weights[1]
    token_rewards = torch.zeros(N, T)
    token_rewards[torch.arange(N), lengths - 1] = total
    batch = {
        "prompts": torch.zeros(N, P, dtype=torch.long),
        "attention_mask": torch.cat([torch.ones(N, P), mask], 1).long(),
    }
    config = {"gdpo_reward_keys": ["correct", "format"], "gdpo_reward_weights": weights}
    theirs, _ = core_algos.get_adv_estimator_fn("gdpo")(
        token_level_rewards=token_rewards,
        response_mask=mask,
        index=index,
        config=config,
        non_tensor_batch={"correct": correct.numpy(), "format": fmt.numpy()},
        batch=batch,
    )
    parts = RewardParts(torch.stack([correct, fmt], 1).to(D), torch.tensor(weights, dtype=D))
    ours = objectives.build("gdpo").advantages(total.to(D), groups, mask.sum(1).to(D), parts)
    ours_tok = ours[:, None] * mask.to(D)
    live = (groups >= 1)[:, None] & mask.bool()
    # verl computes in float32 (its parts, group statistics and whitening): equal to float32 rounding.
    torch.testing.assert_close(theirs.to(D)[live], ours_tok[live], rtol=2e-6, atol=2e-6)
    # Group 0 has no spread in any part: tether 0 (SPEC 4); verl whitens its 0 to (0 - mean_B) / std_B.
    assert (ours[:Gs] == 0).all()
    R = M.normalize_then_sum(parts, groups)
    tok = mask.bool()
    Rt = R[:, None].expand(N, T)[tok]
    n = Rt.numel()
    shift = -Rt.mean() / torch.sqrt(((Rt - Rt.mean()) ** 2).sum() / (n - 1) + 1e-8)
    torch.testing.assert_close(theirs.to(D)[:Gs][tok[:Gs]], shift.expand(int(tok[:Gs].sum())), rtol=2e-6, atol=2e-6)


# ---------------------------------------------------------------- end to end: tether's trainer


@pytest.mark.slow
def test_the_trainer_gives_gdpo_the_weighted_rewards_parts(tiny_dir, tmp_path, monkeypatch):
    """Two steps of `tether train objective=gdpo` with a weighted reward: the advantages are the gdpo
    estimator on each part's own scores and weights (not on their sum), and the run trains."""
    import json
    import math
    from pathlib import Path

    from conftest import DIGIT_REWARD, train_config

    from tether.objectives.runtime import Objective
    from tether.trainer.loop import train

    seen = []
    original = Objective.advantages

    def spy(self, rewards, group_ids, lengths=None, parts=None):
        out = original(self, rewards, group_ids, lengths, parts)
        seen.append((rewards, group_ids, lengths, parts, out))
        return out

    monkeypatch.setattr(Objective, "advantages", spy)
    weights = f"reward.weights={{{DIGIT_REWARD}: 1.0, overlong: {{weight: 0.5, max_tokens: 6, cache: 4}}}}"
    run = train(
        train_config(tiny_dir, tmp_path / "run", "trainer.total_steps=2", "objective=gdpo", weights),
        log=lambda *_: None,
    )
    rows = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(math.isfinite(r["loss/total"]) for r in rows[1:])
    assert len(seen) == 2
    for rewards, groups, lengths, parts, adv in seen:
        assert parts is not None and parts.scores.shape == (16, 2) and parts.weights.tolist() == [1.0, 0.5]
        torch.testing.assert_close(parts.scores.float() @ parts.weights.float(), rewards, rtol=1e-6, atol=1e-6)
        summed = M.normalize_then_sum(parts, groups)
        expected = A.compute_advantages("reinforce_pp", summed, groups, lengths.to(D))
        torch.testing.assert_close(adv.to(D), expected, rtol=1e-6, atol=1e-6)
    assert any(bool((adv != 0).any()) for *_, adv in seen)  # some group had a live part


# ---------------------------------------------------------------- REINFORCE++ without baseline, GRPO with batch std


def test_reinforce_pp_no_baseline_and_grpo_batch_std_hand_values():
    # Rewards (1, 0 | 1, 1 | 0.5, 0), groups of 2, one weight per sequence.
    # Batch: mean 3.5/6, Bessel var = sum (R - 7/12)^2 / 5 = (2 (5/12)^2 + (7/12)^2 ... ) computed below.
    r = torch.tensor([1.0, 0, 1, 1, 0.5, 0], dtype=D)
    g = torch.tensor([0, 0, 1, 1, 2, 2])
    m = 3.5 / 6
    var = ((r - m) ** 2).sum() / 5  # = (3 (5/12)^2 + 2 (7/12)^2 + (1/12)^2) / 5 = (75 + 98 + 1) / 144 / 5
    assert var.item() == pytest.approx(174 / 720, rel=1e-15)
    whitened = (r - m) / torch.sqrt(var + 1e-8)
    expected = torch.where(g == 1, torch.zeros_like(r), whitened)  # the flat group (1, 1) gets exactly 0
    torch.testing.assert_close(A.reinforce_pp_no_baseline(r, g), expected, rtol=1e-14, atol=0)
    # grpo_batch_std: (R - group mean) / (sqrt(174/720) + 1e-6): (.5, -.5, 0, 0, .25, -.25) / 0.491596...
    std_b = (174 / 720) ** 0.5
    torch.testing.assert_close(
        A.grpo_batch_std(r, g),
        torch.tensor([0.5, -0.5, 0, 0, 0.25, -0.25], dtype=D) / (std_b + 1e-6),
        rtol=1e-14,
        atol=0,
    )
    # Token weights (lengths 1, 3, 1, 1, 2, 2): mean = (1 + 1 + 1 + 1) / 10 = 0.4, Bessel over 10 tokens.
    w = torch.tensor([1.0, 3, 1, 1, 2, 2], dtype=D)
    var_w = (w * (r - 0.4) ** 2).sum() / 9  # (.36 + 3 * .16 + .36 + .36 + 2 * .01 + 2 * .16) / 9 = 1.9 / 9
    assert var_w.item() == pytest.approx(1.9 / 9, rel=1e-14)
    got = A.compute_advantages("reinforce_pp_no_baseline", r, g, weights=w)
    torch.testing.assert_close(got, torch.where(g == 1, 0.0, (r - 0.4) / torch.sqrt(var_w + 1e-8)), rtol=1e-14, atol=0)


def test_reinforce_pp_no_baseline_equals_verls_reinforce_plus_plus():
    pytest.importorskip("verl")
    from verl.trainer.ppo import core_algos

    gen = torch.Generator().manual_seed(11)
    N, T, Gs = 16, 7, 4
    lengths = torch.randint(1, T + 1, (N,), generator=gen)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(D)
    r = torch.randint(0, 3, (N,), generator=gen).to(D) / 2
    r[:Gs] = 1.0  # a flat group
    groups = torch.arange(N) // Gs
    token_rewards = torch.zeros(N, T, dtype=D)
    token_rewards[torch.arange(N), lengths - 1] = r
    theirs, returns = core_algos.get_adv_estimator_fn("reinforce_plus_plus")(
        token_level_rewards=token_rewards, response_mask=mask, config=_AlgoGet(gamma=1.0)
    )
    torch.testing.assert_close(returns, r[:, None] * mask, rtol=0, atol=0)  # gamma = 1: R on every token
    ours = A.compute_advantages("reinforce_pp_no_baseline", r, groups, weights=mask.sum(1))[:, None] * mask
    live = (groups >= 1)[:, None] & mask.bool()
    # verl's Bessel factor is float32 (advantages.py, departure 3): a relative 3e-8.
    torch.testing.assert_close(ours[live], theirs[live], rtol=5e-8, atol=1e-12)
    assert (ours[:Gs] == 0).all() and (theirs[:Gs][mask[:Gs].bool()] > 0).all()  # verl pushes the flat group up
    # through the verl plugin: the same estimator under its tether_ name
    plugin, _ = core_algos.get_adv_estimator_fn("tether_reinforce_pp_no_baseline")(
        token_level_rewards=token_rewards, response_mask=mask, index=np.array(groups.tolist(), dtype=object)
    )
    torch.testing.assert_close(plugin, ours, rtol=0, atol=1e-15)


class _AlgoGet(dict):
    """verl's estimator reads `config.gamma`: a dict with attribute access."""

    def __getattr__(self, key):
        return self[key]


def areal_group_mean_batch_std(x: torch.Tensor, group_size: int, eps: float = 1e-5) -> torch.Tensor:
    """AReaL's `AdvNorm` with mean_level="group", std_level="batch", std_unbiased=True, no mask, one process,
    transcribed from inclusionAI/AReaL areal/utils/data.py at 4aef98d8d (`__call__`, `_compute_mean`,
    `_compute_std`): the group mean, then the batch std of x around those means, Bessel-corrected."""
    mean = x.reshape(-1, group_size).mean(1, keepdim=True).expand(-1, group_size).reshape(-1)
    centred = x - mean
    std = torch.sqrt((centred**2).sum() / (x.numel() - 1))
    return centred / (std + eps)


def test_grpo_batch_std_against_areal_and_trl_rules():
    r, g = _binary_groups(4)
    ours = A.grpo_batch_std(r, g)
    # TRL 1.16, scale_rewards="batch": (R - mean_g) / (nanstd(R) + 1e-4), nanstd Bessel-corrected over the batch's
    # rewards (tests/integrations/test_trl_adapter.py checks this rule against TRL's trainer).
    std_raw = r.std()
    trl_rule = A.dr_grpo(r, g) / (std_raw + 1e-4)
    torch.testing.assert_close(ours * (std_raw + 1e-6) / (std_raw + 1e-4), trl_rule, rtol=1e-14, atol=1e-15)
    # AReaL's scale is the batch std of the group-centred rewards (departure 2): a smaller scale, so larger values.
    areal = areal_group_mean_batch_std(r, 8)
    centred_std = torch.sqrt((A.dr_grpo(r, g) ** 2).sum() / (r.numel() - 1))
    torch.testing.assert_close(areal, A.dr_grpo(r, g) / (centred_std + 1e-5), rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(ours, areal * (centred_std + 1e-5) / (std_raw + 1e-6), rtol=1e-12, atol=1e-15)
    assert centred_std < std_raw


def test_tether_list_shows_the_estimators_reward_aggregations_and_the_gdpo_preset(capsys):
    from tether.cli import main

    assert main(["list"]) == 0
    out = capsys.readouterr().out
    lines = {line.split(":")[0].strip(): line for line in out.splitlines() if ":" in line}
    assert all(
        name in lines["advantages"]
        for name in ("maxrl", "reinforce_pp_no_baseline", "grpo_batch_std", "grpo", "reinforce_pp")
    )
    assert lines["reward aggregation"].split(": ")[1] == "sum, normalize_then_sum"
    assert "gdpo" in out and "reward_aggregation=normalize_then_sum" in out
