"""verl 0.9.1's bypass mode (`loss_mode="bypass_mode"`, pi_old = pi_rollout) is tether under
`trainer.old_logprobs: sampler` (bypass anchoring), by calling verl's loss in the test (float64):

- verl's `loss_type="reinforce"` with token-level IS weights pi_theta / pi_rollout truncated at T (`rollout_is="token"`,
  `rollout_is_threshold=T`) is tether's `cispo` with `eps_low: 1.0` (no lower bound) and `eps_high: T - 1`: both are
  -SG(min(w, T)) A lp with w = pi_theta / pi_old;
- verl's `loss_type="ppo_clip"` is tether's `ppo_clip` (the ratio to pi_old is the ratio to the rollout policy).

verl's rejection masks inside the bypass loss (`rollout_rs`) have no tether counterpart (docs/algorithms/rollout_correction.md).
"""

import pytest
import torch

pytest.importorskip("verl")

from verl.trainer.config.algorithm import RolloutCorrectionConfig  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.workers.config import FSDPActorConfig  # noqa: E402
from verl.workers.config.actor import PolicyLossConfig  # noqa: E402

from tether import objectives  # noqa: E402

D = torch.float64


def _batch():
    g = torch.Generator().manual_seed(0)
    n, t = 5, 6
    rollout = -torch.rand(n, t, generator=g, dtype=D) * 3 - 0.05
    lp = (rollout + (torch.rand(n, t, generator=g, dtype=D) * 2.4 - 1.2)).requires_grad_()  # w in [0.30, 3.3]
    adv = torch.tensor([1.0, -0.5, 0.25, 0.0, -1.0], dtype=D)
    mask = torch.ones(n, t, dtype=D)
    mask[0, 3:] = 0
    w = torch.exp(lp - rollout).detach()[mask.bool()]
    assert (w > 2.0).any() and (w < 0.8).any()  # the truncation at 2 and the clip at 0.8 both act
    return lp, rollout, adv, mask


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize(
    "loss_type,spec",
    [
        ("reinforce", {"name": "cispo", "eps_low": 1.0, "eps_high": 1.0}),
        ("ppo_clip", {"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.2}),
    ],
)
def test_tether_under_bypass_anchoring_equals_verls_bypass_mode(loss_type, spec, agg):
    lp, rollout, adv, mask = _batch()
    correction = RolloutCorrectionConfig(
        bypass_mode=True, loss_type=loss_type, rollout_is="token", rollout_is_threshold=2.0
    )
    config = FSDPActorConfig(
        strategy="fsdp",
        rollout_n=5,
        ppo_micro_batch_size_per_gpu=2,
        loss_agg_mode=agg,
        clip_ratio_low=0.2,
        clip_ratio_high=0.2,
        policy_loss=PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=correction),
    )
    theirs, _ = core_algos.get_policy_loss_fn("bypass_mode")(rollout, lp, adv[:, None].expand_as(lp), mask, agg, config)
    ours = objectives.build({**spec, "aggregation": agg})(
        objectives.TokenBatch(logprobs=lp, old_logprobs=rollout, advantages=adv, loss_mask=mask)
    ).loss
    tol = dict(rtol=1e-7, atol=1e-9) if agg == "seq-mean-token-mean" else dict(rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(ours, theirs, **tol)
    torch.testing.assert_close(torch.autograd.grad(ours, lp)[0], torch.autograd.grad(theirs, lp)[0], **tol)
