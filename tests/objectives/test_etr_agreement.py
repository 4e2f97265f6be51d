"""ETR's group statistics have one home (issue 13, item 2): tether's trainer, the TRL adapter and the
verl plugin compute them once over the whole rollout batch and hand every micro-batch its rows, so
all three give the same loss and gradient on one rollout batch, however its rows are shuffled and
split into micro-batches (float64, CPU)."""

import sys

import numpy as np
import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("verl")

from verl.trainer.ppo import core_algos  # noqa: E402
from verl.workers.config import FSDPActorConfig  # noqa: E402

from tether import objectives  # noqa: E402
from tether.integrations import trl as ttrl  # noqa: E402

tv = sys.modules.get("tether.integrations.verl")
if tv is None:
    import tether.integrations.verl as tv

D = torch.float64
N, T, G = 24, 7, 4  # 6 prompt groups of 4


def _rollout(seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T + 1, (N,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    old = -torch.rand(N, T, generator=g, dtype=D) - 0.1
    lp = old + 0.4 * torch.randn(N, T, generator=g, dtype=D)  # ratios on both sides of every bound
    groups = torch.arange(N) // G
    rewards = torch.tensor([float(j < k) for k in range(6) for j in range(G)], dtype=D)  # 0/4 ... 4/4, 1/4
    rewards[20:] = torch.tensor([1.0, 0, 0, 0], dtype=D)
    token_rewards = torch.zeros(N, T, dtype=D)
    token_rewards[torch.arange(N), lengths - 1] = rewards
    uids = np.array([f"p{int(i)}" for i in groups], dtype=object)
    return dict(lp=lp, old=old, mask=mask, groups=groups, rewards=rewards, token_rewards=token_rewards, uids=uids)


def _micro_batches(seed):
    """A shuffled order of the rows, split into 4 micro-batches of 6: groups split across them."""
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(seed))
    return [perm[i : i + 6] for i in range(0, N, 6)]


def _tether_trainer(obj, d, micro):
    """As tether.trainer.step.update does: statistics once, each micro-batch its rows, the mini-batch normaliser."""
    adv = obj.advantages(d["rewards"], d["groups"])
    stats = obj.group_stats(d["rewards"], d["groups"])
    norm = obj.normalizer(d["mask"])
    lp = d["lp"].clone().requires_grad_()
    total = 0.0
    for idx in micro:
        out = obj(
            objectives.TokenBatch(
                lp[idx], d["old"][idx], adv[idx], d["mask"][idx], loss_norm=norm, group_stats=stats.select(idx)
            )
        )
        out.loss.backward()
        total = total + out.loss.detach()
    return total, lp.grad


def _trl_adapter(obj, d, micro):
    """As TetherGRPOTrainer does: (N,) stat columns added at generation time, then shuffled and split."""
    columns = ttrl.group_stat_columns(obj, d["rewards"], d["groups"], slice(0, N))
    assert set(columns) >= {"tether_stat_nu_shift", "tether_stat_nu"}
    adv = ttrl.group_advantages(obj, d["rewards"], d["groups"])
    norm = obj.normalizer(d["mask"])
    lp = d["lp"].clone().requires_grad_()
    total = 0.0
    for idx in micro:
        inputs = {k: v[idx] for k, v in columns.items()}
        out = obj(
            objectives.TokenBatch(
                lp[idx],
                d["old"][idx],
                adv[idx],
                d["mask"][idx],
                loss_norm=norm,
                group_stats=ttrl.group_stats_of(obj, inputs),
            )
        )
        out.loss.backward()
        total = total + out.loss.detach()
    return total, lp.grad


def _verl_plugin(obj, d, micro, overrides):
    """As verl does: the tether estimator on the driver, then the registered loss per micro-batch with
    verl's global-batch normaliser and the hook publishing `returns`."""
    est = core_algos.get_adv_estimator_fn(f"tether_{obj.config.advantage}")
    adv, returns = est(token_level_rewards=d["token_rewards"], response_mask=d["mask"], index=d["uids"])
    config = FSDPActorConfig(
        strategy="fsdp",
        rollout_n=G,
        ppo_micro_batch_size_per_gpu=6,
        policy_loss=tv.TetherPolicyLossConfig(loss_mode="tether_etr", objective="etr", overrides=overrides),
    )
    config.global_batch_info.update({"dp_size": 1, "batch_num_tokens": int(d["mask"].sum()), "global_batch_size": N})
    fn = core_algos.get_policy_loss_fn("tether_etr")
    lp = d["lp"].clone().requires_grad_()
    total = 0.0
    for idx in micro:
        lp_i = lp[idx]
        with tv.micro_batch({"returns": returns[idx]}):
            loss, _ = fn(
                old_log_prob=d["old"][idx],
                log_prob=lp_i,
                advantages=adv[idx],
                response_mask=d["mask"][idx],
                loss_agg_mode="token-mean",
                config=config,
            )
        loss.backward()
        total = total + loss.detach()
    return total, lp.grad


@pytest.mark.parametrize("overrides", [{}, {"alpha": 0.0, "eta": 1.0}])
def test_trainer_trl_and_verl_give_one_etr_loss_and_gradient(overrides):
    d = _rollout()
    obj = tv.objective_from("tether_etr", "etr", overrides)
    # The reference: the whole rollout batch as one batch.
    lp = d["lp"].clone().requires_grad_()
    ref = obj(
        objectives.TokenBatch(
            lp,
            d["old"],
            obj.advantages(d["rewards"], d["groups"]),
            d["mask"],
            group_ids=d["groups"],
            rewards=d["rewards"],
        )
    )
    ref.loss.backward()
    assert float(ref.metrics["policy/clipfrac_high"]) > 0 and float(ref.metrics["policy/clipfrac_low"]) > 0
    for seed in (0, 1):
        micro = _micro_batches(seed)
        for name, (loss, grad) in {
            "trainer": _tether_trainer(obj, d, micro),
            "trl": _trl_adapter(obj, d, micro),
            "verl": _verl_plugin(obj, d, micro, overrides),
        }.items():
            torch.testing.assert_close(loss, ref.loss.detach(), rtol=1e-12, atol=1e-14, msg=name)
            torch.testing.assert_close(grad, lp.grad, rtol=1e-12, atol=1e-14, msg=name)


def test_split_groups_with_per_micro_batch_statistics_would_differ():
    # The defect the shared statistics remove: statistics computed inside each micro-batch.
    d = _rollout()
    obj = objectives.build("etr")
    lp = d["lp"].clone().requires_grad_()
    ref = obj(
        objectives.TokenBatch(
            lp,
            d["old"],
            obj.advantages(d["rewards"], d["groups"]),
            d["mask"],
            group_ids=d["groups"],
            rewards=d["rewards"],
        )
    )
    adv, norm = obj.advantages(d["rewards"], d["groups"]), obj.normalizer(d["mask"])
    total = sum(
        obj(
            objectives.TokenBatch(
                d["lp"][i],
                d["old"][i],
                adv[i],
                d["mask"][i],
                loss_norm=norm,
                group_stats=obj.group_stats(d["rewards"][i], d["groups"][i]),
            )
        ).loss
        for i in _micro_batches(0)
    )
    assert abs(float(total.detach()) - float(ref.loss.detach())) > 1e-6


@pytest.mark.parametrize("macro", ["explicit", "implicit"])
def test_a_micro_batch_without_group_stats_is_refused_naming_the_fix(macro):
    # Issue 22, item 6: rewards and group_ids but no group_stats, with loss_norm set (so a micro-batch of several):
    # computing the statistics from the micro-batch's own rows was silent; it is an error naming the fix.
    d = _rollout()
    obj = objectives.build({"preset": "etr", "macro": macro})
    adv, norm = obj.advantages(d["rewards"], d["groups"]), obj.normalizer(d["mask"])
    i = _micro_batches(0)[0]
    batch = objectives.TokenBatch(
        d["lp"][i], d["old"][i], adv[i], d["mask"][i], group_ids=d["groups"][i], rewards=d["rewards"][i], loss_norm=norm
    )
    with pytest.raises(
        ValueError,
        match=r"loss_norm set.*obj\.group_stats\(rewards, group_ids\).*"
        r"TokenBatch\(group_stats=stats\.select\(idx\)\)",
    ):
        obj(batch)
    with pytest.raises(ValueError, match=r"obj\.group_stats"):
        obj.terms(batch)  # the verl plugin's entry point too
    # The fix named by the error works, and a whole batch (no loss_norm) still computes its own statistics.
    stats = obj.group_stats(d["rewards"], d["groups"])
    assert torch.isfinite(
        obj(
            objectives.TokenBatch(
                d["lp"][i], d["old"][i], adv[i], d["mask"][i], loss_norm=norm, group_stats=stats.select(i)
            )
        ).loss
    )
    assert torch.isfinite(
        obj(objectives.TokenBatch(d["lp"], d["old"], adv, d["mask"], group_ids=d["groups"], rewards=d["rewards"])).loss
    )
    # An objective that reads no group statistics is unaffected.
    off = objectives.build({"preset": "etr", "macro": "off"})
    assert torch.isfinite(
        off(objectives.TokenBatch(d["lp"][i], d["old"][i], adv[i], d["mask"][i], loss_norm=norm)).loss
    )
